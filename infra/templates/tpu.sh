# ---- templates/tpu.sh: the TPU VM trainer ---------------------------------------------
# TensorFlow for TPU: tensorflow-tpu + libtpu from PyPI (requirements/tpu-vm.txt) with the
# rest of the tested lock, installed by tpu-install.sh (above), from the controller's
# wheelhouse when the bucket has one for this Python, else from the package index.
readonly HELPER="${APP_DIR}/bin/tpu-pretrain-helper"

install_requirements() {
  local venv="$1" src="$2" work="$3" python_version key wheels=""
  python_version="$(tpu_python_version)"
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
GCS_CLI=''
$(declare -f log retry_gcloud gcs_cli gcs write_status wait_manifest trainer_stopped)
case \"\${1:-}\" in
  wait-manifest) wait_manifest ;;
  stopped) trainer_stopped ;;
  *) echo \"usage: \$0 wait-manifest|stopped\" >&2; exit 2 ;;
esac"
  if write_if_changed "${HELPER}" 0755 "${body}"; then
    log "helper ${HELPER} installed"
  fi
}

# With set -E the trap fires in every enclosing function: report the innermost line once.
trap '[ -n "${FAILED_AT:-}" ] || { FAILED_AT="${LINENO}"; write_status failed "startup script failed at line ${LINENO}"; }' ERR
log "step 1/4: checks (runtime ${RUNTIME_VERSION}, accelerator ${ACCELERATOR_TYPE})"
gcs_cli
write_status starting "startup script started on ${ACCELERATOR_TYPE} (${RUNTIME_VERSION})"
check_python
log "step 2/4: payload install"
install_payload
log "step 3/4: trainer unit"
libtpu_path="/opt/tpu-pretrain/venv/$(tpu_libtpu_path "${APP_DIR}/venv")"
install_helper

# The trainer waits for the controller's data manifest, then trains; on failure systemd
# restarts it and it resumes from the last checkpoint in the bucket; exit 2 (a user error,
# or no TPU found) stops it. The environment is what TensorFlow needs to find the TPU
# through PJRT, as Google's TF TPU CI sets it for a single host
# (GoogleCloudPlatform/ml-auto-solutions dags/solutions_team/configs/tensorflow/common.py,
# export_env_variables: TF_USE_LEGACY_KERAS, WRAPT_DISABLE_EXTENSIONS, TPU_NAME=local,
# NEXT_PLUGGABLE_DEVICE_USE_C_API, TF_PLUGGABLE_DEVICE_LIBRARY_PATH = libtpu.so; its
# TF_XLA_FLAGS are for its sparse-core models and left out), plus FORCE_TF_AVAILABLE=1:
# transformers 4.57 does not count the `tensorflow-tpu` distribution as TensorFlow.
# systemd units read no login profile: everything is set here.
install_unit tpu-pretrain-train.service "[Unit]
Description=tpu-pretrain trainer for job ${JOB_NAME}
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=oneshot
RemainAfterExit=yes
SyslogIdentifier=tpu-pretrain-train
Environment=PYTHONUNBUFFERED=1
Environment=TF_USE_LEGACY_KERAS=1
Environment=WRAPT_DISABLE_EXTENSIONS=true
Environment=FORCE_TF_AVAILABLE=1
Environment=NEXT_PLUGGABLE_DEVICE_USE_C_API=true
Environment=TF_PLUGGABLE_DEVICE_LIBRARY_PATH=${libtpu_path}
Environment=TPU_NAME=local
Environment=TPU_PRETRAIN_ACCELERATOR_TYPE=${ACCELERATOR_TYPE}
Environment=TPU_PRETRAIN_RUNTIME_VERSION=${RUNTIME_VERSION}
ExecStartPre=/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-manifest
ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload train --job ${JOB_URI}
ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper stopped
Restart=on-failure
RestartSec=60
RestartPreventExitStatus=2
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target"

log "step 4/4: start"
start_units tpu-pretrain-train.service
write_status started "trainer unit started; waits for ${MANIFEST_URI}"
