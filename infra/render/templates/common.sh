# ---- templates/common.sh: shared by every role ----------------------------------------
# Paths are under SANDBOX_ROOT only in the offline tests (empty on a VM).
readonly SANDBOX_ROOT="${TPU_PRETRAIN_SANDBOX:-}"
readonly APP_DIR="${SANDBOX_ROOT}/opt/tpu-pretrain"
readonly UNIT_DIR="${SANDBOX_ROOT}/etc/systemd/system"
readonly RETRY_ATTEMPTS="${TPU_PRETRAIN_RETRY_ATTEMPTS:-10}"
# The payload install is retried as a whole (a half-built venv is removed first).
readonly INSTALL_ATTEMPTS="${TPU_PRETRAIN_INSTALL_ATTEMPTS:-5}"
# Every step is mirrored to the journal (journalctl -t tpu-pretrain) and the serial console.
readonly LOG_TAG=tpu-pretrain
readonly CONSOLE="${SANDBOX_ROOT}/dev/console"
UNITS_CHANGED=0
GCS_CLI=""
HOST_CHECKS=""  # JSON strings: this VM's mismatches with the catalog (templates/facts.sh)

log() {
  echo "tpu-pretrain[${ROLE}]: $*" >&2
  if command -v logger >/dev/null 2>&1; then
    logger -t "${LOG_TAG}" -- "[${ROLE}] $*" 2>/dev/null || true
  fi
  if [ -w "${CONSOLE}" ]; then
    echo "tpu-pretrain[${ROLE}]: $*" >>"${CONSOLE}" 2>/dev/null || true
  fi
}

# Run a Google Cloud command, retrying errors that are transient on fresh resources:
# IAM grants and new buckets/secrets answer 403/404 (PERMISSION_DENIED, NOT_FOUND) for a
# while, and 429/5xx happen. Any other error fails at once. RETRY_LIMIT=N for one call
# tries at most N times (an event must not hold up what its writer does next).
readonly TRANSIENT_ERRORS='(403|404|429|500|502|503|504|forbidden|permission[ _]denied|not[ _]?found|too many|resource[ _]exhausted|timed? ?out|deadline|connection|unavailable)'
retry_gcloud() {
  local attempt=1 delay=5 err
  err="$(mktemp)"
  while true; do
    if "$@" 2>"${err}"; then
      rm -f "${err}"
      return 0
    fi
    if [ "${attempt}" -ge "${RETRY_LIMIT:-${RETRY_ATTEMPTS}}" ] \
      || ! grep -Eqi "${TRANSIENT_ERRORS}" "${err}"; then
      cat "${err}" >&2
      rm -f "${err}"
      return 1
    fi
    log "transient error (attempt ${attempt}/${RETRY_ATTEMPTS}), retrying in ${delay}s: $(tail -n 1 "${err}")"
    sleep "${delay}"
    attempt=$((attempt + 1))
    delay=$((delay * 2 > 120 ? 120 : delay * 2))
  done
}

# One wrapper for Cloud Storage: `gcloud storage` where the SDK has it, else gsutil (some
# TPU images ship an SDK older than `gcloud storage`). Probed once per shell.
#   gcs cp SRC... DST | gcs ls URI
gcs_cli() {
  if [ -n "${GCS_CLI}" ]; then
    return 0
  fi
  if gcloud storage --help >/dev/null 2>&1; then
    GCS_CLI=gcloud
  elif command -v gsutil >/dev/null 2>&1; then
    GCS_CLI=gsutil
    log "this gcloud has no 'storage' command (an old SDK): using gsutil"
  else
    log "neither 'gcloud storage' nor gsutil is available"
    return 1
  fi
}

gcs() {
  local verb="$1"
  shift
  gcs_cli || return 1
  case "${GCS_CLI}:${verb}" in
    gcloud:cp) gcloud storage cp --quiet "$@" ;;
    gcloud:ls) gcloud storage ls "$@" ;;
    gsutil:cp) gsutil -q -m cp "$@" ;;
    gsutil:ls) gsutil ls "$@" ;;
    *)
      log "gcs: unknown verb ${verb}"
      return 2
      ;;
  esac
}

