"""Spot GPU VMs recover: the controller's GPU watchdog (templates/gpu-watch.sh) starts a GPU
VM that preemption stopped, under the TPU watchdog's rules (lease, never after the job's
export, status in the bucket, re-run on a changed installer). The plan under Pulumi's mocks
(its grant: the bootstrap's role, on the project, conditional on the one VM) and the rendered
watchdog run tick by tick in the script sandbox (script_sandbox.py), against a stub
gcloud whose `compute instances describe/start` play the VM's status."""

from __future__ import annotations

import base64
import json
import re
import shlex
import stat

import pytest
from gcloud_flags import problems
from harness import by_name, depends_on, of_type, run_offline, startup_script
from script_sandbox import GpuWatch, publish_payload, publish_startup, shellcheck

from infra.components.recovery import GPU_RECOVERY_ROLE_ID

PROJECT = "tpu-pretrain-test"
PROJECT_IAM = "gcp:projects/iAMMember:IAMMember"
GPU_UNITS = ("tpu-pretrain-gpu-watch.service", "tpu-pretrain-gpu-watch.timer")
TPU_UNITS = (
    "tpu-pretrain-tpu-watch-guard.service",
    "tpu-pretrain-tpu-watch.service",
    "tpu-pretrain-tpu-watch.timer",
)


def _watchdog_of(run) -> str:
    controller = startup_script(run, "controller-vm")
    encoded = re.search(r"^readonly WATCH_SCRIPT_B64=(\S*)$", controller, re.MULTILINE)
    return base64.b64decode(encoded.group(1)).decode() if encoded.group(1) != "''" else ""


def _grants(run) -> list:
    role = f"projects/{PROJECT}/roles/{GPU_RECOVERY_ROLE_ID}"
    return [r for r in of_type(run.resources, PROJECT_IAM) if r.inputs["role"] == role]


# --- the plan -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("stack", "overrides", "on"),
    [
        ("t4-usc1", None, True),  # spot: on by default
        ("l4x2-use1", None, True),
        ("a100x4-usc1", None, False),  # on-demand: Compute Engine restarts it itself
        ("t4-usc1", {"tpu-pretrain:gpuAutoRecover": False}, False),
        ("a100x4-usc1", {"tpu-pretrain:gpuAutoRecover": "true"}, True),
    ],
)
def test_the_watchdog_and_its_grant_follow_gpu_auto_recover(stack, overrides, on):
    run = run_offline(stack, overrides)
    vm = by_name(run, "gpu-vm")
    zone, name = vm.inputs["zone"], vm.inputs["name"]
    controller = by_name(run, "controller-vm")
    script = startup_script(run, "controller-vm")
    assert f"readonly AUTO_RECOVER={'true' if on else 'false'}\n" in script
    assert (f"readonly WATCH_KIND={'gpu' if on else chr(39) * 2}\n") in script
    recovery = run.exports["gpuRecovery"]["watchdog"]
    assert recovery.startswith("on:" if on else "off (tpu-pretrain:gpuAutoRecover=false)")
    leases = [r for r in run.resources if r.name == "controller-tpu-watch-lease"]
    if not on:
        assert _grants(run) == [] and leases == [] and _watchdog_of(run) == ""
        return
    # One grant: the bootstrap's GPU role, to the controller's account, for this VM only.
    (grant,) = _grants(run)
    assert grant.inputs["member"] == (
        f"serviceAccount:tp-{run.stack}-controller@{PROJECT}.iam.gserviceaccount.com"
    )
    assert grant.inputs["condition"]["expression"] == (
        f'resource.name == "projects/{PROJECT}/zones/{zone}/instances/{name}"'
    )
    # No actAs for the GPU watchdog: it starts the VM, it never attaches an account.
    assert not of_type(run.resources, "gcp:serviceaccount/iAMMember:IAMMember")
    # Destroy order: the lease first, then the controller (its watchdog), the GPU VM last.
    (lease,) = leases
    assert depends_on(run, controller, vm) and depends_on(run, lease, controller)
    assert not depends_on(run, vm, controller)
    watchdog = _watchdog_of(run)
    assert f"readonly VM_NAME={name}\n" in watchdog and f"readonly VM_ZONE={zone}\n" in watchdog
    bucket = run.exports["bucketUrl"]
    assert f"readonly LEASE_URI={bucket}/{lease.inputs['name']}\n" in watchdog
    job = json.loads(by_name(run, "payload-job-spec").inputs["content"])
    assert f"readonly EXPORT_MARKER_URI={job['output']}/export/export_complete.json\n" in watchdog
    assert f"status {job['output']}/bootstrap/gpu-watch.json" in recovery


def test_rendered_gpu_watchdog_passes_shellcheck(tmp_path):
    assert shellcheck(_watchdog_of(run_offline("t4-usc1")), tmp_path / "gpu-watch.sh") == ""


