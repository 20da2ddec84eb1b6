# ---- templates/tpu-watch.sh: recreate a preempted TPU VM (controller, systemd timer) ---
# After watch-common.sh (lease, export marker, status, re-run on a changed installer).
# One tick of tpu-pretrain-tpu-watch.timer (`tpu-watch.sh`), or the controller's shutdown
# hook (`tpu-watch.sh shutdown`). A preempted/spot TPU VM cannot be restarted and holds quota
# until it is deleted, so on PREEMPTED or TERMINATED this deletes the VM and creates it again
# under the same name with exactly the settings of the Pulumi program (gcp.tpu.V2Vm): Pulumi
# state still addresses it, `pulumi refresh` finds it. The new VM's startup script installs
# the payload and the trainer resumes from the bucket's checkpoints.
#
# Rules, in the order a tick applies them:
# - It acts only while the lease object (LEASE_URI) exists. Pulumi creates it after the
#   controller and deletes it first on `pulumi destroy`; without it the watchdog cancels its
#   queued resource and does nothing else, so it never leaves a TPU behind a destroyed stack.
# - Once the job's export is complete (EXPORT_MARKER_URI) it never recreates the TPU VM;
#   with RELEASE_WHEN_DONE it deletes it (nothing is left to train).
# - Without capacity it does not fail every tick: a spot or on-demand VM waits in the queued
#   resource QUEUED_RESOURCE (gcloud's GA queued-resources create has no --preemptible);
#   a preemptible VM is created directly, retried after growing waits. FAILED and SUSPENDED
#   queued resources are deleted (they can hold quota).
# - It only ever creates a VM it deleted itself (the pending marker); a VM deleted by hand or
#   by Pulumi is left alone, and a VM that exists again (created by Pulumi or the queue) ends
#   the recovery. A VM is recreated at most once per MIN_RECREATE_SECONDS.
# - A READY VM whose loader gave up, or whose trainer stopped for good (exit 2, or failures in
#   a row), on any host (its guest attributes: watch-common.sh vm_failure) bills while idle:
#   it is deleted, not recreated (it would fail the same way), and the status says why until
#   the VM exists again (pulumi up --replace, the stack output tpuRecovery.replace).
# - The node's health (Cloud TPU v2 API Node.health, "as reported by Health Monitor"):
#   UNHEALTHY_MAINTENANCE is waited out ("the node is under maintenance/priority boost caused
#   rescheduling and will resume running once rescheduled"); TIMEOUT ("the resource is
#   unresponsive") or UNHEALTHY_TENSORFLOW ("the in-guest ML stack is unhealthy") for longer
#   than UNHEALTHY_RECREATE_SECONDS has the node deleted and queued again as for a preemption
#   (the trainer resumes from the checkpoints). The status names the health and its
#   healthDescription; an `unhealthy` event says what was done.
# - A queued resource that waits longer than CAPACITY_WAIT_SECONDS (the stack's
#   tpu-pretrain:capacityWaitMinutes) is reported once per wait (a `capacity-wait` event, the
#   status's capacity_exhausted: capacity, or the quota a failed request named); the status's
#   capacity_wait_s adds up every wait of the job (watch-common.sh capacity_waiting).
# - Events (common.sh emit_event, docs/operating.md): `preempted` when the node is found
#   PREEMPTED or TERMINATED, or gone under a queued resource the service suspended;
#   `recreated` when a new node is asked for; `stopped` when a failed VM is deleted. Each once
#   per occurrence (watch-common.sh event_once), and the last 20 in the status's `events`.
# A multi-host slice (TPU_HOSTS > 1) is one TPU node: the same single delete and create (the
# node's --accelerator-type, e.g. v4-32) replace every host at once; each new host's startup
# script installs the payload again and starts its JAX process, and the processes resume
# together from worker 0's checkpoints once they have joined (jax.distributed.initialize).
# Status: gs://…/runs/<job>/bootstrap/tpu-watch.json.
readonly WATCH_DIR="${APP_DIR}/tpu-watch"
# How long a node may stay TIMEOUT or UNHEALTHY_TENSORFLOW before it is recreated: 15 ticks
# of 2 min. Long enough that a host's restart (a reboot, the runtime or the trainer unit
# restarting: minutes) is not taken for a broken node; short against what a broken node
# costs (nothing trains while the grant's hours go on), and a recreation costs a boot, the
# install and a compile (~10-20 min) plus the steps since the last checkpoint.
readonly UNHEALTHY_RECREATE_SECONDS=1800
readonly UNHEALTHY_SINCE="${WATCH_DIR}/unhealthy-since"  # epoch: first tick it was seen so
readonly STARTUP_FILE="${WATCH_DIR}/tpu-startup.sh"
readonly PENDING="${WATCH_DIR}/pending-create"  # deleted by us, not yet created again (why)
readonly LAST_CREATE="${WATCH_DIR}/last-create"  # epoch seconds of the last recreation
readonly NEXT_ATTEMPT="${WATCH_DIR}/next-attempt"  # preemptible: no create before (epoch, wait)
readonly BOOT_SEEN="${WATCH_DIR}/boot-seen"  # the boot failure last acted on
readonly BOOT_FAILED="${WATCH_DIR}/boot-failed"  # the VM was deleted because of it
readonly WHERE=(--zone "${TPU_ZONE}" --project "${PROJECT}")
readonly MODE="${1:-tick}"
if [ "${TPU_HOSTS}" -gt 1 ]; then
  readonly WHAT="${TPU_NAME} (the whole ${TPU_HOSTS}-host ${ACCELERATOR_TYPE} slice, one node)"
