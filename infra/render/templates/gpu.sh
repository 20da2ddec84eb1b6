# ---- templates/gpu.sh: the GPU VM's startup, after tpu.sh's functions -----------------
# The same install (tpu-install.sh with VM_REQUIREMENTS=requirements/gpu-vm.txt: the lock with
# tensorflow[and-cuda] of the lock's version; or, for the JAX backend (PAYLOAD_BACKEND=jax),
# requirements/gpu-vm-jax.txt: jax[cuda12] + tensorflow-cpu on uv's Python 3.11), the same
# trainer unit, helper and status as the TPU VM. The NVIDIA driver comes with the image or is
# installed here once (install_driver; which one: infra/catalogs/gpu.yaml images).

# What the payload is told about its host (payload/cli.py): a GPU VM with GPU_COUNT GPUs; a
# backend that finds none stops with "GPU not found" (exit 2, not restarted).
trainer_host_env() {
  printf '%s\n' "Environment=TPU_PRETRAIN_GPU=${GPU_NAME}" \
    "Environment=TPU_PRETRAIN_GPU_COUNT=${GPU_COUNT}" \
    "Environment=TPU_PRETRAIN_GPU_PRECISION=${GPU_PRECISION}" \
    "Environment=TPU_PRETRAIN_RUNTIME_VERSION=${RUNTIME_VERSION}"
}

GPUS_LISTED=""  # how many GPUs nvidia-smi lists (check_gpus)

gpu_driver_works() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# The NVIDIA driver of the catalog's image: a Deep Learning VM image brings it
# (DRIVER_PACKAGES empty); on an Ubuntu image it is installed here once, as Google's A4
# Cluster Toolkit blueprint installs it: NVIDIA's CUDA apt repository (its keyring package),
# then the branch's packages of the GPU's kernel-module flavour, held so that unattended
# upgrades do not move the driver under the trainer. Every later boot finds it working and
# installs nothing. When the new modules do not load in this boot, the VM reboots once and
# this script runs again (only a real VM shows whether that is needed).
# The modules are built by DKMS against the headers of the running kernel, installed in the
# same apt transaction: NVIDIA's installation guide ("Pre-installation Actions": the headers
# and development packages of the running kernel must be installed; the deb packages
# otherwise pull the newest headers, "which may or may not match the version of the kernel
# your system is using"). The running kernel is then held (hold_kernel), so an unattended
# upgrade cannot boot a kernel the module was not built for.
# Not used: Ubuntu's prebuilt, Canonical-signed linux-modules-nvidia-<branch>-server[-open]-
# <kernel> (packages.ubuntu.com lists them per kernel flavour, -gcp included): they pair with
# Ubuntu's own -server userspace, not with the packages of NVIDIA's repository that Google's
# A4 blueprint installs (infra/catalogs/gpu.yaml images).
install_driver() {
  local keyring reboot_marker="${APP_DIR}/driver-rebooted" kernel headers
  local -a packages
  [ -n "${DRIVER_PACKAGES}" ] || return 0
  if gpu_driver_works; then
    log "NVIDIA driver present (${DRIVER_MODULES} kernel modules: ${DRIVER_PACKAGES})"
    return 0
  fi
  read -r -a packages <<<"${DRIVER_PACKAGES}"
  kernel="$(uname -r)"
  headers="linux-headers-${kernel}"
  if ! dpkg -s "${headers}" "${packages[@]}" >/dev/null 2>&1; then
    write_status starting "installing the NVIDIA driver (${DRIVER_MODULES} kernel modules: ${DRIVER_PACKAGES}) for kernel ${kernel}"
    keyring="$(mktemp)"
    curl -fsSL --retry "${RETRY_ATTEMPTS}" --retry-delay 15 --retry-connrefused \
      -o "${keyring}" "${DRIVER_REPO}"
    dpkg -i "${keyring}"
    rm -f "${keyring}"
    apt_install "${headers}" "${packages[@]}"
    apt-mark hold "${packages[@]}"
    hold_kernel "${kernel}"
  fi
  modprobe nvidia 2>/dev/null || true
  if gpu_driver_works; then
    log "NVIDIA driver loaded (${DRIVER_MODULES} kernel modules: ${DRIVER_PACKAGES})"
    return 0
  fi
  if [ ! -f "${reboot_marker}" ]; then
    mkdir -p "${APP_DIR}"
    touch "${reboot_marker}"
    write_status starting "NVIDIA driver installed (${DRIVER_PACKAGES}); rebooting once to load it"
    systemctl reboot
    exit 0
  fi
  log "the NVIDIA driver does not load after a reboot (${DRIVER_PACKAGES})"
}

