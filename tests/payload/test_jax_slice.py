"""A slice that agrees, stops or fails together, from its first second: two JAX processes on
127.0.0.1 (one CPU device each, `jax.distributed`), each the real `tpu-payload train` as a
slice worker runs it (test_jax_hosts.py's workers).

- hosts that see different device memory plan the same mesh (the smallest memory decides;
  backends/jax/runtime.py MEMORY_ENV injects a per-process figure, since CPU devices report
  none);
- SIGTERM while both are starting (after their runtime line, before training): both exit 143
  at once, nothing written (JAX's preemption service would otherwise swallow it);
- a user error on ONE host, outside the agreed start checks: every host exits 2 with the
  same one line (systemd's RestartPreventExitStatus=2 stops each unit: no restart loop).

Nothing depends on the machine's speed: the signal lands while both provably wait at a pause
(train_helpers.PausedCli), the error is injected at a fixed call (error_driver.py), and every
wait is bounded by a guard only a hung process reaches.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _free_port
from test_jax_hosts import _errors, _job, _Worker, _worker_env, prepared  # noqa: F401
from test_jax_multihost import HANG_GUARD_S, _env
from train_helpers import PausedCli

from payload import training
from payload.evaluate import micro_batch_count

pytestmark = pytest.mark.slow
SIGTERM_EXIT = 128 + signal.SIGTERM
ERROR_DRIVER = Path(__file__).parent / "error_driver.py"


def test_hosts_that_see_different_memory_plan_the_same_mesh(prepared, tmp_path) -> None:  # noqa: F811
    job = _job(prepared, tmp_path, steps=8, sharding="auto")
    port = _free_port()
    # Process 0 sees a large chip, process 1 a small one: alone, 0 would plan data
    # parallelism and 1 FSDP, compile different programs and hang in the first collective.
    memory = {0: str(64 * 2**30), 1: str(2**20)}
    workers = [
        _Worker(
            tmp_path / "job.yaml",
            tmp_path / "logs",
            port,
            w,
            TPU_PAYLOAD_TEST_DEVICE_MEMORY=memory[w],
        )
        for w in (0, 1)
    ]
    try:
        results = [w.finish() for w in workers]
    finally:
        for w in workers:
            w.kill()
    for code, err in results:
        assert code == 0, err[-3000:]
        assert '"mesh": {"sharding": "fsdp", "data": 1, "fsdp": 2}' in err, err[-3000:]
        assert "the smallest of 2 processes" in err, err[-3000:]
    assert training.is_complete(job)


def test_sigterm_while_both_start_stops_both_at_once(prepared, tmp_path) -> None:  # noqa: F811
    job = _job(prepared, tmp_path, steps=5000)
    port = _free_port()
    point = "after:payload.status:StatusWriter.note_runtime:1"
    train = ("train", "--job", str(tmp_path / "job.yaml"))
    with (
        PausedCli(tmp_path / "logs-0", point, *train, env=_worker_env(port, 0)) as chief,
        PausedCli(tmp_path / "logs-1", point, *train, env=_worker_env(port, 1)) as other,
    ):
        # Both joined the slice and logged their runtime line; neither trains yet.
        assert chief.wait_paused() == f"paused at {point}"
        assert other.wait_paused() == f"paused at {point}"
        chief.signal(signal.SIGTERM)
        other.signal(signal.SIGTERM)
        results = [chief.finish(), other.finish()]
    for code, _, err in results:
        assert code == SIGTERM_EXIT, err[-3000:]
        assert "train: {" in err, err[-3000:]  # the runtime line came first
        assert f"stopped by signal {int(signal.SIGTERM)} outside the training loop" in err
        assert "Traceback" not in err, err[-3000:]
    assert not Path(job.paths.checkpoints).exists() or not any(
        p.name.isdigit() for p in Path(job.paths.checkpoints).iterdir()
    )
    assert not training.is_complete(job)


def test_a_user_error_on_one_host_ends_every_host_once(prepared, tmp_path) -> None:  # noqa: F811
    _job(prepared, tmp_path, steps=5000)
    port = _free_port()
    chief = _Worker(tmp_path / "job.yaml", tmp_path / "logs", port, 0)
    message = "injected: a user error only process 1 sees"
    err_path = tmp_path / "logs" / "1.err"
    with err_path.open("w") as err:
        other = subprocess.Popen(
            [
                sys.executable,
                str(ERROR_DRIVER),
                "payload.model:config_for:1",
                message,
                "train",
                "--job",
                str(tmp_path / "job.yaml"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=_worker_env(port, 1),
            start_new_session=True,
        )
    try:
        code1 = other.wait(timeout=HANG_GUARD_S)
        code0, err0 = chief.finish()
    finally:
        chief.kill()
        if other.poll() is None:
            other.kill()
    err1 = err_path.read_text()
    lines = []
    for code, err in ((code0, err0), (code1, err1)):
        assert code == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert len(_errors(err)) == 1, err[-3000:]
        lines += _errors(err)
    assert lines[0] == lines[1] == f"error: {message}", lines


# ------------------------------------------------------------- one process, a TPU's rules


def _train(job_file: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = _env(**env)
    environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' shared cache (conftest.py)
    return subprocess.run(
        [sys.executable, "-m", "payload", "train", "--job", str(job_file), *extra],
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=False, env=environ,
    )  # fmt: skip


def _cache_counts(stderr: str) -> tuple[str, int, int]:
    found = re.search(r"compilation cache (\S+): (\d+) programs loaded, (\d+) compiled", stderr)
    assert found, stderr[-3000:]
    return found.group(1), int(found.group(2)), int(found.group(3))


def test_a_restart_loads_its_programs_and_a_changed_job_compiles(prepared, tmp_path) -> None:  # noqa: F811
    """JAX's persistent compilation cache in the job's output: the same job again (`--force`,
    as a restart would) loads every program it compiled; a job with another batch compiles."""
    job = _job(prepared, tmp_path / "same", steps=8)
    every = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # tiny programs: cache all
    first = _train(tmp_path / "same" / "job.yaml", **every)
    assert first.returncode == 0, first.stderr[-3000:]
    directory, loaded, compiled = _cache_counts(first.stderr)
    assert directory == f"{job.output}/compilation-cache" and compiled > 0 and loaded == 0
    again = _train(tmp_path / "same" / "job.yaml", "--force", **every)
    assert again.returncode == 0, again.stderr[-3000:]
    _, loaded, compiled_again = _cache_counts(again.stderr)
    assert compiled_again == 0 and loaded >= compiled, again.stderr[-3000:]

    changed = _job(prepared, tmp_path / "changed", steps=8, global_batch_size=8)
    shutil.copytree(directory, f"{changed.output}/compilation-cache")
    other = _train(tmp_path / "changed" / "job.yaml", **every)
    assert other.returncode == 0, other.stderr[-3000:]
    assert _cache_counts(other.stderr)[2] > 0  # another batch: other programs


def test_chunks_bounded_in_seconds_stop_one_chunk_after_the_signal(prepared, tmp_path) -> None:  # noqa: F811
    """runtime.CHUNK_SECONDS on a TPU/GPU (here set through CHUNK_SECONDS_ENV): once a step's
    time is measured (after two chunks of 8), a chunk holds what fits the bound (here 1 step),
    so a SIGTERM during step 40's log line saves step 41 (the chunk dispatched before it),
    not step 48 as 8-step chunks would."""
    job = _job(prepared, tmp_path, steps=5000, log_every=1)
    point = "after:payload.training:Meter.log:40"
    env = _env(TPU_PAYLOAD_CHUNK_SECONDS="1e-9")
    with PausedCli(
        tmp_path / "logs", point, "train", "--job", str(tmp_path / "job.yaml"), env=env
    ) as run:
        assert run.wait_paused() == f"paused at {point}"
        run.signal(signal.SIGTERM)
        code, _, err = run.finish()
    assert code == SIGTERM_EXIT, err[-3000:]
    assert f"stopped by signal {int(signal.SIGTERM)} at step 41;" in err, err[-3000:]
    assert sorted(
        int(p.name) for p in Path(job.paths.checkpoints).iterdir() if p.name.isdigit()
    ) == [41]


def test_evaluation_micro_batches_never_exceed_training_rows() -> None:
    assert micro_batch_count(16, 16) == 1
    assert micro_batch_count(16, 2) == 8  # grad_accum_steps 8: 2 rows per device per pass
    assert micro_batch_count(12, 5) == 3  # 12 rows, at most 5 at once: 3 passes of 4
    assert micro_batch_count(7, 2) == 7  # a prime: one row at a time
    assert micro_batch_count(3, 8) == 1
