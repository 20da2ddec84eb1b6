# ---- templates/common.sh: shared by every role ----------------------------------------
# Paths are under SANDBOX_ROOT only in the offline tests (empty on a VM).
readonly SANDBOX_ROOT="${TPU_PRETRAIN_SANDBOX:-}"
readonly APP_DIR="${SANDBOX_ROOT}/opt/tpu-pretrain"
readonly UNIT_DIR="${SANDBOX_ROOT}/etc/systemd/system"
readonly RETRY_ATTEMPTS="${TPU_PRETRAIN_RETRY_ATTEMPTS:-10}"
UNITS_CHANGED=0

log() {
  echo "tpu-pretrain[${ROLE}]: $*" >&2
}

# Run a Google Cloud command, retrying errors that are transient on fresh resources:
# IAM grants and new buckets/secrets answer 403/404 (PERMISSION_DENIED, NOT_FOUND) for a
# while, and 429/5xx happen. Any other error fails at once.
readonly TRANSIENT_ERRORS='(403|404|429|500|502|503|504|forbidden|permission[ _]denied|not[ _]?found|too many|resource[ _]exhausted|timed? ?out|deadline|connection|unavailable)'
retry_gcloud() {
  local attempt=1 delay=5 err
  err="$(mktemp)"
  while true; do
    if "$@" 2>"${err}"; then
      rm -f "${err}"
      return 0
    fi
    if [ "${attempt}" -ge "${RETRY_ATTEMPTS}" ] \
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

# Bootstrap status next to the payload's own status.json: gs://…/runs/<job>/bootstrap/<role>.json
write_status() {
  local state="$1" message="$2" file
  file="$(mktemp)"
  printf '{"role": "%s", "host": "%s", "state": "%s", "message": "%s", "payload_sha256": "%s", "updated_at": "%s"}\n' \
    "${ROLE}" "$(hostname)" "${state}" "${message//\"/\'}" "${PAYLOAD_SHA256:-}" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"${file}"
  retry_gcloud gcloud storage cp --quiet "${file}" "${RUN_ROOT}/bootstrap/${ROLE}.json" \
    || log "could not write status ${state}"
  rm -f "${file}"
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
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
  fi
}

# Download the content-addressed payload archive, check its sha256 and install it into its
# own virtualenv (venv-<sha>); `venv` points at the current one. A finished install leaves a
# marker, so reboots skip it. Sets PAYLOAD_SWITCHED=1 when `venv` now points elsewhere.
install_payload() {
  local short="${PAYLOAD_SHA256:0:16}" venv src work
  venv="${APP_DIR}/venv-${short}"
  src="${APP_DIR}/src-${short}"
  PAYLOAD_SWITCHED=0
  if [ -f "${venv}/.tpu-pretrain-installed" ]; then
    log "payload ${short} already installed"
  else
    write_status installing "installing payload ${short}"
    ensure_python_venv
    work="$(mktemp -d)"
    retry_gcloud gcloud storage cp --quiet "${PAYLOAD_URI}" "${work}/payload.tar.gz"
    echo "${PAYLOAD_SHA256}  ${work}/payload.tar.gz" | sha256sum --check --quiet -
    rm -rf "${venv}" "${src}"
    mkdir -p "${src}"
    tar -xzf "${work}/payload.tar.gz" -C "${src}"
    python3 -m venv "${venv}"
    install_requirements "${venv}" "${src}" "${work}"
    "${venv}/bin/pip" install --quiet --no-deps "${src}"
    touch "${venv}/.tpu-pretrain-installed"
    rm -rf "${work}"
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
