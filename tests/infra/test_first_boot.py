"""A first boot never leaves a billing VM idle (templates/loader.sh, watch-common.sh): the
loader retries the pointer and what it names with backoff for at least LOADER_WAIT_SECONDS,
reads the pointer again when an object it named is gone, then leaves its failure in the VM's
guest attribute, where the controller's watchdog reads it without the bucket and deletes the
TPU VM or stops the GPU VM. Every wait is the sandbox's `sleep` stub: nothing sleeps."""

from __future__ import annotations

import hashlib
import json
import shlex

import pytest
from gcloud_flags import problems
from harness import run_offline
from script_sandbox import (
    GpuWatch,
    Sandbox,
    Watch,
    loader_script,
    pointer_of,
    publish_payload,
    publish_startup,
)

from infra.render import render

BOOT = "tpu-pretrain/boot"


def _sleeps(box: Sandbox) -> list[int]:
    return [int(c.split()[1]) for c in box.calls if c.startswith("sleep ")]


def _boot_state(box: Sandbox) -> str:
    return (box.state / "guest-attributes" / BOOT).read_text()


def test_a_pointer_unreadable_for_a_while_then_readable_boots(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    bucket = publish_startup(stack_run, sandbox)
    result = sandbox.run(
        loader_script(stack_run, "tpu-vm"), FAIL_FIRST_DOWNLOADS="4", FAIL_MATCH="jobs/current.json"
    )
    assert result.returncode == 0, result.stderr
    assert _sleeps(sandbox)[:4] == [5, 10, 20, 40]  # doubling waits, then the pointer came
    assert f"cannot read the job pointer gs://{bucket}/jobs/current.json (waited 35s of 600s)" in (
        result.stderr
    )
    assert _boot_state(sandbox) == "ok"
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "started"


def test_a_pointer_unreadable_throughout_fails_where_the_watchdog_reads_it(stack_run, sandbox):
    result = sandbox.run(loader_script(stack_run, "tpu-vm"))
    assert result.returncode == 1
    waits = _sleeps(sandbox)
    # At least the documented wait, in growing steps of at most a minute.
    assert sum(waits) >= render.LOADER_WAIT_SECONDS >= 600
    assert waits[:5] == [5, 10, 20, 40, 60] and max(waits) == 60
    assert sum(waits[:-1]) < render.LOADER_WAIT_SECONDS  # no wait after the budget is spent
    state = _boot_state(sandbox)
    assert state.startswith("failed ")
    epoch, message = state.split(" ", 2)[1:]
    assert epoch.isdigit()
    assert message.startswith("cannot read the job pointer gs://")
    assert message.endswith(
        f"after {sum(waits)}s of retries (pulumi up writes it; the VM's account reads the bucket)"
    )
    # One line on the console and the journal, and the whole boot again later.
    assert f"tpu-pretrain[tpu loader]: {message}" in result.stderr.splitlines()
    assert any(
        c.startswith("systemd-run --unit=tpu-pretrain-startup-rerun-") for c in sandbox.calls
    )

    # The controller's watchdog reads it and deletes the TPU VM, which bills while idle.
    watch = Watch(stack_run, sandbox)
    watch.set_state("READY")
    tick = watch.tick()
    assert tick.returncode == 0, tick.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "get-guest-attributes", "delete"]
    assert watch.status["action"] == "boot-failed"
    assert message in watch.status["message"] and "pulumi up --replace" in watch.status["message"]
    assert "worker 0: " in watch.status["message"]
    bad = {c: problems(shlex.split(c)) for c in watch.tpu_commands() if problems(shlex.split(c))}
    assert bad == {}
    # It is not recreated: the status keeps saying why until the VM exists again.
    again = watch.tick()
    assert again.returncode == 0, again.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.creates() == [] and watch.creates("qr-create") == []
    assert watch.status["action"] == "boot-failed" and message in watch.status["message"]
    # `pulumi up --replace` creates it again: a new VM, a new boot, nothing left to act on.
    (sandbox.state / "guest-attributes" / BOOT).write_text("loading")
    watch.set_state("READY")
    assert watch.tick().returncode == 0
    assert watch.status["action"] == "none"