else
  readonly WHAT="${TPU_NAME}"
fi

# {"tpu_state": seen, "health", "health_description", "action": taken, "message",
#  "last_recreate_at", ...watch-common.sh put_status: capacity_wait_s, events, updated_at}
HEALTH=""
HEALTH_DESCRIPTION=""
watch_status() {
  local tpu_state="$1" action="$2" message="$3" last=""
  log "TPU ${TPU_NAME}: state ${tpu_state}, action ${action}: ${message}"
  if [ -f "${LAST_CREATE}" ]; then
    last="$(date -u -d "@$(cat "${LAST_CREATE}")" +%Y-%m-%dT%H:%M:%SZ)"
  fi
  put_status "${action}" "role=${ROLE}" "host=$(hostname)" "job=${JOB_NAME}" "tpu=${TPU_NAME}" \
    "zone=${TPU_ZONE}" "queued_resource=${QUEUED_RESOURCE}" "tpu_state=${tpu_state}" \
    "health=${HEALTH}" "health_description=${HEALTH_DESCRIPTION}" "action=${action}" \
    "message=${message}" "last_recreate_at=${last}"
}

# The node's state, health and healthDescription (Cloud TPU v2 Node; gcloud's value format
# prints several fields with its separator attribute between them:
# googlecloudsdk/core/resource/csv_printer.py ValuePrinter). Sets NODE_STATE, HEALTH and
# HEALTH_DESCRIPTION (MISSING when there is no node); fails (status written) when the
# describe fails otherwise.
read_node() {
  if gcloud_once compute tpus tpu-vm describe "${TPU_NAME}" "${WHERE[@]}" \
    --format='value[separator="|"](state,health,healthDescription)' >"${WATCH_DIR}/state"; then
    IFS='|' read -r NODE_STATE HEALTH HEALTH_DESCRIPTION <"${WATCH_DIR}/state" || true
    NODE_STATE="$(tr -d '[:space:]' <<<"${NODE_STATE:-}")"
    NODE_STATE="${NODE_STATE:-UNKNOWN}"
    HEALTH="$(tr -d '[:space:]' <<<"${HEALTH:-}")"
    HEALTH_DESCRIPTION="${HEALTH_DESCRIPTION:-}"
  elif err_is_not_found; then
    NODE_STATE=MISSING HEALTH="" HEALTH_DESCRIPTION=""
  else
    watch_status UNKNOWN describe-failed "describe failed, retrying on the next tick: $(last_error)"
    return 1
  fi
}

