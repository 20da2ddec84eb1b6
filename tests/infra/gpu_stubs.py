"""The GPU VM's stubs for the script sandbox (script_sandbox.py): nvidia-smi, the venv's
python, NVIDIA's keyring through curl, dpkg and apt-get installing the driver, uname.
install_gpu_stubs adds them to a sandbox: the `box` fixture (conftest.py: test_gpu_scripts.py,
test_gpu_jax_env.py) and the stack twin's GPU VM (stack_twin.py)."""

from __future__ import annotations

import stat
from typing import Any

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
# The driver install (gpu.sh install_driver) on an image without one: NVIDIA's keyring
# package comes through curl, dpkg knows what apt-get installed, and installing the driver's
# utilities (nvidia-utils-570, or cuda-drivers-570) brings nvidia-smi.
KEYRING_CURL = r"""
case "$*" in
  *cuda-keyring*)
    echo "curl $*" >>"$CALLS"
    out="" prev=""
    for arg in "$@"; do [ "$prev" = -o ] && out="$arg"; prev="$arg"; done
    echo keyring >"$out"
    exit 0
    ;;
esac
"""
DPKG = r"""
echo "dpkg $*" >>"$CALLS"
if [ "$1" = -s ]; then
  shift
  for package in "$@"; do [ -f "$STATE/dpkg/$package" ] || exit 1; done
fi
"""
APT_INSTALLS = r"""
if [[ " $* " == *" install "* ]]; then
  mkdir -p "$STATE/dpkg"
  for arg in "$@"; do
    case "$arg" in -* | install | DPkg*) ;; *) touch "$STATE/dpkg/$arg" ;; esac
  done
fi
case " $* " in
  *" nvidia-utils-570 "* | *" cuda-drivers-570 "*)
    cp "$STUB_DIR/nvidia-smi.real" "$STUB_DIR/nvidia-smi" ;;
esac
"""
KERNEL = "6.8.0-1015-gcp"  # what the stub uname says the running kernel is
UNAME = f'if [ "$*" = -r ]; then echo {KERNEL}; else echo Linux; fi\n'


def install_gpu_stubs(sandbox: Any) -> None:
    """A script sandbox (script_sandbox.Sandbox) with the GPU VM's stubs."""
    recorder = 'echo "$(basename "$0") $*" >>"$CALLS"\n'
    for name, body in (
        ("nvidia-smi", NVIDIA_SMI),
        ("nvidia-smi.real", NVIDIA_SMI),
        ("dpkg", DPKG),
        ("apt-mark", recorder),
        ("modprobe", recorder),
        ("uname", UNAME),
    ):
        stub = sandbox.bin / name
        stub.write_text("#!/bin/bash\nset -u\n" + body)
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    for name, extra in (("curl", KEYRING_CURL), ("apt-get", APT_INSTALLS)):
        stub = sandbox.bin / name
        head, body = stub.read_text().split("\n", 1)[0], stub.read_text().split("\n", 1)[1]
        if name == "curl":
            stub.write_text(f"{head}\n{extra}{body}")
        else:
            stub.write_text(f"{head}\n{body}{extra}")
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