def test_a_slice_host_that_fails_deletes_the_whole_node(stack_run, sandbox):
    watch = Watch(stack_run, sandbox)
    watch.set_state("READY")
    for worker, value in (("", "ok"), ("-1", "ok"), ("-2", "failed 1700000000 no pointer")):
        path = sandbox.state / f"guest-attributes{worker}" / BOOT
        path.parent.mkdir(parents=True)
        path.write_text(value)
    assert watch.tick().returncode == 0
    assert watch.tpu_calls[-1] == "delete"
    assert "(worker 2: no pointer)" in watch.status["message"]


def test_a_healthy_or_unreadable_boot_state_changes_nothing(stack_run, sandbox):
    watch = Watch(stack_run, sandbox)
    watch.set_state("READY")
    path = sandbox.state / "guest-attributes" / BOOT
    path.parent.mkdir(parents=True)
    for value in ("loading", "ok", "failed soon"):  # the last one is not the loader's format
        path.write_text(value)
        assert watch.tick().returncode == 0
        assert watch.tpu_calls == ["describe", "qr-describe", "get-guest-attributes"]
        assert watch.status["action"] == "none"


def test_an_object_gone_mid_boot_makes_the_loader_read_the_pointer_again(stack_run, sandbox):
    """`pulumi up` switched the pointer while the VM booted: the script the old pointer named
    is gone (deleted by hand; `pulumi up` itself keeps it). The loader reads the pointer
    again and runs what the new one names."""
    publish_payload(stack_run, sandbox)
    bucket = publish_startup(stack_run, sandbox)
    old = pointer_of(stack_run)
    (sandbox.gcs / bucket / old["script_tpu"]).unlink()
    newer = (
        next(r for r in stack_run.resources if r.name == "startup-tpu-script").inputs["content"]
        + "# the next deploy\n"
    )
    digest = hashlib.sha256(newer.encode()).hexdigest()
    name = f"startup/tpu-{digest[:16]}.sh"
    (sandbox.gcs / bucket / name).write_text(newer)
    switched = sandbox.state / "next-pointer.json"
    switched.write_text(
        json.dumps(
            old | {"script_tpu": name, "script_tpu_sha256": digest}, indent=2, sort_keys=True
        )
        + "\n"
    )
    (sandbox.state / "on-sleep").write_text(
        f"cp {switched} {sandbox.gcs / bucket / render.POINTER_OBJECT}\n"
    )
    result = sandbox.run(loader_script(stack_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    assert f"cannot read the startup script gs://{bucket}/{old['script_tpu']}" in result.stderr
    assert _sleeps(sandbox) == [5]
    assert f"startup script {name}" in result.stderr
    ran = (sandbox.root / "opt/tpu-pretrain/loader/tpu-startup.sh").read_text()
    assert ran.endswith("# the next deploy\n")
    assert _boot_state(sandbox) == "ok"


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        (
            "script_tpu",
            "runs/gpt2-small-clm/evil.sh",
            "the startup script runs/gpt2-small-clm/evil.sh",
        ),
        ("script_tpu", "startup/../runs/evil.sh", "the startup script startup/../runs/evil.sh"),
        ("payload_object", "corpus/payload.tar.gz", "the payload archive corpus/payload.tar.gz"),
    ],
)
def test_a_pointer_naming_objects_outside_the_deploy_prefixes_is_refused(
    stack_run,
    sandbox,
    key,
    value,
    what,
):
    publish_payload(stack_run, sandbox)
    bucket = publish_startup(stack_run, sandbox)
    path = sandbox.gcs / bucket / render.POINTER_OBJECT
    path.write_text(
        json.dumps(pointer_of(stack_run) | {key: value}, indent=2, sort_keys=True) + "\n"
    )
    result = sandbox.run(loader_script(stack_run, "tpu-vm"))
    assert result.returncode == 1
    line = (
        f"the job pointer gs://{bucket}/jobs/current.json names {what}, not an object under "
        f"{'startup' if key == 'script_tpu' else 'payload'}/ (only the deploy identity "
        "writes there): refusing to run it"
    )
    assert line in result.stderr
    assert _sleeps(sandbox) == []  # no retry: the pointer is wrong, not late
    assert not [c for c in sandbox.calls if value in c and c.startswith("gcloud storage cp")]
    assert _boot_state(sandbox).endswith(line)


