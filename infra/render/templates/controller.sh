# ---- templates/controller.sh: data preparation and TensorBoard on CPU -----------------
# The controller runs the tested CPU environment: the lock file as is.
install_requirements() {
  local venv="$1" src="$2"
  "${venv}/bin/pip" install --quiet -r "${src}/requirements/payload.lock"
  "${venv}/bin/pip" install --quiet --no-deps "${src}"
}

# The TPU VM's wheels, downloaded once per lock into gs://<bucket>/wheelhouse/<key>/ for the
# TPU image's Python (TPU_PYTHON_VERSION), `complete` written last. A recreated (preempted)
# TPU VM installs from there instead of the package index. Failure only costs speed.
build_wheelhouse() {
  local src="${APP_DIR}/src-${PAYLOAD_SHA256:0:16}" key dir count
  key="$(tpu_wheelhouse_key "${src}" "${TPU_PYTHON_VERSION}")"
  if gcs ls "${WHEELHOUSE_ROOT}/${key}/complete" >/dev/null 2>&1; then
    log "wheelhouse ${key} (Python ${TPU_PYTHON_VERSION}) is already in the bucket"
    return 0
  fi
  log "building wheelhouse ${key} for the TPU VM (Python ${TPU_PYTHON_VERSION})"
  dir="$(mktemp -d)"
  tpu_build_wheelhouse "${APP_DIR}/venv/bin/pip" "${src}" "${TPU_PYTHON_VERSION}" "${dir}" \
    || { rm -rf "${dir}"; return 1; }
  count="$(find "${dir}" -name '*.whl' | wc -l)"
  retry_gcloud gcs cp "${dir}"/*.whl "${WHEELHOUSE_ROOT}/${key}/" || { rm -rf "${dir}"; return 1; }
  date -u +%Y-%m-%dT%H:%M:%SZ >"${dir}/complete"
  retry_gcloud gcs cp "${dir}/complete" "${WHEELHOUSE_ROOT}/${key}/complete" \
    || { rm -rf "${dir}"; return 1; }
  rm -rf "${dir}"
  log "wheelhouse ${key}: ${count} wheels uploaded to ${WHEELHOUSE_ROOT}/${key}/"
}

# What the data unit's ExecStartPre runs: wait until every corpus pattern of the job spec
# (gs://) matches an object, so a corpus uploaded after `pulumi up` is picked up (exit 2 of the
# stages is not retried, see below). The patterns are read from the job spec itself.
wait_corpus() {
  local waited=0 spec patterns pattern out reason previous=""
  gcs_cli
  spec="$(mktemp)"
  retry_gcloud gcs cp "${JOB_URI}" "${spec}" || { rm -f "${spec}"; return 1; }
  # corpus.paths, or every source's paths (a mixture); Hub datasets (hf://) are not waited for.
  patterns="$("${APP_DIR}/venv/bin/python" -c 'import json, sys
corpus = json.load(open(sys.argv[1]))["corpus"]
paths = [p for s in corpus.get("sources", [corpus]) for p in s["paths"]]
print("\n".join(p for p in paths if p.startswith("gs://")))' "${spec}")" \
    || { rm -f "${spec}"; return 1; }
  rm -f "${spec}"
  while true; do
    reason=""
    while IFS= read -r pattern; do
      if ! out="$(gcs ls "${pattern}" 2>&1)"; then
        reason="${pattern}: $(printf '%s\n' "${out}" | tail -n 1)"
        break
      fi
    done <<<"${patterns}"
    if [ -z "${reason}" ]; then
      log "corpus found after ${waited}s"
      return 0
    fi
    log "waiting for the corpus (${waited}s so far): ${reason}"
    if [ "${reason}" != "${previous}" ]; then
      write_status waiting "waiting for the corpus: upload it (docs/deploy-gcp.md): ${reason}"
      previous="${reason}"
    fi
    sleep 60
    waited=$((waited + 60))
  done
}

# What the data unit's ExecStopPost runs, as the TPU VM's trainer unit does (tpu.sh,
# trainer_stopped): systemd sets SERVICE_RESULT, EXIT_CODE and EXIT_STATUS for it. Exit 2 is
# the payload's user error (bad job spec, corpus or output; the line is in status.json):
# restarting cannot fix it, so RestartPreventExitStatus=2 stops the unit and this says so.
data_stopped() {
  local code="${EXIT_STATUS:-}"
  case "${code}" in
    0) write_status finished "data preparation finished (exit 0); the manifest is ${MANIFEST_URI}" ;;
    2) write_status stopped "data preparation stopped with exit 2: a user error (last_error in ${STATUS_URI}); not restarted (RestartPreventExitStatus=2): fix it, then sudo systemctl restart tpu-pretrain-data" ;;
    *) write_status restarting "data preparation ended (${SERVICE_RESULT:-unknown}, exit ${code:-none}); systemd restarts it in 60s and it continues from the finished shards" ;;
  esac
}

# systemd cannot call shell functions: the helper is this script's own functions and
# constants, written next to the venv (as on the TPU VM).
readonly HELPER="${APP_DIR}/bin/tpu-pretrain-helper"
install_helper() {
  local body sdk_path="" tool
  # systemd's PATH need not contain the image's SDK (e.g. /snap/bin): pin where it is now.
  for tool in gcloud gsutil; do
    if command -v "${tool}" >/dev/null 2>&1; then
      sdk_path="${sdk_path}$(dirname "$(command -v "${tool}")"):"
    fi
  done
  body="#!/usr/bin/env bash
# tpu-pretrain: the data unit's helper, written by the controller's startup script.
set -Euo pipefail
export PATH=${sdk_path}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
$(declare -p SANDBOX_ROOT APP_DIR RETRY_ATTEMPTS LOG_TAG CONSOLE TRANSIENT_ERRORS)
$(declare -p ROLE RUN_ROOT JOB_URI MANIFEST_URI STATUS_URI PAYLOAD_SHA256)
GCS_CLI=''
STATUS_NAME=''
$(declare -p HOST_CHECKS)
$(declare -f log retry_gcloud gcs_cli gcs write_status wait_corpus data_stopped)
case \"\${1:-}\" in
  wait-corpus) wait_corpus ;;
  data-stopped) data_stopped ;;
  *) echo \"usage: \$0 wait-corpus|data-stopped\" >&2; exit 2 ;;
esac"
  if write_if_changed "${HELPER}" 0755 "${body}"; then
    log "helper ${HELPER} installed"
  fi
}

trap 'write_status failed "startup script failed at line ${LINENO}"' ERR
gcs_cli
write_status starting "startup script started"
install_started="${SECONDS}"
install_payload
record_facts "$((SECONDS - install_started))"
install_helper

# Tokenizer, then encoding; each stage skips work that is already complete in the bucket.
# It starts once the corpus is uploaded; exit 2 (a user error) is not restarted: the helper
# records it in the bootstrap status.
install_unit tpu-pretrain-data.service "[Unit]
Description=tpu-pretrain data preparation for job ${JOB_NAME}
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=oneshot
RemainAfterExit=yes
Environment=PYTHONUNBUFFERED=1
Environment=TPU_PAYLOAD_VERBOSE=1
Environment=TPU_PRETRAIN_HOST_FACTS=/opt/tpu-pretrain/host-facts.json
ExecStartPre=/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-corpus
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload tokenizer --job ${JOB_URI}
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload encode --job ${JOB_URI}
ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper data-stopped
Restart=on-failure
RestartSec=60
RestartPreventExitStatus=2
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target"

# TensorBoard for the user, over the VPN: the hop reaches the controller at its internal
# address (infra/components/network.py lets the hop's tag in on TENSORBOARD_PORT, nothing
# else), so it listens there and nowhere else, read from the metadata server at every boot.
# It reads ${RUN_ROOT}/logs from the bucket itself (gs://, as the VM's account, whose token
# any local process gets from the metadata server) and writes nothing but its /tmp: the
# trainer on the accelerator VM writes those logs. So it runs as a user of its own
# (DynamicUser) with no privileges and a read-only system. Each setting below was checked
# against what TensorBoard 2.20 and its data server 0.7.2 do when serving a logdir with
# --load_fast=true, run under the same restrictions and traced: sockets AF_UNIX, AF_INET and
# AF_INET6 only; the data server's port file in a temp dir; /proc/sys and its own /proc/<pid>
# read, nothing else of /proc/<pid>; native system calls only; no namespace, personality,
# scheduler, clock, hostname, module or kernel-log call. AF_NETLINK stays for the C
# library's resolver on the way to storage.googleapis.com (not exercised offline); no
# system-call filter, for the same reason.
internal_ip() {
  local attempt=1 ip
  while ! ip="$(curl -fsS -H 'Metadata-Flavor: Google' "${METADATA_INSTANCE}/network-interfaces/0/ip" 2>/dev/null)" \
    || [ -z "${ip}" ]; do
    if [ "${attempt}" -ge "${RETRY_ATTEMPTS}" ]; then
      log "metadata network-interfaces/0/ip: not readable after ${attempt} attempts"
      return 1
    fi
    sleep 5
    attempt=$((attempt + 1))
  done
  printf '%s\n' "${ip}"
}
tensorboard_host="$(internal_ip)"
install_unit tpu-pretrain-tensorboard.service "[Unit]
Description=TensorBoard for job ${JOB_NAME} (reach it over the VPN)
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/opt/tpu-pretrain/venv/bin/tensorboard --logdir ${RUN_ROOT}/logs --host ${tensorboard_host} --port ${TENSORBOARD_PORT} --load_fast=true
DynamicUser=yes
NoNewPrivileges=yes
CapabilityBoundingSet=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
ProtectProc=invisible
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target"

units=(tpu-pretrain-data.service tpu-pretrain-tensorboard.service)

# Preemption recovery (tpu-pretrain:tpuAutoRecover / gpuAutoRecover): a timer runs the
# accelerator's watchdog (templates/tpu-watch.sh recreates a preempted TPU VM with the
# startup script installed next to it; templates/gpu-watch.sh starts a stopped spot GPU VM).
# Turned off, the watchdog is removed.
# Decode base64 into a file, byte for byte; rewritten only when the bytes change.
install_decoded() {
  local path="$1" mode="$2" data="$3" tmp
  mkdir -p "$(dirname "${path}")"
  tmp="$(mktemp)"
  base64 -d <<<"${data}" >"${tmp}"
  if [ -f "${path}" ] && cmp -s "${tmp}" "${path}"; then
    rm -f "${tmp}"
    return 1
  fi
  chmod "${mode}" "${tmp}"
  mv -f "${tmp}" "${path}"
  log "installed ${path}"
}

# Every watchdog a controller may have carried (a stack is TPU or GPU; either may be off).
remove_watchdog() {
  local kind="$1" dir="${APP_DIR}/$1-watch" unit="tpu-pretrain-$1-watch"
  if [ ! -e "${UNIT_DIR}/${unit}.timer" ] && [ ! -d "${dir}" ]; then
    return 0
  fi
  systemctl disable --now --quiet "${unit}.timer" || true
  systemctl disable --quiet "${unit}-guard.service" 2>/dev/null || true
  rm -f "${UNIT_DIR}/${unit}.timer" "${UNIT_DIR}/${unit}.service" "${UNIT_DIR}/${unit}-guard.service"
  rm -rf "${dir}"
  UNITS_CHANGED=1
  log "${kind^^} watchdog removed"
}

for kind in tpu gpu; do
  if [ "${AUTO_RECOVER}" != true ] || [ "${kind}" != "${WATCH_KIND}" ]; then
    remove_watchdog "${kind}"
  fi
done
if [ "${AUTO_RECOVER}" = true ]; then
  watch_dir="${APP_DIR}/${WATCH_KIND}-watch"
  watch_unit="tpu-pretrain-${WATCH_KIND}-watch"
  watch_script="/opt/tpu-pretrain/${WATCH_KIND}-watch/${WATCH_KIND}-watch.sh"
  if [ "${WATCH_KIND}" = tpu ]; then
    # The TPU VM's own startup script, byte for byte: a recreated VM gets the same metadata.
    install_decoded "${watch_dir}/tpu-startup.sh" 0644 "${TPU_STARTUP_SCRIPT_B64}" || true
    what="recreate the TPU VM of job ${JOB_NAME} when it is preempted"
    after=" ${watch_unit}-guard.service"
  else
    what="start the spot GPU VM of job ${JOB_NAME} again when it is preempted"
    after=""
  fi
  install_decoded "${watch_dir}/${WATCH_KIND}-watch.sh" 0755 "${WATCH_SCRIPT_B64}" || true
  gcloud_dir="$(dirname "$(command -v gcloud)")"
  install_unit "${watch_unit}.service" "[Unit]
Description=tpu-pretrain: ${what}
Wants=network-online.target
After=network-online.target${after}

[Service]
Type=oneshot
Environment=PATH=${gcloud_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStart=${watch_script}
TimeoutStartSec=45min"
  if [ "${WATCH_KIND}" = tpu ]; then
    # On shutdown (after any running tick is stopped, before the network goes): when the
    # stack is being destroyed, cancel the watchdog's queued resource before the VM is gone.
    install_unit "${watch_unit}-guard.service" "[Unit]
Description=tpu-pretrain: cancel the TPU watchdog's queue when the stack is destroyed
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
Environment=PATH=${gcloud_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStart=/bin/true
ExecStop=${watch_script} shutdown
TimeoutStopSec=90

[Install]
WantedBy=multi-user.target"
    units+=("${watch_unit}-guard.service")
  fi
  install_unit "${watch_unit}.timer" "[Unit]
Description=tpu-pretrain: check the ${WATCH_KIND^^} VM every ${WATCH_INTERVAL}

[Timer]
OnBootSec=${WATCH_INTERVAL}
OnUnitActiveSec=${WATCH_INTERVAL}

[Install]
WantedBy=timers.target"
  units+=("${watch_unit}.timer")
fi

start_units "${units[@]}"
write_status started "units started: ${units[*]}"
build_wheelhouse || log "wheelhouse not built; TPU VMs install from the package index"
