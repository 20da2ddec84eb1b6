# ---- templates/watch-common.sh: what every accelerator watchdog shares (controller) -----
# The TPU watchdog (tpu-watch.sh) and the GPU watchdog (gpu-watch.sh) are one tick of a
# systemd timer on the controller. Both act only while the lease object (LEASE_URI) exists,
# never once the job's export is complete (EXPORT_MARKER_URI), write their status to
# gs://…/runs/<job>/bootstrap/<role>.json, and re-run the controller's startup script when
# `pulumi up` wrote a job pointer that names another controller script than the one the
# controller's loader ran. A VM whose loader gave up or whose trainer stopped for good (its
# guest attributes, vm_failure below) is deleted (TPU) or stopped (GPU) instead of billing
# idle, and not recreated or started again by the watchdog. Each defines watch_status STATE ACTION MESSAGE
# and WATCH_DIR (BOOT_SEEN: the boot failure last acted on; BOOT_FAILED: the VM is down
# because of it).
# The controller's loader (templates/loader.sh) keeps the job pointer it ran in LOADER_DIR
# and holds LOADER_LOCK while a run of the startup script is in progress (the guest agent's at
# boot, a re-run by hand or by this watchdog).
readonly LOADER_DIR="${APP_DIR}/loader"
readonly LOADER_LOCK="${LOADER_DIR}/lock"

# One gcloud call, no retry (the next tick is the retry); its stderr is left in ${ERR_FILE}.
gcloud_once() {
  if gcloud "$@" 2>"${ERR_FILE}"; then
    return 0
  fi
  cat "${ERR_FILE}" >&2
  return 1
}

# NOT_FOUND without a permission error: the resource does not exist (a fresh IAM grant also
# answers 403, which must not look like a missing one). `gcloud storage ls` says "matched no
# objects" (googlecloudsdk/command_lib/storage/list_util.py).
err_is_not_found() {
  grep -Eqi 'not[ _]?found|404|matched no objects' "${ERR_FILE}" \
    && ! grep -Eqi '403|permission[ _]denied|forbidden' "${ERR_FILE}"
}

# Out of capacity or quota: worth waiting for, not an error in the request.
err_is_capacity() {
  grep -Eqi 'resource[ _]?exhausted|no more capacity|stockout|insufficient capacity|quota' "${ERR_FILE}"
}

last_error() {
  tail -n 1 "${ERR_FILE}" | tr -d '\r' | cut -c 1-300
}

# Prints present or missing; fails (status written) when the bucket cannot be read.
object_state() {
  local uri="$1" what="$2"
  if gcloud_once storage ls "${uri}" >/dev/null; then
    echo present
  elif err_is_not_found; then
    echo missing
  else
    watch_status UNCHECKED check-failed "cannot read ${what} ${uri}, retrying on the next tick: $(last_error)" >&2
    return 1
  fi
}

# One field of a job pointer: a flat JSON object, one "key": "value" per line (loader.sh
# field); empty when the file or the field is missing.
pointer_field() {
  sed -n "s/^  \"$1\": \"\([A-Za-z0-9._/:=+-]*\)\",\{0,1\}\$/\1/p" "$2" 2>/dev/null || true
}

# The settings of a watchdog come from the controller script that installed it, which the
# loader ran from the job pointer. The controller's metadata holds only the loader, which
# `pulumi up` does not change: it writes a new pointer instead. When the pointer in the bucket
# names another controller script than the one the loader last ran (LOADER_DIR/current.json),
# or the loader never ran, run the startup script now (it installs the current watchdog, or
# removes it). Succeeds when it did: the caller leaves this tick to the new watchdog.
rerun_if_installer_changed() {
  local ran current shown
  ran="$(pointer_field script_controller_sha256 "${LOADER_DIR}/current.json")"
  if ! gcloud_once storage cp --quiet "${POINTER_URI}" "${WATCH_DIR}/pointer" >/dev/null; then
    log "cannot read the job pointer ${POINTER_URI} ($(last_error)); checking with the installed settings"
    return 1
  fi
  current="$(pointer_field script_controller_sha256 "${WATCH_DIR}/pointer")"
  if [ -z "${current}" ]; then
    log "the job pointer ${POINTER_URI} names no controller script; checking with the installed settings"
    return 1
  fi
  if [ "${current}" = "${ran}" ]; then
    return 1
  fi
  shown="${ran:0:16}"
  watch_status UNCHECKED rerun-startup "the job pointer names controller script ${current:0:16}, the loader ran ${shown:-none} (pulumi up); re-running the startup script"
  if google_metadata_script_runner startup; then
    return 0
  fi
  log "re-running the controller's startup script failed; checking with the installed settings"
  return 1
}

# Whether no run of the startup script is in progress (the loader's lock is free).
loader_idle() {
  [ ! -e "${LOADER_LOCK}" ] || flock -n "${LOADER_LOCK}" true
}

