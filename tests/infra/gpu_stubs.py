"""The GPU VM's stubs for the script sandbox (script_sandbox.py): nvidia-smi, the venv's
python, NVIDIA's keyring through curl, dpkg and apt-get installing the driver, uname. The
`box` fixture (conftest.py) adds them to a sandbox (test_gpu_scripts.py, test_gpu_jax_env.py)."""

from __future__ import annotations

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
