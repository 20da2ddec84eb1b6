"""The GPU VM's rendered startup script, run in script_sandbox.py's sandbox
(stub gcloud/pip/systemctl, a fake bucket) plus a stub nvidia-smi: the driver check, the
install (retried, the GPU overlay), the trainer unit's environment, and "GPU not found" as
exit 2 with the reason in the bucket's status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_stubs import KERNEL
from harness import run_offline, startup_script, uv_resolver
from script_sandbox import Sandbox, publish_payload, shellcheck, short_sha, unit_environment

from infra.catalogs.gpu import load_gpu_catalog
from infra.render import render

ROOT = Path(__file__).resolve().parents[2]

# The ptxas folder the stub venv python names (gpu_stubs.VENV_PYTHON).
PTXAS = "/opt/tpu-pretrain/venv/lib/python3.10/site-packages/nvidia/cuda_nvcc/bin"
DRIVER_PACKAGES = ["nvidia-open-570", "nvidia-utils-570"]


@pytest.fixture(scope="module")
def gpu_run():
    return run_offline("l4x2-use1")  # G2: Ubuntu, the driver installed at boot


@pytest.fixture(scope="module")
def dlvm_run():
    return run_offline("t4-usc1")  # the Deep Learning VM image brings its driver


def _status(box: Sandbox, bucket: str) -> dict:
    path = box.gcs / bucket / "runs/bert-small-mlm-gpu/bootstrap/gpu.json"
    return json.loads(path.read_text())


def test_gpu_script_passes_shellcheck(gpu_run, tmp_path):
    assert shellcheck(startup_script(gpu_run, "gpu-vm"), tmp_path / "gpu.sh") == ""


def test_gpu_script_installs_the_cuda_build_and_a_trainer_that_sees_the_gpus(gpu_run, box):
    bucket, _ = publish_payload(gpu_run, box)
    script = startup_script(gpu_run, "gpu-vm")
    short = short_sha(script)
    first = box.run(script, SMI_GPUS="2")
    assert first.returncode == 0, first.stderr
    calls = box.calls
    assert "nvidia-smi -L" in calls
    pip_calls = [c for c in calls if c.startswith("pip ")]
    assert len(pip_calls) == 3
    (requirements,) = box.state.glob("requirements-*.txt")
    lock = requirements.read_text()
    # requirements/gpu-vm.txt replaces the lock's tensorflow with its CUDA build.
    assert not re.search(r"^(tensorflow|tf[-_]keras)==", lock, re.MULTILINE)
    assert lock.splitlines()[-3:] == [
        "tensorflow[and-cuda]==2.20.0",
        "keras==3.12.4",
        "Markdown==3.10.3",
    ]
    assert not re.search(r"^(tensorflow-tpu|libtpu)==", lock, re.MULTILINE)
    unit = (box.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    assert "RestartPreventExitStatus=2\n" in unit and "Restart=on-failure\n" in unit
    assert "Description=tpu-pretrain trainer for job bert-small-mlm-gpu (2x L4 on " in unit
    assert unit_environment(unit) == {
        "PYTHONUNBUFFERED": "1",
        "TF_USE_LEGACY_KERAS": "1",
        "WRAPT_DISABLE_EXTENSIONS": "true",
        "FORCE_TF_AVAILABLE": "1",
        "TPU_PAYLOAD_BACKEND": "tf",
        "TPU_PAYLOAD_VERBOSE": "1",
        "PATH": f"{PTXAS}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "TPU_PRETRAIN_GPU": "L4",
        "TPU_PRETRAIN_GPU_COUNT": "2",
        "TPU_PRETRAIN_GPU_PRECISION": "mixed_bfloat16",
        "TPU_PRETRAIN_RUNTIME_VERSION": "ubuntu-2204-lts",
        "TPU_PRETRAIN_HOST_FACTS": "/opt/tpu-pretrain/host-facts.json",
    }
    assert "systemctl restart --no-block tpu-pretrain-train.service" in calls
    status = _status(box, bucket)
    assert status["state"] == "started" and status["role"] == "gpu"
    # Idempotent: a reboot finds the install and the unit as they are.
    second = box.run(script, SMI_GPUS="2")
    assert second.returncode == 0, second.stderr
    assert not [c for c in box.calls if c.startswith(("pip ", "python3 -m venv"))]
    assert f"payload {short} already installed" in second.stderr


def test_a_failed_install_is_retried(gpu_run, box):
    bucket, _ = publish_payload(gpu_run, box)
    result = box.run(
        startup_script(gpu_run, "gpu-vm"), FAIL_FIRST_PIP="1", TPU_PRETRAIN_INSTALL_ATTEMPTS="3"
    )
    assert result.returncode == 0, result.stderr
    assert "attempt 2/3" in result.stderr
    assert _status(box, bucket)["state"] == "started"


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"SMI_FAIL": "1"}, "GPU not found: nvidia-smi fails on 1x T4 on n1-standard-8: "),
        ({"SMI_GPUS": "0"}, "GPU not found: nvidia-smi lists no GPU on 1x T4 on n1-standard-8"),
    ],
)
def test_no_gpu_is_exit_2_with_the_reason_in_the_status(dlvm_run, box, env, reason):
    """The image's own driver (DLVM) fails or sees no GPU: nothing is installed or rebooted."""
    bucket, _ = publish_payload(dlvm_run, box)
    result = box.run(startup_script(dlvm_run, "gpu-vm"), **env)
    assert result.returncode == 2, result.stderr
    status = _status(box, bucket)
    assert status["state"] == "failed"
    assert status["message"].startswith(reason), status["message"]
    assert "not training on the CPU" in status["message"]
    # Nothing installed, no trainer unit: exit 2 is not retried by anything.
    assert not [c for c in box.calls if c.startswith(("pip ", "systemctl", "apt-get"))]
    assert not (box.root / "etc/systemd/system/tpu-pretrain-train.service").exists()


