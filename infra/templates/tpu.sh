# ---- templates/tpu.sh: the trainer's functions -----------------------------------------
# The TPU VM's script runs them from tpu-main.sh, the GPU VM's from gpu.sh.
# TensorFlow for TPU: tensorflow-tpu + libtpu from PyPI (requirements/tpu-vm.txt) with the
# rest of the tested lock, installed by tpu-install.sh (above), from the controller's
# wheelhouse when the bucket has one for this Python, else from the package index.
readonly HELPER="${APP_DIR}/bin/tpu-pretrain-helper"

install_requirements() {
  local venv="$1" src="$2" work="$3" python_version key wheels=""
  python_version="$(tpu_env_python_version "${src}")"
  key="$(tpu_wheelhouse_key "${src}" "${python_version}")"
  if gcs ls "${WHEELHOUSE_ROOT}/${key}/complete" >/dev/null 2>&1; then
    mkdir -p "${work}/wheels"
    if retry_gcloud gcs cp "${WHEELHOUSE_ROOT}/${key}/*.whl" "${work}/wheels/"; then
      wheels="${work}/wheels"
      log "wheelhouse ${key}: $(find "${wheels}" -name '*.whl' | wc -l) wheels downloaded"
    else
      log "wheelhouse ${key} could not be downloaded: installing from the package index"
    fi
  else
    log "no wheelhouse ${key} for Python ${python_version} yet (the controller builds it):" \
      "installing from the package index"
  fi
  tpu_install_env "${venv}" "${src}" "${wheels}"
}

# The venv's interpreter: the image's python3, or the Python the overlay names (the JAX
# environment's, installed by uv under APP_DIR: tpu-install.sh tpu_env_python).
# shellcheck disable=SC2329  # invoked by common.sh install_payload_once
payload_python() {
  tpu_env_python "$1" "${APP_DIR}"
}

# The TPU VM's python3 must run the payload (the catalog refuses older images; this is the
# same rule on the VM itself, for an image changed by hand).
check_python() {
  local version
  version="$(tpu_python_version)"
  if ! python3 -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)'; then
    write_status failed "python3 is ${version} on runtime ${RUNTIME_VERSION}; the payload needs Python >= 3.10 (use an image from infra/catalog.yaml)"
    exit 1
  fi
}

# What the trainer unit's ExecStartPre and ExecStopPost run: this script's own functions and
# constants, written next to the venv (systemd cannot call shell functions).
wait_manifest() {
  local waited=0 out reason previous=""
  gcs_cli
  while true; do
    if out="$(gcs ls "${MANIFEST_URI}" 2>&1)"; then
      log "data manifest found after ${waited}s: ${MANIFEST_URI}"
      return 0
    fi
    out="$(printf '%s\n' "${out}" | tail -n 1)"
    if grep -Eqi '(403|permission|denied|forbidden)' <<<"${out}"; then
      reason="no permission to read it yet (IAM grants propagate slowly): ${out}"
    elif grep -Eqi '(404|not ?found|matched no objects|no urls matched)' <<<"${out}"; then
      reason="not written yet: the controller writes it after its tokenizer and encode stages (see ${STATUS_URI})"
    else
      reason="${out}"
    fi
    log "waiting for the data manifest ${MANIFEST_URI} (${waited}s so far): ${reason}"
    if [ "${reason}" != "${previous}" ]; then
      write_status waiting "waiting for the data manifest: ${reason}"
      previous="${reason}"
    fi
    sleep 60
    waited=$((waited + 60))
  done
}

# systemd sets SERVICE_RESULT, EXIT_CODE and EXIT_STATUS for ExecStopPost.
trainer_stopped() {
  local code="${EXIT_STATUS:-}"
  case "${code}" in
    0) write_status finished "trainer finished (exit 0); see ${STATUS_URI}" ;;
    2) write_status stopped "trainer stopped with exit 2: a user error or no TPU (last_error in ${STATUS_URI}); not restarted (RestartPreventExitStatus=2): fix it, then sudo systemctl restart tpu-pretrain-train" ;;
    *) write_status restarting "trainer ended (${SERVICE_RESULT:-unknown}, exit ${code:-none}); systemd restarts it in 60s and it resumes from the last checkpoint" ;;
  esac
}

