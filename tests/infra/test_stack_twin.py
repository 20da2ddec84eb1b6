"""A stack's whole life, fed only by what the program deploys (stack_twin.py): the bucket is the
program's objects in the storage emulator, each VM's metadata its resource's input (or the
watchdog's own create request), and the cloud's state moves as GCP's would. Every wait is the
sandbox's `sleep` stub: nothing sleeps."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from harness import by_name, run_offline
from script_sandbox import job_with_backend
from stack_twin import StackTwin

from infra import jobspec
from infra.render import render

pytestmark = pytest.mark.emulator

REPO = Path(__file__).resolve().parents[2]
# The environment of the TPU VM's payload (the lock + the payload: `make venv-tpu`), the one
# the controller's own venv is built from; the page is drawn by this checkout's payload.
PAYLOAD_PYTHON = REPO / ".venv-tpu" / "bin" / "python"


@pytest.fixture(scope="module")
def tpu_run(tmp_path_factory):
    """v6e-euw4 (spot, the watchdog on) on the TensorFlow backend, as conftest's stack_run."""
    job = job_with_backend(tmp_path_factory.mktemp("jobs"), "tf")
    return run_offline("v6e-euw4", {"tpu-pretrain:job": job})


@pytest.fixture
def twin(tpu_run, tmp_path, gcs_emulator) -> StackTwin:
    return StackTwin(tpu_run, tmp_path, gcs_emulator)


