# ---- templates/tpu-watch.sh: recreate a preempted TPU VM (controller, systemd timer) ---
# One tick of tpu-pretrain-tpu-watch.timer. A preempted/spot TPU VM cannot be restarted and
# holds quota until it is deleted, so on PREEMPTED or TERMINATED this deletes the VM and
# creates it again under the same name with exactly the settings of the Pulumi program
# (gcp.tpu.V2Vm): Pulumi state still addresses it, `pulumi refresh` finds it. The new VM's
# startup script installs the payload and the trainer resumes from the bucket's checkpoints.
# A failed create (no capacity) is retried on the next tick; a VM that is preempted again
# soon after is recreated at most once per MIN_RECREATE_SECONDS. Status: bootstrap/tpu-watch.json.
readonly WATCH_DIR="${APP_DIR}/tpu-watch"
readonly STARTUP_FILE="${WATCH_DIR}/tpu-startup.sh"
readonly PENDING="${WATCH_DIR}/pending-create"  # deleted by us, not yet created again
readonly LAST_CREATE="${WATCH_DIR}/last-create"  # epoch seconds of the last recreation
readonly METADATA_URL="http://metadata.google.internal/computeMetadata/v1/instance/attributes/startup-script"

# {"tpu_state": seen, "action": taken, "message", "last_recreate_at", "updated_at"}
watch_status() {
  local tpu_state="$1" action="$2" message="$3" file last=""
  log "TPU ${TPU_NAME}: state ${tpu_state}, action ${action}: ${message}"
  if [ -f "${LAST_CREATE}" ]; then
    last="$(date -u -d "@$(cat "${LAST_CREATE}")" +%Y-%m-%dT%H:%M:%SZ)"
  fi
  file="$(mktemp)"
  printf '{"role": "%s", "host": "%s", "job": "%s", "tpu": "%s", "zone": "%s", "tpu_state": "%s", "action": "%s", "message": "%s", "last_recreate_at": "%s", "updated_at": "%s"}\n' \
    "${ROLE}" "$(hostname)" "${JOB_NAME}" "${TPU_NAME}" "${TPU_ZONE}" "${tpu_state}" "${action}" \
    "${message//\"/\'}" "${last}" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"${file}"
  retry_gcloud gcloud storage cp --quiet "${file}" "${RUN_ROOT}/bootstrap/${ROLE}.json" \
    || log "could not write status ${action}"
  rm -f "${file}"
}

# One gcloud call, no retry (the next tick is the retry); its stderr is left in ${ERR_FILE}.
gcloud_once() {
  if gcloud "$@" 2>"${ERR_FILE}"; then
    return 0
  fi
  cat "${ERR_FILE}" >&2
  return 1
}

# NOT_FOUND without a permission error: the VM does not exist (a fresh IAM grant also
# answers 403, which must not look like a missing VM).
err_is_not_found() {
  grep -Eqi 'not[ _]?found|404' "${ERR_FILE}" \
    && ! grep -Eqi '403|permission[ _]denied|forbidden' "${ERR_FILE}"
}

last_error() {
  tail -n 1 "${ERR_FILE}" | tr -d '\r' | cut -c 1-300
}

create_tpu() {
  local args
  if ! echo "${TPU_STARTUP_SHA256}  ${STARTUP_FILE}" | sha256sum --check --quiet - 2>/dev/null; then
    watch_status MISSING create-failed "${STARTUP_FILE} is missing or not the rendered TPU startup script; re-run the controller's startup script"
    return 1
  fi
  args=(compute tpus tpu-vm create "${TPU_NAME}" --zone "${TPU_ZONE}" --project "${PROJECT}"
    --accelerator-type "${ACCELERATOR_TYPE}" --version "${RUNTIME_VERSION}"
    --network "${TPU_NETWORK}" --subnetwork "${TPU_SUBNETWORK}"
    --service-account "${SERVICE_ACCOUNT}" --scopes "${SCOPES}"
    --description "${DESCRIPTION}" --labels "${LABELS}" --tags "${TAGS}"
    --metadata "${METADATA}" --metadata-from-file "startup-script=${STARTUP_FILE}")
  if [ "${EXTERNAL_IPS}" != true ]; then
    args+=(--internal-ips)
  fi
  case "${SCHEDULING}" in
    spot) args+=(--spot) ;;
    preemptible) args+=(--preemptible) ;;
  esac
  if [ "${SECURE_BOOT}" = true ]; then
    args+=(--shielded-secure-boot)
  fi
  watch_status MISSING creating "creating ${TPU_NAME} (${ACCELERATOR_TYPE}, ${SCHEDULING})"
  if ! gcloud_once "${args[@]}"; then
    watch_status MISSING create-failed "create failed, retrying on the next tick: $(last_error)"
    return 1
  fi
  date -u +%s >"${LAST_CREATE}"
  rm -f "${PENDING}"
  watch_status CREATED recreated "${TPU_NAME} recreated; its startup script installs the payload and training resumes from the checkpoints"
}