# --- the watchdog in the sandbox ----------------------------------------------------------
@pytest.fixture
def watch(gpu_run, sandbox) -> GpuWatch:
    return GpuWatch(gpu_run, sandbox)


def test_the_controller_installs_the_gpu_watchdog_and_removes_it_when_off(gpu_run, sandbox):
    watch = GpuWatch(gpu_run, sandbox)
    unit_dir = sandbox.root / "etc/systemd/system"
    service, timer = ((unit_dir / unit).read_text() for unit in GPU_UNITS)
    assert "ExecStart=/opt/tpu-pretrain/gpu-watch/gpu-watch.sh\n" in service
    assert "Type=oneshot\n" in service and "After=network-online.target\n" in service
    assert "OnUnitActiveSec=2min\n" in timer
    assert "systemctl enable --quiet tpu-pretrain-gpu-watch.timer" in sandbox.calls
    # No TPU pieces: no guard (nothing is queued), no TPU startup script.
    assert not [p for p in unit_dir.iterdir() if p.name in TPU_UNITS]
    assert sorted(p.name for p in watch.dir.iterdir()) == ["gpu-watch.sh"]
    assert (watch.dir / "gpu-watch.sh").read_text() == _watchdog_of(gpu_run)
    assert stat.S_IMODE((watch.dir / "gpu-watch.sh").stat().st_mode) == 0o755

    again = sandbox.run(startup_script(gpu_run, "controller-vm"))
    assert again.returncode == 0, again.stderr
    assert "systemctl daemon-reload" not in sandbox.calls

    off = run_offline("t4-usc1", {"tpu-pretrain:gpuAutoRecover": False})
    removed = sandbox.run(startup_script(off, "controller-vm"))
    assert removed.returncode == 0, removed.stderr
    assert "systemctl disable --now --quiet tpu-pretrain-gpu-watch.timer" in sandbox.calls
    assert "systemctl daemon-reload" in sandbox.calls
    assert not [p for p in unit_dir.iterdir() if p.name in GPU_UNITS]
    assert not watch.dir.exists()


def test_a_tpu_watchdog_left_by_an_earlier_script_is_removed(gpu_run, sandbox):
    """The controller removes every watchdog that is not its own (a stack that changed its
    accelerator keeps no TPU timer that would act on a TPU VM that is gone)."""
    tpu = run_offline("v6e-euw4")
    publish_payload(tpu, sandbox)
    assert sandbox.run(startup_script(tpu, "controller-vm")).returncode == 0
    unit_dir = sandbox.root / "etc/systemd/system"
    assert all((unit_dir / unit).exists() for unit in TPU_UNITS)
    GpuWatch(gpu_run, sandbox)
    assert "systemctl disable --now --quiet tpu-pretrain-tpu-watch.timer" in sandbox.calls
    assert not [p for p in unit_dir.iterdir() if p.name in TPU_UNITS]
    assert not (sandbox.root / "opt/tpu-pretrain/tpu-watch").exists()
    assert all((unit_dir / unit).exists() for unit in GPU_UNITS)


def test_a_running_vm_is_left_alone(watch):
    watch.set_state("RUNNING")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.verbs == ["describe", "get-guest-attributes"]
    assert watch.vm_calls == [
        f"gcloud compute instances describe {watch.name} --zone {watch.zone} "
        f"--project {PROJECT} --format=value(status)",
        # Its boot state (tests/infra/test_first_boot.py): no failure, nothing to do.
        f"gcloud compute instances get-guest-attributes {watch.name} --zone {watch.zone} "
        f"--project {PROJECT} --format=value(key,value) --query-path=tpu-pretrain/",
    ]
    bucket = f"gs://{watch.bucket}/runs/bert-small-mlm-gpu"
    assert [c for c in watch.box.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {bucket}/bootstrap/tpu-watch-lease",
        f"gcloud storage ls {bucket}/export/export_complete.json",
    ]
    status = watch.status
    assert status["role"] == "gpu-watch" and status["vm"] == watch.name
    assert (status["vm_state"], status["action"]) == ("RUNNING", "none")
    assert status["start_attempts"] == 0


