"""The TPU watchdog (preemption recovery on the controller).

The controller's rendered watchdog (templates/tpu-watch.sh) through shellcheck, installed in
the script sandbox (script_sandbox.py) and run tick by tick (script_sandbox.Watch) against a
stub gcloud whose TPU and queued-resource APIs play the node's state: a preempted TPU waits in
a queued resource with Pulumi's settings, never after the job's export, not without the
lease, failed calls retried on the next tick."""

from __future__ import annotations

import base64
import fcntl
import re
import stat
from pathlib import Path

import pytest
from harness import run_offline, startup_script
from script_sandbox import (
    Watch,
    assert_gcloud_flags_exist,
    flag_pairs,
    publish_startup,
    shellcheck,
    split_flags,
)

from infra.render import render

WATCH_UNITS = (
    "tpu-pretrain-tpu-watch-guard.service",
    "tpu-pretrain-tpu-watch.service",
    "tpu-pretrain-tpu-watch.timer",
)


def _watchdog_of(run) -> str:
    controller = startup_script(run, "controller-vm")
    encoded = re.search(r"^readonly WATCH_SCRIPT_B64=(\S+)$", controller, re.MULTILINE)
    return base64.b64decode(encoded.group(1)).decode()


@pytest.mark.parametrize(
    ("stack", "overrides"),
    [
        ("v2-usc1", None),
        ("v6e-euw4", None),
        ("v4-32-usc2", None),  # a slice
        ("v3-euw4", {"tpu-pretrain:tpuAutoRecover": True, "tpu-pretrain:tpuExternalIp": True}),
    ],
)
def test_rendered_watchdog_passes_shellcheck(stack, overrides, tmp_path):
    found = shellcheck(_watchdog_of(run_offline(stack, overrides)), tmp_path / "tpu-watch.sh")
    assert found == "", f"{stack}:\n{found}"


@pytest.fixture
def watch(stack_run, sandbox) -> Watch:
    return Watch(stack_run, sandbox)


def test_controller_installs_the_watchdog_once_and_removes_it_when_off(stack_run, sandbox):
    watch = Watch(stack_run, sandbox)
    unit_dir = sandbox.root / "etc/systemd/system"
    guard, service, timer = ((unit_dir / unit).read_text() for unit in WATCH_UNITS)
    assert "Type=oneshot\n" in service
    assert "ExecStart=/opt/tpu-pretrain/tpu-watch/tpu-watch.sh\n" in service
    assert f"Environment=PATH={sandbox.bin}:" in service  # where gcloud is
    # At shutdown a running tick stops first, then the guard's hook runs (network still up).
    assert "After=network-online.target tpu-pretrain-tpu-watch-guard.service\n" in service
    assert "ExecStop=/opt/tpu-pretrain/tpu-watch/tpu-watch.sh shutdown\n" in guard
    assert "RemainAfterExit=yes\n" in guard and "After=network-online.target\n" in guard
    assert "OnUnitActiveSec=2min\n" in timer and "WantedBy=timers.target" in timer
    assert "systemctl enable --quiet tpu-pretrain-tpu-watch.timer" in sandbox.calls
    assert "systemctl enable --quiet tpu-pretrain-tpu-watch-guard.service" in sandbox.calls
    # The TPU VM's startup script, byte for byte as Pulumi sets it.
    startup = (watch.dir / "tpu-startup.sh").read_bytes()
    assert startup == watch.vm.inputs["metadata"]["startup-script"].encode()
    assert (watch.dir / "tpu-watch.sh").read_text() == _watchdog_of(stack_run)
    assert stat.S_IMODE((watch.dir / "tpu-watch.sh").stat().st_mode) == 0o755

    again = sandbox.run(startup_script(stack_run, "controller-vm"))
    assert again.returncode == 0, again.stderr
    assert "systemctl daemon-reload" not in sandbox.calls
    assert f"installed {watch.dir}" not in again.stderr

    off = run_offline("v6e-euw4", {"tpu-pretrain:tpuAutoRecover": False})
    removed = sandbox.run(startup_script(off, "controller-vm"))
    assert removed.returncode == 0, removed.stderr
    assert "systemctl disable --now --quiet tpu-pretrain-tpu-watch.timer" in sandbox.calls
    assert "systemctl daemon-reload" in sandbox.calls
    assert not [p for p in unit_dir.iterdir() if p.name in WATCH_UNITS]
    assert not watch.dir.exists()


