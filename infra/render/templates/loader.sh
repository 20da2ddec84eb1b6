# ---- templates/loader.sh: the VM's startup script, stable across jobs and payloads -----
# The VM's metadata holds only this loader (its bucket, its role), so a new payload or a new
# job changes no input of the VM: `pulumi up` rewrites the pointer object POINTER_URI
# (jobs/current.json: the job, the payload archive and its sha256, each role's startup
# script and its sha256; infra/render/render.py render_pointer), and the VM runs what it names at
# its next start, or now: sudo google_metadata_script_runner startup (Pulumi's output
# rerunStartupCommands). The role's script is the one rendered from the catalogs and the job
# (render_tpu_script, render_gpu_script, render_controller_script): the loader checks the
# sha256 of the script and of the payload archive against the pointer, then runs the script
# with the verified archive (common.sh install_payload_once checks it again).
#
# Only the deploy identity writes the pointer, startup/ and payload/ (IAM conditions on every
# VM's bucket grant, docs/guard-rails.md "What a VM runs"); the loader also refuses a pointer
# that names anything else.
#
# A fresh VM's grants may not have propagated yet (Google: typically about 2 minutes, 7 or
# longer at times: iam/docs/access-change-propagation), and `pulumi up` may switch the
# pointer while a VM boots. So every read is retried, from the pointer on, with waits that
# double from 5 s to 60 s and add up to at least BOOT_WAIT_SECONDS (infra/render/render.py
# LOADER_WAIT_SECONDS). Then the boot has failed: the VM's guest attribute BOOT_ATTRIBUTE
# says so (where the controller's watchdog and `make smoke` read it without the bucket; the
# watchdog stops or deletes a VM that bills idle), a `stopped` event says so (source loader),
# the startup script runs again in 30 min.
readonly SANDBOX_ROOT="${TPU_PRETRAIN_SANDBOX:-}"
readonly APP_DIR="${SANDBOX_ROOT}/opt/tpu-pretrain"
readonly LOADER_DIR="${APP_DIR}/loader"
readonly WAIT_SECONDS="${TPU_PRETRAIN_BOOT_WAIT_SECONDS:-${BOOT_WAIT_SECONDS}}"
readonly CONSOLE="${SANDBOX_ROOT}/dev/console"
readonly GUEST_ATTRIBUTES="http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes"
WAITED=0
DELAY=5

log() {
  echo "tpu-pretrain[${ROLE} loader]: $*" >&2
  if command -v logger >/dev/null 2>&1; then
    logger -t tpu-pretrain -- "[${ROLE} loader] $*" 2>/dev/null || true
  fi
  if [ -w "${CONSOLE}" ]; then
    echo "tpu-pretrain[${ROLE} loader]: $*" >>"${CONSOLE}" 2>/dev/null || true
  fi
}

# The boot's state as the VM's guest attribute (Compute Engine's "Setting and querying guest
# attributes": a startup script signalling its state; the metadata key
# enable-guest-attributes=TRUE of every VM of the stack turns them on): "loading", "ok", or
# "failed <epoch seconds> <message>".
boot_state() {
  if ! curl -fsS -X PUT --data "$1" -H 'Metadata-Flavor: Google' \
    "${GUEST_ATTRIBUTES}/${BOOT_ATTRIBUTE}" >/dev/null 2>&1; then
    log "could not set the guest attribute ${BOOT_ATTRIBUTE}"
  fi
}

# One read: gcloud storage where the SDK has it, else gsutil (older TPU images).
fetch() {
  if gcloud storage --help >/dev/null 2>&1; then
    gcloud storage cp --quiet "$1" "$2"
  else
    gsutil -q cp "$1" "$2"
  fi
}

# Wait before the next attempt (from the pointer on); fails once the waits add up to
# WAIT_SECONDS.
back_off() {
  if [ "${WAITED}" -ge "${WAIT_SECONDS}" ]; then
    return 1
  fi
  log "$1 (waited ${WAITED}s of ${WAIT_SECONDS}s); reading the pointer again in ${DELAY}s"
  sleep "${DELAY}"
  WAITED=$((WAITED + DELAY))
  DELAY=$((DELAY * 2 > 60 ? 60 : DELAY * 2))
}

# The next attempt at the whole boot, later: a transient timer of the guest agent's runner,
# one unit name per attempt (as templates/common.sh schedule_rerun, which says why).
schedule_rerun() {
  local runner unit
  runner="$(command -v google_metadata_script_runner || true)"
  [ -n "${runner}" ] || return 0
  unit="tpu-pretrain-startup-rerun-$(date -u +%Y%m%dT%H%M%SZ)-$$"
  systemctl stop 'tpu-pretrain-startup-rerun*.timer' >/dev/null 2>&1 || true
  if systemd-run --unit="${unit}" --collect --timer-property=RemainAfterElapse=no \
    --on-active=30min "${runner}" startup >/dev/null 2>&1; then
    log "the startup script runs again in 30 min (${unit}.timer)"
  fi
}