def test_a_preempted_vm_is_started_and_attempts_are_counted_until_it_runs(watch):
    """Spot + STOP: preemption leaves TERMINATED. Each tick that finds it so asks for a start
    (--async: Compute Engine accepts it, a spot VM without capacity drops back to TERMINATED);
    a RUNNING VM resets the count."""
    watch.set_state("TERMINATED")
    first = watch.tick(START_RESULT="TERMINATED")  # accepted, but no capacity
    assert first.returncode == 0, first.stderr
    assert watch.verbs == ["describe", "start"]
    start = next(c for c in watch.vm_calls if " start " in c)
    assert start == (
        f"gcloud compute instances start {watch.name} --zone {watch.zone} "
        f"--project {PROJECT} --async"
    )
    assert problems(shlex.split(start)) == []
    assert problems(shlex.split(watch.vm_calls[0])) == []
    status = watch.status
    assert (status["action"], status["start_attempts"]) == ("started", 1)
    assert status["last_start_at"] and "attempt 1" in status["message"]
    assert "resumes from the checkpoints" in status["message"]

    second = watch.tick()  # still TERMINATED: asked again, and the status says why
    assert second.returncode == 0, second.stderr
    assert watch.verbs == ["describe", "start"]
    status = watch.status
    assert (status["action"], status["start_attempts"]) == ("started", 2)
    assert status["message"].startswith(
        "start request 1 did not keep it running (a spot VM without capacity in "
        f"{watch.zone} goes back to TERMINATED)"
    )
    assert watch.state == "STAGING"

    staging = watch.tick()  # on its way: nothing to do
    assert watch.verbs == ["describe"] and watch.status["action"] == "none"
    assert staging.returncode == 0
    watch.set_state("RUNNING")
    assert watch.tick().returncode == 0
    assert watch.status["start_attempts"] == 0


@pytest.mark.parametrize("state", ["STOPPED", "TERMINATED"])
def test_stopped_is_started_too(watch, state):
    watch.set_state(state)
    assert watch.tick().returncode == 0
    assert watch.verbs == ["describe", "start"] and watch.state == "STAGING"


@pytest.mark.parametrize("state", ["TERMINATED", "RUNNING", None])
def test_a_finished_job_is_never_started(watch, state):
    watch.set_state(state)
    watch.export_marker.parent.mkdir(parents=True, exist_ok=True)
    watch.export_marker.write_text("{}")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert "start" not in watch.verbs
    assert watch.status["action"] == "complete"
    assert watch.status["vm_state"] == (state or "MISSING")


def test_without_the_lease_nothing_is_touched(watch):
    watch.set_state("TERMINATED")
    watch.lease.unlink()
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.vm_calls == []
    assert watch.status["action"] == "stopped"
    assert "being destroyed" in watch.status["message"]


def test_a_lease_that_cannot_be_read_changes_nothing(watch):
    watch.set_state("TERMINATED")
    result = watch.tick(STORAGE_LS_ERROR="HTTPError 403: permission denied")
    assert result.returncode == 1
    assert watch.vm_calls == []
    assert watch.status["action"] == "check-failed"


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (None, "does not exist (deleted by Pulumi or by hand; preemption only stops it)"),
        ("SUSPENDED", "resume it by hand: gcloud compute instances resume"),
        ("STOPPING", "is STOPPING; checking again on the next tick"),
        ("PROVISIONING", "is PROVISIONING; checking again on the next tick"),
    ],
)
def test_a_vm_that_is_gone_suspended_or_on_its_way_is_not_started(watch, state, expected):
    watch.set_state(state)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.verbs == ["describe"]
    assert expected in watch.status["message"]
    assert watch.status["vm_state"] == (state or "MISSING")
    if state == "SUSPENDED":  # the command it prints works as printed
        command = watch.status["message"].split("by hand: ", 1)[1]
        assert command.startswith(f"gcloud compute instances resume {watch.name} --zone")
        assert problems(shlex.split(command)) == []


def test_a_refused_start_is_reported_and_retried_on_the_next_tick(watch):
    watch.set_state("TERMINATED")
    refused = watch.tick(
        START_ERROR="Could not fetch resource: - Required 'compute.instances.start' permission"
    )
    assert refused.returncode == 1
    status = watch.status
    assert status["action"] == "start-failed" and status["start_attempts"] == 0
    assert "compute.instances.start" in status["message"]
    assert "retrying on the next tick" in status["message"]
    retried = watch.tick()
    assert retried.returncode == 0, retried.stderr
    assert watch.verbs == ["describe", "start"] and watch.status["action"] == "started"


def test_a_describe_error_is_not_taken_for_a_missing_vm(watch):
    watch.set_state("TERMINATED")
    result = watch.tick(VM_ERROR="HTTPError 403: Required 'compute.instances.get' permission")
    assert result.returncode == 1
    assert watch.verbs == ["describe"]
    assert watch.status["action"] == "describe-failed"


def test_a_tick_that_finds_the_lock_held_does_nothing(watch):
    import fcntl

    watch.set_state("TERMINATED")
    with (watch.dir / "lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = watch.tick()
    assert result.returncode == 0
    assert "another tick holds" in result.stderr
    assert watch.vm_calls == []


def test_a_changed_controller_script_is_rerun_before_anything_else(watch):
    """`pulumi up` wrote a pointer to another controller script (here: the watchdog turned
    off): the tick re-runs the startup script and leaves the VM alone."""
    off = run_offline("t4-usc1", {"tpu-pretrain:gpuAutoRecover": False})
    publish_startup(off, watch.box)
    watch.set_state("TERMINATED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert "google_metadata_script_runner startup" in watch.box.calls
    assert watch.vm_calls == []
    assert watch.status["action"] == "rerun-startup"
