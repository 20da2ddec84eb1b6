"""What the scripts tell people: run events (common.sh emit_event, docs/operating.md) from the
watchdogs, the loader and the trainer unit, the TPU's health and the waits for capacity.

The rendered scripts run in the script sandbox (script_sandbox.py) against the gcloud stub,
which keeps every `gcloud logging write` (Box.logged). An event is written once per
occurrence, not once per tick; the watchdog's status keeps the last 20 and capacity_wait_s.
Time passes by rewriting the watchdog's own clocks in WATCH_DIR: nothing sleeps."""

from __future__ import annotations

import base64
import json
import re
import time

import pytest
from harness import run_offline, startup_script
from script_sandbox import (
    GpuWatch,
    Watch,
    loader_script,
    new_sandbox,
    publish_payload,
    run_helper,
)

from infra.render import render
from payload.core.events import EVENTS, MATCHED_FIELDS, SCHEMA

TRAINER = "tpu-pretrain/trainer"


def _events(box) -> list[str]:
    return [entry["payload"]["event"] for entry in box.logged()]


def _check_entry(entry: dict, bucket: str, source: str) -> dict:
    """An entry as the alert policies match it: the log, the severity of EVENTS, the schema."""
    payload = entry["payload"]
    spec = EVENTS[payload["event"]]
    assert entry["log"] == "tpu-pretrain-events"
    assert entry["severity"] == spec.severity
    assert "--payload-type=json" in entry["flags"]
    assert payload["schema"] == SCHEMA and payload["bucket"] == bucket
    assert payload["source"] == source and source in spec.sources
    assert set(MATCHED_FIELDS) <= set(payload)
    extra = set(payload) - {"schema", "event", "bucket", "job", "source", "host", "message", "at"}
    assert extra <= set(spec.fields), extra
    return payload


@pytest.fixture
def watch(stack_run, sandbox) -> Watch:
    return Watch(stack_run, sandbox)


@pytest.fixture(scope="module")
def spot_gpu_run():
    return run_offline("t4-usc1")  # a spot GPU stack: the GPU watchdog on


def _age(path, seconds: int) -> None:
    """A clock file of the watchdog (epoch seconds) moved `seconds` into the past."""
    path.write_text(f"{int(time.time()) - seconds}\n")


def test_a_preemption_is_one_preempted_and_one_recreated_event(watch):
    watch.set_state("PREEMPTED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    preempted, recreated = (_check_entry(e, watch.bucket, "watchdog") for e in watch.box.logged())
    assert preempted["event"] == "preempted" and preempted["state"] == "PREEMPTED"
    assert preempted["job"] == "gpt2-small-clm"
    assert recreated["event"] == "recreated" and recreated["reason"] == "preempted"
    # The status keeps them, each as the entry's own JSON object (the page's timeline).
    status = watch.status
    assert status["events"] == [preempted, recreated]
    # The wait for capacity begins with the request (its seconds: the tick's own, here).
    assert isinstance(status["capacity_wait_s"], int) and status["capacity_exhausted"] == ""
    assert (watch.dir / "capacity-since").exists()
    # The tick ends with the status page, written by the controller's payload.
    run_root = f"gs://{watch.bucket}/runs/gpt2-small-clm"
    assert watch.box.calls[-1] == f"tpu-payload page --run {run_root}"

    # Waiting in the queue: nothing new is told, tick after tick.
    for _ in range(2):
        assert watch.tick().returncode == 0
        assert _events(watch.box) == ["preempted", "recreated"]
    assert len(watch.status["events"]) == 2


def test_a_long_wait_for_capacity_is_reported_once_and_counted(watch):
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0
    since = watch.dir / "capacity-since"
    assert since.exists()
    _age(since, render.CAPACITY_WAIT_MINUTES * 60 + 120)
    assert watch.tick().returncode == 0
    wait = _check_entry(watch.box.logged()[-1], watch.bucket, "watchdog")
    assert wait["event"] == "capacity-wait" and wait["exhausted"] == "capacity"
    assert wait["waited_s"] >= render.CAPACITY_WAIT_MINUTES * 60 + 120
    status = watch.status
    assert status["capacity_exhausted"] == "capacity"
    assert status["capacity_wait_s"] >= 3720 and status["events"][-1] == wait
    assert watch.tick().returncode == 0
    assert _events(watch.box) == ["preempted", "recreated", "capacity-wait"]

    # The queue created the node: the wait is over and stays counted.
    watch.set_state("READY", qr="ACTIVE")
    assert watch.tick().returncode == 0
    status = watch.status
    assert not since.exists() and status["capacity_exhausted"] == ""
    assert isinstance(status["capacity_wait_s"], int) and status["capacity_wait_s"] >= 3720
    # The next preemption is a new occurrence: told again, and a new wait begins.
    (watch.dir / "last-create").write_text("1000\n")
    watch.set_state("PREEMPTED", qr="ACTIVE")
    assert watch.tick().returncode == 0
    assert _events(watch.box)[-2:] == ["preempted", "recreated"]
    assert watch.status["capacity_wait_s"] >= 3720


def test_a_quota_named_by_a_failed_queued_resource_is_what_is_exhausted(watch):
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0
    quota = "TPUV6EPreemptiblePodPerProjectPerZoneForTPUAPI"
    watch.set_state(None, qr="FAILED")
    (watch.box.state / "qr-detail").write_text(
        f"SERVICE|Quota limit '{quota}' has been exceeded. Limit: 0 in zone europe-west4-a\n"
    )
    assert watch.tick().returncode == 0
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "qr-create"]
    assert watch.status["capacity_exhausted"] == f"quota {quota}"
    (watch.box.state / "qr-detail").unlink()
    _age(watch.dir / "capacity-since", 2 * 3600)
    assert watch.tick().returncode == 0
    wait = watch.box.logged()[-1]["payload"]
    assert wait["event"] == "capacity-wait" and wait["exhausted"] == f"quota {quota}"
    assert f"quota {quota}" in watch.status["message"]


