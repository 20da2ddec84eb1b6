# ---- templates/loader.sh: the VM's startup script, stable across jobs and payloads -----
# The VM's metadata holds only this loader (its bucket, its role), so a new payload or a new
# job changes no input of the VM: `pulumi up` rewrites the pointer object POINTER_URI
# (jobs/current.json: the job, the payload archive and its sha256, each role's startup
# script and its sha256; infra/render.py render_pointer), and the VM runs what it names at
# its next start, or now: sudo google_metadata_script_runner startup (Pulumi's output
# rerunStartupCommands). The role's script is the one rendered from the catalogs and the job
# (render_tpu_script, render_gpu_script, render_controller_script): the loader checks the
# sha256 of the script and of the payload archive against the pointer, then runs the script
# with the verified archive (common.sh install_payload_once checks it again).
readonly SANDBOX_ROOT="${TPU_PRETRAIN_SANDBOX:-}"
readonly APP_DIR="${SANDBOX_ROOT}/opt/tpu-pretrain"
readonly LOADER_DIR="${APP_DIR}/loader"
readonly RETRY_ATTEMPTS="${TPU_PRETRAIN_RETRY_ATTEMPTS:-10}"
readonly CONSOLE="${SANDBOX_ROOT}/dev/console"

log() {
  echo "tpu-pretrain[${ROLE} loader]: $*" >&2
  if command -v logger >/dev/null 2>&1; then
    logger -t tpu-pretrain -- "[${ROLE} loader] $*" 2>/dev/null || true
  fi
  if [ -w "${CONSOLE}" ]; then
    echo "tpu-pretrain[${ROLE} loader]: $*" >>"${CONSOLE}" 2>/dev/null || true
  fi
}

# gcloud storage where the SDK has it, else gsutil (older TPU images), retried: a fresh
# bucket and fresh grants answer 403/404 for a while.
fetch() {
  local uri="$1" target="$2" attempt=1
  while true; do
    if gcloud storage --help >/dev/null 2>&1; then
      gcloud storage cp --quiet "${uri}" "${target}" && return 0
    else
      gsutil -q cp "${uri}" "${target}" && return 0
    fi
    if [ "${attempt}" -ge "${RETRY_ATTEMPTS}" ]; then
      return 1
    fi
    log "could not read ${uri} (attempt ${attempt}/${RETRY_ATTEMPTS}); retrying in 10s"
    sleep 10
    attempt=$((attempt + 1))
  done
}

# The loader's own failure, in one line, where the job's bootstrap status would be (when
# the pointer names a job) and on the console. In a $(field) subshell it only ends that
# subshell: the caller's `|| fail` (errexit) stops the loader.
fail() {
  local message="$1" file
  log "${message}"
  if [ -n "${RUN_ROOT:-}" ]; then
    file="$(mktemp)"
    printf '{"role": "%s", "host": "%s", "state": "failed", "message": "%s", "updated_at": "%s"}\n' \
      "${ROLE}" "$(hostname)" "${message//\"/\'}" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"${file}"
    fetch "${file}" "${RUN_ROOT}/bootstrap/${ROLE}.json" >/dev/null 2>&1 || true
    rm -f "${file}"
  fi
  exit 1
}

# check_sha256 FILE EXPECTED WHAT: the file's digest against the pointer's.
check_sha256() {
  local actual
  actual="$(sha256sum "$1" | cut -d' ' -f1)"
  if [ "${actual}" != "$2" ]; then
    fail "${3} has sha256 ${actual}, but ${POINTER_URI} names $2: the bucket holds another upload than the pointer (run pulumi up again)"
  fi
}

mkdir -p "${LOADER_DIR}"
pointer="${LOADER_DIR}/current.json"
if ! fetch "${POINTER_URI}" "${pointer}.new"; then
  fail "cannot read the job pointer ${POINTER_URI} (pulumi up writes it)"
fi
mv -f "${pointer}.new" "${pointer}"
# One field of the pointer: a flat JSON object, one "key": "value" per line, values of
# [A-Za-z0-9._/:=+-] only (infra/render.py render_pointer writes and checks it), so sed reads
# it without a JSON parser on the image.
field() {
  local value
  value="$(sed -n "s/^  \"$1\": \"\([A-Za-z0-9._/:=+-]*\)\",\{0,1\}\$/\1/p" "${pointer}")"
  [ -n "${value}" ] || fail "the job pointer ${POINTER_URI} has no $1 (pulumi up writes it)"
  echo "${value}"
}
RUN_ROOT=""
JOB_NAME="$(field job)"
RUN_ROOT="$(field run_root)"
payload_object="$(field payload_object)"
payload_sha256="$(field payload_sha256)"
script_object="$(field "script_${ROLE}")"
script_sha256="$(field "script_${ROLE}_sha256")"
log "job ${JOB_NAME}: payload ${payload_sha256:0:16}, startup script ${script_object}"

script="${LOADER_DIR}/${ROLE}-startup.sh"
fetch "${BUCKET_URI}/${script_object}" "${script}.new" \
  || fail "cannot read the startup script ${BUCKET_URI}/${script_object} of job ${JOB_NAME}"
check_sha256 "${script}.new" "${script_sha256}" "the startup script ${BUCKET_URI}/${script_object}"
mv -f "${script}.new" "${script}"

# The payload archive, unless this payload is installed already (common.sh install_payload).
archive=""
if [ ! -f "${APP_DIR}/venv-${payload_sha256:0:16}/.tpu-pretrain-installed" ]; then
  archive="${LOADER_DIR}/payload-${payload_sha256:0:16}.tar.gz"
  if [ ! -f "${archive}" ] || [ "$(sha256sum "${archive}" | cut -d' ' -f1)" != "${payload_sha256}" ]; then
    fetch "${BUCKET_URI}/${payload_object}" "${archive}.new" \
      || fail "cannot read the payload archive ${BUCKET_URI}/${payload_object} of job ${JOB_NAME}"
    check_sha256 "${archive}.new" "${payload_sha256}" "the payload archive ${BUCKET_URI}/${payload_object}"
    mv -f "${archive}.new" "${archive}"
  fi
fi
# Archives of other payloads are not needed any more.
for old in "${LOADER_DIR}"/payload-*.tar.gz; do
  if [ -f "${old}" ] && [ "${old}" != "${archive}" ]; then
    rm -f "${old}"
  fi
done
export TPU_PRETRAIN_PAYLOAD_ARCHIVE="${archive}"
exec bash "${script}"