# Every tick: the scratch file for gcloud's errors and the lock on ${WATCH_DIR}/lock (fd 9).
watch_open() {
  mkdir -p "${WATCH_DIR}"
  ERR_FILE="$(mktemp)"
  trap 'rm -f "${ERR_FILE}"' EXIT
  exec 9>"${WATCH_DIR}/lock"
}

# A tick that finds another tick, or a run of the startup script, still running leaves it
# alone (exits 0), else it re-runs a changed installer first and then exits (the new watchdog
# takes the next tick).
watch_tick_start() {
  if ! flock -n 9; then
    log "another tick holds ${WATCH_DIR}/lock; nothing to do"
    exit 0
  fi
  # At boot the timer's first tick may come while the guest agent's own run still installs
  # (install_payload_once begins with rm -rf venv src): leave the tick to the next one.
  if ! loader_idle; then
    log "the controller's startup script is running (${LOADER_LOCK}); nothing to do until it ends"
    exit 0
  fi
  if rerun_if_installer_changed; then
    exit 0
  fi
}

# The VM's state from `gcloud <describe command...> --format='value(<field>)'`; MISSING when
# it does not exist. A describe that fails otherwise writes the status and fails.
vm_state() {
  local state
  if gcloud_once "$@" >"${WATCH_DIR}/state"; then
    state="$(tr -d '[:space:]' <"${WATCH_DIR}/state")"
    echo "${state:-UNKNOWN}"
  elif err_is_not_found; then
    echo MISSING
  else
    watch_status UNKNOWN describe-failed "describe failed, retrying on the next tick: $(last_error)"
    return 1
  fi
}

# Why the accelerator VM bills while idle, from its guest attributes in the namespace of
# BOOT_ATTRIBUTE, read with `gcloud <get-guest-attributes command...>
# --format='value([worker_id,]key,value)'`: its loader gave up (BOOT_ATTRIBUTE "failed <epoch>
# <message>", templates/loader.sh boot_state), or its trainer stopped for good
# (TRAINER_ATTRIBUTE "stopped <epoch> <message>": exit 2, or failures in a row, templates/tpu.sh
# trainer_stopped). Prints the first such line not acted on yet (BOOT_SEEN holds the last one
# acted on: a stopped and restarted VM may still show it); fails when there is none or the
# attributes cannot be read (logged: the next tick reads again).
vm_failure() {
  local values line
  if ! values="$(gcloud_once "$@" --query-path="${BOOT_ATTRIBUTE%%/*}/")"; then
    log "cannot read the VM's state (guest attributes ${BOOT_ATTRIBUTE%%/*}/): $(last_error)"
    return 1
  fi
  line="$(awk -F'\t' -v boot="${BOOT_ATTRIBUTE#*/}" -v trainer="${TRAINER_ATTRIBUTE#*/}" \
    'NF >= 2 && (($(NF-1) == boot && $NF ~ /^failed [0-9]+ /) || ($(NF-1) == trainer && $NF ~ /^stopped [0-9]+ /)) { print; exit }' <<<"${values}")"
  if [ -z "${line}" ] || [ "${line}" = "$(cat "${BOOT_SEEN}" 2>/dev/null || true)" ]; then
    return 1
  fi
  echo "${line}"
}

# What a vm_failure line is: boot-failed (its loader) or trainer-stopped (its trainer).
failure_action() {
  if [[ "${1##*$'\t'}" == failed\ * ]]; then
    echo boot-failed
  else
    echo trainer-stopped
  fi
}

# "the boot of VM failed (…)" or "the trainer of VM stopped for good (…)" for a vm_failure line.
failure_cause() {
  local line="$1" vm="$2"
  if [ "$(failure_action "${line}")" = boot-failed ]; then
    echo "the boot of ${vm} failed ($(boot_message "${line}"))"
  else
    echo "the trainer of ${vm} stopped for good ($(boot_message "${line}"))"
  fi
}

# The VM is down because of a vm_failure (BOOT_FAILED: its action, then why): say so again.
down_status() {
  local action why
  action="$(sed -n 1p "${BOOT_FAILED}")"
  why="$(sed -n 2p "${BOOT_FAILED}")"
  if [ -z "${why}" ]; then  # written by an earlier watchdog: the message alone
    why="${action}"
    action=boot-failed
  fi
  watch_status "$1" "${action}" "${why}"
}

# "[worker W: ]<message>" of a vm_failure line.
boot_message() {
  local line="$1" value worker=""
  value="${line##*$'\t'}"
  if [ "$(awk -F'\t' '{ print NF }' <<<"${line}")" -ge 3 ]; then
    worker="worker ${line%%$'\t'*}: "
  fi
  value="${value#* }"  # "failed " or "stopped "
  echo "${worker}${value#* }"
}
