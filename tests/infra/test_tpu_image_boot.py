"""First boot on a real TPU image: retries, old SDKs, the wheelhouse.

The TPU VM's rendered startup script in the script sandbox (script_sandbox.py) against what a
real image brings: a held dpkg lock, installs that fail (retried as a whole, then a status
and the next re-run timer), an SDK without `gcloud storage`, the controller's wheelhouse, an
old Python, and every step mirrored to the serial console and the journal."""

from __future__ import annotations

import re
import shutil
import subprocess

from harness import startup_script
from script_sandbox import (
    Sandbox,
    bootstrap_status,
    publish_payload,
    run_helper,
    short_sha,
)


def test_apt_waits_for_the_dpkg_lock_and_is_retried(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    (sandbox.bin / "python3").write_text(
        (sandbox.bin / "python3")
        .read_text()
        .replace(
            'echo "python3 $*" >>"$CALLS"',
            'echo "python3 $*" >>"$CALLS"\n'
            'if [ "$2" = "import ensurepip" ] && [ ! -f "$STATE/venv-pkg" ]; then exit 1; fi',
        )
    )
    (sandbox.bin / "apt-get").write_text(
        (sandbox.bin / "apt-get").read_text() + '\ncase " $* " in *" python3-venv "*) '
        'touch "$STATE/venv-pkg" ;; esac\n'
    )
    result = sandbox.run(startup_script(stack_run, "tpu-vm"), FAIL_FIRST_APT="2")
    assert result.returncode == 0, result.stderr
    apt = [c for c in sandbox.calls if c.startswith("apt-get")]
    lock = "apt-get -o DPkg::Lock::Timeout=600 -q"
    assert apt == [f"{lock} update"] * 3 + [f"{lock} install -y python3-venv"]
    assert [c for c in sandbox.calls if c.startswith("sleep")] == ["sleep 15", "sleep 15"]
    assert "apt-get update failed (attempt 1/4); retrying in 15s" in result.stderr


def test_a_failed_install_is_retried_as_a_whole(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    script = startup_script(stack_run, "tpu-vm")
    result = sandbox.run(script, FAIL_FIRST_PIP="1", TPU_PRETRAIN_INSTALL_ATTEMPTS="3")
    assert result.returncode == 0, result.stderr
    assert "payload install attempt 1 failed (exit 1); retrying the whole install in 30s" in (
        result.stderr
    )
    assert "sleep 30" in sandbox.calls
    # The whole unit again: download, unpack, a fresh venv, every pip step.
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "/payload/" in c]
    assert len(downloads) == 2
    assert len([c for c in sandbox.calls if c.startswith("python3 -m venv")]) == 2
    assert len([c for c in sandbox.calls if c.startswith("pip ")]) == 1 + 3
    assert (
        sandbox.root / f"opt/tpu-pretrain/venv-{short_sha(script)}/.tpu-pretrain-installed"
    ).exists()
    assert bootstrap_status(sandbox, bucket)["state"] == "started"


def test_an_install_that_keeps_failing_stops_with_a_status(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    result = sandbox.run(
        startup_script(stack_run, "tpu-vm"), FAIL_FIRST_PIP="9", TPU_PRETRAIN_INSTALL_ATTEMPTS="2"
    )
    assert result.returncode == 1
    assert [c for c in sandbox.calls if c.startswith("sleep")] == ["sleep 30"]
    status = bootstrap_status(sandbox, bucket)
    assert status["state"] == "failed"
    assert status["message"] == (
        "payload install failed 2 times (last exit 1); see journalctl -t tpu-pretrain; "
        "the startup script runs again in 30 min"
    )
    assert not list((sandbox.root / "opt/tpu-pretrain").glob("venv*"))
    # Not left idle: a transient timer runs the startup script again.
    (rerun,) = [c for c in sandbox.calls if c.startswith("systemd-run")]
    assert re.fullmatch(
        r"systemd-run --unit=tpu-pretrain-startup-rerun-\d{8}T\d{6}Z-\d+ --collect "
        r"--timer-property=RemainAfterElapse=no --on-active=30min "
        + re.escape(f"{sandbox.bin}/google_metadata_script_runner startup"),
        rerun,
    )
    assert _loaded_units(sandbox) == {
        f"{_pending_rerun(sandbox)}.timer": "waiting remain=0",
        f"{_pending_rerun(sandbox)}.service": "inactive collect=1",
    }


def _loaded_units(box: Sandbox) -> dict[str, str]:
    units = box.state / "units"
    return {
        p.name: p.read_text().strip()
        for p in (units.iterdir() if units.is_dir() else ())
        if p.suffix in (".timer", ".service")
    }


def _pending_rerun(box: Sandbox) -> str:
    (timer,) = [u for u, state in _loaded_units(box).items() if state.startswith("waiting")]
    return timer.removesuffix(".timer")


def _elapse_rerun_timer(box: Sandbox, script: str, **extra: str) -> subprocess.CompletedProcess:
    """What systemd does when the pending re-run timer elapses: its service starts and runs
    the guest agent's runner, i.e. the startup script (while the service is loaded and
    active); when it ends, a --collect service is unloaded (a failed one otherwise stays
    loaded until reset-failed), and a RemainAfterElapse=no timer with it (systemd-run(1),
    systemd.timer(5))."""
    unit = _pending_rerun(box)
    units = box.state / "units"
    timer, service = units / f"{unit}.timer", units / f"{unit}.service"
    assert (units / f"{unit}.service.cmd").read_text().split()[-2:] == [
        f"{box.bin}/google_metadata_script_runner",
        "startup",
    ]
    timer.write_text(timer.read_text().replace("waiting", "elapsed", 1))
    collect = service.read_text().split()[1] == "collect=1"
    service.write_text(f"active collect={int(collect)}")
    result = box.run(script, **extra)
    if result.returncode == 0 or collect:
        service.unlink()
        # Unloaded with it; or already, if the script stopped it.
        if timer.exists() and "remain=0" in timer.read_text():
            timer.unlink()
    else:
        service.write_text("failed collect=0")
    return result


def test_the_sandbox_refuses_a_transient_unit_name_that_is_still_loaded(sandbox):
    """The old fixed re-run name, as systemd treats it: a second systemd-run of the same
    --unit while the first one's service is loaded (here: running) is refused."""
    run = ["systemd-run", "--unit=tpu-pretrain-startup-rerun", "--on-active=30min", "true"]
    env = sandbox.env()
    assert subprocess.run(run, env=env, check=False).returncode == 0
    units = sandbox.state / "units"
    (units / "tpu-pretrain-startup-rerun.service").write_text("active collect=0")
    stop = ["systemctl", "stop", "tpu-pretrain-startup-rerun*.timer"]
    subprocess.run(stop, env=env, check=True)
    assert _loaded_units(sandbox) == {"tpu-pretrain-startup-rerun.service": "active collect=0"}
    again = subprocess.run(run, env=env, check=False, capture_output=True, text=True)
    assert again.returncode == 1
    assert "Unit tpu-pretrain-startup-rerun.service was already loaded" in again.stderr


def test_every_failed_startup_schedules_the_next_rerun(stack_run, sandbox):
    """A re-run that fails again runs inside the previous re-run's (still loaded) service:
    it must still schedule the next one, every time, until an install succeeds."""
    bucket, _ = publish_payload(stack_run, sandbox)
    script = startup_script(stack_run, "tpu-vm")
    assert sandbox.run(script, FAIL_FIRST_PIP="99").returncode == 1
    first = _pending_rerun(sandbox)
    seen = [first]
    for _ in range(2):
        failed = _elapse_rerun_timer(sandbox, script, FAIL_FIRST_PIP="99")
        assert failed.returncode == 1
        assert "could not schedule" not in failed.stderr, failed.stderr
        assert bootstrap_status(sandbox, bucket)["state"] == "failed"
        # The elapsed timer and the running service are still loaded, the next one waits.
        seen.append(_pending_rerun(sandbox))
        assert seen[-1] not in seen[:-1]
    done = _elapse_rerun_timer(sandbox, script, FAIL_FIRST_PIP="0")
    assert done.returncode == 0, done.stderr
    assert bootstrap_status(sandbox, bucket)["state"] == "started"
    # Nothing left loaded: no failed units pile up, no re-run pending.
    assert _loaded_units(sandbox) == {}


def test_an_old_sdk_without_gcloud_storage_uses_gsutil(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    result = sandbox.run(startup_script(stack_run, "tpu-vm"), NO_GCLOUD_STORAGE="1")
    assert result.returncode == 0, result.stderr
    assert "this gcloud has no 'storage' command (an old SDK): using gsutil" in result.stderr
    gsutil = [c for c in sandbox.calls if c.startswith("gsutil")]
    assert any(c.startswith("gsutil -q -m cp gs://") and "/payload/" in c for c in gsutil)
    assert any(c.startswith("gsutil ls gs://") and "/wheelhouse/" in c for c in gsutil)
    assert not [c for c in sandbox.calls if c.startswith("gcloud storage c")]
    assert bootstrap_status(sandbox, bucket)["state"] == "started"
    # The unit's helper uses the same wrapper: the manifest wait works with gsutil too.
    manifest = sandbox.gcs / bucket / "runs/gpt2-small-clm/data/manifest.json"
    waited = run_helper(
        sandbox, "wait-manifest", NO_GCLOUD_STORAGE="1", CREATE_ON_SLEEP=str(manifest)
    )
    assert waited.returncode == 0, waited.stderr
    assert [c for c in sandbox.calls if c.startswith("gsutil ls")] == [
        f"gsutil ls gs://{bucket}/runs/gpt2-small-clm/data/manifest.json"
    ] * 2


def test_the_tpu_vm_installs_from_the_controllers_wheelhouse(stack_run, sandbox, tmp_path):
    bucket, _ = publish_payload(stack_run, sandbox)
    controller = sandbox.run(startup_script(stack_run, "controller-vm"))
    assert controller.returncode == 0, controller.stderr
    (wheelhouse,) = (sandbox.gcs / bucket / "wheelhouse").iterdir()
    built = sorted(p.name for p in wheelhouse.glob("*.whl"))
    shutil.rmtree(sandbox.root / "opt")  # the TPU VM is another machine; the bucket stays

    seen = tmp_path / "seen.txt"
    tpu = sandbox.run(startup_script(stack_run, "tpu-vm"), WHEELHOUSE_SEEN=str(seen))
    assert tpu.returncode == 0, tpu.stderr
    assert f"wheelhouse {wheelhouse.name}: 2 wheels downloaded" in tpu.stderr, tpu.stderr
    pip_calls = [c for c in sandbox.calls if c.startswith("pip ")]
    assert re.fullmatch(
        r"pip install --quiet --no-index --find-links \S+/wheels -r \S+", pip_calls[0]
    )
    assert re.fullmatch(
        r"pip install --quiet --no-index --find-links \S+/wheels --no-deps tf_keras==2\.19\.0",
        pip_calls[1],
    )
    assert pip_calls[2].startswith("pip install --quiet --no-deps ")  # the payload
    assert sorted(seen.read_text().split()) == built
    assert "installed from the wheelhouse" in tpu.stderr


def test_an_incomplete_wheelhouse_falls_back_to_the_index(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    assert sandbox.run(startup_script(stack_run, "controller-vm")).returncode == 0
    shutil.rmtree(sandbox.root / "opt")
    # pip cannot resolve offline (a wheel is missing): fail the first (offline) pip call.
    result = sandbox.run(startup_script(stack_run, "tpu-vm"), FAIL_FIRST_PIP="1")
    assert result.returncode == 0, result.stderr
    assert "wheelhouse incomplete; installing from the package index" in result.stderr
    pip_calls = [c for c in sandbox.calls if c.startswith("pip ")]
    assert "--no-index" in pip_calls[0]
    assert re.fullmatch(r"pip install --quiet -r \S+", pip_calls[1])
    assert pip_calls[2] == "pip install --quiet --no-deps tf_keras==2.19.0"


def test_an_image_with_an_old_python_is_refused_on_the_vm(stack_run, sandbox):
    bucket, _ = publish_payload(stack_run, sandbox)
    result = sandbox.run(startup_script(stack_run, "tpu-vm"), STUB_PYTHON_VERSION="3.8")
    assert result.returncode == 1
    assert not [c for c in sandbox.calls if c.startswith(("pip ", "python3 -m venv"))]
    assert bootstrap_status(sandbox, bucket)["message"] == (
        "python3 is 3.8 on runtime v2-alpha-tpuv6e; the payload needs Python >= 3.10 "
        "(use an image from infra/catalogs/tpu.yaml)"
    )


def test_steps_are_mirrored_to_the_serial_console_and_the_journal(stack_run, sandbox):
    publish_payload(stack_run, sandbox)
    console = sandbox.root / "dev/console"
    console.parent.mkdir()
    console.write_text("")
    assert sandbox.run(startup_script(stack_run, "tpu-vm")).returncode == 0
    lines = console.read_text().splitlines()
    steps = [line for line in lines if "step " in line]
    assert steps[0].startswith("tpu-pretrain[tpu]: step 1/4: checks (runtime v2-alpha-tpuv6e")
    assert [line.split(":")[1] for line in steps] == [
        " step 1/4",
        " step 2/4",
        " step 3/4",
        " step 4/4",
    ]
    journal = (sandbox.state / "journal").read_text().splitlines()
    assert "logger -t tpu-pretrain -- [tpu] step 4/4: start" in journal