# The queued resource's state in QR (MISSING when there is none), its QR_INITIATOR
# (state.stateInitiator: USER or SERVICE) and QR_ERROR (state.failedData.error.message of a
# FAILED request: what it ran out of, e.g. a quota): Cloud TPU v2 API QueuedResourceState.
# Fails when it cannot be read.
QR=MISSING
QR_INITIATOR=""
QR_ERROR=""
read_queued() {
  local line
  QR_INITIATOR="" QR_ERROR=""
  if gcloud_once compute tpus queued-resources describe "${QUEUED_RESOURCE}" "${WHERE[@]}" \
    --format='value[separator="|"](state.state,state.stateInitiator,state.failedData.error.message)' \
    >"${WATCH_DIR}/qr"; then
    line="$(head -n 1 "${WATCH_DIR}/qr")"
    IFS='|' read -r QR QR_INITIATOR QR_ERROR <<<"${line}" || true
    QR="$(tr -d '[:space:]' <<<"${QR:-}")"
    QR="${QR:-UNKNOWN}"
    QR_INITIATOR="$(tr -d '[:space:]' <<<"${QR_INITIATOR:-}")"
    QR_ERROR="${QR_ERROR:-}"
  elif err_is_not_found; then
    QR=MISSING
  else
    return 1
  fi
}

# Delete the queued resource. --force also deletes a node it created (gcloud's help for
# --force); --async returns at once (a shutdown hook has little time).
delete_queued() {
  gcloud_once compute tpus queued-resources delete "${QUEUED_RESOURCE}" "${WHERE[@]}" \
    --quiet "$@" || err_is_not_found
}

# The stack is not deployed yet, or `pulumi destroy` is under way: cancel what is queued
# (it would create a TPU nobody owns) and forget the recovery.
stand_down() {
  local why="$1"
  rm -f "${PENDING}" "${NEXT_ATTEMPT}" "${UNHEALTHY_SINCE}"
  capacity_wait_end
  if ! read_queued; then
    watch_status UNCHECKED stand-down-failed "${why}; cannot read ${QUEUED_RESOURCE}, retrying: $(last_error)"
    return 1
  fi
  if [ "${QR}" != MISSING ]; then
    if ! delete_queued --force --async; then
      watch_status UNCHECKED stand-down-failed "${why}; deleting ${QUEUED_RESOURCE} (${QR}) failed, retrying: $(last_error)"
      return 1
    fi
    watch_status UNCHECKED stopped "${why}; deleted the queued resource ${QUEUED_RESOURCE} (${QR})"
  else
    watch_status UNCHECKED stopped "${why}; nothing to do"
  fi
}

check_startup_file() {
  if ! echo "${TPU_STARTUP_SHA256}  ${STARTUP_FILE}" | sha256sum --check --quiet - 2>/dev/null; then
    watch_status MISSING create-failed "${STARTUP_FILE} is missing or not the rendered TPU startup script; re-run the controller's startup script"
    return 1
  fi
}

# The V2Vm's settings as gcloud flags, shared by `tpu-vm create` and `queued-resources create`
# (every flag is GA in both: tests/infra/data/gcloud_flags.yaml).
node_flags() {
  NODE_FLAGS=(--accelerator-type "${ACCELERATOR_TYPE}"
    --network "${TPU_NETWORK}" --subnetwork "${TPU_SUBNETWORK}"
    --service-account "${SERVICE_ACCOUNT}" --scopes "${SCOPES}"
    --description "${DESCRIPTION}" --labels "${LABELS}" --tags "${TAGS}"
    --metadata "${METADATA}" --metadata-from-file "startup-script=${STARTUP_FILE}")
  if [ "${EXTERNAL_IPS}" != true ]; then
    NODE_FLAGS+=(--internal-ips)
  fi
  if [ "${SECURE_BOOT}" = true ]; then
    NODE_FLAGS+=(--shielded-secure-boot)
  fi
}

# A slice's hosts are gone with its node: overwrite each host's status, so that no status of
# the deleted slice reads as one of the next slice's hosts.
workers_gone() {
  local state="$1" i file
  file="$(mktemp)"
  for ((i = 0; i < TPU_HOSTS; i++)); do
    printf '{"role": "tpu", "host": "", "state": "recreating", "message": "the %s slice was deleted by the watchdog (%s); this host comes back with the new slice", "worker": "%s", "slice": "", "updated_at": "%s"}\n' \
      "${ACCELERATOR_TYPE}" "${state}" "${i}" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"${file}"
    retry_gcloud gcloud storage cp --quiet "${file}" "${RUN_ROOT}/bootstrap/tpu-worker-${i}.json" \
      || log "could not reset the status of worker ${i}"
  done
  rm -f "${file}"
}

# Why the node is asked for again (the pending marker's reason: preempted, unhealthy).
pending_reason() {
  local reason
  reason="$(head -n 1 "${PENDING}" 2>/dev/null || true)"
  echo "${reason:-preempted}"
}