def test_a_run_root_outside_runs_is_refused(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    bucket = publish_startup(stack_run, sandbox)
    path = sandbox.gcs / bucket / render.POINTER_OBJECT
    pointer = pointer_of(stack_run) | {"run_root": f"gs://{bucket}/startup"}
    path.write_text(json.dumps(pointer, indent=2, sort_keys=True) + "\n")
    result = sandbox.run(loader_script(stack_run, "tpu-vm"))
    assert result.returncode == 1
    assert f"names the run root gs://{bucket}/startup, not gs://{bucket}/runs/" in result.stderr
    assert not (sandbox.gcs / bucket / "startup/bootstrap").exists()  # no status written there


def test_the_gpu_watchdog_stops_a_vm_whose_boot_failed_and_does_not_start_it(gpu_run, sandbox):
    loader = loader_script(gpu_run, "gpu-vm")
    assert sandbox.run(loader, TPU_PRETRAIN_BOOT_WAIT_SECONDS="30").returncode == 1
    failed = _boot_state(sandbox)
    watch = GpuWatch(gpu_run, sandbox)
    watch.set_state("RUNNING")
    tick = watch.tick()
    assert tick.returncode == 0, tick.stderr
    assert watch.verbs == ["describe", "get-guest-attributes", "stop"]
    assert watch.state == "TERMINATED"
    assert watch.status["action"] == "boot-failed"
    assert failed.split(" ", 2)[2] in watch.status["message"]
    assert "gpuRecovery.start" in watch.status["message"]
    bad = {c: problems(shlex.split(c)) for c in watch.vm_calls if problems(shlex.split(c))}
    assert bad == {}
    # Stopped for its failed boot: never started again by the watchdog.
    assert watch.tick().returncode == 0
    assert watch.verbs == ["describe"] and watch.status["action"] == "boot-failed"
    # Started by hand: the old failure (still in its attributes) is not acted on again...
    watch.set_state("RUNNING")
    assert watch.tick().returncode == 0
    assert watch.verbs == ["describe", "get-guest-attributes"]
    assert watch.status["action"] == "none"
    # ... a new one is, and a preemption after a good boot is recovered as before.
    (sandbox.state / "guest-attributes" / BOOT).write_text("failed 1999999999 again")
    assert watch.tick().returncode == 0
    assert watch.verbs[-1] == "stop" and "(again)" in watch.status["message"]
    (sandbox.state / "guest-attributes" / BOOT).write_text("ok")
    watch.set_state("RUNNING")
    assert watch.tick().returncode == 0
    watch.set_state("TERMINATED")
    assert watch.tick().returncode == 0
    assert watch.verbs[-1] == "start"


def test_a_failed_stop_is_reported_and_retried(gpu_run, sandbox):
    watch = GpuWatch(gpu_run, sandbox)
    path = sandbox.state / "guest-attributes" / BOOT
    path.parent.mkdir(parents=True)
    path.write_text("failed 1700000000 no pointer")
    watch.set_state("RUNNING")
    result = watch.tick(STOP_ERROR="Required 'compute.instances.stop' permission")
    assert result.returncode == 1
    assert watch.status["action"] == "stop-failed"
    assert "compute.instances.stop" in watch.status["message"]
    assert watch.tick().returncode == 0
    assert watch.verbs[-1] == "stop" and watch.status["action"] == "boot-failed"


def test_objects_a_pointer_may_name_are_never_deleted_by_pulumi_up():
    """Replaced or dropped objects leave the state, not the bucket: a VM that read the
    previous pointer still finds what it names."""
    run = run_offline("v6e-euw4")
    objects = [r for r in run.resources if r.type_ == "gcp:storage/bucketObject:BucketObject"]
    delivered = [r for r in objects if r.name.startswith(("payload-", "startup-"))]
    assert {r.inputs["name"].split("/")[0] for r in delivered} == {"payload", "startup", "jobs"}
    assert all(r.options["retainOnDelete"] is True for r in delivered)