mkdir -p "${WATCH_DIR}"
ERR_FILE="$(mktemp)"
trap 'rm -f "${ERR_FILE}"' EXIT
exec 9>"${WATCH_DIR}/lock"
if ! flock -n 9; then
  log "another tick holds ${WATCH_DIR}/lock; nothing to do"
  exit 0
fi

# The settings above come from the controller startup script that installed this watchdog.
# `pulumi up` updates that script in the controller's metadata without running it; when the
# watchdog it carries differs from this one, run it now (it installs the current watchdog
# and TPU startup script, or removes them) and leave this tick to the new watchdog.
if current="$(curl -fsS -H 'Metadata-Flavor: Google' "${METADATA_URL}" 2>"${ERR_FILE}")"; then
  encoded="$(sed -n 's/^readonly TPU_WATCH_SCRIPT_B64=//p' <<<"${current}")"
  if [ "${encoded}" = "''" ] || ! cmp -s <(base64 -d <<<"${encoded}" 2>/dev/null) "$0"; then
    watch_status UNCHECKED rerun-startup "the controller's startup script changed (pulumi up); re-running it"
    if google_metadata_script_runner startup; then
      exit 0
    fi
    log "re-running the controller's startup script failed; checking with the installed settings"
  fi
else
  log "cannot read the controller's metadata ($(last_error)); checking with the installed settings"
fi

if gcloud_once compute tpus tpu-vm describe "${TPU_NAME}" --zone "${TPU_ZONE}" \
  --project "${PROJECT}" --format='value(state)' >"${WATCH_DIR}/state"; then
  state="$(tr -d '[:space:]' <"${WATCH_DIR}/state")"
  state="${state:-UNKNOWN}"
elif err_is_not_found; then
  state=MISSING
else
  watch_status UNKNOWN describe-failed "describe failed, retrying on the next tick: $(last_error)"
  exit 1
fi

case "${state}" in
  PREEMPTED | TERMINATED)
    now="$(date -u +%s)"
    last="$(cat "${LAST_CREATE}" 2>/dev/null || echo 0)"
    if [ $((now - last)) -lt "${MIN_RECREATE_SECONDS}" ]; then
      watch_status "${state}" waiting "recreated $((now - last))s ago; recreating again after ${MIN_RECREATE_SECONDS}s"
      exit 0
    fi
    # Marked before the delete: if this tick dies after it, the next one creates the VM.
    touch "${PENDING}"
    watch_status "${state}" deleting "deleting the ${state} VM (it holds quota and cannot restart)"
    if ! gcloud_once compute tpus tpu-vm delete "${TPU_NAME}" --zone "${TPU_ZONE}" \
      --project "${PROJECT}" --quiet && ! err_is_not_found; then
      watch_status "${state}" delete-failed "delete failed, retrying on the next tick: $(last_error)"
      exit 1
    fi
    create_tpu
    ;;
  MISSING)
    if [ -f "${PENDING}" ]; then
      create_tpu
    else
      # Not deleted by this watchdog (not created yet, or deleted on purpose): leave it.
      watch_status MISSING none "${TPU_NAME} does not exist and was not deleted by this watchdog; run pulumi up to create it"
    fi
    ;;
  *)
    # The VM exists (e.g. a create that timed out on our side went through): a later
    # deletion is not ours, so forget the pending create.
    rm -f "${PENDING}"
    watch_status "${state}" none "nothing to do"
    ;;
esac