def test_a_spot_node_deleted_by_the_service_is_a_preemption(watch):
    """A spot node preempted under its queued resource is deleted by the service, which
    suspends the request (stateInitiator SERVICE): recreated like a PREEMPTED node."""
    watch.set_state(None, qr="SUSPENDED")
    (watch.box.state / "qr-detail").write_text("SERVICE|\n")
    assert watch.tick().returncode == 0
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "qr-create"]
    assert [(e["event"], e.get("state")) for e in (x["payload"] for x in watch.box.logged())] == [
        ("preempted", "SUSPENDED"),
        ("recreated", None),
    ]
    # Suspended by someone (USER): the node was deleted on purpose, nothing is created.
    box = new_sandbox(watch.box.root.parent / "by-hand")
    other = Watch(watch.run, box)
    other.set_state(None, qr="SUSPENDED")
    (box.state / "qr-detail").write_text("USER|\n")
    assert other.tick().returncode == 0
    assert other.creates("qr-create") == [] and box.logged() == []
    assert other.status["action"] == "none"


def test_maintenance_is_waited_out_and_said_once(watch):
    watch.set_state("READY")
    description = "The node is under maintenance; it resumes once rescheduled"
    (watch.box.state / "tpu-health").write_text(f"UNHEALTHY_MAINTENANCE|{description}\n")
    for _ in range(2):
        result = watch.tick()
        assert result.returncode == 0, result.stderr
        assert watch.tpu_calls == ["describe", "qr-describe", "get-guest-attributes"]
    status = watch.status
    assert status["action"] == "maintenance" and status["health"] == "UNHEALTHY_MAINTENANCE"
    assert status["health_description"] == description
    assert "waiting it out" in status["message"]
    (event,) = [_check_entry(e, watch.bucket, "watchdog") for e in watch.box.logged()]
    assert event["event"] == "unhealthy" and event["action"] == "wait"
    assert event["health"] == "UNHEALTHY_MAINTENANCE"
    assert event["health_description"] == description
    # Healthy again: the next maintenance is told again.
    (watch.box.state / "tpu-health").write_text("HEALTHY|\n")
    assert watch.tick().returncode == 0 and watch.status["health"] == "HEALTHY"
    (watch.box.state / "tpu-health").write_text(f"UNHEALTHY_MAINTENANCE|{description}\n")
    assert watch.tick().returncode == 0
    assert _events(watch.box) == ["unhealthy", "unhealthy"]


