# ---- templates/gpu-watch.sh: start a preempted spot GPU VM again (controller, timer) ----
# After watch-common.sh (lease, export marker, status, re-run on a changed installer).
# One tick of tpu-pretrain-gpu-watch.timer. A spot GPU VM is created with
# instance_termination_action STOP (infra/components/gpu.py): when Compute Engine preempts
# it, it is stopped (status TERMINATED) and keeps its boot disk, its name and its place in
# Pulumi's state. Starting it again runs its startup script (every boot), which finds the
# payload installed and starts the trainer; the trainer resumes from the bucket's checkpoints.
#
# Rules, in the order a tick applies them (the TPU watchdog's, tpu-watch.sh):
# - It acts only while the lease object (LEASE_URI) exists: `pulumi destroy` deletes it
#   first, so a VM being destroyed is never started again.
# - Once the job's export is complete (EXPORT_MARKER_URI) it never starts the VM.
# - TERMINATED or STOPPED: `gcloud compute instances start --async`. --async returns once
#   Compute Engine accepted the request, without polling the zone operation (the grant is
#   compute.instances.start and .get on this one VM, not compute.zoneOperations.get). A spot
#   VM without capacity goes back to TERMINATED (the operation fails with
#   ZONE_RESOURCE_POOL_EXHAUSTED); the next tick starts it again and the status counts the
#   attempts. An attempt that is refused (permission, quota) is retried on the next tick.
# - It never creates or deletes the VM: with STOP the VM is never deleted by preemption, and
#   a VM that is gone was deleted by Pulumi or by hand (`pulumi up` creates it again).
# - SUSPENDED (someone suspended it) is left alone: resume it by hand.
# - A RUNNING VM whose loader gave up, or whose trainer stopped for good (its guest
#   attributes: watch-common.sh vm_failure), bills while idle: it is stopped (`compute instances stop --async`), and not started again by
#   the watchdog until it runs again (started by hand once the cause is fixed: the stack
#   output gpuRecovery.start).
# - Events (common.sh emit_event, docs/operating.md), each once per occurrence: `preempted` when
#   a VM that ran is found TERMINATED or STOPPED, `recreated` at the first start request after
#   it, `capacity-wait` once the start has been refused (or undone) for longer than
#   CAPACITY_WAIT_SECONDS (tpu-pretrain:capacityWaitMinutes), `stopped` when a failed VM is
#   stopped. The status keeps the last 20 and capacity_wait_s, the seconds this job has waited
#   for capacity (from the first start request until the VM runs).
# Status: gs://…/runs/<job>/bootstrap/gpu-watch.json.
readonly WATCH_DIR="${APP_DIR}/gpu-watch"
readonly LAST_START="${WATCH_DIR}/last-start"  # epoch seconds of the last start request
readonly ATTEMPTS="${WATCH_DIR}/start-attempts"  # start requests since the VM last ran
readonly BOOT_SEEN="${WATCH_DIR}/boot-seen"  # the boot failure last acted on
readonly BOOT_FAILED="${WATCH_DIR}/boot-failed"  # the VM was stopped because of it
readonly WHERE=(--zone "${VM_ZONE}" --project "${PROJECT}")

# {"vm_state": seen, "action": taken, "message", "start_attempts", "last_start_at",
#  ...watch-common.sh put_status: capacity_wait_s, capacity_exhausted, events, updated_at}
watch_status() {
  local vm_state="$1" action="$2" message="$3" last="" attempts
  log "GPU VM ${VM_NAME}: state ${vm_state}, action ${action}: ${message}"
  if [ -f "${LAST_START}" ]; then
    last="$(date -u -d "@$(cat "${LAST_START}")" +%Y-%m-%dT%H:%M:%SZ)"
  fi
  attempts="$(cat "${ATTEMPTS}" 2>/dev/null || echo 0)"
  put_status "${action}" "role=${ROLE}" "host=$(hostname)" "job=${JOB_NAME}" "vm=${VM_NAME}" \
    "zone=${VM_ZONE}" "vm_state=${vm_state}" "action=${action}" "message=${message}" \
    "start_attempts:=${attempts}" "last_start_at=${last}"
}

watch_open
watch_tick_start