# What the payload is told about its host (payload/cli.py): a TPU VM here; gpu.sh redefines
# it for a GPU VM.
# shellcheck disable=SC2329  # invoked by install_trainer_unit (gpu.sh's version in a GPU script)
trainer_host_env() {
  printf '%s\n' "Environment=TPU_PRETRAIN_ACCELERATOR_TYPE=${ACCELERATOR_TYPE}" \
    "Environment=TPU_PRETRAIN_RUNTIME_VERSION=${RUNTIME_VERSION}"
}

# What the training backend needs in the unit (PAYLOAD_BACKEND, from the job's train.backend:
# infra/config.py resolve_backend); TPU_PAYLOAD_BACKEND is the payload's default for
# train.backend: auto. TensorFlow (tf): TF_USE_LEGACY_KERAS and WRAPT_DISABLE_EXTENSIONS as
# Google's TF TPU CI sets them, FORCE_TF_AVAILABLE for transformers (tpu-main.sh). Keras 3 on
# JAX (jax): KERAS_BACKEND=jax, as Keras 3 defaults to the TensorFlow backend
# (keras-team/keras 3.15.1 keras/src/backend/config.py: _BACKEND = "tensorflow", KERAS_BACKEND
# overrides it), and none of the TensorFlow ones (no tf_keras in that environment).
trainer_backend_env() {
  if [ "${PAYLOAD_BACKEND}" = jax ]; then
    printf '%s\n' "Environment=KERAS_BACKEND=jax"
  else
    printf '%s\n' "Environment=TF_USE_LEGACY_KERAS=1" "Environment=WRAPT_DISABLE_EXTENSIONS=true" \
      "Environment=FORCE_TF_AVAILABLE=1"
  fi
  printf '%s\n' "Environment=TPU_PAYLOAD_BACKEND=${PAYLOAD_BACKEND}"
}

# The trainer unit, one definition for a single host and a slice's worker 0. It waits for
# the controller's data manifest, then trains; on failure systemd restarts it and it resumes
# from the last checkpoint in the bucket; exit 2 (a user error, or no TPU found) stops it.
# $1: Description suffix, $2: units it also waits for (" a.service"), $3: how TensorFlow
# finds the TPU (Environment= lines), $4: further ExecStartPre= lines (or "").
install_trainer_unit() {
  local about="$1" after="$2" tpu_env="$3" pre="$4"
  install_unit tpu-pretrain-train.service "[Unit]
Description=tpu-pretrain trainer for job ${JOB_NAME}${about}
Wants=network-online.target${after}
After=network-online.target${after}
StartLimitIntervalSec=0

[Service]
Type=oneshot
RemainAfterExit=yes
SyslogIdentifier=tpu-pretrain-train
Environment=PYTHONUNBUFFERED=1
Environment=TPU_PAYLOAD_VERBOSE=1
$(trainer_backend_env)
Environment=TPU_PRETRAIN_HOST_FACTS=/opt/tpu-pretrain/host-facts.json
${tpu_env}
$(trainer_host_env)
ExecStartPre=/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-manifest${pre:+
${pre}}
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload train --job ${JOB_URI}
ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper stopped
Restart=on-failure
RestartSec=60
RestartPreventExitStatus=2
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target"
}