# What the current capacity wait is for: what the last refusal named, else capacity.
exhausted_now() {
  local exhausted
  exhausted="$(cat "${WATCH_DIR}/capacity-exhausted" 2>/dev/null || true)"
  echo "${exhausted:-capacity}"
}

# Preemptible: `tpu-vm create --preemptible`; without capacity, wait CAPACITY_BACKOFF_FIRST
# seconds, doubling up to CAPACITY_BACKOFF_MAX, and exit 0 (waiting is not a failure).
create_directly() {
  local now delay=0 next=0 reason
  now="$(date -u +%s)"
  reason="$(pending_reason)"
  if [ -f "${NEXT_ATTEMPT}" ]; then
    read -r next delay <"${NEXT_ATTEMPT}"
    if [ "${now}" -lt "${next}" ]; then
      capacity_waiting "$(exhausted_now)"
      watch_status MISSING waiting-capacity "no capacity at the last attempt ($(exhausted_now)); next attempt in $((next - now))s"
      return 0
    fi
  fi
  check_startup_file || return 1
  node_flags
  capacity_wait_begin
  watch_status MISSING creating "creating ${WHAT} (${ACCELERATOR_TYPE}, ${SCHEDULING})"
  if ! gcloud_once compute tpus tpu-vm create "${TPU_NAME}" "${WHERE[@]}" \
    --version "${RUNTIME_VERSION}" "${NODE_FLAGS[@]}" --preemptible; then
    if err_is_capacity; then
      delay=$((delay > 0 ? delay * 2 : CAPACITY_BACKOFF_FIRST))
      delay=$((delay > CAPACITY_BACKOFF_MAX ? CAPACITY_BACKOFF_MAX : delay))
      echo "$((now + delay)) ${delay}" >"${NEXT_ATTEMPT}"
      capacity_waiting "$(exhausted_of "$(last_error)")"
      watch_status MISSING waiting-capacity "no capacity, trying again in ${delay}s: $(last_error)"
      return 0
    fi
    watch_status MISSING create-failed "create failed, retrying on the next tick: $(last_error)"
    return 1
  fi
  date -u +%s >"${LAST_CREATE}"
  rm -f "${PENDING}" "${NEXT_ATTEMPT}"
  capacity_wait_end
  watch_event recreated "${WHAT} created again (${reason}); its startup script installs the payload and training resumes from the checkpoints" "reason=${reason}"
  watch_status CREATED recreated "${WHAT} recreated; its startup script installs the payload and training resumes from the checkpoints"
}

# Spot and on-demand: wait in the queued resource, which creates the node ${TPU_NAME} when
# capacity frees up (a tick that then finds the VM ends the recovery).
create_queued() {
  local reason
  case "${QR}" in
    MISSING)
      check_startup_file || return 1
      node_flags
      local tier=()
      if [ "${SCHEDULING}" = spot ]; then
        tier=(--spot)
      fi
      reason="$(pending_reason)"
      if ! gcloud_once compute tpus queued-resources create "${QUEUED_RESOURCE}" "${WHERE[@]}" \
        --node-id "${TPU_NAME}" --runtime-version "${RUNTIME_VERSION}" "${NODE_FLAGS[@]}" \
        "${tier[@]}" --async; then
        if err_is_capacity; then
          capacity_waiting "$(exhausted_of "$(last_error)")"
        fi
        watch_status MISSING create-failed "queued resource ${QUEUED_RESOURCE} not created, retrying on the next tick: $(last_error)"
        return 1
      fi
      date -u +%s >"${LAST_CREATE}"
      capacity_wait_begin
      watch_event recreated \
        "queued ${QUEUED_RESOURCE} for ${WHAT} (${reason}); the node is created when capacity frees up" \
        "reason=${reason}"
      watch_status MISSING queued "queued ${QUEUED_RESOURCE} for ${WHAT} (${ACCELERATOR_TYPE}, ${SCHEDULING}); the node is created when capacity frees up"
      ;;
    *)
      capacity_waiting "$(exhausted_now)"
      watch_status MISSING queued "waiting in ${QUEUED_RESOURCE} (${QR}) for ${TPU_NAME} ($(exhausted_now)), $(($(capacity_waited) / 60)) min so far"
      ;;
  esac
}