def test_a_ready_tpu_is_left_alone(watch):
    watch.set_state("READY")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    # The job pointer the bucket holds now, against the one the controller's loader ran.
    assert watch.box.calls[0] == (
        f"gcloud storage cp --quiet gs://{watch.bucket}/{render.POINTER_OBJECT} {watch.dir}/pointer"
    )
    bucket = f"gs://{watch.bucket}/runs/gpt2-small-clm"
    assert [c for c in watch.box.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {bucket}/bootstrap/tpu-watch-lease",
        f"gcloud storage ls {bucket}/export/export_complete.json",
    ]
    assert not [c for c in watch.box.calls if c.startswith("google_metadata_script_runner")]
    # READY: its hosts' boot state too (a failed boot: tests/infra/test_first_boot.py).
    assert watch.tpu_calls == ["describe", "qr-describe", "get-guest-attributes"]
    assert watch.creates() == [] and watch.creates("qr-create") == []
    assert watch.status["tpu_state"] == "READY" and watch.status["action"] == "none"
    assert_gcloud_flags_exist(watch)


def test_a_preempted_spot_tpu_waits_in_a_queued_resource_with_pulumis_settings(watch):
    """Spot: deleted, then queued (GA `queued-resources create --spot`) instead of a create
    that fails every tick without capacity; the queue creates the node under its name."""
    watch.set_state("PREEMPTED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    assert_gcloud_flags_exist(watch)
    (delete,) = [c for c in watch.box.calls if "tpu-vm delete" in c]
    vm = watch.vm.inputs
    assert delete == (
        f"gcloud compute tpus tpu-vm delete {vm['name']} --zone {vm['zone']} "
        f"--project {vm['project']} --quiet"
    )
    assert watch.creates() == []
    (argv,) = watch.creates("qr-create")
    positional, flags, switches = split_flags(argv)
    assert positional == ["compute", "tpus", "queued-resources", "create", watch.qr]
    assert flags["--node-id"] == vm["name"]
    assert flags["--zone"] == vm["zone"] == "europe-west4-a"
    assert flags["--project"] == vm["project"]
    assert flags["--accelerator-type"] == vm["acceleratorType"] == "v6e-8"
    assert flags["--runtime-version"] == vm["runtimeVersion"]
    assert flags["--network"] == vm["networkConfig"]["network"]
    assert flags["--subnetwork"] == vm["networkConfig"]["subnetwork"]
    assert flags["--service-account"] == vm["serviceAccount"]["email"]
    assert flags["--scopes"] == ",".join(vm["serviceAccount"]["scopes"])
    assert flags["--description"] == vm["description"]
    assert flags["--tags"] == ",".join(vm["tags"])
    assert flag_pairs(flags["--labels"]) == vm["labels"] | {"goog-pulumi-provisioned": "true"}
    metadata = dict(vm["metadata"])
    startup = metadata.pop("startup-script")
    assert flag_pairs(flags["--metadata"]) == metadata
    key, path = flags["--metadata-from-file"].split("=", 1)
    assert key == "startup-script" and Path(path).read_text() == startup
    # No external IP, spot, secure boot: as the V2Vm says.
    assert vm["networkConfig"]["enableExternalIps"] is False
    assert vm["schedulingConfig"] == {"preemptible": False, "spot": True}
    assert vm["shieldedInstanceConfig"] == {"enableSecureBoot": True}
    assert switches == {"--internal-ips", "--spot", "--shielded-secure-boot", "--async"}
    assert set(flags) == {
        "--zone", "--project", "--node-id", "--accelerator-type", "--runtime-version",
        "--network", "--subnetwork", "--service-account", "--scopes", "--description",
        "--tags", "--labels", "--metadata", "--metadata-from-file",
    }  # fmt: skip
    status = watch.status
    assert status["action"] == "queued" and status["queued_resource"] == watch.qr
    assert status["role"] == "tpu-watch" and status["job"] == "gpt2-small-clm"
    assert status["last_recreate_at"] and status["updated_at"]

    # No capacity yet: every tick waits, quietly (exit 0), nothing else is created.
    waiting = watch.tick()
    assert waiting.returncode == 0, waiting.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert (
        watch.status["action"] == "queued" and "WAITING_FOR_RESOURCES" in (watch.status["message"])
    )

    # Capacity: the queue created the node; the recovery is over.
    watch.set_state("READY", qr="ACTIVE")
    found = watch.tick()
    assert found.returncode == 0, found.stderr
    assert watch.status["action"] == "none" and not (watch.dir / "pending-create").exists()
    assert watch.qr_state == "ACTIVE"  # a queued resource with a node is kept

    # Preempted again at once: no second recreation within the minimum interval.
    watch.set_state("PREEMPTED", qr="ACTIVE")
    second = watch.tick()
    assert second.returncode == 0, second.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.status["tpu_state"] == "PREEMPTED" and watch.status["action"] == "waiting"
    assert "recreating again after 900s" in watch.status["message"]

    # Once the interval has passed: the queued resource and its VM go, the name is queued again.
    (watch.dir / "last-create").write_text("1000\n")
    third = watch.tick()
    assert third.returncode == 0, third.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "qr-create"]
    (qr_delete,) = [c for c in watch.box.calls if "queued-resources delete" in c]
    assert qr_delete.endswith(" --quiet --force")
    assert len(watch.creates("qr-create")) == 2 and watch.qr_state == "WAITING_FOR_RESOURCES"
    assert_gcloud_flags_exist(watch)