def _ok(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def _job_object(run) -> str:
    return str(by_name(run, "payload-job-spec").inputs["name"])


def test_first_boot_runs_the_pointers_scripts_and_starts_the_trainer(twin):
    _ok(twin.boot_controller())
    pointer = twin.read_json(render.POINTER_OBJECT)
    kept = twin.controller.root / "opt/tpu-pretrain/loader/current.json"
    assert json.loads(kept.read_text()) == pointer
    assert (twin.controller.root / "opt/tpu-pretrain/tpu-watch/tpu-watch.sh").exists()

    vm = twin.boot_accelerator()
    _ok(vm.result)
    assert vm.job_uri == f"gs://{twin.bucket}/{_job_object(twin.run)}"
    assert vm.started_trainer
    assert twin.read_json(f"{twin.run_root}/bootstrap/tpu.json")["state"] == "started"
    assert (twin.cloud / "guest-attributes" / render.BOOT_ATTRIBUTE).read_text() == "ok"

    tick = twin.tick()
    _ok(tick)
    assert twin.api_calls == ["describe", "qr-describe", "get-guest-attributes"]
    assert twin.watch_status()["action"] == "none"
    assert "google_metadata_script_runner startup" not in twin.controller.calls


def _output(twin) -> str:
    """The run's output prefix as the job spec in the bucket names it (what the trainer
    writes under: checkpoints/, export/)."""
    spec = twin.read_json(_job_object(twin.run))
    return str(spec["output"]).removeprefix(f"gs://{twin.bucket}/")


def test_a_new_job_reaches_the_watchdog_and_the_trainer(twin, tmp_path):
    _ok(twin.boot_controller())
    vm = twin.boot_accelerator()
    _ok(vm.result)
    old = twin.read_json(render.POINTER_OBJECT)
    job = job_with_backend(tmp_path, "tf", "stacks/jobs/bert-small-mlm.yaml")
    new_run = run_offline("v6e-euw4", {"tpu-pretrain:job": job})
    twin.deploy(new_run)
    new = twin.read_json(render.POINTER_OBJECT)
    assert new["job"] != old["job"] and new["script_tpu"] != old["script_tpu"]
    # What the old pointer names is still there for a VM that read it a moment ago.
    for key in ("payload_object", "script_tpu", "script_controller"):
        assert twin.store.exists(old[key]), key

    # The watchdog sees another controller script named and re-runs the startup script.
    _ok(twin.tick())
    assert "google_metadata_script_runner startup" in twin.controller.calls
    assert twin.api_calls == []
    kept = twin.controller.root / "opt/tpu-pretrain/loader/current.json"
    assert json.loads(kept.read_text()) == new
    watch = (twin.controller.root / "opt/tpu-pretrain/tpu-watch/tpu-watch.sh").read_text()
    assert f"readonly JOB_NAME={new['job']}" in watch
    # The next tick is the new watchdog's: it acts, and reports under the new job.
    _ok(twin.tick())
    assert "google_metadata_script_runner startup" not in twin.controller.calls
    assert twin.api_calls[:2] == ["describe", "qr-describe"]
    assert twin.watch_status()["job"] == new["job"]

    # The trainer takes the new job when the TPU VM's startup script runs again.
    again = twin.reboot(vm)
    _ok(again.result)
    assert again.job_uri == f"gs://{twin.bucket}/{_job_object(new_run)}"
    assert "systemctl restart --no-block tpu-pretrain-train.service" in again.box.calls


def test_a_vm_that_read_the_old_pointer_boots_on_what_it_names(twin, tmp_path):
    """`pulumi up` switches the pointer right after a booting VM read it: the script and the
    archive the old pointer names are still readable, and the VM boots on them whole."""
    _ok(twin.boot_controller())
    old = twin.read_json(render.POINTER_OBJECT)
    job = job_with_backend(tmp_path, "tf", "stacks/jobs/bert-small-mlm.yaml")
    hook = twin.deploy_hook(run_offline("v6e-euw4", {"tpu-pretrain:job": job}))
    old_job = f"gs://{twin.bucket}/jobs/{old['job']}.json"
    vm = twin.boot_accelerator(TWIN_AFTER_READ=render.POINTER_OBJECT, TWIN_HOOK=str(hook))
    _ok(vm.result)
    assert (vm.box.state / "twin-hook-done").exists()
    assert twin.read_json(render.POINTER_OBJECT)["job"] != old["job"]  # it switched meanwhile
    assert json.loads((vm.box.root / "opt/tpu-pretrain/loader/current.json").read_text()) == old
    assert vm.job_uri == old_job


def test_preemption_queues_a_new_vm_that_boots_the_same_pointer_and_checkpoints(twin):
    _ok(twin.boot_controller())
    first = twin.boot_accelerator()
    _ok(first.result)
    # The trainer wrote a checkpoint (Orbax's <step>/ directory under the job's output, on
    # gs:// committed by its commit_success.txt, written last).
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        twin.store.put(f"{_output(twin)}/checkpoints/40/{name}", b"{}")
    _real_page_command(twin)
    twin.preempt()
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "qr-describe", "delete", "qr-create"]
    assert twin.watch_status()["action"] == "queued"
    assert twin.cloud_state("tpu-state") is None
    # Told in Cloud Logging, where the stack's alerts match them, and in the status.
    events = [entry["payload"] for entry in twin.events]
    job = twin.read_json(render.POINTER_OBJECT)["job"]
    assert [(e["event"], e["source"], e["job"]) for e in events] == [
        ("preempted", "watchdog", job),
        ("recreated", "watchdog", job),
    ]
    assert [entry["severity"] for entry in twin.events] == ["WARNING", "NOTICE"]
    assert events[0]["state"] == "PREEMPTED" and events[1]["reason"] == "preempted"
    assert twin.watch_status()["events"] == events
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "queued"  # waiting for capacity
    assert twin.api_calls == ["describe", "qr-describe"]
    assert len(twin.events) == 2  # once per preemption, not per tick

    metadata = twin.provision()
    # The new node's metadata is the program's: the loader, byte for byte, and its keys.
    assert metadata == dict(twin.vm.inputs["metadata"])
    second = twin.boot_accelerator(metadata)
    _ok(second.result)
    assert second.job_uri == first.job_uri and second.started_trainer
    # The new VM's trainer finds the checkpoint the old one wrote (its helper lists them).
    ended = second.helper("stopped", EXIT_STATUS="1", EXIT_CODE="exited", SERVICE_RESULT="x")
    _ok(ended)
    status = twin.read_json(f"{twin.run_root}/bootstrap/tpu.json")
    assert "newest: 40" in status["message"], status
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "none"
    assert twin.cloud_state("qr-state") == "ACTIVE"
    status = twin.watch_status()
    assert [e["event"] for e in status["events"]] == ["preempted", "recreated"]
    assert status["capacity_exhausted"] == "" and isinstance(status["capacity_wait_s"], int)
    # The page in the bucket, drawn by the watchdog's tick (`tpu-payload page`), shows the
    # restart: both events in its table and on its timeline.
    markup = twin.store.get(f"{twin.run_root}/status.html").decode()
    rows = re.findall(r"<tr><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td>", markup)
    assert rows == [("recreated", "watchdog"), ("preempted", "watchdog")]  # newest first
    assert re.search(r'<svg [^>]*id="plot-timeline"', markup)
    assert html.escape(events[0]["message"]) in markup