@pytest.mark.parametrize(
    ("stack", "health"), [("v6e-euw4", "TIMEOUT"), ("v4-32-usc2", "UNHEALTHY_TENSORFLOW")]
)
def test_a_node_unhealthy_past_its_bound_is_recreated(stack, health, tmp_path):
    """TIMEOUT or UNHEALTHY_TENSORFLOW within the bound: said, not acted on; past it, the
    node (a slice's every host: one node) is deleted and queued again, with the events."""
    watch = Watch(run_offline(stack), new_sandbox(tmp_path))
    watch.set_state("READY", qr="ACTIVE")
    (watch.box.state / "tpu-health").write_text(f"{health}|the host stopped answering\n")
    assert watch.tick().returncode == 0
    status = watch.status
    assert status["action"] == "unhealthy" and status["health"] == health
    assert f"recreated once it lasts {30} min" in status["message"]
    assert watch.creates("qr-create") == [] and watch.box.logged() == []

    _age(watch.dir / "unhealthy-since", 31 * 60)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == [
        "describe", "qr-describe", "get-guest-attributes", "qr-delete", "qr-create"
    ]  # fmt: skip
    unhealthy, recreated = (e["payload"] for e in watch.box.logged())
    assert unhealthy["event"] == "unhealthy" and unhealthy["action"] == "recreate"
    assert unhealthy["health"] == health
    assert unhealthy["health_description"] == "the host stopped answering"
    assert recreated["event"] == "recreated" and recreated["reason"] == "unhealthy"
    assert watch.status["action"] == "queued"
    assert not (watch.dir / "unhealthy-since").exists()


def test_a_failed_vm_that_is_deleted_is_one_stopped_event(watch):
    watch.set_state("READY")
    path = watch.box.state / "guest-attributes" / TRAINER
    path.parent.mkdir(parents=True)
    path.write_text("stopped 1700000000 trainer stopped with exit 2: a user error")
    assert watch.tick().returncode == 0
    (stopped,) = [_check_entry(e, watch.bucket, "watchdog") for e in watch.box.logged()]
    assert stopped["event"] == "stopped" and stopped["reason"] == "trainer-stopped"
    assert "a user error" in stopped["message"]
    assert watch.tick().returncode == 0 and len(watch.box.logged()) == 1


def test_the_status_is_json_for_any_message_and_events_never_fail_a_tick(watch):
    error = 'backend said "no"\tand\\then\x01 left'
    watch.set_state("READY")
    failed = watch.tick(DESCRIBE_ERROR=error)
    assert failed.returncode == 1
    assert error in watch.status["message"]
    # Cloud Logging refuses the write: the tick goes on, the status still keeps the event.
    watch.set_state("PREEMPTED")
    result = watch.tick(LOGGING_WRITE_ERROR="PERMISSION_DENIED: logging.logEntries.create")
    assert result.returncode == 0, result.stderr
    assert "not written to Cloud Logging" in result.stderr
    # Two tries per event at most: recovery does not wait on Cloud Logging.
    writes = [c for c in watch.box.calls if c.startswith("gcloud logging write ")]
    assert len(writes) == 4 and watch.creates("qr-create") != []
    assert [e["event"] for e in watch.status["events"]] == ["preempted", "recreated"]


def test_the_page_is_optional_and_never_fails_a_tick(watch):
    cli = watch.box.root / "opt/tpu-pretrain/venv/bin/tpu-payload"
    cli.write_text("#!/bin/bash\necho 'page: no status.json yet' >&2\nexit 1\n")
    watch.set_state("READY")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert "the status page was not written: page: no status.json yet" in result.stderr
    cli.unlink()
    assert watch.tick().returncode == 0


def test_the_events_kept_in_the_status_are_the_last_twenty(watch):
    log = watch.dir / "events.jsonl"
    log.write_text("".join(json.dumps({"event": "preempted", "n": i}) + "\n" for i in range(25)))
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0
    events = watch.status["events"]
    assert len(events) == 20 and events[-1]["event"] == "recreated"
    assert events[0]["n"] == 7 and len(log.read_text().splitlines()) == 20


def test_capacity_wait_minutes_is_rendered_and_checked():
    run = run_offline("v6e-euw4", {"tpu-pretrain:capacityWaitMinutes": 90})
    controller = startup_script(run, "controller-vm")
    encoded = re.search(r"^readonly WATCH_SCRIPT_B64=(\S+)$", controller, re.MULTILINE)
    script = base64.b64decode(encoded.group(1)).decode()
    assert "\nreadonly CAPACITY_WAIT_SECONDS=5400\n" in script
    plain = startup_script(run_offline("v6e-euw4"), "controller-vm")
    encoded = re.search(r"^readonly WATCH_SCRIPT_B64=(\S+)$", plain, re.MULTILINE)
    assert "\nreadonly CAPACITY_WAIT_SECONDS=3600\n" in base64.b64decode(encoded.group(1)).decode()