def test_terminated_is_recovered_too(watch):
    watch.set_state("TERMINATED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]


@pytest.mark.parametrize("dead", ["FAILED", "SUSPENDED"])
def test_failed_and_suspended_queued_resources_are_cleaned_up(watch, dead):
    # A VM that is running: the dead queued resource is only deleted (without --force).
    watch.set_state("READY", qr=dead)
    kept = watch.tick()
    assert kept.returncode == 0, kept.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "get-guest-attributes"]
    assert "--force" not in watch.tpu_commands()[-2]
    assert watch.qr_state is None and watch.status["action"] == "none"
    # A VM being recovered: the dead queue is deleted, then the name is queued again.
    (watch.dir / "pending-create").touch()
    watch.set_state(None, qr=dead)
    requeued = watch.tick()
    assert requeued.returncode == 0, requeued.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "qr-create"]
    assert watch.qr_state == "WAITING_FOR_RESOURCES"


def test_a_preempted_vm_beside_a_stale_queue_is_deleted_with_it(watch):
    """A queued resource that does not own the preempted VM (still waiting) is deleted, and
    so is the VM itself, before the name is queued again."""
    watch.set_state("PREEMPTED", qr="WAITING_FOR_RESOURCES")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "delete", "qr-create"]
    assert watch.qr_state == "WAITING_FOR_RESOURCES" and watch.status["action"] == "queued"


def test_a_vm_created_by_pulumi_meanwhile_cancels_the_queue(watch):
    """`pulumi up` (after a refresh) created the VM while the watchdog waited: the waiting
    queued resource is cancelled, without --force, and the recovery is over."""
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0
    watch.set_state("CREATING", qr="WAITING_FOR_RESOURCES")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete"]
    assert "--force" not in watch.tpu_commands()[-1]
    assert watch.status["action"] == "dequeued" and watch.qr_state is None
    assert not (watch.dir / "pending-create").exists()


def test_a_failed_queued_resource_create_is_retried_on_the_next_tick(watch):
    watch.set_state("PREEMPTED")
    error = "INVALID_ARGUMENT: runtime version not found"
    failed = watch.tick(QR_CREATE_ERROR=error)
    assert failed.returncode == 1
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    assert not [c for c in watch.box.calls if c.startswith("sleep")]
    status = watch.status
    assert status["action"] == "create-failed" and status["tpu_state"] == "MISSING"
    assert error in status["message"] and "next tick" in status["message"]
    assert status["last_recreate_at"] == ""  # nothing was requested: no interval applies

    retried = watch.tick()
    assert retried.returncode == 0, retried.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-create"]  # already deleted
    assert watch.status["action"] == "queued"