# apt-get that waits for the dpkg lock (a first boot runs unattended-upgrades and the
# guest agent's own apt) and retries transient mirror errors. DPkg::Lock::Timeout exists
# since apt 1.9.11 (Ubuntu 22.04 ships apt 2.4, Debian 12 apt 2.6).
apt_get() {
  local attempt=1
  while ! DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -q "$@"; do
    if [ "${attempt}" -ge "${RETRY_ATTEMPTS}" ]; then
      log "apt-get $* failed ${attempt} times"
      return 1
    fi
    log "apt-get $* failed (attempt ${attempt}/${RETRY_ATTEMPTS}); retrying in 15s"
    sleep 15
    attempt=$((attempt + 1))
  done
}

apt_install() {
  apt_get update
  apt_get install -y "$@"
}

# Bootstrap status next to the payload's own status.json: gs://…/runs/<job>/bootstrap/<role>.json
# (STATUS_NAME instead of the role when set: each host of a slice has its own,
# tpu-worker-<i>.json, which also names the host's worker index and the slice's worker IPs).
write_status() {
  local state="$1" message="$2" file slice=""
  file="$(mktemp)"
  if [ -n "${WORKER:-}" ]; then
    slice="$(printf ', "worker": "%s", "slice": "%s"' "${WORKER}" "${SLICE_IPS:-}")"
  fi
  if [ -n "${HOST_CHECKS:-}" ]; then
    slice="${slice}, \"host_checks\": [${HOST_CHECKS}]"
  fi
  printf '{"role": "%s", "host": "%s", "state": "%s", "message": "%s", "payload_sha256": "%s", "updated_at": "%s"%s}\n' \
    "${ROLE}" "$(hostname)" "${state}" "${message//\"/\'}" "${PAYLOAD_SHA256:-}" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${slice}" >"${file}"
  log "status ${state}: ${message}"
  retry_gcloud gcs cp "${file}" "${RUN_ROOT}/bootstrap/${STATUS_NAME:-${ROLE}}.json" \
    || log "could not write status ${state}"
  rm -f "${file}"
}

# A run event (the table: payload/core/events.py EVENTS, docs/operating.md) for Cloud Logging,
# where the stack's alert policies match it: the scripts' only
# writer of events, as payload.core.events.emit is the payload's.
#   emit_event EVENT SOURCE MESSAGE [FIELD=VALUE ...]   (EVENT_LOG=FILE: also append it there)
# The entry goes to the journal and to `gcloud logging write tpu-pretrain-events` (resource
# global, the VM's logWriter role); a failed write is logged and never fails the caller.
# event_severity mirrors EVENTS' severities (tests/test_contract.py keeps them equal).
event_severity() {
  case "$1" in
    preempted | capacity-wait | unhealthy | eta-past-grant) echo WARNING ;;
    recreated | finished) echo NOTICE ;;
    hung | stopped) echo ERROR ;;
    *) return 1 ;;
  esac
}