# --- the GPU watchdog -------------------------------------------------------------------


@pytest.fixture
def gpu_watch(spot_gpu_run, sandbox) -> GpuWatch:
    return GpuWatch(spot_gpu_run, sandbox)


def test_a_preempted_gpu_vm_is_told_once_and_its_wait_counted(gpu_watch):
    watch = gpu_watch
    watch.set_state("TERMINATED")
    assert watch.tick(START_RESULT="TERMINATED").returncode == 0
    preempted, recreated = (_check_entry(e, watch.bucket, "watchdog") for e in watch.box.logged())
    assert preempted["event"] == "preempted" and preempted["state"] == "TERMINATED"
    assert recreated["event"] == "recreated" and recreated["reason"] == "preempted"
    # Back to TERMINATED without capacity: more attempts, no more preemptions.
    assert watch.tick(START_RESULT="TERMINATED").returncode == 0
    assert _events(watch.box) == ["preempted", "recreated"]
    _age(watch.dir / "capacity-since", 61 * 60)
    assert watch.tick(START_RESULT="TERMINATED").returncode == 0
    wait = watch.box.logged()[-1]["payload"]
    assert wait["event"] == "capacity-wait" and wait["exhausted"] == "capacity"
    assert watch.status["capacity_exhausted"] == "capacity"
    # A start refused for a quota names it.
    refused = watch.tick(START_ERROR="Quota 'NVIDIA_L4_GPUS' exceeded. Limit: 0.0 in region")
    assert refused.returncode == 1
    assert watch.status["capacity_exhausted"] == "quota NVIDIA_L4_GPUS"
    # Running: the wait is over, counted in capacity_wait_s.
    watch.set_state("RUNNING")
    assert watch.tick().returncode == 0
    status = watch.status
    assert status["capacity_exhausted"] == "" and status["capacity_wait_s"] >= 61 * 60
    assert [e["event"] for e in status["events"]] == ["preempted", "recreated", "capacity-wait"]
    assert status["start_attempts"] == 0


def test_a_gpu_vm_stopped_for_a_failed_boot_is_one_stopped_event(gpu_watch):
    watch = gpu_watch
    watch.set_state("RUNNING")
    path = watch.box.state / "guest-attributes" / "tpu-pretrain/boot"
    path.parent.mkdir(parents=True)
    path.write_text("failed 1700000000 cannot read the job pointer")
    assert watch.tick().returncode == 0
    (stopped,) = [_check_entry(e, watch.bucket, "watchdog") for e in watch.box.logged()]
    assert stopped["event"] == "stopped" and stopped["reason"] == "boot-failed"
    # Stopped (TERMINATED) because of it: not started, not told again.
    assert watch.tick().returncode == 0
    assert len(watch.box.logged()) == 1 and "start" not in watch.verbs


# --- the loader and the trainer unit ----------------------------------------------------


def test_a_loader_that_gives_up_writes_one_stopped_event(stack_run, sandbox):
    loader = loader_script(stack_run, "tpu-vm")
    assert sandbox.run(loader).returncode == 1
    (stopped,) = sandbox.logged()
    bucket = re.search(r"^readonly BUCKET_URI=gs://(\S+)$", loader, re.MULTILINE).group(1)
    payload = _check_entry(stopped, bucket, "loader")
    assert payload["event"] == "stopped" and payload["reason"] == "boot-failed"
    assert payload["message"].startswith("cannot read the job pointer")
    # The scheduled re-run fails the same way: nothing new to tell.
    assert sandbox.run(loader).returncode == 1
    assert len(sandbox.logged()) == 1


def test_a_trainer_that_stops_for_good_writes_a_stopped_event(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    assert sandbox.run(startup_script(stack_run, "tpu-vm")).returncode == 0
    result = run_helper(sandbox, "stopped", SERVICE_RESULT="exit-code", EXIT_STATUS="2")
    assert result.returncode == 0, result.stderr
    (stopped,) = sandbox.logged()
    payload = _check_entry(stopped, bucket, "trainer-unit")
    assert payload["event"] == "stopped" and payload["reason"] == "user-error"
    assert payload["job"] == "gpt2-small-clm" and "exit 2" in payload["message"]
    # A restart after a signal (a preemption, a shutdown) is not a stop.
    again = run_helper(sandbox, "stopped", SERVICE_RESULT="signal", EXIT_STATUS="TERM")
    assert again.returncode == 0 and len(sandbox.logged()) == 1
