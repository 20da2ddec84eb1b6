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
    write_status failed "python3 is ${version} on runtime ${RUNTIME_VERSION}; the payload needs Python >= 3.10 (use an image from infra/catalogs/tpu.yaml)"
    exit 1
  fi
}

# What the trainer unit's ExecStartPre and ExecStopPost run: this script's own functions and
# constants, written next to the venv (systemd cannot call shell functions).
wait_manifest() {
  local waited=0 out reason previous=""
  # A start (at boot, by systemd's restart, by hand) ends any earlier stop for good.
  trainer_state running
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

# A trainer that fails again and again without writing a newer checkpoint (the same bug at
# every start, a host that cannot join the others, a device out of memory) is stopped after
# TRAINER_FAILURES_MAX failures in a row, with a status that says so, instead of being
# restarted every minute for ever. Exit 75 (the payload's transient failures: Cloud Storage
# still failing after its retries, a TPU attached but not initialised) is restarted and
# counted like any other failure: a slice whose storage is down for good stops after
# TRAINER_FAILURES_MAX. A stop by SIGTERM or SIGINT (exit 143/130: a preemption,
# a shutdown, another host's stop) is not counted: the watchdog's recovery of a preempted
# VM, and systemd's restart after another host's stop, stay as they are.
readonly TRAINER_FAILURES_MAX=5
readonly TRAINER_FAILURES="${APP_DIR}/trainer-failures"
readonly GUEST_ATTRIBUTES_URL="http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes"

# The trainer's state as the VM's guest attribute TRAINER_ATTRIBUTE, beside the loader's boot
# state (templates/loader.sh boot_state): "running" while the unit starts, "stopped <epoch>
# <message>" once it stopped for good. The controller's watchdog reads it without the bucket
# and deletes the TPU VM (or stops the GPU VM), which would bill while idle (watch-common.sh
# vm_failure). A host whose attributes are off only logs it.
trainer_state() {
  if ! curl -fsS -X PUT --data "$1" -H 'Metadata-Flavor: Google' \
    "${GUEST_ATTRIBUTES_URL}/${TRAINER_ATTRIBUTE}" >/dev/null 2>&1; then
    log "could not set the guest attribute ${TRAINER_ATTRIBUTE}"
  fi
}

# Stopped for good: the bootstrap status, the guest attribute and a `stopped` event (source
# trainer-unit; common.sh emit_event) say the same. Called once per stop: the unit is not
# restarted after it.
trainer_gave_up() {
  write_status stopped "$1"
  trainer_state "stopped $(date -u +%s) $1"
  RETRY_LIMIT=2 emit_event stopped trainer-unit "$1" "reason=$2"  # ExecStopPost: briefly
}

# The newest committed checkpoint's step in the bucket; "none" when there is none or the
# bucket cannot be listed. An Orbax step (JAX) counts once Orbax committed it: on gs:// it
# writes <step>/commit_success.txt last (orbax-checkpoint 0.12.8 _src/path/atomicity.py,
# CommitFileTemporaryPath.finalize); <step>/_CHECKPOINT_METADATA is written when the step's
# directory is created (_create_tmp_directory), so a step directory alone is a write in
# progress or one a stop cut short, not progress. TF's: ckpt-<step>.index.
newest_checkpoint() {
  local orbax tf newest
  orbax="$(gcs ls "${RUN_ROOT}/checkpoints/*/commit_success.txt" 2>/dev/null)" || orbax=""
  tf="$(gcs ls "${RUN_ROOT}/checkpoints/ckpt-*.index" 2>/dev/null)" || tf=""
  newest="$(printf '%s\n%s\n' "${orbax}" "${tf}" \
    | sed -nE 's#.*/checkpoints/(([0-9]+)/commit_success[.]txt|ckpt-([0-9]+)[.]index)$#\2\3#p' \
    | sort -n | tail -n 1)"
  printf '%s\n' "${newest:-none}"
}

