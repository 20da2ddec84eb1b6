"""A new payload or a new job replaces no VM: every VM's metadata holds the stable loader
(templates/loader.sh), `pulumi up` rewrites the job pointer jobs/current.json and the
content-addressed startup scripts it names (components/delivery.py StartupDelivery), and the
loader checks what it downloads against the pointer before it runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from harness import run_offline
from script_sandbox import (
    loader_script,
    pointer_of,
    publish_payload,
    publish_startup,
    shellcheck,
)

from infra.render import render

ROOT = Path(__file__).resolve().parents[2]
VM_TYPES = ("gcp:tpu/v2Vm:V2Vm", "gcp:compute/instance:Instance")


def _vms(run) -> dict[str, str]:
    """Every VM's inputs, serialised: what `pulumi up` would diff."""
    return {
        r.name: json.dumps(r.inputs, sort_keys=True, default=str)
        for r in run.resources
        if r.type_ in VM_TYPES
    }


def _renamed_job(directory: Path, stack: str, name: str) -> str:
    source = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())
    template = yaml.safe_load((ROOT / source["config"]["tpu-pretrain:job"]).read_text())
    template["name"] = name
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(template))
    return str(path)


@pytest.mark.parametrize("stack", ["v6e-euw4", "v4-32-usc2", "l4x2-use1"])
def test_a_payload_or_job_change_rewrites_the_pointer_and_no_vm(stack, tmp_path, monkeypatch):
    before = run_offline(stack)
    # A job commit: another job (its name, hence its run root and status objects).
    job = run_offline(stack, {"tpu-pretrain:job": _renamed_job(tmp_path, stack, "next-job")})
    # A payload commit: another archive, another digest.
    other = render.PayloadArchive(
        name="tpu-pretrain-payload-abababababababab.tar.gz", sha256="ab" * 32, data=b"x"
    )
    monkeypatch.setattr(render, "build_payload_archive", lambda root=render.REPO_ROOT: other)
    payload = run_offline(stack)
    assert _vms(before) and _vms(job) == _vms(before) and _vms(payload) == _vms(before)
    assert pointer_of(job)["job"] == "next-job" != pointer_of(before)["job"]
    assert (
        pointer_of(payload)["payload_sha256"] == "ab" * 32 != pointer_of(before)["payload_sha256"]
    )
    # The loader is what every VM boots; the rendered scripts live in the bucket.
    for vm in (r for r in before.resources if r.type_ in VM_TYPES):
        if vm.name != "vpn-hop-vm":
            assert "readonly POINTER_URI=" in vm.inputs["metadata"]["startup-script"]
            assert "PAYLOAD_SHA256" not in vm.inputs["metadata"]["startup-script"]


def test_the_watchdog_recreates_the_tpu_vm_with_the_loader():
    """The controller's embedded copy of the TPU VM's script (the watchdog's recreations)
    is the loader too, so it never goes stale."""
    run = run_offline("v6e-euw4")
    (vm,) = [r for r in run.resources if r.name == "tpu-vm"]
    controller = next(r for r in run.resources if r.name == "startup-controller-script")
    script = controller.inputs["content"]
    embedded = render.b64(vm.inputs["metadata"]["startup-script"])
    assert f"readonly TPU_STARTUP_SCRIPT_B64={embedded}\n" in script


def test_the_loader_passes_shellcheck(tmp_path):
    assert shellcheck(render.render_loader("tpu", "b"), tmp_path / "loader.sh") == ""


@pytest.fixture(scope="module")
def tpu_run():
    return run_offline("v6e-euw4")


def test_the_loader_runs_the_script_and_payload_the_pointer_names(tpu_run, sandbox):
    publish_payload(tpu_run, sandbox)
    bucket = publish_startup(tpu_run, sandbox)
    result = sandbox.run(loader_script(tpu_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    assert "job gpt2-small-clm: payload " in result.stderr
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "started"
    pointer = pointer_of(tpu_run)
    assert status["payload_sha256"] == pointer["payload_sha256"]
    # The payload came from the loader's checked copy: the script downloaded no second one.
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "payload/" in c]
    assert len(downloads) == 1


@pytest.mark.parametrize("tampered", ["payload", "script"])
def test_the_loader_refuses_what_the_pointer_does_not_name(tpu_run, sandbox, tampered):
    _, archive = publish_payload(tpu_run, sandbox)
    bucket = publish_startup(tpu_run, sandbox)
    pointer = pointer_of(tpu_run)
    name = archive if tampered == "payload" else pointer["script_tpu"]
    path = sandbox.gcs / bucket / name
    path.write_bytes(path.read_bytes() + b"\n")
    result = sandbox.run(loader_script(tpu_run, "tpu-vm"))
    assert result.returncode == 1
    what = "the payload archive" if tampered == "payload" else "the startup script"
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "failed"
    assert status["message"].startswith(f"{what} gs://{bucket}/{name} has sha256 ")
    expected = pointer["payload_sha256"] if tampered == "payload" else pointer["script_tpu_sha256"]
    assert f"but gs://{bucket}/jobs/current.json names {expected}" in status["message"]
    assert not [c for c in sandbox.calls if c.startswith("pip ")]


def test_a_missing_pointer_is_one_clear_line(tpu_run, sandbox):
    # No wait at all (the retries: tests/infra/test_first_boot.py).
    result = sandbox.run(loader_script(tpu_run, "tpu-vm"), TPU_PRETRAIN_BOOT_WAIT_SECONDS="0")
    assert result.returncode == 1
    assert "cannot read the job pointer gs://" in result.stderr
    assert "/jobs/current.json after 0s of retries (pulumi up writes it;" in result.stderr