def _real_page_command(twin: StackTwin) -> None:
    """The controller's `tpu-payload` (a recorder in the sandbox) as the real payload CLI, on
    the bucket in the emulator: the watchdog's ticks draw the real page."""
    assert PAYLOAD_PYTHON.exists(), f"{PAYLOAD_PYTHON} is missing: `make venv-tpu` builds it"
    cli = twin.controller.root / "opt/tpu-pretrain/venv/bin/tpu-payload"
    assert cli.exists(), "the controller's boot installs the payload"
    cli.write_text(f'#!/bin/bash\nPYTHONPATH="{REPO}" exec "{PAYLOAD_PYTHON}" -m payload "$@"\n')


def test_release_when_done_deletes_the_vm_once_the_export_is_complete(tmp_path, gcs_emulator):
    job = job_with_backend(tmp_path, "tf")
    run = run_offline(
        "v6e-euw4", {"tpu-pretrain:job": job, "tpu-pretrain:tpuReleaseWhenDone": True}
    )
    twin = StackTwin(run, tmp_path / "twin", gcs_emulator)
    _ok(twin.boot_controller())
    _ok(twin.boot_accelerator().result)
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "none"
    # The payload's export writes its marker last (payload/training/export.py).
    twin.store.put(f"{_output(twin)}/export/{jobspec.EXPORT_MARKER}", b"{}")
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "qr-describe", "delete"]
    assert twin.watch_status()["action"] == "released"
    assert twin.cloud_state("tpu-state") is None
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "complete" and "delete" not in twin.api_calls


def test_a_loader_that_gave_up_gets_its_vm_deleted(twin):
    _ok(twin.boot_controller())
    vm = twin.boot_accelerator(FAIL_FIRST_DOWNLOADS="1000", FAIL_MATCH=render.POINTER_OBJECT)
    assert vm.result.returncode == 1
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "qr-describe", "get-guest-attributes", "delete"]
    status = twin.watch_status()
    assert status["action"] == "boot-failed" and "cannot read the job pointer" in status["message"]
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "qr-describe"]  # not recreated
    assert twin.watch_status()["action"] == "boot-failed"


def test_a_trainer_that_stopped_for_good_gets_its_vm_deleted(twin):
    _ok(twin.boot_controller())
    vm = twin.boot_accelerator()
    _ok(vm.result)
    # The controller's data stage wrote the manifest: the unit's ExecStartPre returns.
    twin.store.put(f"{_output(twin)}/data/manifest.json", b"{}")
    _ok(vm.helper("wait-manifest"))
    assert (twin.cloud / "guest-attributes" / render.TRAINER_ATTRIBUTE).read_text() == "running"
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "none"

    _ok(vm.helper("stopped", EXIT_STATUS="2", EXIT_CODE="exited", SERVICE_RESULT="exit-code"))
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "qr-describe", "get-guest-attributes", "delete"]
    status = twin.watch_status()
    assert status["action"] == "trainer-stopped", status
    assert "stopped for good (worker 0: trainer stopped with exit 2: a user" in status["message"]
    assert "pulumi up --replace" in status["message"]
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "qr-describe"]  # not recreated
    assert twin.watch_status()["action"] == "trainer-stopped"