# systemd sets SERVICE_RESULT, EXIT_CODE and EXIT_STATUS (a code, or a signal's name) for
# ExecStopPost. A `systemctl stop` from here keeps systemd from restarting the unit: a stop
# job sets forbid_restart even while the unit runs its ExecStopPost (systemd
# src/core/service.c service_stop: "Don't create restart jobs from manual stops").
trainer_stopped() {
  local code="${EXIT_STATUS:-}" failures=0 seen="" newest why
  case "${code}" in
    0)
      rm -f "${TRAINER_FAILURES}"
      write_status finished "trainer finished (exit 0); see ${STATUS_URI}"
      ;;
    2)
      rm -f "${TRAINER_FAILURES}"
      trainer_gave_up "trainer stopped with exit 2: a user error or no TPU (last_error in ${STATUS_URI}); not restarted (RestartPreventExitStatus=2): fix it, then sudo systemctl restart tpu-pretrain-train" user-error
      ;;
    130 | 143 | INT | TERM)
      write_status restarting "trainer stopped by a signal (${SERVICE_RESULT:-unknown}, exit ${code}); systemd restarts it in 60s and it resumes from the last checkpoint"
      ;;
    *)
      # 75: the payload's progress watchdog (payload/backends/jax/progress.py HUNG_EXIT): no
      # progress within its bound, every thread's stack in the journal. A failure like any
      # other: restarted, and counted (a host that hangs at every start is stopped).
      why="${SERVICE_RESULT:-unknown}, exit ${code:-none}"
      if [ "${code}" = 75 ]; then
        why="hung: no progress within its bound, the stacks in journalctl -u tpu-pretrain-train; exit 75"
      fi
      newest="$(newest_checkpoint)"
      if [ -f "${TRAINER_FAILURES}" ]; then
        read -r failures seen <"${TRAINER_FAILURES}" || true
      fi
      [[ "${failures}" =~ ^[0-9]+$ ]] || failures=0
      if [ "${failures}" -gt 0 ] && [ "${newest}" != "${seen}" ]; then
        failures=0 # a newer checkpoint since the last failure: progress
      fi
      failures=$((failures + 1))
      if [ "${failures}" -ge "${TRAINER_FAILURES_MAX}" ]; then
        rm -f "${TRAINER_FAILURES}" # a restart by hand counts afresh
        trainer_gave_up "trainer failed ${failures} times in a row without a newer checkpoint (newest: ${newest}; last: ${why}); not restarted: see journalctl -u tpu-pretrain-train and last_error in ${STATUS_URI}, fix it, then sudo systemctl restart tpu-pretrain-train" failures-in-a-row
        systemctl --no-block stop tpu-pretrain-train.service || log "could not stop tpu-pretrain-train.service"
        return 0
      fi
      printf '%s %s\n' "${failures}" "${newest}" >"${TRAINER_FAILURES}"
      write_status restarting "trainer ended (${why}; failure ${failures} of ${TRAINER_FAILURES_MAX} in a row without a newer checkpoint, newest: ${newest}); systemd restarts it in 60s and it resumes from the last checkpoint"
      ;;
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
# infra/config/job.py resolve_backend); TPU_PAYLOAD_BACKEND is the payload's default for
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

# The trainer unit, one definition for a single host and every host of a slice. It waits for
# the controller's data manifest, then trains; on failure systemd restarts it and it resumes
# from the last checkpoint in the bucket; exit 2 (a user error, or no TPU found) stops it.
# $1: Description suffix, $2: the tpu-payload command ("" = train; a slice runs `run`),
# $3: how the backend finds the TPU (Environment= lines), $4: further ExecStartPre= lines
# (or "").
install_trainer_unit() {
  local about="$1" command="${2:-train}" tpu_env="$3" pre="$4"
  install_unit tpu-pretrain-train.service "[Unit]
Description=tpu-pretrain trainer for job ${JOB_NAME}${about}
Wants=network-online.target
After=network-online.target
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
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload ${command} --job ${JOB_URI}
ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper stopped
Restart=on-failure
RestartSec=60
RestartPreventExitStatus=2
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target"
}

# ---- a multi-host slice (TPU_HOSTS > 1; JAX only, infra/config/job.py resolve_backend): one
# script for every host, which reads its worker index. Every host installs the same JAX
# environment and runs the same trainer unit, one JAX process per host, as Google documents
# JAX on slices (https://cloud.google.com/tpu/docs/jax-pods: the same program on every
# worker; jax-ml/jax docs/multi_process.md: jax.distributed.initialize() with no arguments
# on Cloud TPU). No TensorFlow TPU worker, nothing listening for the other hosts here: JAX's
# own coordination service (on worker 0) joins the processes.
WORKER=""  # this host's index in the slice (metadata agent-worker-number); empty on one host
SLICE_IPS=""  # every host's address, in worker order (an IP, or a hostname: see read_slice)
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