def test_a_preemptible_vm_without_capacity_waits_with_growing_intervals(sandbox):
    """gcloud's GA queued-resources create has no --preemptible: a preemptible VM is created
    directly (with every V2Vm setting), and a stockout is waited out, not failed."""
    watch = Watch(run_offline("v2-usc1"), sandbox)
    watch.set_state("PREEMPTED")
    stockout = "RESOURCE_EXHAUSTED: There is no more capacity in the zone us-central1-f"
    first = watch.tick(CREATE_ERROR=stockout)
    assert first.returncode == 0, first.stderr
    assert watch.tpu_calls == ["describe", "delete", "create"]  # no queued resource calls
    assert_gcloud_flags_exist(watch)
    assert watch.status["action"] == "waiting-capacity" and "240s" in watch.status["message"]
    _, delay = (watch.dir / "next-attempt").read_text().split()
    assert delay == "240"

    early = watch.tick(CREATE_ERROR=stockout)
    assert early.returncode == 0
    assert watch.tpu_calls == ["describe"]
    assert (
        watch.status["action"] == "waiting-capacity"
        and "next attempt in" in (watch.status["message"])
    )

    (watch.dir / "next-attempt").write_text("1000 240\n")  # the wait is over
    again = watch.tick(CREATE_ERROR=stockout)
    assert again.returncode == 0 and watch.tpu_calls == ["describe", "create"]
    assert (watch.dir / "next-attempt").read_text().split()[1] == "480"

    (watch.dir / "next-attempt").write_text("1000 2400\n")
    capped = watch.tick(CREATE_ERROR=stockout)
    assert capped.returncode == 0
    assert (watch.dir / "next-attempt").read_text().split()[1] == "3600"

    (watch.dir / "next-attempt").write_text("1000 3600\n")
    created = watch.tick()
    assert created.returncode == 0, created.stderr
    assert watch.status["action"] == "recreated"
    assert not (watch.dir / "next-attempt").exists()
    assert not (watch.dir / "pending-create").exists()
    (argv,) = {tuple(a) for a in watch.creates()}  # the same request every time
    _, flags, switches = split_flags(list(argv))
    assert switches == {"--internal-ips", "--preemptible"}  # v2: no secure boot
    assert flags["--version"] == watch.vm.inputs["runtimeVersion"]


def test_a_create_error_that_is_not_capacity_fails_the_tick(sandbox):
    watch = Watch(run_offline("v2-usc1"), sandbox)
    watch.set_state("PREEMPTED")
    failed = watch.tick(CREATE_ERROR="INVALID_ARGUMENT: bad runtime")
    assert failed.returncode == 1
    assert watch.status["action"] == "create-failed"
    assert not (watch.dir / "next-attempt").exists()


def test_a_vm_the_watchdog_did_not_delete_is_not_created(watch):
    watch.set_state(None)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.status["action"] == "none" and "run pulumi up" in watch.status["message"]


def test_a_permission_error_is_not_taken_for_a_missing_vm(watch):
    watch.set_state("PREEMPTED")
    denied = "PERMISSION_DENIED: Permission 'tpu.nodes.get' denied (or it may not be found)"
    result = watch.tick(DESCRIBE_ERROR=denied)
    assert result.returncode == 1
    assert watch.tpu_calls == ["describe"]
    assert watch.status["action"] == "describe-failed"


def test_a_tick_that_finds_the_lock_held_does_nothing(watch):
    watch.set_state("PREEMPTED")
    with (watch.dir / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.box.calls == []
    assert "another tick holds" in result.stderr


def test_a_failed_delete_creates_nothing_and_is_retried(watch):
    watch.set_state("PREEMPTED")
    failed = watch.tick(DELETE_ERROR="INTERNAL: backend error")
    assert failed.returncode == 1
    assert watch.tpu_calls == ["describe", "qr-describe", "delete"]
    assert watch.status["action"] == "delete-failed"
    assert "INTERNAL: backend error" in watch.status["message"]
    retried = watch.tick()
    assert retried.returncode == 0, retried.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]


def test_a_create_that_went_through_anyway_is_not_repeated(sandbox):
    watch = Watch(run_offline("v2-usc1"), sandbox)
    watch.set_state("PREEMPTED")
    assert watch.tick(CREATE_ERROR="DEADLINE_EXCEEDED: timed out").returncode == 1
    watch.set_state("CREATING")  # the operation went on server-side
    assert watch.tick().returncode == 0
    assert watch.status["action"] == "none"
    watch.set_state(None)  # deleted on purpose later: not recreated
    assert watch.tick().returncode == 0
    assert watch.tpu_calls == ["describe"]
    assert len(watch.creates()) == 1


@pytest.mark.parametrize("tpu_state", ["PREEMPTED", "READY", None])
def test_a_finished_job_is_never_recreated(watch, tpu_state):
    watch.export_marker.parent.mkdir(parents=True)
    watch.export_marker.write_text("{}")
    (watch.dir / "pending-create").touch()
    watch.set_state(tpu_state)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]  # nothing deleted, nothing created
    assert watch.status["action"] == "complete" and "not recreated" in watch.status["message"]
    assert not (watch.dir / "pending-create").exists()