# ---- a multi-host slice (TPU_HOSTS > 1): one script for every host, branching on the
# worker index. Every host installs the same environment and runs TensorFlow's TPU worker
# (gRPC, TPU_WORKER_PORT); worker 0 also runs the trainer, once every worker is ready.
libtpu_path=""  # libtpu.so in the venv (set by tpu-main.sh; a slice's TPU worker loads it)
WORKER=""  # this host's index in the slice (metadata agent-worker-number); empty on one host
SLICE_IPS=""  # every host's internal IP, in worker order
SLICE_NOTE=""  # set when the node's host count differs from the catalog's
STATUS_NAME=""  # bootstrap status object: tpu-worker-<i> on a slice, the role otherwise
readonly METADATA_ATTRIBUTES="http://metadata.google.internal/computeMetadata/v1/instance/attributes"

# One instance attribute of this TPU VM; retried (the metadata server can lag a fresh boot).
metadata_attr() {
  local key="$1" attempt=1 value
  while ! value="$(curl -fsS -H 'Metadata-Flavor: Google' "${METADATA_ATTRIBUTES}/${key}" 2>/dev/null)"; do
    if [ "${attempt}" -ge "${RETRY_ATTEMPTS}" ]; then
      log "metadata ${key}: not readable after ${attempt} attempts"
      return 1
    fi
    log "metadata ${key} not readable yet (attempt ${attempt}/${RETRY_ATTEMPTS}); retrying in 5s"
    sleep 5
    attempt=$((attempt + 1))
  done
  printf '%s\n' "${value}"
}

# This host's worker index and the slice's worker IPs. The TPU VM's metadata names both:
# agent-worker-number, and worker-network-endpoints, one comma-separated entry per worker
# whose third ':' field is its IP (tensorflow-tpu 2.19.1/2.20.0 grpc_tpu_worker.py reads the same
# attributes the same way, and so does jax's cloud_tpu_cluster.py).
read_slice() {
  local endpoints entry ip ips=()
  if ! WORKER="$(metadata_attr agent-worker-number)" \
    || ! endpoints="$(metadata_attr worker-network-endpoints)"; then
    WORKER=""
    write_status failed "a host of the ${ACCELERATOR_TYPE} slice cannot read its worker number or the worker endpoints from the metadata server; the startup script runs again in 30 min"
    schedule_rerun
    exit 1
  fi
  IFS=',' read -r -a entries <<<"${endpoints}"
  for entry in "${entries[@]}"; do
    ip="$(cut -d: -f3 <<<"${entry}")"
    if ! [[ "${ip}" =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]]; then
      ips=()
      break
    fi
    ips+=("${ip}")
  done
  if ! [[ "${WORKER}" =~ ^[0-9]+$ ]] || [ "${#ips[@]}" -lt 2 ] \
    || [ "${WORKER}" -ge "${#ips[@]}" ]; then
    local seen="${WORKER}"
    WORKER=""
    write_status failed "metadata does not describe a multi-host ${ACCELERATOR_TYPE} slice: agent-worker-number '${seen}', worker-network-endpoints '${endpoints}'"
    exit 1
  fi
  SLICE_IPS="$(IFS=','; echo "${ips[*]}")"
  STATUS_NAME="tpu-worker-${WORKER}"
  # The node's own endpoint list is the truth; the catalog's host count is what we expect.
  SLICE_NOTE=""
  if [ "${#ips[@]}" -ne "${TPU_HOSTS}" ]; then
    SLICE_NOTE=" (the catalog expects ${TPU_HOSTS} hosts for ${ACCELERATOR_TYPE}, the node has ${#ips[@]}: going by the node; please correct infra/catalog.yaml)"
  fi
  log "worker ${WORKER} of a ${#ips[@]}-host slice (workers ${SLICE_IPS})${SLICE_NOTE}"
}

# The workers' endpoints in worker order, the trainer's TPU_NAME (payload/strategy.py).
slice_tpu_name() {
  local ip out=""
  IFS=',' read -r -a ips <<<"${SLICE_IPS}"
  for ip in "${ips[@]}"; do
    out="${out:+${out},}grpc://${ip}:${TPU_WORKER_PORT}"
  done
  echo "${out}"
}