# This host's worker index and the slice's workers, from the metadata JAX itself reads
# (jax-ml/jax cec06d11 jax/_src/clusters/cloud_tpu_cluster.py GceTpuCluster: process id =
# agent-worker-number; workers = worker-network-endpoints, comma-separated, each entry either
# a hostname (the newer format) or name:id:ip (the older one, the IP in the third field)).
# The index becomes the trainer's TPU_PRETRAIN_WORKER; jax.distributed.initialize() reads the
# same attributes again by itself.
read_slice() {
  local endpoints entry addr fields ips=()
  if ! WORKER="$(metadata_attr agent-worker-number)" \
    || ! endpoints="$(metadata_attr worker-network-endpoints)"; then
    WORKER=""
    write_status failed "a host of the ${ACCELERATOR_TYPE} slice cannot read its worker number or the worker endpoints from the metadata server; the startup script runs again in 30 min"
    schedule_rerun
    exit 1
  fi
  IFS=',' read -r -a entries <<<"${endpoints}"
  for entry in "${entries[@]}"; do
    fields="$(tr -cd ':' <<<"${entry}" | wc -c)"
    case "${fields}" in
      0) addr="${entry}" ;;
      2) addr="$(cut -d: -f3 <<<"${entry}")" ;;
      *) addr="" ;;
    esac
    if ! [[ "${addr}" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]]; then
      ips=()
      break
    fi
    ips+=("${addr}")
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
    SLICE_NOTE=" (the catalog expects ${TPU_HOSTS} hosts for ${ACCELERATOR_TYPE}, the node has ${#ips[@]}: going by the node; please correct infra/catalogs/tpu.yaml)"
  fi
  log "worker ${WORKER} of a ${#ips[@]}-host slice (workers ${SLICE_IPS})${SLICE_NOTE}"
}

# The trainer's bootstrap status object: the role's (tpu.json) on one host and on a slice's
# worker 0, whose process writes the job's outputs; tpu-worker-<i>.json on any other worker.
trainer_status_name() {
  if [ -n "${WORKER}" ] && [ "${WORKER}" != 0 ]; then
    printf '%q\n' "tpu-worker-${WORKER}"
  else
    printf '%q\n' ""
  fi
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
$(declare -p ROLE JOB_NAME RUN_ROOT MANIFEST_URI STATUS_URI PAYLOAD_SHA256)
$(declare -p TPU_HOSTS WORKER SLICE_IPS)
GCS_CLI=''
STATUS_NAME=$(trainer_status_name)
$(declare -p HOST_CHECKS TRAINER_FAILURES TRAINER_FAILURES_MAX TRAINER_ATTRIBUTE GUEST_ATTRIBUTES_URL)
$(declare -f log retry_gcloud gcs_cli gcs write_status trainer_state trainer_gave_up)
$(declare -f event_severity emit_event)
$(declare -f wait_manifest newest_checkpoint trainer_stopped)
case \"\${1:-}\" in
  wait-manifest) wait_manifest ;;
  stopped) trainer_stopped ;;
  *) echo \"usage: \$0 wait-manifest|stopped\" >&2; exit 2 ;;
esac"
  if write_if_changed "${HELPER}" 0755 "${body}"; then
    log "helper ${HELPER} installed"
  fi
}

# A slice host: the same trainer unit on every host, with the single-host JAX unit's
# environment (tpu-main.sh) plus TPU_PAYLOAD_JAX_DISTRIBUTED=auto (the payload calls
# jax.distributed.initialize() with no arguments: Cloud TPU auto-detection) and
# TPU_PRETRAIN_WORKER (this host's index: worker 0 runs every stage and writes status,
# checkpoints and the export; any other worker takes no lease, waits for worker 0's data
# manifest, trains as its own JAX process on its own shards and writes nothing). `run`, not
# `train`: the payload's CLI decides per worker which stages it runs. The image's own
# services (tpu-runtime.service among them) are left as they are.
slice_units() {
  install_trainer_unit " (worker ${WORKER} of the ${ACCELERATOR_TYPE} slice)" run \
    "Environment=JAX_PLATFORMS=tpu
Environment=TPU_PAYLOAD_JAX_DISTRIBUTED=auto
Environment=TPU_PRETRAIN_WORKER=${WORKER}" ""
  log "step 4/4: start"
  start_units tpu-pretrain-train.service
  write_status started "trainer unit started on worker ${WORKER}; it waits for ${MANIFEST_URI}, then joins the other workers' JAX processes (jax.distributed.initialize)"
}