emit_event() {
  local event="$1" source="$2" message="$3" severity payload project=()
  shift 3
  if ! severity="$(event_severity "${event}")"; then
    log "emit_event: unknown event ${event}"
    return 0
  fi
  payload="$(python3 - "${event}" "${source}" "${message}" "${RUN_ROOT:-}" "${JOB_NAME:-}" \
    "$(hostname)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$@" <<'PY'
import json, sys
event, source, message, run_root, job, host, at, *pairs = sys.argv[1:]
bucket = run_root[len("gs://"):].split("/", 1)[0] if run_root.startswith("gs://") else ""
doc = {"schema": "tpu-pretrain.event/1", "event": event, "bucket": bucket, "job": job,
       "source": source, "host": host, "message": " ".join(message.split())[:500], "at": at}
for pair in pairs:
    key, _, value = pair.partition("=")
    doc[key] = int(value) if value.isdigit() else value
print(json.dumps(doc, sort_keys=True))
PY
  )" || { log "emit_event: cannot build the ${event} event"; return 0; }
  log "event ${payload}"
  # A watchdog keeps the events it wrote for its status's timeline (watch-common.sh).
  if [ -n "${EVENT_LOG:-}" ]; then
    printf '%s\n' "${payload}" >>"${EVENT_LOG}" || log "emit_event: cannot keep ${event} in ${EVENT_LOG}"
  fi
  if [ -n "${PROJECT:-}" ]; then
    project=(--project "${PROJECT}")
  fi
  if [ -n "${RUN_ROOT:-}" ] && [ "${TPU_PRETRAIN_EVENTS:-on}" != off ]; then
    retry_gcloud gcloud logging write tpu-pretrain-events "${payload}" --payload-type=json \
      --severity="${severity}" "${project[@]}" >/dev/null \
      || log "emit_event: ${event} not written to Cloud Logging"
  fi
  return 0
}

# Write a file only when its content changes; returns 0 if it was (re)written.
write_if_changed() {
  local path="$1" mode="$2" content="$3" tmp
  mkdir -p "$(dirname "${path}")"
  tmp="$(mktemp)"
  printf '%s\n' "${content}" >"${tmp}"
  if [ -f "${path}" ] && cmp -s "${tmp}" "${path}"; then
    rm -f "${tmp}"
    return 1
  fi
  chmod "${mode}" "${tmp}"
  mv -f "${tmp}" "${path}"
  return 0
}

install_unit() {
  local name="$1" content="$2"
  if write_if_changed "${UNIT_DIR}/${name}" 0644 "${content}"; then
    log "unit ${name} installed"
    UNITS_CHANGED=1
  fi
}

ensure_python_venv() {
  if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
    log "installing python3-venv"
    apt_install python3-venv
  fi
}

# The interpreter that makes the payload's venv (SRC: the unpacked payload): python3. The
# accelerator VM's tpu.sh gives its environment's own (tpu-install.sh tpu_env_python).
# shellcheck disable=SC2329  # tpu.sh redefines it for the TPU and GPU VMs
payload_python() {
  echo python3
}

# Download the content-addressed payload archive, check its sha256 and install it into its
# own virtualenv (venv-<sha>); `venv` points at the current one. A finished install leaves a
# marker, so reboots skip it. The install is retried as a unit (INSTALL_ATTEMPTS, backoff):
# a failed attempt's venv is removed and the next one starts from the download.
# Sets PAYLOAD_SWITCHED=1 when `venv` now points elsewhere.
install_payload_once() {
  local venv="$1" src="$2" work
  ensure_python_venv
  work="$(mktemp -d)"
  # The loader (templates/loader.sh) hands over the archive it downloaded and checked
  # against the job pointer; by hand (or without it) the archive comes from the bucket.
  if [ -n "${TPU_PRETRAIN_PAYLOAD_ARCHIVE:-}" ] && [ -f "${TPU_PRETRAIN_PAYLOAD_ARCHIVE}" ]; then
    cp "${TPU_PRETRAIN_PAYLOAD_ARCHIVE}" "${work}/payload.tar.gz"
  else
    retry_gcloud gcs cp "${PAYLOAD_URI}" "${work}/payload.tar.gz"
  fi
  echo "${PAYLOAD_SHA256}  ${work}/payload.tar.gz" | sha256sum --check --quiet -
  rm -rf "${venv}" "${src}"
  mkdir -p "${src}"
  tar -xzf "${work}/payload.tar.gz" -C "${src}"
  "$(payload_python "${src}")" -m venv "${venv}"
  install_requirements "${venv}" "${src}" "${work}"
  touch "${venv}/.tpu-pretrain-installed"
  rm -rf "${work}"
}