def test_a_finished_job_cancels_a_waiting_queue(watch):
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0 and watch.qr_state == "WAITING_FOR_RESOURCES"
    watch.export_marker.parent.mkdir(parents=True)
    watch.export_marker.write_text("{}")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete"]
    assert watch.qr_state is None and watch.creates("qr-create") != []
    assert watch.status["action"] == "complete"


def test_release_when_done_deletes_the_finished_tpu(stack_run, sandbox):
    run = run_offline("v6e-euw4", {"tpu-pretrain:tpuReleaseWhenDone": True})
    watch = Watch(run, sandbox)
    watch.export_marker.parent.mkdir(parents=True)
    watch.export_marker.write_text("{}")
    watch.set_state("READY")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete"]
    (delete,) = [c for c in watch.box.calls if "tpu-vm delete" in c]
    assert delete.endswith(" --quiet --async")
    assert watch.status["action"] == "released"
    assert_gcloud_flags_exist(watch)
    # Released: a missing VM stays missing.
    again = watch.tick()
    assert again.returncode == 0 and watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.status["action"] == "complete"


def test_without_the_lease_the_watchdog_stands_down(watch):
    """`pulumi destroy` deletes the lease first: the queue is cancelled (with its node, which
    Pulumi deletes next anyway) and nothing is recreated, so no TPU outlives the stack."""
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0 and watch.qr_state == "WAITING_FOR_RESOURCES"
    watch.lease.unlink()
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["qr-describe", "qr-delete"]  # the TPU VM is not even looked at
    (qr_delete,) = [c for c in watch.box.calls if "queued-resources delete" in c]
    assert qr_delete.endswith(" --quiet --force --async")
    assert watch.qr_state is None and not (watch.dir / "pending-create").exists()
    assert watch.status["action"] == "stopped" and "being destroyed" in watch.status["message"]
    assert_gcloud_flags_exist(watch)
    # The VM is gone (Pulumi deleted it): still nothing is created.
    watch.set_state(None)
    assert watch.tick().returncode == 0
    assert watch.tpu_calls == ["qr-describe"] and watch.creates("qr-create") != []


def test_a_lease_that_cannot_be_read_changes_nothing(watch):
    watch.set_state("PREEMPTED")
    result = watch.tick(STORAGE_LS_ERROR="HTTPError 403: caller does not have storage.objects.list")
    assert result.returncode == 1
    assert watch.tpu_calls == []
    assert watch.status["action"] == "check-failed"


@pytest.mark.parametrize("lease", [True, False], ids=["reboot", "destroy"])
def test_the_shutdown_hook_cancels_the_queue_only_when_the_stack_goes(watch, lease):
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0 and watch.qr_state == "WAITING_FOR_RESOURCES"
    if not lease:
        watch.lease.unlink()
    result = watch.tick("shutdown")
    assert result.returncode == 0, result.stderr
    assert not [c for c in watch.box.calls if c.startswith("curl")]  # no re-run at shutdown
    if lease:
        assert watch.tpu_calls == [] and watch.qr_state == "WAITING_FOR_RESOURCES"
        assert (watch.dir / "pending-create").exists()
    else:
        assert watch.tpu_calls == ["qr-describe", "qr-delete", "describe"]
        assert watch.qr_state is None and watch.status["action"] == "stopped"


def test_at_destroy_the_shutdown_hook_waits_for_a_node_still_deleting(watch):
    """A tick's delete cut short by the shutdown goes on in the API: the hook waits until
    the node is gone, so that Pulumi's delete of the TPU VM finds NOT_FOUND (done)."""
    watch.set_state("DELETING")
    watch.lease.unlink()
    # The API finishes the delete while the hook sleeps (the stub runs on-sleep once).
    (watch.box.state / "on-sleep").write_text('rm -f "$STATE/tpu-state"\n')
    result = watch.tick("shutdown")
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["qr-describe", "describe", "describe"]
    assert [c for c in watch.box.calls if c.startswith("sleep")] == ["sleep 10"]
    assert "is DELETING; waiting for it to be gone" in result.stderr
    assert "still DELETING" not in result.stderr


def test_the_wait_for_a_deleting_node_is_bounded(watch):
    watch.set_state("DELETING")
    watch.lease.unlink()
    result = watch.tick("shutdown")
    assert result.returncode == 0, result.stderr
    assert [c for c in watch.box.calls if c.startswith("sleep")] == ["sleep 10"] * 6
    assert "still DELETING after 60s; pulumi destroy may have to be run again" in result.stderr


