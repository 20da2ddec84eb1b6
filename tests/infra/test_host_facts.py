"""Every startup script records what its VM really is and compares it with the catalog
(templates/facts.sh): gs://…/runs/<job>/bootstrap/facts-<name>.json, one line per mismatch in
the bootstrap status, and the local file the payload carries into status.json. Run in the
script sandbox (script_sandbox.py): the metadata server, the image's units, its EFI
variables, python3, gcloud, gsutil and the installed libtpu are the test's."""

from __future__ import annotations

import json
import re
import shutil
import stat

import pytest
from harness import run_offline, startup_script
from script_sandbox import Sandbox, as_worker, publish_payload

from infra.components.controller import SHIELDED_VM
from infra.render import render

EFI_GUID = "8be4df61-93ca-11d2-aa0d-00e098032b8c"  # EFI_GLOBAL_VARIABLE (UEFI spec)
NVIDIA_SMI = """#!/bin/bash
echo "nvidia-smi $*" >>"$CALLS"
for ((i = 0; i < ${SMI_GPUS:-1}; i++)); do echo "GPU $i: NVIDIA L4 (UUID: GPU-0$i)"; done
"""
FACT_KEYS = {
    "python", "gcloud", "gsutil", "image", "os", "secure_boot", "accelerator_type",
    "machine_type", "worker_network_endpoints", "tpu_env", "tpu_runtime_unit", "libtpu",
    "gpus", "install_seconds", "kernel", "nvidia_modules", "nvidia_driver", "nvidia_branch",
    "nic_driver",
}  # fmt: skip
EXPECTED_KEYS = {
    "python", "accelerator_type", "machine_type", "libtpu", "gpus", "secure_boot",
    "nvidia_modules", "nvidia_branch", "nic_driver",
}  # fmt: skip
# /proc/driver/nvidia/version's first line for each flavour (the open one names itself).
OPEN_570 = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build"
PROPRIETARY_550 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.163.01  Tue Apr 8 2025"


@pytest.fixture(scope="module")
def tpu_run():
    return run_offline("v6e-euw4")  # v6e: secure boot asked (catalog shielded_boot)


def _metadata(box: Sandbox, **values: str) -> None:
    md = box.state / "md"
    md.mkdir(exist_ok=True)
    for key, value in values.items():
        (md / key.replace("_", "-")).write_text(value + "\n")


def _secure_boot(box: Sandbox, on: bool) -> None:
    efivars = box.root / "sys/firmware/efi/efivars"
    efivars.mkdir(parents=True, exist_ok=True)
    (efivars / f"SecureBoot-{EFI_GUID}").write_bytes(b"\x06\x00\x00\x00" + bytes([int(on)]))


def _facts(box: Sandbox, bucket: str, job: str, name: str) -> dict:
    doc = json.loads((box.gcs / bucket / f"runs/{job}/bootstrap/facts-{name}.json").read_text())
    assert set(doc) == {"role", "name", "host", "collected_at", "facts", "expected", "mismatches"}
    assert set(doc["facts"]) >= FACT_KEYS and set(doc["expected"]) == EXPECTED_KEYS
    assert isinstance(doc["facts"]["install_seconds"], int)
    return doc


def _expected_libtpu(script: str) -> str:
    """The libtpu the rendered script expects: its backend's overlay's."""
    return re.search(r"^readonly EXPECT_LIBTPU=(\S+)$", script, re.MULTILINE).group(1)


def _nvidia(box: Sandbox, banner: str) -> None:
    path = box.root / "proc/driver/nvidia/version"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(banner + "\nGCC version:  gcc version 12.3.0\n")


def _nic(box: Sandbox, driver: str) -> None:
    """sysfs of one NIC: /sys/class/net/ens4/device/driver -> .../drivers/<driver>."""
    target = box.root / "sys/bus/pci/drivers" / driver
    target.mkdir(parents=True, exist_ok=True)
    device = box.root / "sys/class/net/ens4/device"
    device.mkdir(parents=True, exist_ok=True)
    (device / "driver").symlink_to(target)
    (box.root / "sys/class/net/lo").mkdir(parents=True, exist_ok=True)  # no device: skipped


def _bootstrap(box: Sandbox, bucket: str, job: str, name: str) -> dict:
    return json.loads((box.gcs / bucket / f"runs/{job}/bootstrap/{name}.json").read_text())