# Hold the running kernel: its image, headers and modules, and the flavour's metapackages
# that would pull a newer ABI (linux-gcp, linux-image-gcp, linux-headers-gcp on Ubuntu's GCE
# images), as far as they are installed. `apt-mark unhold` of the same names releases it.
hold_kernel() {
  local kernel="$1" flavour package
  local -a held=()
  flavour="${kernel##*-}"
  for package in "linux-image-${kernel}" "linux-headers-${kernel}" "linux-modules-${kernel}" \
    "linux-${flavour}" "linux-image-${flavour}" "linux-headers-${flavour}"; do
    if dpkg -s "${package}" >/dev/null 2>&1; then
      held+=("${package}")
    fi
  done
  if [ "${#held[@]}" -gt 0 ]; then
    apt-mark hold "${held[@]}"
    log "kernel ${kernel} held for the NVIDIA module: ${held[*]}"
  fi
}

# The driver must list the GPUs the machine type carries before anything is installed.
check_gpus() {
  local listed count
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    write_status failed "GPU not found: no nvidia-smi on image ${RUNTIME_VERSION} (the NVIDIA driver is missing; use the image of infra/catalogs/gpu.yaml); not training on the CPU"
    exit 2
  fi
  if ! listed="$(nvidia-smi -L 2>&1)"; then
    write_status failed "GPU not found: nvidia-smi fails on ${ACCELERATOR_TYPE}: $(head -n 1 <<<"${listed}"); not training on the CPU"
    exit 2
  fi
  count="$(grep -c '^GPU [0-9]' <<<"${listed}" || true)"
  GPUS_LISTED="${count}"
  if [ "${count}" -lt 1 ]; then
    write_status failed "GPU not found: nvidia-smi lists no GPU on ${ACCELERATOR_TYPE}; not training on the CPU"
    exit 2
  fi
  if [ "${count}" -ne "${GPU_COUNT}" ]; then
    log "nvidia-smi lists ${count} GPUs, the catalog expects ${GPU_COUNT} on ${ACCELERATOR_TYPE}"
  fi
  log "GPUs (catalog: ${GPU_COUNT} x ${GPU_TYPE}): $(paste -sd ';' <<<"${listed}")"
}

# ptxas for XLA's GPU compiler: the nvidia-cuda-nvcc-cu12 wheel (a dependency of
# tensorflow[and-cuda], and of jax-cuda12-plugin[with-cuda]) ships it under
# nvidia/cuda_nvcc/bin, and TF 2.20's XLA looks for ptxas on PATH (libtensorflow_cc.so.2:
# tsl::PreferPtxasFromPath, FindPtxAsExecutable). The CUDA libraries need no path: TF's own
# libraries carry RUNPATH $ORIGIN/../nvidia/*/lib. Printed relative to the venv, like
# tpu_libtpu_path.
gpu_ptxas_dir() {
  "$1/bin/python" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("nvidia.cuda_nvcc")
print(os.path.relpath(os.path.join(list(spec.submodule_search_locations)[0], "bin"), sys.prefix))'
}

trap '[ -n "${FAILED_AT:-}" ] || { FAILED_AT="${LINENO}"; write_status failed "startup script failed at line ${LINENO}"; }' ERR
log "step 1/4: checks (image ${RUNTIME_VERSION}, ${ACCELERATOR_TYPE})"
gcs_cli
write_status starting "startup script started on ${ACCELERATOR_TYPE} (${RUNTIME_VERSION})"
check_python
install_driver
check_gpus
log "step 2/4: payload install"
install_started="${SECONDS}"
install_payload
record_facts "$((SECONDS - install_started))"
log "step 3/4: trainer unit"
ptxas_dir="/opt/tpu-pretrain/venv/$(gpu_ptxas_dir "${APP_DIR}/venv")"
install_helper
# Keras 3 on JAX (PAYLOAD_BACKEND=jax) gets no JAX_PLATFORMS here, unlike the TPU VM's unit:
# with JAX_PLATFORMS=cuda and a CUDA plugin that cannot initialise, jax 0.10.2 ends in a bare
# AssertionError (jax/_src/xla_bridge.py backends(): `assert _default_backend is not None`,
# seen with .venv-gpu-jax on a host without a GPU), which systemd would restart every minute.
# Without it JAX falls back to the CPU, and the payload, told by trainer_host_env that this VM
# has GPUs, stops with "GPU not found" and exit 2 (payload/backends/jax/train.py _devices).
gpu_env="Environment=PATH=${ptxas_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
install_trainer_unit " (${ACCELERATOR_TYPE})" "" "${gpu_env}" ""
log "step 4/4: start"
start_units tpu-pretrain-train.service
write_status started "trainer unit started; waits for ${MANIFEST_URI}"
