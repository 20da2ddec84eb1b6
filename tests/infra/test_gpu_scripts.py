"""The GPU VM's rendered startup script, run in the script sandbox of test_infra_scripts.py
(stub gcloud/pip/systemctl, a fake bucket) plus a stub nvidia-smi: the driver check, the
install (retried, the GPU overlay), the trainer unit's environment, and "GPU not found" as
exit 2 with the reason in the bucket's status."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_offline
from test_infra_scripts import (  # the sandbox and its helpers, shared with the TPU tests
    Sandbox,
    _publish_payload,
    _script,
    _short_sha,
    sandbox,  # noqa: F401  (a fixture)
    shellcheck,
    unit_environment,
)

from infra import render
from infra.gpu_catalog import load_gpu_catalog

ROOT = Path(__file__).resolve().parents[2]

NVIDIA_SMI = r"""
echo "nvidia-smi $*" >>"$CALLS"
if [ -n "${SMI_FAIL:-}" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
  exit 9
fi
for ((i = 0; i < ${SMI_GPUS:-1}; i++)); do
  echo "GPU $i: NVIDIA L4 (UUID: GPU-0000000$i)"
done
"""
# The venv's python answers gpu.sh's ptxas question like a venv with the CUDA wheels would.
VENV_PYTHON = r"""
echo "$(basename "$0") $*" >>"$CALLS"
case "$*" in
  *cuda_nvcc*) echo "lib/python3.10/site-packages/nvidia/cuda_nvcc/bin" ;;
esac
"""
PTXAS = "/opt/tpu-pretrain/venv/lib/python3.10/site-packages/nvidia/cuda_nvcc/bin"


@pytest.fixture(scope="module")
def gpu_run():
    return run_offline("l4x2-use1")


@pytest.fixture
def box(sandbox: Sandbox) -> Sandbox:  # noqa: F811
    for name, body in (("nvidia-smi", NVIDIA_SMI),):
        stub = sandbox.bin / name
        stub.write_text("#!/bin/bash\nset -u\n" + body)
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    # `python3 -m venv` copies the recorder as every venv tool: make its python answer.
    recorder = sandbox.bin / "recorder"
    recorder.write_text(
        recorder.read_text().replace('echo "lib/python3.10/site-packages/libtpu/libtpu.so"', "true")
    )
    python = sandbox.bin / "venv-python"
    python.write_text("#!/bin/bash\nset -u\n" + VENV_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    stub = sandbox.bin / "python3"
    stub.write_text(
        stub.read_text().replace(
            'if [ -n "${STUB_VENV_PYTHON:-}" ]; then',
            'cp "$STUB_DIR/venv-python" "$3/bin/python"\n  if [ -n "${STUB_VENV_PYTHON:-}" ]; then',
        )
    )
    return sandbox


def _status(box: Sandbox, bucket: str) -> dict:
    path = box.gcs / bucket / "runs/bert-small-mlm-gpu/bootstrap/gpu.json"
    return json.loads(path.read_text())


def test_gpu_script_passes_shellcheck(gpu_run, tmp_path):
    assert shellcheck(_script(gpu_run, "gpu-vm"), tmp_path / "gpu.sh") == ""


def test_gpu_script_installs_the_cuda_build_and_a_trainer_that_sees_the_gpus(gpu_run, box):
    bucket, _ = _publish_payload(gpu_run, box)
    script = _script(gpu_run, "gpu-vm")
    short = _short_sha(script)
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
        "TPU_PRETRAIN_RUNTIME_VERSION": "common-cu128-ubuntu-2204-nvidia-570",
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
    bucket, _ = _publish_payload(gpu_run, box)
    result = box.run(
        _script(gpu_run, "gpu-vm"), FAIL_FIRST_PIP="1", TPU_PRETRAIN_INSTALL_ATTEMPTS="3"
    )
    assert result.returncode == 0, result.stderr
    assert "attempt 2/3" in result.stderr
    assert _status(box, bucket)["state"] == "started"


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"SMI_FAIL": "1"}, "GPU not found: nvidia-smi fails on 2x L4 on g2-standard-24: "),
        ({"SMI_GPUS": "0"}, "GPU not found: nvidia-smi lists no GPU on 2x L4 on g2-standard-24"),
    ],
)
def test_no_gpu_is_exit_2_with_the_reason_in_the_status(gpu_run, box, env, reason):
    bucket, _ = _publish_payload(gpu_run, box)
    result = box.run(_script(gpu_run, "gpu-vm"), **env)
    assert result.returncode == 2, result.stderr
    status = _status(box, bucket)
    assert status["state"] == "failed"
    assert status["message"].startswith(reason), status["message"]
    assert "not training on the CPU" in status["message"]
    # Nothing installed, no trainer unit: exit 2 is not retried by anything.
    assert not [c for c in box.calls if c.startswith(("pip ", "systemctl"))]
    assert not (box.root / "etc/systemd/system/tpu-pretrain-train.service").exists()


def test_no_driver_at_all_is_exit_2(gpu_run, box):
    bucket, _ = _publish_payload(gpu_run, box)
    (box.bin / "nvidia-smi").unlink()
    result = box.run(_script(gpu_run, "gpu-vm"))
    assert result.returncode == 2, result.stderr
    message = _status(box, bucket)["message"]
    assert message.startswith(
        "GPU not found: no nvidia-smi on image common-cu128-ubuntu-2204-nvidia-570"
    )


def test_trainer_exit_2_is_reported_as_not_restarted(gpu_run, box):
    bucket, _ = _publish_payload(gpu_run, box)
    assert box.run(_script(gpu_run, "gpu-vm"), SMI_GPUS="2").returncode == 0
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
    and the GPU VM's install ask (metadata only; needs the package index, like the TPU
    VM's check in test_tpu_parity.py)."""
    python_version = load_gpu_catalog().image_python
    pip = str(Path(sys.executable).with_name("pip"))
    check = '. infra/templates/tpu-install.sh; tpu_check_resolves "$0" . "$1"'
    result = subprocess.run(
        ["bash", "-c", check, pip, python_version],
        cwd=ROOT,
        env={**os.environ, "VM_REQUIREMENTS": render.GPU_REQUIREMENTS_FILE},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
