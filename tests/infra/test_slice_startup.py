"""A multi-host slice: one startup script, every host.

Each supported slice type's rendered startup script run as every worker index, each in a
fresh script sandbox (script_sandbox.py): the same JAX trainer on every host, each worker's
own status, the slice metadata (retried while the metadata server lags, refused when it is not
this slice, hostname endpoints as JAX reads them), and the watchdog recreating a preempted
slice as one node."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness import run_offline, startup_script
from script_sandbox import (
    SLICE_IPS,
    Sandbox,
    Watch,
    as_worker,
    assert_gcloud_flags_exist,
    new_sandbox,
    publish_payload,
    run_helper,
    shellcheck,
    short_sha,
    split_flags,
    unit_environment,
)

# Every slice type infra/catalogs/tpu.yaml supports, as a stack: zone and base image (the ones its
# evidence uses where the catalog offers them) and its hosts.
SLICE_STACKS = {
    "v4-16": ("us-central2-b", "tpu-ubuntu2204-base", 2),
    "v4-32": ("us-central2-b", "tpu-ubuntu2204-base", 4),
    "v5litepod-16": ("europe-west4-b", "v2-alpha-tpuv5-lite", 4),
    "v5litepod-32": ("europe-west4-b", "v2-alpha-tpuv5-lite", 8),
    "v5p-32": ("us-east5-a", "v2-alpha-tpuv5", 4),
}


@pytest.fixture(scope="module")
def slice_run():
    return run_offline("v4-32-usc2")


def slice_stack(accelerator_type: str):
    """The v4-32-usc2 stack (job bert-base-mlm, train.backend auto) on another slice type."""
    zone, image, _ = SLICE_STACKS[accelerator_type]
    return run_offline(
        "v4-32-usc2",
        {
            "tpu-pretrain:tpuZone": zone,
            "tpu-pretrain:acceleratorType": accelerator_type,
            "tpu-pretrain:runtimeVersion": image,
        },
    )


def _slice_status(sandbox: Sandbox, bucket: str, name: str) -> dict:
    return json.loads(
        (sandbox.gcs / bucket / f"runs/bert-base-mlm/bootstrap/{name}.json").read_text()
    )


def _slice_unit_env(accelerator_type: str, image: str, worker: int) -> dict[str, str]:
    """The trainer unit of a slice host: the single-host JAX unit's environment
    (test_tpu_jax_env.py) plus the two the payload reads on a slice."""
    return {
        "PYTHONUNBUFFERED": "1",
        "TPU_PAYLOAD_VERBOSE": "1",
        "KERAS_BACKEND": "jax",
        "TPU_PAYLOAD_BACKEND": "jax",
        "JAX_PLATFORMS": "tpu",
        "TPU_PAYLOAD_JAX_DISTRIBUTED": "auto",
        "TPU_PRETRAIN_WORKER": str(worker),
        "TPU_PRETRAIN_ACCELERATOR_TYPE": accelerator_type,
        "TPU_PRETRAIN_RUNTIME_VERSION": image,
        "TPU_PRETRAIN_HOST_FACTS": "/opt/tpu-pretrain/host-facts.json",
    }


TPU_RUNTIME_UNIT = (
    "[Service]\nExecStart=/usr/bin/docker run --name tpu-runtime "
    "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.18.0-pjrt\n"
)


@pytest.mark.parametrize("accelerator_type", sorted(SLICE_STACKS))
def test_every_worker_of_a_supported_slice_runs_the_same_jax_trainer(accelerator_type, tmp_path):
    """The startup script of each supported slice type, run as every worker index: the JAX
    environment (as on a single host), the one trainer unit with this worker's index, no TF
    TPU worker, and the image's tpu-runtime.service left alone."""
    _, image, hosts = SLICE_STACKS[accelerator_type]
    run = slice_stack(accelerator_type)
    script = startup_script(run, "tpu-vm")
    assert f"readonly TPU_HOSTS={hosts}\n" in script
    assert "readonly PAYLOAD_BACKEND=jax\n" in script
    assert "readonly VM_REQUIREMENTS=requirements/tpu-vm-jax.txt\n" in script
    assert shellcheck(script, tmp_path / "tpu.sh") == ""
    ips = tuple(f"10.10.0.{i + 2}" for i in range(hosts))
    units = {}
    for worker in range(hosts):
        box = new_sandbox(tmp_path / f"worker-{worker}")
        bucket, _ = publish_payload(run, box)
        as_worker(box, worker, ips, accelerator_type)
        (box.state / "unit-files").mkdir()
        (box.state / "unit-files/tpu-runtime.service").write_text(TPU_RUNTIME_UNIT)
        app = f"{box.root}/opt/tpu-pretrain"
        short = short_sha(script)

        first = box.run(script)
        assert first.returncode == 0, (worker, first.stderr)
        calls = box.calls
        # The JAX environment exactly as on one host: uv's Python 3.12, the JAX overlay, no
        # tf_keras.
        assert "uv python install --quiet --no-bin 3.12" in calls
        assert f"uv-python -m venv {app}/venv-{short}" in calls
        assert not [c for c in calls if "tf_keras" in c]
        (requirements,) = box.state.glob("requirements-*.txt")
        assert "jax==0.12.0.1" in requirements.read_text()
        # One unit, the same on every host but for the worker's index.
        unit_dir = box.root / "etc/systemd/system"
        assert [p.name for p in unit_dir.iterdir()] == ["tpu-pretrain-train.service"]
        unit = (unit_dir / "tpu-pretrain-train.service").read_text()
        assert unit_environment(unit) == _slice_unit_env(accelerator_type, image, worker)
        assert (
            f"ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload run --job gs://{bucket}/jobs/"
            "bert-base-mlm.json\n" in unit
        )
        assert re.findall(r"^ExecStartPre=(.*)$", unit, re.MULTILINE) == [
            "/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-manifest"
        ]
        assert "Restart=on-failure\n" in unit and "RestartPreventExitStatus=2\n" in unit
        assert "systemctl restart --no-block tpu-pretrain-train.service" in calls
        units[worker] = unit
        # No TensorFlow TPU worker and none of its variables; tpu-runtime.service untouched
        # (the host facts only read it).
        assert "grpc" not in unit and "TPU_NAME" not in unit and "8470" not in unit
        assert not [c for c in calls if "tpu-pretrain-tpu-worker" in c or "grpc_tpu_worker" in c]
        runtime = [c for c in calls if "tpu-runtime" in c]
        assert runtime == ["systemctl cat tpu-runtime.service"], runtime
        status = _slice_status(box, bucket, f"tpu-worker-{worker}")
        assert (status["state"], status["worker"]) == ("started", str(worker))
        assert status["slice"] == ",".join(ips)
        boot = box.gcs / bucket / "runs/bert-base-mlm/bootstrap"
        facts = json.loads((boot / f"facts-tpu-worker-{worker}.json").read_text())["facts"]
        assert (facts["worker"], facts["slice_hosts"]) == (str(worker), str(hosts))
        # The trainer's status: worker 0's is the job's (tpu.json), every other worker's its own.
        helper = (box.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper").read_text()
        expected = "''" if worker == 0 else f"tpu-worker-{worker}"
        assert f"\nSTATUS_NAME={expected}\n" in helper
        assert "wait-workers" not in helper and "worker-ready" not in helper

        second = box.run(script)  # idempotent: nothing installed or restarted again
        assert second.returncode == 0, second.stderr
        assert not [c for c in box.calls if c.startswith(("pip ", "uv ")) or "restart" in c]
        assert (unit_dir / "tpu-pretrain-train.service").read_text() == unit
    # ...and the units differ in nothing else.
    assert len({re.sub(r"(WORKER=|\(worker )\d+", r"\1N", u) for u in units.values()}) == 1


def test_slice_workers_trainers_report_to_their_own_status(slice_run, sandbox):
    """Worker 0's trainer writes the job's bootstrap status (tpu.json, as on one host); any
    other worker's trainer writes its own host's, so that no worker overwrites worker 0's."""
    bucket, _ = publish_payload(slice_run, sandbox)
    as_worker(sandbox, 2)
    assert sandbox.run(startup_script(slice_run, "tpu-vm")).returncode == 0
    stopped = run_helper(sandbox, "stopped", SERVICE_RESULT="exit-code", EXIT_STATUS="1")
    assert stopped.returncode == 0, stopped.stderr
    status = _slice_status(sandbox, bucket, "tpu-worker-2")
    assert status["state"] == "restarting" and status["worker"] == "2"
    assert not (sandbox.gcs / bucket / "runs/bert-base-mlm/bootstrap/tpu.json").exists()
    as_worker(sandbox, 0)
    assert sandbox.run(startup_script(slice_run, "tpu-vm")).returncode == 0
    finished = run_helper(sandbox, "stopped", SERVICE_RESULT="success", EXIT_STATUS="0")
    assert finished.returncode == 0, finished.stderr
    assert _slice_status(sandbox, bucket, "tpu")["state"] == "finished"


def test_the_single_host_script_reads_no_slice_metadata(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    result = sandbox.run(startup_script(stack_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    # Only the host check's single reads (templates/facts.sh records what is there), never
    # the slice's worker number with its retries.
    instance = "http://metadata.google.internal/computeMetadata/v1/instance"
    assert [c for c in sandbox.calls if c.startswith("curl ")] == [
        f"curl -fsS -H Metadata-Flavor: Google {instance}/{key}"
        for key in (
            "image",
            "attributes/accelerator-type",
            "machine-type",
            "attributes/worker-network-endpoints",
        )
    ]
    assert "readonly TPU_HOSTS=1\n" in startup_script(stack_run, "tpu-vm")


def test_slice_metadata_is_retried_while_the_metadata_server_lags(slice_run, sandbox):
    bucket, _ = publish_payload(slice_run, sandbox)
    as_worker(sandbox, 2)
    result = sandbox.run(startup_script(slice_run, "tpu-vm"), FAIL_FIRST_METADATA="2")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("metadata agent-worker-number not readable yet") == 2
    assert sandbox.calls.count("sleep 5") == 2
    assert _slice_status(sandbox, bucket, "tpu-worker-2")["state"] == "started"


def test_unreadable_slice_metadata_fails_with_a_status_and_a_rerun(slice_run, sandbox):
    bucket, _ = publish_payload(slice_run, sandbox)
    as_worker(sandbox, 2)
    result = sandbox.run(startup_script(slice_run, "tpu-vm"), FAIL_FIRST_METADATA="99")
    assert result.returncode == 1
    status = _slice_status(sandbox, bucket, "tpu")
    assert status["state"] == "failed"
    assert "cannot read its worker number" in status["message"]
    assert [c for c in sandbox.calls if c.startswith("systemd-run --unit=tpu-pretrain-startup")]
    assert not (sandbox.root / "etc/systemd/system").exists()


def test_hostname_endpoints_are_read_as_jax_reads_them(slice_run, sandbox):
    """worker-network-endpoints' newer format, bare hostnames (jax cloud_tpu_cluster.py)."""
    bucket, _ = publish_payload(slice_run, sandbox)
    names = tuple(f"t1v-n-0123abcd-w-{i}" for i in range(4))
    as_worker(sandbox, 3, names, hostnames=True)
    result = sandbox.run(startup_script(slice_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    status = _slice_status(sandbox, bucket, "tpu-worker-3")
    assert status["slice"] == ",".join(names)
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    assert unit_environment(unit)["TPU_PRETRAIN_WORKER"] == "3"


@pytest.mark.parametrize(
    ("worker", "ips"),
    [
        (4, SLICE_IPS),
        ("x", SLICE_IPS),
        (0, SLICE_IPS[:1]),
        (0, ("10.10.0.2", "", "a", "b")),
        (0, ("a:b", "c:d", "e:f", "g:h")),
    ],
    ids=["index-too-high", "index-not-a-number", "one-endpoint", "empty-entry", "two-fields"],
)
def test_metadata_that_is_not_this_slice_is_refused(slice_run, sandbox, worker, ips):
    bucket, _ = publish_payload(slice_run, sandbox)
    as_worker(sandbox, worker, ips, hostnames=":" in ips[0])
    result = sandbox.run(startup_script(slice_run, "tpu-vm"))
    assert result.returncode == 1
    status = _slice_status(sandbox, bucket, "tpu")
    assert status["state"] == "failed"
    assert status["message"].startswith("metadata does not describe a multi-host v4-32 slice")
    assert not (sandbox.root / "etc/systemd/system").exists()


def test_the_nodes_own_host_count_wins_over_the_catalogs(slice_run, sandbox):
    """Host counts in the catalog are from google/xpk; the node's worker-network-endpoints is
    the truth (jax.distributed.initialize reads it too): noted, not refused."""
    bucket, _ = publish_payload(slice_run, sandbox)
    as_worker(sandbox, 1, SLICE_IPS[:2])
    result = sandbox.run(startup_script(slice_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    status = _slice_status(sandbox, bucket, "tpu-worker-1")
    assert status["slice"] == "10.10.0.2,10.10.0.3"
    assert "the catalog expects 4 hosts for v4-32, the node has 2" in result.stderr
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    assert unit_environment(unit)["TPU_PRETRAIN_WORKER"] == "1"


def test_a_preempted_slice_is_recreated_as_one_node(slice_run, sandbox):
    """A v4-32 slice is one TPU node of 4 hosts: one describe, one delete, one queued create
    with the slice's accelerator type; never a host at a time."""
    watch = Watch(slice_run, sandbox)
    # Every host of the old slice had reported ready.
    boot = watch.run_root / "bootstrap"
    for worker in range(4):
        (boot / f"tpu-worker-{worker}.json").write_text(
            json.dumps({"state": "ready", "worker": str(worker), "slice": ",".join(SLICE_IPS)})
        )
    watch.set_state("PREEMPTED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    # ...and none of them counts for the next slice, even if it gets the same IPs.
    for worker in range(4):
        status = json.loads((boot / f"tpu-worker-{worker}.json").read_text())
        assert (status["state"], status["worker"], status["slice"]) == (
            "recreating",
            str(worker),
            "",
        )
    (argv,) = watch.creates("qr-create")
    positional, flags, switches = split_flags(argv)
    assert positional[-1] == watch.qr
    assert flags["--node-id"] == watch.vm.inputs["name"] == "tp-v4-32-usc2-tpu"
    assert flags["--accelerator-type"] == "v4-32"
    assert flags["--runtime-version"] == "tpu-ubuntu2204-base"
    assert "--spot" in switches
    _, path = flags["--metadata-from-file"].split("=", 1)
    startup = Path(path).read_text()
    assert startup == watch.vm.inputs["metadata"]["startup-script"]
    # Every new host runs the loader, which runs the one slice script the pointer names.
    assert "readonly ROLE=tpu\n" in startup
    assert "readonly TPU_HOSTS=4\n" in startup_script(watch.run, "tpu-vm")
    assert watch.status["message"].startswith(
        f"queued {watch.qr} for tp-v4-32-usc2-tpu (the whole 4-host v4-32 slice, one node)"
    )
    assert_gcloud_flags_exist(watch)