def test_destroy_takes_the_lease_and_the_watchdog_cancels_its_queue(twin):
    _ok(twin.boot_controller())
    _ok(twin.boot_accelerator().result)
    twin.preempt()
    _ok(twin.tick())
    assert twin.cloud_state("qr-state") == "WAITING_FOR_RESOURCES"
    deleted = twin.destroy_objects()
    lease = str(by_name(twin.run, "controller-tpu-watch-lease").inputs["name"])
    assert deleted == [lease]  # everything else a VM runs or reads is retained
    _ok(twin.tick())
    assert twin.api_calls == ["qr-describe", "qr-delete"]
    assert twin.cloud_state("qr-state") is None
    assert twin.watch_status()["action"] == "stopped"
    _ok(twin.tick("shutdown"))  # the controller's own deletion: nothing left to cancel
    assert "qr-create" not in twin.api_calls and "create" not in twin.api_calls


def test_a_reboots_first_tick_leaves_the_guest_agents_run_alone(twin):
    _ok(twin.boot_controller())
    # At the reboot the timer's first tick comes while the loader is between reading the
    # pointer and running the script it names.
    tick_log = twin.root / "tick.log"
    hook = twin.root / "tick"
    watch = twin.controller.root / "opt/tpu-pretrain/tpu-watch/tpu-watch.sh"
    hook.write_text(f'#!/bin/bash\nbash {watch} >{tick_log} 2>&1\necho "exit $?" >>{tick_log}\n')
    hook.chmod(0o755)
    _ok(twin.boot_controller(TWIN_AFTER_READ=render.POINTER_OBJECT, TWIN_HOOK=str(hook)))
    log = tick_log.read_text()
    assert "the controller's startup script is running" in log and log.endswith("exit 0\n")
    calls = twin.controller.calls
    assert calls.count("google_metadata_script_runner startup") == 1  # the guest agent's only
    assert not [c for c in calls if c.startswith("gcloud compute")]


@pytest.fixture(scope="module")
def spot_gpu_run():
    return run_offline("t4-usc1")  # a spot GPU stack: the GPU watchdog on


def test_a_spot_gpu_vm_is_started_again_and_boots_its_trainer(spot_gpu_run, tmp_path, gcs_emulator):
    twin = StackTwin(spot_gpu_run, tmp_path, gcs_emulator)
    _ok(twin.boot_controller())
    vm = twin.boot_accelerator()
    _ok(vm.result)
    assert vm.started_trainer
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "none"
    twin.terminate()  # Compute Engine stops the spot VM; its disk stays
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "start"]
    assert twin.watch_status()["action"] == "started"
    twin.set_vm_state("RUNNING")
    again = twin.reboot(vm)
    _ok(again.result)
    assert again.started_trainer and again.job_uri == vm.job_uri
    _ok(twin.tick())
    assert twin.watch_status()["action"] == "none"


def test_a_gpu_trainer_failing_five_times_gets_its_vm_stopped(spot_gpu_run, tmp_path, gcs_emulator):
    twin = StackTwin(spot_gpu_run, tmp_path, gcs_emulator)
    _ok(twin.boot_controller())
    vm = twin.boot_accelerator()
    _ok(vm.result)
    for _ in range(5):
        _ok(vm.helper("stopped", EXIT_STATUS="1", EXIT_CODE="exited", SERVICE_RESULT="exit-code"))
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "get-guest-attributes", "stop"]
    assert twin.cloud_state("vm-state") == "TERMINATED"
    status = twin.watch_status()
    assert status["action"] == "trainer-stopped", status
    assert "trainer failed 5 times in a row" in status["message"]
    assert "gpuRecovery.start" in status["message"]
    _ok(twin.tick())
    assert twin.api_calls == ["describe"]  # not started again
    assert twin.watch_status()["action"] == "trainer-stopped"


def test_a_gpu_loader_that_gave_up_gets_its_vm_stopped(spot_gpu_run, tmp_path, gcs_emulator):
    twin = StackTwin(spot_gpu_run, tmp_path, gcs_emulator)
    _ok(twin.boot_controller())
    vm = twin.boot_accelerator(FAIL_FIRST_DOWNLOADS="1000", FAIL_MATCH=render.POINTER_OBJECT)
    assert vm.result.returncode == 1
    _ok(twin.tick())
    assert twin.api_calls == ["describe", "get-guest-attributes", "stop"]
    assert twin.watch_status()["action"] == "boot-failed"
