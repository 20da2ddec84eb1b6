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
# takes the next tick). A tick that goes on writes the status page when it ends (write_page).
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
  trap 'write_page; rm -f "${ERR_FILE}"' EXIT
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

# ---- events, capacity and the status object ---------------------------------------------
# The events a watchdog wrote (common.sh emit_event, source watchdog) are kept in
# ${WATCH_DIR}/events.jsonl, the newest EVENTS_KEPT of them, for its status's `events` (the
# status page's timeline). An event is written once per occurrence, not once per tick: the
# callers keep what they reported in WATCH_DIR (event_once).
readonly EVENTS_KEPT=20

watch_event() {
  local event="$1" message="$2" log="${WATCH_DIR}/events.jsonl"
  shift 2
  # Two tries at most: the next step of the tick (a delete, a create) must not wait on it.
  EVENT_LOG="${log}" RETRY_LIMIT=2 emit_event "${event}" watchdog "${message}" "$@"
  if [ -f "${log}" ] && [ "$(wc -l <"${log}")" -gt "${EVENTS_KEPT}" ]; then
    tail -n "${EVENTS_KEPT}" "${log}" >"${log}.new" && mv -f "${log}.new" "${log}"
  fi
}

# event_once NAME EVENT MESSAGE [FIELD=VALUE ...]: the event, unless the occurrence NAME was
# already reported (event_over NAME ends it; the next one is reported again).
event_once() {
  local name="$1"
  shift
  if [ -f "${WATCH_DIR}/reported-${name}" ]; then
    return 0
  fi
  watch_event "$@"
  touch "${WATCH_DIR}/reported-${name}"
}

event_over() {
  local name
  for name in "$@"; do
    rm -f "${WATCH_DIR}/reported-${name}"
  done
}

# Waiting for capacity: from the request for the accelerator (a queued resource, a create,
# a start) until it exists. ${WATCH_DIR}/capacity-since holds when the current wait began,
# capacity-total the seconds of the earlier ones (the status's capacity_wait_s, the goodput's
# "waiting for capacity"), capacity-exhausted what the last refusal named.
capacity_wait_begin() {
  if [ ! -f "${WATCH_DIR}/capacity-since" ]; then
    date -u +%s >"${WATCH_DIR}/capacity-since"
    rm -f "${WATCH_DIR}/capacity-exhausted"
    event_over capacity-wait
  fi
}

capacity_wait_end() {
  local since total
  if [ -f "${WATCH_DIR}/capacity-since" ]; then
    since="$(cat "${WATCH_DIR}/capacity-since")"
    total="$(cat "${WATCH_DIR}/capacity-total" 2>/dev/null || echo 0)"
    echo $((total + $(date -u +%s) - since)) >"${WATCH_DIR}/capacity-total"
    rm -f "${WATCH_DIR}/capacity-since" "${WATCH_DIR}/capacity-exhausted"
    event_over capacity-wait
  fi
}

# Seconds of this wait so far (0 when none is under way).
capacity_waited() {
  local since
  since="$(cat "${WATCH_DIR}/capacity-since" 2>/dev/null || true)"
  if [[ "${since}" =~ ^[0-9]+$ ]]; then
    echo $(($(date -u +%s) - since))
  else
    echo 0
  fi
}

# What a refusal's text names as exhausted: the quota it quotes ("quota NAME"), a quota, or
# capacity (a stockout: ZONE_RESOURCE_POOL_EXHAUSTED, "no more capacity", a queued resource
# WAITING_FOR_RESOURCES).
exhausted_of() {
  local text="$1" quota
  quota="$(grep -oEi "quota (limit |metric )?'[^']+'" <<<"${text}" | head -n 1 | cut -d"'" -f2 || true)"
  if [ -n "${quota}" ]; then
    echo "quota ${quota}"
  elif grep -qi quota <<<"${text}"; then
    echo quota
  else
    echo capacity
  fi
}

# Still waiting, for EXHAUSTED: once the wait passes CAPACITY_WAIT_SECONDS (the stack's
# tpu-pretrain:capacityWaitMinutes), one capacity-wait event for this wait.
capacity_waiting() {
  local exhausted="$1" waited
  capacity_wait_begin
  echo "${exhausted}" >"${WATCH_DIR}/capacity-exhausted"
  waited="$(capacity_waited)"
  if [ "${waited}" -ge "${CAPACITY_WAIT_SECONDS}" ]; then
    event_once capacity-wait capacity-wait \
      "the accelerator has waited $((waited / 60)) min for ${exhausted} (more than the stack's capacityWaitMinutes, $((CAPACITY_WAIT_SECONDS / 60)))" \
      "waited_s=${waited}" "exhausted=${exhausted}"
  fi
}

# The watchdog's status object (gs://…/runs/<job>/bootstrap/<role>.json), valid JSON for any
# message (python3 builds it, as emit_event does): the role's fields as KEY=VALUE (a string)
# or KEY:=NUMBER, then what every watchdog keeps: capacity_wait_s (the seconds this job has
# waited for capacity, a number), capacity_exhausted (what the current wait is for, "" when
# none), events (the last EVENTS_KEPT events, each its entry's JSON object) and updated_at.
put_status() {
  local action="$1" file total
  shift
  total="$(cat "${WATCH_DIR}/capacity-total" 2>/dev/null || echo 0)"
  [[ "${total}" =~ ^[0-9]+$ ]] || total=0
  file="$(mktemp)"
  if python3 - "$((total + $(capacity_waited)))" \
    "$(cat "${WATCH_DIR}/capacity-exhausted" 2>/dev/null || true)" \
    "${WATCH_DIR}/events.jsonl" "$@" >"${file}" <<'PY'; then
import json, sys, time
wait_s, exhausted, log, *pairs = sys.argv[1:]
doc = {}
for pair in pairs:
    key, _, value = pair.partition("=")
    if key.endswith(":"):
        doc[key[:-1]] = int(value) if value.lstrip("-").isdigit() else None
    else:
        doc[key] = value
events = []
try:
    with open(log, encoding="utf-8") as lines:
        for line in lines.read().splitlines()[-20:]:
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
except OSError:
    pass
doc.update(capacity_wait_s=int(wait_s), capacity_exhausted=exhausted, events=events,
           updated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
print(json.dumps(doc))
PY
    retry_gcloud gcloud storage cp --quiet "${file}" "${RUN_ROOT}/bootstrap/${ROLE}.json" \
      || log "could not write status ${action}"
  else
    log "could not build status ${action}"
  fi
  rm -f "${file}"
}

# The run's status page, runs/<job>/status.html, at the end of every tick that got past
# watch_tick_start: the payload's `tpu-payload page` (it reads runs/<job>/status.json and
# bootstrap/*.json), where the controller has the payload installed. Bounded (120 s) and never
# failing the tick.
write_page() {
  local cli="${APP_DIR}/venv/bin/tpu-payload"
  if [ -x "${cli}" ]; then
    timeout 120 "${cli}" page --run "${RUN_ROOT}" >/dev/null 2>"${ERR_FILE}.page" \
      || log "the status page was not written: $(tail -n 1 "${ERR_FILE}.page" 2>/dev/null)"
    rm -f "${ERR_FILE}.page"
  fi
}