@pytest.mark.parametrize(
    ("stack", "overrides", "switches"),
    [
        ("v2-usc1", None, {"--internal-ips", "--preemptible"}),  # v2: no secure boot
        (
            "v3-euw4",
            {"tpu-pretrain:tpuAutoRecover": True, "tpu-pretrain:tpuExternalIp": True},
            {"--async"},  # on-demand, external IP: a queued resource without a tier flag
        ),
    ],
)
def test_recreation_flags_follow_the_stack(stack, overrides, switches, sandbox):
    watch = Watch(run_offline(stack, overrides), sandbox)
    watch.set_state("TERMINATED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    (argv,) = watch.creates() + watch.creates("qr-create")
    _, flags, found = split_flags(argv)
    assert found == switches
    assert flags["--accelerator-type"] == watch.vm.inputs["acceleratorType"]
    assert flag_pairs(flags["--labels"])["stack"] == stack
    assert_gcloud_flags_exist(watch)


@pytest.mark.parametrize(
    "overrides",
    [{"tpu-pretrain:tpuExternalIp": True}, {"tpu-pretrain:tpuAutoRecover": False}],
    ids=["settings-changed", "turned-off"],
)
def test_a_changed_controller_script_is_rerun_before_anything_else(watch, overrides):
    """`pulumi up` wrote a job pointer that names another controller script (the metadata
    still holds the same loader): the watchdog re-runs the startup script (installing the
    current watchdog, or removing it) instead of using stale settings."""
    watch.set_state("PREEMPTED")
    changed = run_offline("v6e-euw4", overrides)
    publish_startup(changed, watch.box)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert "google_metadata_script_runner startup" in watch.box.calls
    assert watch.tpu_calls == [] and watch.creates("qr-create") == []
    assert watch.status["action"] == "rerun-startup"


def test_without_the_pointer_or_a_working_rerun_it_uses_the_installed_settings(watch):
    pointer = watch.box.gcs / watch.bucket / render.POINTER_OBJECT
    kept = pointer.read_text()
    watch.set_state("PREEMPTED")
    pointer.unlink()
    unreachable = watch.tick()
    assert unreachable.returncode == 0, unreachable.stderr
    assert "cannot read the job pointer" in unreachable.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    pointer.write_text(kept)

    watch.set_state("PREEMPTED", qr=None)
    (watch.dir / "last-create").write_text("1000\n")
    changed = run_offline("v6e-euw4", {"tpu-pretrain:tpuExternalIp": True})
    publish_startup(changed, watch.box)
    failed_rerun = watch.tick(RUNNER_EXIT="1")
    assert failed_rerun.returncode == 0, failed_rerun.stderr
    assert "google_metadata_script_runner startup" in watch.box.calls
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    assert "--internal-ips" in watch.creates("qr-create")[-1]  # the installed (older) settings


def test_the_real_loader_in_metadata_leaves_the_tick_to_act(watch):
    """The controller's metadata is the program's loader (no WATCH_SCRIPT_B64 in it) and the
    pointer names the script the loader ran: the tick acts on the preempted TPU instead of
    re-running the startup script every time (what it did since the loader landed)."""
    assert "WATCH_SCRIPT_B64" not in (watch.box.state / "metadata").read_text()
    watch.set_state("PREEMPTED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert "google_metadata_script_runner startup" not in watch.box.calls
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]


def test_no_tick_runs_while_the_startup_script_does(watch):
    """At boot the timer's first tick can come while the guest agent's run of the startup
    script still installs: a tick that finds the loader's lock held does nothing, and a
    second run of the loader leaves the first to finish."""
    lock = watch.box.root / "opt/tpu-pretrain/loader/lock"
    watch.set_state("PREEMPTED")
    publish_startup(run_offline("v6e-euw4", {"tpu-pretrain:tpuExternalIp": True}), watch.box)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tick = watch.tick()
        assert tick.returncode == 0, tick.stderr
        assert "the controller's startup script is running" in tick.stderr
        assert watch.box.calls == []
        second = watch.box.run((watch.box.state / "metadata").read_text())
    assert second.returncode == 0, second.stderr
    assert "another run of the startup script holds" in second.stderr
    assert not any(c.startswith("gcloud storage cp") for c in watch.box.calls)