# shellcheck disable=SC2016  # $0/$1 belong to the inner bash
port_open() {
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

# The TPU worker unit's ExecStartPost: ready once the local gRPC port accepts connections.
worker_ready() {
  local waited=0
  while ! port_open 127.0.0.1 "${TPU_WORKER_PORT}"; do
    if [ "${waited}" -ge 600 ]; then
      STATUS_NAME="tpu-worker-${WORKER}" write_status failed "TPU worker ${WORKER} does not accept connections on port ${TPU_WORKER_PORT} after ${waited}s (journalctl -u tpu-pretrain-tpu-worker); systemd restarts it"
      return 1
    fi
    sleep 5
    waited=$((waited + 5))
  done
  STATUS_NAME="tpu-worker-${WORKER}" write_status ready "TPU worker ${WORKER} serves on port ${TPU_WORKER_PORT}"
}

worker_stopped() {
  STATUS_NAME="tpu-worker-${WORKER}" write_status restarting "TPU worker ${WORKER} ended (${SERVICE_RESULT:-unknown}, exit ${EXIT_STATUS:-none}); systemd restarts it in 10s"
}

# Worker 0's trainer starts once every host's status says ready for this very slice (the
# same worker IPs: a status left by a slice before a recreation does not count).
wait_workers() {
  local waited=0 i dir file state reason previous="" waiting hosts
  hosts="$(tr ',' '\n' <<<"${SLICE_IPS}" | wc -l)"
  gcs_cli
  dir="$(mktemp -d)"
  while true; do
    waiting=""
    for ((i = 0; i < hosts; i++)); do
      file="${dir}/tpu-worker-${i}.json"
      rm -f "${file}"
      if ! gcs cp "${RUN_ROOT}/bootstrap/tpu-worker-${i}.json" "${file}" >/dev/null 2>&1; then
        state="no status yet"
      elif ! grep -qF "\"slice\": \"${SLICE_IPS}\"" "${file}"; then
        state="status of an earlier slice"
      else
        state="$(sed -n 's/.*"state": "\([a-z-]*\)".*/\1/p' "${file}")"
      fi
      if [ "${state}" != ready ]; then
        waiting="${waiting:+${waiting}, }${i} (${state:-unknown})"
      fi
    done
    if [ -z "${waiting}" ]; then
      rm -rf "${dir}"
      write_status starting "all ${hosts} TPU workers are ready after ${waited}s; the trainer starts"
      return 0
    fi
    reason="waiting for the slice's TPU workers: ${waiting} (see ${RUN_ROOT}/bootstrap/tpu-worker-<i>.json)"
    log "${reason}, ${waited}s so far"
    if [ "${reason}" != "${previous}" ]; then
      write_status waiting "${reason}"
      previous="${reason}"
    fi
    sleep 30
    waited=$((waited + 30))
  done
}

install_helper() {
  local body sdk_path="" tool
  # systemd's PATH need not contain the image's SDK (e.g. /snap/bin): pin where it is now.
  for tool in gcloud gsutil; do
    if command -v "${tool}" >/dev/null 2>&1; then
      sdk_path="${sdk_path}$(dirname "$(command -v "${tool}")"):"
    fi
  done
  body="#!/usr/bin/env bash
# tpu-pretrain: the trainer unit's helper, written by the TPU VM's startup script.
set -Euo pipefail
export PATH=${sdk_path}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
$(declare -p SANDBOX_ROOT APP_DIR RETRY_ATTEMPTS LOG_TAG CONSOLE TRANSIENT_ERRORS)
$(declare -p ROLE RUN_ROOT MANIFEST_URI STATUS_URI PAYLOAD_SHA256)
$(declare -p TPU_HOSTS TPU_WORKER_PORT WORKER SLICE_IPS)
GCS_CLI=''
STATUS_NAME=''
$(declare -p HOST_CHECKS)
$(declare -f log retry_gcloud gcs_cli gcs write_status wait_manifest trainer_stopped)
$(declare -f port_open worker_ready worker_stopped wait_workers)
case \"\${1:-}\" in
  wait-manifest) wait_manifest ;;
  wait-workers) wait_workers ;;
  stopped) trainer_stopped ;;
  worker-ready) worker_ready ;;
  worker-stopped) worker_stopped ;;
  *) echo \"usage: \$0 wait-manifest|wait-workers|stopped|worker-ready|worker-stopped\" >&2; exit 2 ;;