# The boot failed, in one line: the guest attribute, the job's bootstrap status when the
# pointer named a job (RUN_ROOT), the journal and the console. In a $(field) subshell it only
# ends that subshell: the caller's assignment then stops the loader (errexit).
fail() {
  local message="$1" file
  log "${message}"
  boot_state "failed $(date -u +%s) ${message}"
  # The `stopped` event (emit_event, from common.sh), once per failure: a re-run that fails
  # the same way says nothing new. Before the pointer named a job, the bucket alone.
  if [ "$(cat "${LOADER_DIR}/stopped-event" 2>/dev/null || true)" != "${message}" ]; then
    RUN_ROOT="${RUN_ROOT:-${BUCKET_URI}}" emit_event stopped loader "${message}" reason=boot-failed
    printf '%s\n' "${message}" >"${LOADER_DIR}/stopped-event" || true
  fi
  if [ -n "${RUN_ROOT:-}" ]; then
    file="$(mktemp)"
    printf '{"role": "%s", "host": "%s", "state": "failed", "message": "%s", "updated_at": "%s"}\n' \
      "${ROLE}" "$(hostname)" "${message//\"/\'}" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"${file}"
    fetch "${file}" "${RUN_ROOT}/bootstrap/${ROLE}.json" >/dev/null 2>&1 || true
    rm -f "${file}"
  fi
  schedule_rerun
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

# deploy_written OBJECT PREFIX WHAT: the object is under PREFIX/, where only the deploy
# identity writes, and names nothing else ("..", "//").
deploy_written() {
  case "$1" in
    *..* | *//*) ;;
    "$2"/?*) return 0 ;;
  esac
  fail "the job pointer ${POINTER_URI} names ${3} ${1}, not an object under ${2}/ (only the deploy identity writes there): refusing to run it"
}

# One field of the pointer: a flat JSON object, one "key": "value" per line, values of
# [A-Za-z0-9._/:=+-] only (infra/render/render.py render_pointer writes and checks it), so sed reads
# it without a JSON parser on the image.
field() {
  local value
  value="$(sed -n "s/^  \"$1\": \"\([A-Za-z0-9._/:=+-]*\)\",\{0,1\}\$/\1/p" "${pointer}")"
  [ -n "${value}" ] || fail "the job pointer ${POINTER_URI} has no $1 (pulumi up writes it)"
  echo "${value}"
}

mkdir -p "${LOADER_DIR}"
# One run at a time (the guest agent's at boot, a re-run by hand, the controller watchdog's,
# a scheduled retry): the lock stays held through the role's script (exec keeps fd 8), whose
# units systemd starts without it.
exec 8>"${LOADER_DIR}/lock"
if ! flock -n 8; then
  log "another run of the startup script holds ${LOADER_DIR}/lock; leaving it to finish"
  exit 0
fi
boot_state loading
pointer="${LOADER_DIR}/current.json"
script="${LOADER_DIR}/${ROLE}-startup.sh"
while true; do
  RUN_ROOT=""
  if ! fetch "${POINTER_URI}" "${pointer}.new"; then
    back_off "cannot read the job pointer ${POINTER_URI}" && continue
    fail "cannot read the job pointer ${POINTER_URI} after ${WAITED}s of retries (pulumi up writes it; the VM's account reads the bucket)"
  fi
  mv -f "${pointer}.new" "${pointer}"
  JOB_NAME="$(field job)"
  RUN_ROOT="$(field run_root)"
  payload_object="$(field payload_object)"
  payload_sha256="$(field payload_sha256)"
  script_object="$(field "script_${ROLE}")"
  script_sha256="$(field "script_${ROLE}_sha256")"
  if [ "${RUN_ROOT}" != "${BUCKET_URI}/runs/${JOB_NAME}" ]; then
    bad_root="${RUN_ROOT}"
    RUN_ROOT=""
    fail "the job pointer ${POINTER_URI} names the run root ${bad_root}, not ${BUCKET_URI}/runs/${JOB_NAME}: refusing it"
  fi
  deploy_written "${script_object}" startup "the startup script"
  deploy_written "${payload_object}" payload "the payload archive"
  log "job ${JOB_NAME}: payload ${payload_sha256:0:16}, startup script ${script_object}"

  # An object the pointer names may be gone by now: `pulumi up` switched the pointer (it
  # keeps earlier objects, but a VM must not depend on that). Read the pointer again.
  if ! fetch "${BUCKET_URI}/${script_object}" "${script}.new"; then
    back_off "cannot read the startup script ${BUCKET_URI}/${script_object} of job ${JOB_NAME}" \
      && continue
    fail "cannot read the startup script ${BUCKET_URI}/${script_object} of job ${JOB_NAME} after ${WAITED}s of retries"
  fi
  check_sha256 "${script}.new" "${script_sha256}" "the startup script ${BUCKET_URI}/${script_object}"

  # The payload archive, unless this payload is installed already (common.sh install_payload).
  archive=""
  if [ ! -f "${APP_DIR}/venv-${payload_sha256:0:16}/.tpu-pretrain-installed" ]; then
    archive="${LOADER_DIR}/payload-${payload_sha256:0:16}.tar.gz"
    if [ ! -f "${archive}" ] || [ "$(sha256sum "${archive}" | cut -d' ' -f1)" != "${payload_sha256}" ]; then
      if ! fetch "${BUCKET_URI}/${payload_object}" "${archive}.new"; then
        back_off "cannot read the payload archive ${BUCKET_URI}/${payload_object} of job ${JOB_NAME}" \
          && continue
        fail "cannot read the payload archive ${BUCKET_URI}/${payload_object} of job ${JOB_NAME} after ${WAITED}s of retries"
      fi
      check_sha256 "${archive}.new" "${payload_sha256}" "the payload archive ${BUCKET_URI}/${payload_object}"
      mv -f "${archive}.new" "${archive}"
    fi
  fi
  break
done
mv -f "${script}.new" "${script}"
# Archives of other payloads are not needed any more.
for old in "${LOADER_DIR}"/payload-*.tar.gz; do
  if [ -f "${old}" ] && [ "${old}" != "${archive}" ]; then
    rm -f "${old}"
  fi
done
boot_state ok
rm -f "${LOADER_DIR}/stopped-event"
export TPU_PRETRAIN_PAYLOAD_ARCHIVE="${archive}"
exec bash "${script}"