def test_no_driver_at_all_is_exit_2(dlvm_run, box):
    """An image that should bring its driver (DLVM) and has none: nothing is installed."""
    bucket, _ = publish_payload(dlvm_run, box)
    (box.bin / "nvidia-smi").unlink()
    result = box.run(startup_script(dlvm_run, "gpu-vm"))
    assert result.returncode == 2, result.stderr
    message = _status(box, bucket)["message"]
    assert message.startswith(
        "GPU not found: no nvidia-smi on image common-cu128-ubuntu-2204-nvidia-570"
    )
    assert not [c for c in box.calls if c.startswith(("apt-get", "dpkg", "curl"))]


def test_the_driver_is_installed_once_from_nvidias_repository(gpu_run, box):
    bucket, _ = publish_payload(gpu_run, box)
    (box.bin / "nvidia-smi").unlink()
    # The image's kernel and its flavour's metapackage are installed; linux-modules is not.
    (box.state / "dpkg").mkdir(parents=True, exist_ok=True)
    for package in (f"linux-image-{KERNEL}", "linux-image-gcp", "linux-gcp"):
        (box.state / "dpkg" / package).touch()
    script = startup_script(gpu_run, "gpu-vm")
    first = box.run(script, SMI_GPUS="2")
    assert first.returncode == 0, first.stderr
    calls = box.calls
    keyring = [c for c in calls if c.startswith("curl ") and "cuda-keyring" in c]
    assert len(keyring) == 1
    assert keyring[0].endswith(
        " https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/"
        "cuda-keyring_1.1-1_all.deb"
    )
    assert any(c.startswith("dpkg -i ") for c in calls)
    # The running kernel's headers in the same transaction (DKMS builds for that kernel,
    # not for apt's newest headers), then the driver and the running kernel held.
    assert (
        f"apt-get -o DPkg::Lock::Timeout=600 -q install -y linux-headers-{KERNEL} "
        f"{' '.join(DRIVER_PACKAGES)}"
    ) in calls
    assert f"apt-mark hold {' '.join(DRIVER_PACKAGES)}" in calls
    assert (
        f"apt-mark hold linux-image-{KERNEL} linux-headers-{KERNEL} linux-gcp linux-image-gcp"
    ) in calls
    assert f"kernel {KERNEL} held for the NVIDIA module" in first.stderr
    assert "modprobe nvidia" in calls
    # The driver before the GPU check, the GPU check before the payload install.
    first_pip = next(i for i, c in enumerate(calls) if c.startswith("pip "))
    assert calls.index("modprobe nvidia") < calls.index("nvidia-smi -L") < first_pip
    assert "NVIDIA driver loaded (open kernel modules: nvidia-open-570 nvidia-utils-570)" in (
        first.stderr
    )
    assert _status(box, bucket)["state"] == "started"
    assert "systemctl reboot" not in calls
    # Every later boot finds the driver working and installs nothing.
    second = box.run(script, SMI_GPUS="2")
    assert second.returncode == 0, second.stderr
    assert not [c for c in box.calls if c.startswith(("apt-get", "apt-mark", "dpkg"))]
    assert not [c for c in box.calls if "cuda-keyring" in c]
    assert "NVIDIA driver present (open kernel modules" in second.stderr


