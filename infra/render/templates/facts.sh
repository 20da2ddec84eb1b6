# ---- templates/facts.sh: what this VM really is, against what the catalog expects -----
# Much of the design rests on facts that only a real VM shows (the image's Python, its
# gcloud, a tpu-runtime unit, the metadata a slice host gets, libtpu, secure boot). Every
# startup script records them once per boot in gs://…/runs/<job>/bootstrap/facts-<name>.json
# (<name>: the role, or tpu-worker-<i> on a slice) and compares them with the EXPECT_*
# constants rendered from the catalogs (infra/catalogs/tpu.yaml, infra/catalogs/gpu.yaml,
# requirements/tpu-vm.txt). A mismatch does not stop the boot: it is a line in the
# bootstrap status and, through ${HOST_FACTS} (read by the payload's trainer and data
# stages), in the job's status.json ("catalog says python 3.10 on v2-alpha-tpuv6e; this VM
# has 3.12"). Nothing here needs a network beyond the metadata server and the bucket.
readonly HOST_FACTS="${APP_DIR}/host-facts.json"
readonly METADATA_INSTANCE="http://metadata.google.internal/computeMetadata/v1/instance"
FACT_MISMATCHES=()

# A JSON string: backslash, quote, newline, tab escaped, other control characters dropped.
json_str() {
  local s
  s="$(printf '%s' "$1" | tr -d '\000-\010\013\014\016-\037')"
  s="${s//\\/\\\\}"
  s="${s//\"/\\\"}"
  s="${s//$'\n'/\\n}"
  s="${s//$'\t'/\\t}"
  s="${s//$'\r'/}"
  printf '"%s"' "${s}"
}

# One metadata value, one try ("" when the server does not have it: a fact, not an error).
metadata_once() {
  curl -fsS -H 'Metadata-Flavor: Google' "${METADATA_INSTANCE}/$1" 2>/dev/null || true
}

# Secure boot as the firmware reports it: the SecureBoot EFI variable (4 attribute bytes,
# then 1 = on); "unknown" without EFI variables (mokutil --sb-state reads the same variable).
secure_boot_state() {
  local var
  var="$(find "${SANDBOX_ROOT}/sys/firmware/efi/efivars" -maxdepth 1 -name 'SecureBoot-*' 2>/dev/null | head -n 1)"
  if [ -z "${var}" ]; then
    echo unknown
  elif [ "$(od -An -t u1 -j 4 -N 1 "${var}" 2>/dev/null | tr -d ' ')" = 1 ]; then
    echo enabled
  else
    echo disabled
  fi
}

# The image's own TPU runtime unit (the -pod TF images run TensorFlow's TPU worker in it).
tpu_runtime_unit() {
  local unit
  if ! unit="$(systemctl cat tpu-runtime.service 2>/dev/null)"; then
    echo absent
    return 0
  fi
  grep -m 1 '^ExecStart=' <<<"${unit}" || echo "present (no ExecStart)"
}

# The loaded NVIDIA kernel module, from its own banner (/proc/driver/nvidia/version: "NVRM
# version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20 ..." for the open flavour,
# "NVIDIA UNIX x86_64 Kernel Module  570..." for the proprietary one). Prints
# "<flavour> <version>", or nothing without a loaded module (a TPU VM, a driver that failed).
nvidia_module() {
  local banner version flavour=proprietary
  banner="$(head -n 1 "${SANDBOX_ROOT}/proc/driver/nvidia/version" 2>/dev/null || true)"
  [ -n "${banner}" ] || return 0
  version="$(grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' <<<"${banner}" | head -n 1 || true)"
  if grep -q 'Open Kernel Module' <<<"${banner}"; then
    flavour=open
  fi
  echo "${flavour} ${version:-unknown}"
}

# The driver of the first network interface backed by a device (gve: Google's gVNIC driver,
# virtio_net: VirtIO), from sysfs; "unknown" without one.
nic_driver() {
  local dev driver
  for dev in "${SANDBOX_ROOT}"/sys/class/net/*; do
    if [ -e "${dev}/device/driver" ]; then
      driver="$(readlink "${dev}/device/driver")"
      echo "${driver##*/}"
      return 0
    fi
  done
  echo unknown
}