# Delete the node (and its queued resource) to create it again: a preempted or terminated
# VM (it holds quota and cannot restart), or one unhealthy past its bound. REASON goes with
# the pending marker to the `recreated` event.
delete_for_recreation() {
  local reason="$1" why="$2" now last
  now="$(date -u +%s)"
  last="$(cat "${LAST_CREATE}" 2>/dev/null || echo 0)"
  if [ $((now - last)) -lt "${MIN_RECREATE_SECONDS}" ]; then
    watch_status "${NODE_STATE}" waiting "${why}; recreated $((now - last))s ago; recreating again after ${MIN_RECREATE_SECONDS}s"
    exit 0
  fi
  # Marked before the delete: if this tick dies after it, the next one creates the VM.
  echo "${reason}" >"${PENDING}"
  watch_status "${NODE_STATE}" deleting "${why}; deleting it"
  if [ "${QR}" != MISSING ] && ! delete_queued --force; then
    # ACTIVE: the VM came from our queued resource, --force deletes both; any other state:
    # a stale request that must not race the new one (the name is queued again below).
    watch_status "${NODE_STATE}" delete-failed "deleting ${QUEUED_RESOURCE} (${QR}) failed, retrying on the next tick: $(last_error)"
    exit 1
  fi
  if [ "${QR}" != ACTIVE ] && ! gcloud_once compute tpus tpu-vm delete "${TPU_NAME}" \
    "${WHERE[@]}" --quiet && ! err_is_not_found; then
    watch_status "${NODE_STATE}" delete-failed "delete failed, retrying on the next tick: $(last_error)"
    exit 1
  fi
  rm -f "${UNHEALTHY_SINCE}"
  if [ "${TPU_HOSTS}" -gt 1 ]; then
    workers_gone "${NODE_STATE}"
  fi
  QR=MISSING
}

# A READY node's health. HEALTHY (or none reported): nothing. UNHEALTHY_MAINTENANCE: waited
# out, said in the status (exit 0). TIMEOUT, UNHEALTHY_TENSORFLOW: counted from the first tick
# that saw it; within UNHEALTHY_RECREATE_SECONDS said in the status (exit 0), past it the
# node is recreated (returns 0: the caller deletes it). Anything else is reported and waited.
unhealthy_past_bound() {
  local since waited about
  about="${HEALTH}${HEALTH_DESCRIPTION:+: ${HEALTH_DESCRIPTION}}"
  case "${HEALTH}" in
    "" | HEALTHY | HEALTH_UNSPECIFIED)
      rm -f "${UNHEALTHY_SINCE}"
      event_over unhealthy-maintenance unhealthy-recreate
      return 1
      ;;
    UNHEALTHY_MAINTENANCE)
      rm -f "${UNHEALTHY_SINCE}"
      event_once unhealthy-maintenance unhealthy \
        "${WHAT} is under maintenance (${about}); the watchdog waits: the TPU API says it resumes once rescheduled" \
        "health=${HEALTH}" "health_description=${HEALTH_DESCRIPTION}" action=wait
      watch_status "${NODE_STATE}" maintenance "${about}; waiting it out: the node resumes running once rescheduled (Cloud TPU API)"
      exit 0
      ;;
    TIMEOUT | UNHEALTHY_TENSORFLOW)
      if [ ! -f "${UNHEALTHY_SINCE}" ]; then
        date -u +%s >"${UNHEALTHY_SINCE}"
      fi
      since="$(cat "${UNHEALTHY_SINCE}")"
      waited=$(($(date -u +%s) - since))
      if [ "${waited}" -lt "${UNHEALTHY_RECREATE_SECONDS}" ]; then
        watch_status "${NODE_STATE}" unhealthy "${about} for $((waited / 60)) min; recreated once it lasts $((UNHEALTHY_RECREATE_SECONDS / 60)) min"
        exit 0
      fi
      event_once unhealthy-recreate unhealthy \
        "${WHAT} has been ${HEALTH} for $((waited / 60)) min (${about}); deleting and recreating it, training resumes from the checkpoints" \
        "health=${HEALTH}" "health_description=${HEALTH_DESCRIPTION}" action=recreate
      return 0
      ;;
    *)
      watch_status "${NODE_STATE}" unhealthy "health ${about}, not one the watchdog acts on; checking again on the next tick"
      exit 0
      ;;
  esac
}