lease="$(object_state "${LEASE_URI}" lease)" || exit 1
if [ "${lease}" = missing ]; then
  capacity_wait_end
  watch_status UNCHECKED stopped "no lease ${LEASE_URI}: the stack is not deployed yet or is being destroyed; nothing to do"
  exit 0
fi
export_state="$(object_state "${EXPORT_MARKER_URI}" "the export marker")" || exit 1

state="$(vm_state compute instances describe "${VM_NAME}" "${WHERE[@]}" \
  --format='value(status)')" || exit 1

if [ "${export_state}" = present ]; then
  rm -f "${ATTEMPTS}"
  capacity_wait_end
  watch_status "${state}" complete "the job's export is complete; ${VM_NAME} is not started again"
  exit 0
fi

case "${state}" in
  TERMINATED | STOPPED)
    if [ -f "${BOOT_FAILED}" ]; then
      down_status "${state}"
      exit 0
    fi
    ;;
  MISSING)
    watch_status MISSING none "${VM_NAME} does not exist (deleted by Pulumi or by hand; preemption only stops it); run pulumi up to create it"
    exit 0
    ;;
  SUSPENDED)
    watch_status SUSPENDED none "${VM_NAME} was suspended (not by preemption); resume it by hand: gcloud compute instances resume ${VM_NAME} --zone ${VM_ZONE} --project ${PROJECT}"
    exit 0
    ;;
  RUNNING)
    rm -f "${ATTEMPTS}" "${BOOT_FAILED}"
    capacity_wait_end
    event_over preempted
    if failure="$(vm_failure compute instances get-guest-attributes "${VM_NAME}" \
      "${WHERE[@]}" --format='value(key,value)')"; then
      cause="$(failure_cause "${failure}" "${VM_NAME}")"
      if ! gcloud_once compute instances stop "${VM_NAME}" "${WHERE[@]}" --async; then
        watch_status RUNNING stop-failed "${cause}; stopping ${VM_NAME} failed, retrying on the next tick: $(last_error)"
        exit 1
      fi
      echo "${failure}" >"${BOOT_SEEN}"
      why="${cause}; stopped it, which billed while idle, and it is not started again: fix the cause, then start it (the stack output gpuRecovery.start)"
      printf '%s\n%s\n' "$(failure_action "${failure}")" "${why}" >"${BOOT_FAILED}"
      watch_event stopped "${why}" "reason=$(failure_action "${failure}")"
      down_status RUNNING
      exit 0
    fi
    watch_status RUNNING none "nothing to do"
    exit 0
    ;;
  *)
    # PROVISIONING, STAGING, STOPPING, SUSPENDING, REPAIRING: on its way; look again later.
    watch_status "${state}" none "${VM_NAME} is ${state}; checking again on the next tick"
    exit 0
    ;;
esac

attempts="$(cat "${ATTEMPTS}" 2>/dev/null || echo 0)"
if [ "${attempts}" -gt 0 ]; then
  why="start request ${attempts} did not keep it running (a spot VM without capacity in ${VM_ZONE} goes back to TERMINATED); "
  capacity_waiting "$(cat "${WATCH_DIR}/capacity-exhausted" 2>/dev/null || echo capacity)"
else
  why=""
  event_once preempted preempted "${VM_NAME} is ${state} (a spot VM's preemption stops it); the watchdog starts it again" \
    "state=${state}"
  capacity_wait_begin
fi
if ! gcloud_once compute instances start "${VM_NAME}" "${WHERE[@]}" --async; then
  if err_is_not_found; then
    watch_status MISSING none "${VM_NAME} was deleted meanwhile; run pulumi up to create it"
    exit 0
  fi
  if err_is_capacity; then
    capacity_waiting "$(exhausted_of "$(last_error)")"
  fi
  watch_status "${state}" start-failed "${why}starting ${VM_NAME} failed, retrying on the next tick: $(last_error)"
  exit 1
fi
date -u +%s >"${LAST_START}"
echo $((attempts + 1)) >"${ATTEMPTS}"
if [ "${attempts}" = 0 ]; then
  watch_event recreated "asked Compute Engine to start ${VM_NAME} again; its startup script starts the trainer, which resumes from the checkpoints" \
    reason=preempted
fi
watch_status "${state}" started "${why}asked Compute Engine to start ${VM_NAME} (attempt $((attempts + 1))); its startup script starts the trainer, which resumes from the checkpoints"