esac"
  if write_if_changed "${HELPER}" 0755 "${body}"; then
    log "helper ${HELPER} installed"
  fi
}

# A slice host: TensorFlow's TPU worker on every host (the tensorflow-tpu wheel's console
# script start_grpc_tpu_worker = tensorflow/python/tools/grpc_tpu_worker.py, which reads
# agent-worker-number, accelerator-type and worker-network-endpoints from the metadata server
# itself and serves on TPU_TASK_PORT); on worker 0 also the trainer, as a TPUStrategy client
# of every worker: TPU_NAME=grpc://<ip0>:8470,... in worker order and TPU_LOAD_LIBRARY=0
# (the local TPU worker owns this host's chips), without the single-host PJRT variables
# (payload/strategy.py refuses TF_PLUGGABLE_DEVICE_LIBRARY_PATH on a slice).
slice_units() {
  local units=(tpu-pretrain-tpu-worker.service)
  if [ ! -x "${APP_DIR}/venv/bin/start_grpc_tpu_worker" ]; then
    write_status failed "the installed tensorflow-tpu has no start_grpc_tpu_worker (the TPU worker of a slice); check requirements/tpu-vm.txt"
    exit 1
  fi
  # The -pod TF images run the TPU worker in a `tpu-runtime` service on the same port
  # (tensorflow/tpu tools/grpc_tpu_worker/README.md stops it first); the base images are not
  # known to have it: stop it only where it exists.
  if systemctl cat tpu-runtime.service >/dev/null 2>&1; then
    log "stopping tpu-runtime.service (it would hold port ${TPU_WORKER_PORT})"
    systemctl disable --now tpu-runtime.service || log "could not stop tpu-runtime.service"
  fi
  # TPU_LIBRARY_PATH: the libtpu the worker loads (TensorFlow's FindAndLoadTpuLibrary reads
  # it; without it TF looks next to its own wheel).
  install_unit tpu-pretrain-tpu-worker.service "[Unit]
Description=tpu-pretrain TensorFlow TPU worker ${WORKER} (gRPC port ${TPU_WORKER_PORT})
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=simple
SyslogIdentifier=tpu-pretrain-tpu-worker
Environment=PYTHONUNBUFFERED=1
Environment=TPU_TASK_PORT=${TPU_WORKER_PORT}
Environment=TPU_LIBRARY_PATH=${libtpu_path}
ExecStart=/opt/tpu-pretrain/venv/bin/start_grpc_tpu_worker
ExecStartPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper worker-ready
ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper worker-stopped
Restart=always
RestartSec=10
TimeoutStartSec=900

[Install]
WantedBy=multi-user.target"
  if [ "${WORKER}" = 0 ]; then
    install_trainer_unit " (worker 0 of the ${ACCELERATOR_TYPE} slice)" \
      " tpu-pretrain-tpu-worker.service" \
      "Environment=TPU_NAME=$(slice_tpu_name)
Environment=TPU_LOAD_LIBRARY=0" \
      "ExecStartPre=/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-workers"
    units+=(tpu-pretrain-train.service)
  fi
  log "step 4/4: start"
  start_units "${units[@]}"
  if [ "${WORKER}" = 0 ]; then
    write_status started "TPU worker and trainer units started; the trainer waits for ${MANIFEST_URI} and for every worker's TPU server"
  else
    write_status started "TPU worker unit started; worker 0 trains once every worker is ready"
  fi
}