# expect WHAT EXPECTED ACTUAL [WHERE]: a mismatch line when both are known and differ.
expect() {
  local what="$1" expected="$2" actual="$3" where="${4:-}"
  if [ -n "${expected}" ] && [ -n "${actual}" ] && [ "${actual}" != unknown ] \
    && [ "${expected}" != "${actual}" ]; then
    FACT_MISMATCHES+=("catalog says ${what} ${expected}${where}; this VM has ${actual}")
  fi
}

# record_facts INSTALL_SECONDS [NAME=VALUE...]: collect, compare, write locally and to the
# bucket; a mismatch also goes into the bootstrap status. Extra NAME=VALUE facts come from
# the caller (a GPU's nvidia-smi count, a slice's worker index).
record_facts() {
  local install_seconds="$1" python gcloud_version="" gsutil_version="" image os="" line
  local secure libtpu="" accelerator machine endpoints tpu_env="" runtime_unit
  local kernel nvidia nvidia_modules="" nvidia_driver="" nvidia_branch="" nic
  local name="${STATUS_NAME:-${ROLE}}" file extra="" pair mismatches=""
  shift
  python="$(tpu_python_version 2>/dev/null || echo unknown)"
  gcloud_version="$(gcloud --version 2>/dev/null | sed -n 's/^Google Cloud SDK //p' | head -n 1 || true)"
  if command -v gsutil >/dev/null 2>&1; then
    gsutil_version="$(gsutil version 2>/dev/null | sed -n 's/^gsutil version: //p' | head -n 1 || true)"
  fi
  image="$(metadata_once image)"
  if [ -f "${SANDBOX_ROOT}/etc/os-release" ]; then
    os="$(sed -n 's/^PRETTY_NAME=//p' "${SANDBOX_ROOT}/etc/os-release" | tr -d '"')"
  fi
  secure="$(secure_boot_state)"
  accelerator="$(metadata_once attributes/accelerator-type)"
  machine="$(metadata_once machine-type)"
  machine="${machine##*/}"
  endpoints="$(metadata_once attributes/worker-network-endpoints)"
  if [ -f "${SANDBOX_ROOT}/home/tpu-runtime/tpu-env" ]; then
    tpu_env="$(head -c 4000 "${SANDBOX_ROOT}/home/tpu-runtime/tpu-env")"
  fi
  runtime_unit="$(tpu_runtime_unit)"
  kernel="$(uname -r 2>/dev/null || echo unknown)"
  nvidia="$(nvidia_module)"
  if [ -n "${nvidia}" ]; then
    nvidia_modules="${nvidia%% *}"
    nvidia_driver="${nvidia#* }"
    nvidia_branch="${nvidia_driver%%.*}"
  fi
  nic="$(nic_driver)"
  if [ -n "${EXPECT_LIBTPU}" ] && [ -x "${APP_DIR}/venv/bin/python" ]; then
    libtpu="$("${APP_DIR}/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("libtpu"))' 2>/dev/null | tail -n 1 || true)"
  fi

  FACT_MISMATCHES=()
  expect "python" "${EXPECT_PYTHON}" "${python}" "${RUNTIME_VERSION:+ on ${RUNTIME_VERSION}}"
  expect "accelerator type" "${EXPECT_ACCELERATOR}" "${accelerator}"
  expect "machine type" "${EXPECT_MACHINE}" "${machine}"
  expect "libtpu" "${EXPECT_LIBTPU}" "${libtpu}"
  expect "GPUs" "${EXPECT_GPUS}" "${GPUS_LISTED:-}" "${EXPECT_MACHINE:+ on ${EXPECT_MACHINE}}"
  expect "NVIDIA kernel modules" "${EXPECT_NVIDIA_MODULES}" "${nvidia_modules:-none loaded}"
  expect "NVIDIA driver branch" "${EXPECT_NVIDIA_BRANCH}" "${nvidia_branch:-none loaded}"
  expect "NIC driver" "${EXPECT_NIC_DRIVER}" "${nic}"
  if [ -n "${EXPECT_SECURE_BOOT}" ]; then
    expect "secure boot" "$([ "${EXPECT_SECURE_BOOT}" = true ] && echo enabled || echo disabled)" "${secure}"
  fi
  for pair in "$@"; do
    extra="${extra}, $(json_str "${pair%%=*}"): $(json_str "${pair#*=}")"
  done
  for line in "${FACT_MISMATCHES[@]}"; do
    mismatches="${mismatches:+${mismatches}, }$(json_str "${line}")"
  done

  file="$(mktemp)"
  {
    printf '{"role": %s, "name": %s, "host": %s, "collected_at": %s' \
      "$(json_str "${ROLE}")" "$(json_str "${name}")" "$(json_str "$(hostname)")" \
      "$(json_str "$(date -u +%Y-%m-%dT%H:%M:%SZ)")"
    printf ', "facts": {"python": %s, "gcloud": %s, "gsutil": %s, "image": %s, "os": %s' \
      "$(json_str "${python}")" "$(json_str "${gcloud_version}")" "$(json_str "${gsutil_version}")" \
      "$(json_str "${image}")" "$(json_str "${os}")"
    printf ', "secure_boot": %s, "accelerator_type": %s, "machine_type": %s' \
      "$(json_str "${secure}")" "$(json_str "${accelerator}")" "$(json_str "${machine}")"
    printf ', "worker_network_endpoints": %s, "tpu_env": %s, "tpu_runtime_unit": %s' \
      "$(json_str "${endpoints}")" "$(json_str "${tpu_env}")" "$(json_str "${runtime_unit}")"
    printf ', "kernel": %s, "nvidia_modules": %s, "nvidia_driver": %s, "nvidia_branch": %s, "nic_driver": %s' \
      "$(json_str "${kernel}")" "$(json_str "${nvidia_modules}")" "$(json_str "${nvidia_driver}")" \
      "$(json_str "${nvidia_branch}")" "$(json_str "${nic}")"
    printf ', "libtpu": %s, "gpus": %s, "install_seconds": %s%s}' \
      "$(json_str "${libtpu}")" "$(json_str "${GPUS_LISTED:-}")" "${install_seconds}" "${extra}"
    printf ', "expected": {"python": %s, "accelerator_type": %s, "machine_type": %s, "libtpu": %s, "gpus": %s, "secure_boot": %s' \
      "$(json_str "${EXPECT_PYTHON}")" "$(json_str "${EXPECT_ACCELERATOR}")" \
      "$(json_str "${EXPECT_MACHINE}")" "$(json_str "${EXPECT_LIBTPU}")" \
      "$(json_str "${EXPECT_GPUS}")" "$(json_str "${EXPECT_SECURE_BOOT}")"
    printf ', "nvidia_modules": %s, "nvidia_branch": %s, "nic_driver": %s}' \
      "$(json_str "${EXPECT_NVIDIA_MODULES}")" "$(json_str "${EXPECT_NVIDIA_BRANCH}")" \
      "$(json_str "${EXPECT_NIC_DRIVER}")"
    printf ', "mismatches": [%s]}\n' "${mismatches}"
  } >"${file}"
  mkdir -p "$(dirname "${HOST_FACTS}")"
  chmod 0644 "${file}"
  mv -f "${file}" "${HOST_FACTS}"
  retry_gcloud gcs cp "${HOST_FACTS}" "${RUN_ROOT}/bootstrap/facts-${name}.json" \
    || log "could not write facts-${name}.json"
  HOST_CHECKS="${mismatches}"
  if [ "${#FACT_MISMATCHES[@]}" -gt 0 ]; then
    for line in "${FACT_MISMATCHES[@]}"; do
      log "host check: ${line}"
    done
    write_status starting "host check: $(printf '%s; ' "${FACT_MISMATCHES[@]}" | sed 's/; $//') (facts in ${RUN_ROOT}/bootstrap/facts-${name}.json)"
  else
    log "host facts match the catalog (${RUN_ROOT}/bootstrap/facts-${name}.json)"
  fi
}