# A VM must not sit idle after a failed boot: run the startup script again later, from a
# transient systemd timer (google_metadata_script_runner is the guest agent's runner). Every
# failure schedules the next attempt, including a failed re-run, which runs inside the
# previous attempt's transient service: that unit is still loaded then, and systemd refuses a
# transient unit whose name is loaded ("Unit NAME.service was already loaded or has a
# fragment file": systemd/systemd#40345, coreos/bootupd#707). So each attempt has its own unit
# name; --collect unloads its service when it ends, failed or not, and
# RemainAfterElapse=no its elapsed timer (systemd-run(1), systemd.timer(5), systemd 252).
# Pending timers of earlier attempts (e.g. before a re-run by hand) are stopped first:
# stopping a timer leaves the service it already started running.
schedule_rerun() {
  local runner unit
  runner="$(command -v google_metadata_script_runner || true)"
  if [ -z "${runner}" ]; then
    log "google_metadata_script_runner not found: re-run the startup script by hand"
    return 0
  fi
  unit="tpu-pretrain-startup-rerun-$(date -u +%Y%m%dT%H%M%SZ)-$$"
  systemctl stop 'tpu-pretrain-startup-rerun*.timer' >/dev/null 2>&1 || true
  if systemd-run --unit="${unit}" --collect --timer-property=RemainAfterElapse=no \
    --on-active=30min "${runner}" startup; then
    log "the startup script runs again in 30 min (${unit}.timer)"
  else
    log "could not schedule a re-run of the startup script"
  fi
}

install_payload() {
  local short="${PAYLOAD_SHA256:0:16}" venv src attempt=1 delay=30 rc
  venv="${APP_DIR}/venv-${short}"
  src="${APP_DIR}/src-${short}"
  PAYLOAD_SWITCHED=0
  if [ -f "${venv}/.tpu-pretrain-installed" ]; then
    log "payload ${short} already installed"
  else
    while true; do
      write_status installing "installing payload ${short} (attempt ${attempt}/${INSTALL_ATTEMPTS})"
      # A subshell with its own errexit: any failing command ends this attempt only.
      set +e
      (
        set -e
        trap - ERR
        install_payload_once "${venv}" "${src}"
      )
      rc=$?
      set -e
      if [ "${rc}" = 0 ]; then
        break
      fi
      rm -rf "${venv}" "${src}"
      if [ "${attempt}" -ge "${INSTALL_ATTEMPTS}" ]; then
        write_status failed "payload install failed ${attempt} times (last exit ${rc}); see journalctl -t ${LOG_TAG}; the startup script runs again in 30 min"
        schedule_rerun
        exit 1
      fi
      log "payload install attempt ${attempt} failed (exit ${rc}); retrying the whole install in ${delay}s"
      sleep "${delay}"
      attempt=$((attempt + 1))
      delay=$((delay * 2 > 600 ? 600 : delay * 2))
    done
  fi
  if [ "$(readlink "${APP_DIR}/venv" || true)" != "${venv}" ]; then
    ln -sfn "${venv}" "${APP_DIR}/venv"
    PAYLOAD_SWITCHED=1
  fi
  # Earlier payload versions are no longer referenced: free their disk.
  local old
  for old in "${APP_DIR}"/venv-* "${APP_DIR}"/src-*; do
    case "${old}" in
      "${venv}" | "${src}") ;;
      *) if [ -d "${old}" ]; then rm -rf "${old}" && log "removed ${old}"; fi ;;
    esac
  done
}

# Enable and (re)start units without waiting for them: oneshot stages run for hours.
start_units() {
  local unit
  if [ "${UNITS_CHANGED}" = 1 ]; then
    systemctl daemon-reload
  fi
  for unit in "$@"; do
    systemctl enable --quiet "${unit}"
    if [ "${UNITS_CHANGED}" = 1 ] || [ "${PAYLOAD_SWITCHED:-0}" = 1 ]; then
      systemctl restart --no-block "${unit}"
    else
      systemctl start --no-block "${unit}"
    fi
  done
}
# ---- end of common.sh ------------------------------------------------------------------