def test_a_driver_that_does_not_load_reboots_once_then_reports(gpu_run, box):
    bucket, _ = publish_payload(gpu_run, box)
    (box.bin / "nvidia-smi").unlink()
    script = startup_script(gpu_run, "gpu-vm")
    first = box.run(script, SMI_FAIL="1")
    assert first.returncode == 0, first.stderr
    assert box.calls[-1] == "systemctl reboot"
    status = _status(box, bucket)
    assert status["state"] == "starting"
    assert status["message"] == (
        "NVIDIA driver installed (nvidia-open-570 nvidia-utils-570); rebooting once to load it"
    )
    assert not [c for c in box.calls if c.startswith("pip ")]
    # After the reboot: installed already, still not loading: no second reboot, exit 2.
    second = box.run(script, SMI_FAIL="1")
    assert second.returncode == 2, second.stderr
    assert "systemctl reboot" not in box.calls
    assert not [c for c in box.calls if c.startswith("apt-get") or "cuda-keyring" in c]
    assert _status(box, bucket)["message"].startswith("GPU not found: nvidia-smi fails on ")


def test_trainer_exit_2_is_reported_as_not_restarted(gpu_run, box):
    bucket, _ = publish_payload(gpu_run, box)
    assert box.run(startup_script(gpu_run, "gpu-vm"), SMI_GPUS="2").returncode == 0
    helper = box.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"
    result = subprocess.run(
        [str(helper), "stopped"],
        env=box.env(EXIT_STATUS="2", SERVICE_RESULT="exit-code"),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    status = _status(box, bucket)
    assert status["state"] == "stopped"
    assert "not restarted (RestartPreventExitStatus=2)" in status["message"]


def test_the_gpu_vm_requirements_resolve_for_the_images_python():
    """The GPU VM's exact requirements (the lock with tensorflow[and-cuda], the 3.10 pins)
    resolve for the image's Python with binary wheels only, as the controller's wheelhouse
    and the GPU VM's install ask (needs the package index, like the TPU VM's check in
    test_tpu_parity.py, which pip runs; here uv: harness.uv_resolver)."""
    (python_version,) = {image.python for image in load_gpu_catalog().images.values()}
    pip = str(Path(sys.executable).with_name("pip"))
    check = '. infra/render/templates/tpu-install.sh; tpu_check_resolves "$0" . "$1"'
    result = subprocess.run(
        ["bash", "-c", check, pip, python_version],
        cwd=ROOT,
        env={**os.environ, "VM_REQUIREMENTS": render.GPU_REQUIREMENTS_FILE, **uv_resolver()},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