# `pulumi destroy` deletes the TPU VM right after this controller. A node still DELETING
# (a tick's delete that the shutdown cut short goes on in the API) could make that delete
# fail: the provider's generated delete treats only NOT_FOUND as done
# (GoogleCloudPlatform/magic-modules mmv1/templates/terraform/resource.go.tmpl: an error of
# the DELETE request goes through transport_tpg.HandleNotFoundError). So the shutdown hook
# waits for such a node to be gone: at most 60 s of polls, and never past 80 s since it
# started (the guard unit's TimeoutStopSec is 90).
settle_deleting_node() {
  local waited=0 state
  while state="$(vm_state compute tpus tpu-vm describe "${TPU_NAME}" "${WHERE[@]}" \
    --format='value(state)')" && [ "${state}" = DELETING ]; do
    if [ "${waited}" -ge 60 ] || [ "${SECONDS}" -ge 80 ]; then
      log "${TPU_NAME} is still DELETING after ${waited}s; pulumi destroy may have to be run again"
      return 0
    fi
    log "${TPU_NAME} is DELETING; waiting for it to be gone before pulumi deletes it"
    sleep 10
    waited=$((waited + 10))
  done
}

watch_open
if [ "${MODE}" = shutdown ]; then
  # The controller is going down. If it is because the stack is being destroyed (the lease
  # is gone), cancel the queue now: the next tick would never come.
  flock -w 60 9 || log "a tick still holds the lock; going on"
  lease="$(object_state "${LEASE_URI}" lease)" || exit 1
  if [ "${lease}" = missing ]; then
    stand_down "controller shutting down and the lease is gone (pulumi destroy)" || exit 1
    settle_deleting_node
  else
    log "controller shutting down; the stack is still deployed, nothing to do"
  fi
  exit 0
fi
watch_tick_start

lease="$(object_state "${LEASE_URI}" lease)" || exit 1
if [ "${lease}" = missing ]; then
  stand_down "no lease ${LEASE_URI}: the stack is not deployed yet or is being destroyed" || exit 1
  exit 0
fi
export_state="$(object_state "${EXPORT_MARKER_URI}" "the export marker")" || exit 1

read_node || exit 1
state="${NODE_STATE}"

QR=MISSING
if [ "${SCHEDULING}" != preemptible ]; then
  if ! read_queued; then
    watch_status "${state}" describe-failed "cannot read ${QUEUED_RESOURCE}, retrying on the next tick: $(last_error)"
    exit 1
  fi
  case "${QR}" in
    FAILED | SUSPENDED)
      # A node gone under a queued resource the service suspended (stateInitiator SERVICE:
      # "the resources specified in the QueuedResource request have been deleted") was taken
      # back: a spot node's preemption. It was ours (only this watchdog queues ${QUEUED_RESOURCE}).
      if [ "${QR}" = SUSPENDED ] && [ "${QR_INITIATOR}" = SERVICE ] && [ "${state}" = MISSING ] \
        && [ "${export_state}" != present ] && [ ! -f "${BOOT_FAILED}" ]; then
        event_once preempted preempted \
          "${WHAT} was taken back: the service suspended ${QUEUED_RESOURCE} and deleted the node" \
          state=SUSPENDED
        [ -f "${PENDING}" ] || echo preempted >"${PENDING}"
      fi
      if [ "${QR}" = FAILED ] && [ -n "${QR_ERROR}" ]; then
        log "the queued resource ${QUEUED_RESOURCE} FAILED: ${QR_ERROR}"
        if [ -f "${WATCH_DIR}/capacity-since" ]; then
          exhausted_of "${QR_ERROR}" >"${WATCH_DIR}/capacity-exhausted"
        fi
      fi
      # Nothing more comes from it (and it can hold quota): delete it, queue again if needed.
      if ! delete_queued; then
        watch_status "${state}" cleanup-failed "deleting the ${QR} queued resource ${QUEUED_RESOURCE} failed, retrying: $(last_error)"
        exit 1
      fi
      log "deleted the ${QR} queued resource ${QUEUED_RESOURCE}"
      QR=MISSING
      ;;
  esac
fi

