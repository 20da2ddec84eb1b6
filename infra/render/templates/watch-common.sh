# ---- templates/watch-common.sh: what every accelerator watchdog shares (controller) -----
# The TPU watchdog (tpu-watch.sh) and the GPU watchdog (gpu-watch.sh) are one tick of a
# systemd timer on the controller. Both act only while the lease object (LEASE_URI) exists,
# never once the job's export is complete (EXPORT_MARKER_URI), write their status to
# gs://…/runs/<job>/bootstrap/<role>.json, and re-run the controller's startup script when
# `pulumi up` changed the watchdog it carries. A VM whose loader gave up (its boot state,
# boot_failure below) is deleted (TPU) or stopped (GPU) instead of billing idle, and not
# recreated or started again by the watchdog. Each defines watch_status STATE ACTION MESSAGE
# and WATCH_DIR (BOOT_SEEN: the boot failure last acted on; BOOT_FAILED: the VM is down
# because of it).
readonly METADATA_URL="http://metadata.google.internal/computeMetadata/v1/instance/attributes/startup-script"

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

# The settings of a watchdog come from the controller startup script that installed it.
# `pulumi up` updates that script in the controller's metadata without running it; when the
# watchdog it carries (WATCH_SCRIPT_B64) differs from this one, or it carries none, run it
# now (it installs the current watchdog, or removes it). Succeeds when it did: the caller
# leaves this tick to the new watchdog.
rerun_if_installer_changed() {
  local current encoded
  if ! current="$(curl -fsS -H 'Metadata-Flavor: Google' "${METADATA_URL}" 2>"${ERR_FILE}")"; then
    log "cannot read the controller's metadata ($(last_error)); checking with the installed settings"
    return 1
  fi
  encoded="$(sed -n 's/^readonly WATCH_SCRIPT_B64=//p' <<<"${current}")"
  if [ "${encoded}" != "''" ] && cmp -s <(base64 -d <<<"${encoded}" 2>/dev/null) "$0"; then
    return 1
  fi
  watch_status UNCHECKED rerun-startup "the controller's startup script changed (pulumi up); re-running it"
  if google_metadata_script_runner startup; then
    return 0
  fi
  log "re-running the controller's startup script failed; checking with the installed settings"
  return 1
}

# Every tick: the scratch file for gcloud's errors and the lock on ${WATCH_DIR}/lock (fd 9).
watch_open() {
  mkdir -p "${WATCH_DIR}"
  ERR_FILE="$(mktemp)"
  trap 'rm -f "${ERR_FILE}"' EXIT
  exec 9>"${WATCH_DIR}/lock"
}

# A tick that finds another tick still running leaves it alone (exits 0), else it re-runs a
# changed installer first and then exits (the new watchdog takes the next tick).
watch_tick_start() {
  if ! flock -n 9; then
    log "another tick holds ${WATCH_DIR}/lock; nothing to do"
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

# The accelerator VM's boot state (templates/loader.sh boot_state): the guest attribute
# BOOT_ATTRIBUTE ("failed <epoch> <message>" when its loader gave up), read with
# `gcloud <get-guest-attributes command...> --format='value([worker_id,]key,value)'` over the
# attribute's namespace. Prints the first failure not acted on yet (BOOT_SEEN holds the last
# one acted on: a stopped and restarted VM may still show it); fails when there is none or
# the attributes cannot be read (logged: the next tick reads again).
boot_failure() {
  local values line
  if ! values="$(gcloud_once "$@" --query-path="${BOOT_ATTRIBUTE%%/*}/")"; then
    log "cannot read the boot state (guest attribute ${BOOT_ATTRIBUTE}): $(last_error)"
    return 1
  fi
  line="$(awk -F'\t' -v key="${BOOT_ATTRIBUTE#*/}" \
    'NF >= 2 && $(NF-1) == key && $NF ~ /^failed [0-9]+ / { print; exit }' <<<"${values}")"
  if [ -z "${line}" ] || [ "${line}" = "$(cat "${BOOT_SEEN}" 2>/dev/null || true)" ]; then
    return 1
  fi
  echo "${line}"
}

# "[worker W: ]<message>" of a boot_failure line.
boot_message() {
  local line="$1" value worker=""
  value="${line##*$'\t'}"
  if [ "$(awk -F'\t' '{ print NF }' <<<"${line}")" -ge 3 ]; then
    worker="worker ${line%%$'\t'*}: "
  fi
  value="${value#failed }"
  echo "${worker}${value#* }"
}