def test_a_tpu_vm_that_matches_the_catalog(tpu_run, sandbox):
    bucket, _ = publish_payload(tpu_run, sandbox)
    _metadata(sandbox, image="v2-alpha-tpuv6e", accelerator_type="v6e-8")
    _secure_boot(sandbox, on=True)
    result = sandbox.run(startup_script(tpu_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    doc = _facts(sandbox, bucket, "gpt2-small-clm", "tpu")
    facts = doc["facts"]
    assert (doc["role"], doc["name"]) == ("tpu", "tpu")
    assert facts["python"] == "3.10" and facts["gcloud"] == "499.0.0"
    assert facts["gsutil"] == "5.31" and facts["image"] == "v2-alpha-tpuv6e"
    assert facts["accelerator_type"] == "v6e-8" and facts["secure_boot"] == "enabled"
    # v6e installs the JAX environment (auto): its libtpu is the JAX overlay's.
    libtpu = _expected_libtpu(startup_script(tpu_run, "tpu-vm"))
    assert libtpu == "0.0.52"
    assert facts["libtpu"] == libtpu
    assert facts["tpu_runtime_unit"] == "absent" and facts["tpu_env"] == ""
    assert doc["expected"] == {
        "python": "3.10",
        "accelerator_type": "v6e-8",
        "machine_type": "",
        "libtpu": libtpu,
        "gpus": "",
        "secure_boot": "true",
        "nvidia_modules": "",
        "nvidia_branch": "",
        "nic_driver": "",
    }
    assert doc["mismatches"] == []
    # The trainer reads the same document (TPU_PRETRAIN_HOST_FACTS of its unit).
    local = sandbox.root / "opt/tpu-pretrain/host-facts.json"
    assert json.loads(local.read_text()) == doc
    assert stat.S_IMODE(local.stat().st_mode) == 0o644
    assert "host_checks" not in _bootstrap(sandbox, bucket, "gpt2-small-clm", "tpu")
    assert "host facts match the catalog" in result.stderr


def test_every_mismatch_is_one_line_in_the_bootstrap_status(tpu_run, sandbox):
    bucket, _ = publish_payload(tpu_run, sandbox)
    _metadata(sandbox, accelerator_type="v5litepod-8")
    _secure_boot(sandbox, on=False)
    result = sandbox.run(
        startup_script(tpu_run, "tpu-vm"), STUB_PYTHON_VERSION="3.12", STUB_LIBTPU_VERSION="0.0.21"
    )
    assert result.returncode == 0, result.stderr  # reported, not fatal
    libtpu = _expected_libtpu(startup_script(tpu_run, "tpu-vm"))
    lines = [
        "catalog says python 3.10 on v2-alpha-tpuv6e; this VM has 3.12",
        "catalog says accelerator type v6e-8; this VM has v5litepod-8",
        f"catalog says libtpu {libtpu}; this VM has 0.0.21",
        "catalog says secure boot enabled; this VM has disabled",
    ]
    assert _facts(sandbox, bucket, "gpt2-small-clm", "tpu")["mismatches"] == lines
    # Every later status of this boot carries them (the last one here: "started").
    status = _bootstrap(sandbox, bucket, "gpt2-small-clm", "tpu")
    assert status["state"] == "started" and status["host_checks"] == lines
    for line in lines:
        assert f"host check: {line}" in result.stderr
    # So does the trainer unit's helper, which writes the statuses after the boot.
    helper = (sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper").read_text()
    assert "declare -- HOST_CHECKS=" in helper and "this VM has 3.12" in helper


def test_a_slice_host_records_its_worker_endpoints_runtime_unit_and_tpu_env(sandbox):
    run = run_offline("v4-32-usc2")
    bucket, _ = publish_payload(run, sandbox)
    as_worker(sandbox, 1)
    units = sandbox.state / "unit-files"
    units.mkdir()
    (units / "tpu-runtime.service").write_text(
        "[Service]\nExecStartPre=/bin/true\nExecStart=/usr/bin/docker run --name tpu-runtime "
        "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.18.0-pjrt\n"
    )
    tpu_env = sandbox.root / "home/tpu-runtime"
    tpu_env.mkdir(parents=True)
    raw = "ACCELERATOR_TYPE: 'v4-32'\nTOPOLOGY: \"2x2x4\"\tWORKER_ID: \\1\x07\n"
    (tpu_env / "tpu-env").write_text(raw)
    # A slice installs the JAX environment: its libtpu is the JAX overlay's.
    script = startup_script(run, "tpu-vm")
    libtpu = re.search(r"^readonly EXPECT_LIBTPU=(\S+)$", script, re.MULTILINE).group(1)
    assert libtpu != render.read_pins().libtpu
    result = sandbox.run(script, STUB_LIBTPU_VERSION=libtpu)
    assert result.returncode == 0, result.stderr
    doc = _facts(sandbox, bucket, "bert-base-mlm", "tpu-worker-1")
    facts = doc["facts"]
    assert doc["name"] == "tpu-worker-1"
    assert (facts["worker"], facts["slice_hosts"]) == ("1", "4")
    assert facts["worker_network_endpoints"] == ",".join(
        f"unknown:unknown:10.10.0.{i}" for i in (2, 3, 4, 5)
    )
    assert facts["tpu_runtime_unit"].startswith("ExecStart=/usr/bin/docker run --name tpu-runtime")
    # Quotes, backslashes, tabs and newlines survive as JSON; other control bytes are dropped.
    assert facts["tpu_env"] == raw.replace("\x07", "").rstrip("\n")
    assert facts["accelerator_type"] == "v4-32" and doc["mismatches"] == []


def test_a_gpu_vm_checks_its_machine_type_and_gpu_count(sandbox):
    run = run_offline("l4x2-use1")  # g2-standard-24 carries 2 x L4; secure boot off
    bucket, _ = publish_payload(run, sandbox)
    smi = sandbox.bin / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    _metadata(sandbox, machine_type="projects/123/zones/us-east1-d/machineTypes/g2-standard-24")
    _secure_boot(sandbox, on=False)
    _nvidia(sandbox, OPEN_570)
    script = startup_script(run, "gpu-vm")
    result = sandbox.run(script, SMI_GPUS="1")
    assert result.returncode == 0, result.stderr
    doc = _facts(sandbox, bucket, "bert-small-mlm-gpu", "gpu")
    assert doc["facts"]["machine_type"] == "g2-standard-24" and doc["facts"]["gpus"] == "1"
    assert doc["expected"]["gpus"] == "2" and doc["expected"]["secure_boot"] == "false"
    assert doc["mismatches"] == ["catalog says GPUs 2 on g2-standard-24; this VM has 1"]

    # Which driver and kernel loaded: the catalog's flavour and branch (nvidia-open-570).
    facts = doc["facts"]
    assert (facts["nvidia_modules"], facts["nvidia_driver"], facts["nvidia_branch"]) == (
        "open", "570.133.20", "570",
    )  # fmt: skip
    assert facts["kernel"] and facts["nic_driver"] == "unknown"
    assert (doc["expected"]["nvidia_modules"], doc["expected"]["nvidia_branch"]) == ("open", "570")
    assert doc["expected"]["nic_driver"] == ""  # G2 keeps the default NIC

    shutil.rmtree(sandbox.root / "opt/tpu-pretrain/gpu-watch", ignore_errors=True)
    again = sandbox.run(script, SMI_GPUS="2")
    assert again.returncode == 0, again.stderr
    assert _facts(sandbox, bucket, "bert-small-mlm-gpu", "gpu")["mismatches"] == []


def test_a_gpu_vm_says_which_driver_and_nic_loaded_against_the_catalog(sandbox):
    """An A3 VM (gVNIC, NVIDIA's open 570 modules installed at boot) that booted the
    proprietary 550 module on a VirtIO NIC: three lines, each naming what loaded."""
    overrides = {
        "tpu-pretrain:gpuMachineType": "a3-highgpu-8g",
        "tpu-pretrain:gpuZone": "us-central1-b",
        "tpu-pretrain:scheduling": "spot",
    }
    run = run_offline("a100x4-usc1", overrides)
    bucket, _ = publish_payload(run, sandbox)
    smi = sandbox.bin / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    _nvidia(sandbox, PROPRIETARY_550)
    _nic(sandbox, "virtio_net")
    result = sandbox.run(startup_script(run, "gpu-vm"), SMI_GPUS="8")
    assert result.returncode == 0, result.stderr
    doc = _facts(sandbox, bucket, "gpt2-small-clm", "gpu")
    assert doc["facts"]["nic_driver"] == "virtio_net"
    assert doc["expected"]["nic_driver"] == "gve"
    assert doc["mismatches"] == [
        "catalog says NVIDIA kernel modules open; this VM has proprietary",
        "catalog says NVIDIA driver branch 570; this VM has 550",
        "catalog says NIC driver gve; this VM has virtio_net",
    ]


def test_the_controller_expects_secure_boot(tpu_run, sandbox):
    bucket, _ = publish_payload(tpu_run, sandbox)
    _secure_boot(sandbox, on=False)
    result = sandbox.run(startup_script(tpu_run, "controller-vm"))
    assert result.returncode == 0, result.stderr
    doc = _facts(sandbox, bucket, "gpt2-small-clm", "controller")
    # What the program asks of the controller VM (its shielded settings).
    assert render.CONTROLLER_SECURE_BOOT is SHIELDED_VM["enable_secure_boot"] is True
    assert doc["expected"]["secure_boot"] == "true" and doc["expected"]["python"] == ""
    assert doc["mismatches"] == ["catalog says secure boot enabled; this VM has disabled"]
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-data.service").read_text()
    assert "Environment=TPU_PRETRAIN_HOST_FACTS=/opt/tpu-pretrain/host-facts.json\n" in unit


def test_unknown_facts_are_recorded_and_never_called_a_mismatch(tpu_run, sandbox):
    """No metadata values, no EFI variables, a gsutil that cannot say its version: empty or
    "unknown", no mismatch."""
    bucket, _ = publish_payload(tpu_run, sandbox)
    result = sandbox.run(startup_script(tpu_run, "tpu-vm"), STUB_GSUTIL_VERSION="")
    assert result.returncode == 0, result.stderr
    doc = _facts(sandbox, bucket, "gpt2-small-clm", "tpu")
    facts = doc["facts"]
    assert facts["secure_boot"] == "unknown" and facts["accelerator_type"] == ""
    assert facts["gsutil"] == "" and facts["image"] == ""
    assert doc["mismatches"] == []