if [ "${export_state}" = present ]; then
  # The job is finished: nothing to resume, never recreate the VM.
  rm -f "${PENDING}" "${NEXT_ATTEMPT}" "${UNHEALTHY_SINCE}"
  capacity_wait_end
  case "${QR}" in
    MISSING | ACTIVE) ;;
    *) delete_queued --force --async || log "could not cancel ${QUEUED_RESOURCE}: $(last_error)" ;;
  esac
  if [ "${RELEASE_WHEN_DONE}" = true ] && [ "${state}" != MISSING ] && [ "${state}" != DELETING ]; then
    if ! gcloud_once compute tpus tpu-vm delete "${TPU_NAME}" "${WHERE[@]}" --quiet --async \
      && ! err_is_not_found; then
      watch_status "${state}" release-failed "the job is complete; deleting ${TPU_NAME} failed, retrying: $(last_error)"
      exit 1
    fi
    watch_status "${state}" released "the job's export is complete; deleted ${TPU_NAME} (tpu-pretrain:tpuReleaseWhenDone)"
  else
    watch_status "${state}" complete "the job's export is complete; ${TPU_NAME} is not recreated"
  fi
  exit 0
fi

case "${state}" in
  PREEMPTED | TERMINATED)
    event_once preempted preempted "${WHAT} is ${state}: taken back by Compute Engine; the watchdog deletes and recreates it" \
      "state=${state}"
    delete_for_recreation preempted "the ${state} VM holds quota and cannot restart"
    ;;
  MISSING)
    if [ ! -f "${PENDING}" ] && [ -f "${BOOT_FAILED}" ]; then
      down_status MISSING
      exit 0
    fi
    if [ ! -f "${PENDING}" ]; then
      # Not deleted by this watchdog (not created yet, or deleted on purpose): leave it.
      watch_status MISSING none "${TPU_NAME} does not exist and was not deleted by this watchdog; run pulumi up to create it"
      exit 0
    fi
    ;;
  *)
    # The VM exists (recreated by the queue or by `pulumi up`, or a create that timed out on
    # our side went through): a later deletion is not ours, so forget the pending create.
    rm -f "${PENDING}" "${NEXT_ATTEMPT}"
    capacity_wait_end
    event_over preempted
    case "${QR}" in
      WAITING_FOR_RESOURCES | ACCEPTED | CREATING)
        # Someone else (pulumi up) created the VM first: the queue is not needed any more.
        # No --force: a queued resource that has a node is never deleted here.
        if delete_queued; then
          watch_status "${state}" dequeued "${TPU_NAME} exists; cancelled ${QUEUED_RESOURCE} (${QR})"
        else
          watch_status "${state}" cleanup-failed "${TPU_NAME} exists; cancelling ${QUEUED_RESOURCE} failed, retrying: $(last_error)"
        fi
        exit 0
        ;;
    esac
    rm -f "${BOOT_FAILED}"
    if [ "${state}" = READY ] && failure="$(vm_failure compute tpus tpu-vm get-guest-attributes \
      "${TPU_NAME}" "${WHERE[@]}" --format='value(worker_id,key,value)')"; then
      cause="$(failure_cause "${failure}" "${WHAT}")"
      if ! gcloud_once compute tpus tpu-vm delete "${TPU_NAME}" "${WHERE[@]}" --quiet --async \
        && ! err_is_not_found; then
        watch_status "${state}" delete-failed "${cause}; deleting ${TPU_NAME} failed, retrying on the next tick: $(last_error)"
        exit 1
      fi
      echo "${failure}" >"${BOOT_SEEN}"
      why="${cause}; deleted it, which billed while idle, and it is not recreated: fix the cause, then recreate it with pulumi up --replace (the stack output tpuRecovery.replace)"
      printf '%s\n%s\n' "$(failure_action "${failure}")" "${why}" >"${BOOT_FAILED}"
      rm -f "${UNHEALTHY_SINCE}"
      watch_event stopped "${why}" "reason=$(failure_action "${failure}")"
      down_status "${state}"
      exit 0
    fi
    if [ "${state}" != READY ] || ! unhealthy_past_bound; then
      watch_status "${state}" none "nothing to do"
      exit 0
    fi
    delete_for_recreation unhealthy "${HEALTH} for longer than $((UNHEALTHY_RECREATE_SECONDS / 60)) min (${HEALTH_DESCRIPTION:-no description})"
    ;;
esac

if [ "${SCHEDULING}" = preemptible ]; then
  create_directly
else
  create_queued
fi
