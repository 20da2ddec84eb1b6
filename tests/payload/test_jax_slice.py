"""A slice that agrees, stops or fails together, from its first second: two JAX processes on
127.0.0.1 (one CPU device each, `jax.distributed`), each the real `tpu-payload train` as a
slice worker runs it (multihost.py's workers, as in test_jax_hosts.py).

- hosts that see different device memory plan the same mesh (the smallest memory decides;
  backends/jax/runtime.py MEMORY_ENV injects a per-process figure, since CPU devices report
  none), hosts told different chunk budgets run the same chunks, and the other host waits
  for the chief's slow export (held at a gate the test opens): both finish, exit 0;
- SIGTERM to the chief while both are starting (before its model build): every host exits
  143 within seconds, nothing written (JAX's preemption service would otherwise swallow
  it; the chief's main thread is held at a pause, so its guard thread ends it);
- a user error on the chief after the final evaluation, while the other host is inside the
  export's all-gathers of the FSDP-sharded weights (where no abort reaches it): both exit 2
  with the same one line (systemd's RestartPreventExitStatus=2 stops each unit);
- a bug (not a user error) on one host mid-training: both exit 1 with the same line, no
  wait for the agreement's timeout.

Nothing depends on the machine's speed: a signal lands while the process provably waits at
a pause (train_helpers.PausedCli), errors are injected at fixed calls (drivers/error_driver.py), and
every wait is bounded by a guard only a hung process reaches. How long each slice took to end
is printed (`-s`), never asserted.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _free_port
from multihost import (
    HANG_GUARD_S,
    TINY_CHUNKS,
    Worker,
    child_env,
    copy_job,
    error_lines,
    exits_seen,
    injected_at,
    prepared,  # noqa: F401  (a fixture)
    wait_until,
    worker_env,
)
from train_helpers import PausedCli

from payload import __version__ as payload_version
from payload.training import shared
from payload.training.heldout import micro_batch_count

pytestmark = pytest.mark.slow
SIGTERM_EXIT = 128 + signal.SIGTERM
ONE_PROGRAM = (
    r"^train: the 2 processes of this slice run one program \(digest ([0-9a-f]{16}): "
    + re.escape(payload_version)
    + r" source [0-9a-f]{12}, restored step none, programs train_chunk [0-9a-f]{16}, eval_step "
    r"[0-9a-f]{16}\)$"
)


def test_hosts_that_see_different_memory_and_chunk_budgets_agree_and_finish(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """Process 0 sees a large chip, process 1 a small one: alone, 0 would plan data
    parallelism and 1 FSDP, compile different programs and hang in the first collective.
    Process 1 is also told a chunk budget (one step a chunk) that process 0 is not (8): a
    chunk of another length on one host would hang both in its collectives. Process 1's
    SIGTERM handler is replaced during its compile and again by its first step (as libtpu
    may): it is taken back, and said, each time. Both log the same digest of what shapes
    the run (backends/jax/agreement.py). Then a slow export (the chief waits at a gate the
    test opens, backends/jax/train.py EXPORT_GATE_ENV): the other process waits for it
    instead of exiting, then both exit 0 with the export complete."""
    job = copy_job(prepared, tmp_path, steps=8, sharding="auto")
    port = _free_port()
    gate = tmp_path / "export-gate"
    extra = {
        0: {"TPU_PAYLOAD_TEST_DEVICE_MEMORY": str(64 * 2**30)},
        1: {"TPU_PAYLOAD_TEST_DEVICE_MEMORY": str(2**20), **TINY_CHUNKS},
    }
    job_file, logs = tmp_path / "job.yaml", tmp_path / "logs"
    replaced = (
        "default-sigterm@payload.backends.jax.program:build:1,"
        "default-sigterm@payload.training.shared:Meter.record_steps:1",
        "-",
    )
    workers = [
        Worker(
            job_file, logs, port, w, inject=replaced if w == 1 else None,
            TPU_PAYLOAD_TEST_EXPORT_GATE=str(gate), **extra[w],
        )
        for w in (0, 1)
    ]  # fmt: skip
    chief, other = workers
    try:
        # The chief holds its export at the gate; the other has finished training.
        waiting = Path(f"{gate}.waiting")
        wait_until(lambda: waiting.exists() or chief.proc.poll() is not None, "chief at the gate")
        assert waiting.exists(), chief.stderr[-3000:]
        line = "train: waiting for process 0's export"
        wait_until(lambda: line in other.stderr or other.proc.poll() is not None, "worker 1 waits")
        assert line in other.stderr, other.stderr[-3000:]
        assert other.proc.poll() is None, other.stderr[-3000:]  # waiting, not gone
        assert not shared.is_complete(job)
        gate.touch()
        results = [w.finish() for w in workers]
    finally:
        for w in workers:
            w.kill()
    digests = set()
    for code, err in results:
        assert code == 0, err[-3000:]
        assert '"mesh": {"sharding": "fsdp", "data": 1, "fsdp": 2}' in err, err[-3000:]
        assert "the smallest of 2 processes" in err, err[-3000:]
        assert "step 8/8" in err, err[-3000:]
        found = re.findall(ONE_PROGRAM, err, re.M)
        assert len(found) == 1, err[-3000:]
        digests |= set(found)
    assert len(digests) == 1, digests
    err1 = results[1][1]
    for when in ("during the compile", "by the first step"):
        assert re.search(rf"SIGTERM's handler was replaced by .* {when}; taken back", err1), err1
    assert "replaced by" not in results[0][1], results[0][1][-3000:]
    assert shared.is_complete(job)


def test_sigterm_to_the_chief_while_it_starts_stops_every_host(prepared, tmp_path) -> None:  # noqa: F811
    """SIGTERM to the chief, held at a pause before its model build: its guard thread tells
    the other host and ends it; both exit 143 (test_jax_hosts.py: the other host, inside a
    garbage collection during its data checks)."""
    signalled, point = 0, "before:payload.backends.jax.train:_build:1"
    job = copy_job(prepared, tmp_path, steps=5000)
    port = _free_port()
    train = ("train", "--job", str(tmp_path / "job.yaml"))
    other = 1 - signalled
    plain = Worker(tmp_path / "job.yaml", tmp_path / "logs", port, other)
    try:
        env = worker_env(port, signalled)
        with PausedCli(tmp_path / f"logs-{signalled}", point, *train, env=env) as paused:
            assert paused.wait_paused() == f"paused at {point}"
            paused.signal(signal.SIGTERM)
            sent = time.time()
            exits = exits_seen([paused.proc, plain.proc])
            err_signalled = paused.stderr
    finally:
        plain.kill()
    print(f"SIGTERM to process {signalled} at {point}: every process ended "
          f"{max(t for _, t in exits) - sent:.1f} s after it")  # fmt: skip
    err_other = plain.stderr
    for (code, _), err in zip(exits, (err_signalled, err_other), strict=True):
        assert code == SIGTERM_EXIT, err[-3000:]
        assert "Traceback" not in err and not error_lines(err), err[-3000:]
    line = f"stopped by signal {int(signal.SIGTERM)} outside the training loop"
    assert f"train: {line}" in err_signalled, err_signalled[-3000:]
    assert f"train: process {signalled} of the slice {line}" in err_other, err_other[-3000:]
    assert "train: {" in err_signalled  # the runtime line came first
    assert not Path(job.paths.checkpoints).exists() or not any(
        p.name.isdigit() for p in Path(job.paths.checkpoints).iterdir()
    )
    assert not shared.is_complete(job)


def _ended(
    workers: list[Worker], label: str, injected_on: int, action: str
) -> list[tuple[int, str]]:
    """Every worker's (exit status, stderr), once all ended; prints how long after the
    injection on `injected_on` the last one ended."""
    try:
        exits = exits_seen([w.proc for w in workers])
    finally:
        for w in workers:
            w.kill()
    errs = [w.stderr for w in workers]
    injected = injected_at(errs[injected_on], action)
    print(f"{label}: every process ended {max(t for _, t in exits) - injected:.1f} s after it")
    return [(code, err) for (code, _), err in zip(exits, errs, strict=True)]


def test_a_user_error_on_the_chief_after_the_final_evaluation_ends_every_host(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """The chief's status write after the final evaluation fails (a UserError, as a
    persistent StorageError is); the other host is already in the export's all-gathers of
    the FSDP-sharded weights, which wait for the chief for ever: its guard thread reads the
    chief's abort and ends it with the same line and exit 2, and the chief, which hosts the
    coordination service, leaves last."""
    job = copy_job(prepared, tmp_path, steps=8, sharding="fsdp")
    port = _free_port()
    message = "injected: the chief's status.json cannot be written"
    chief = Worker(
        tmp_path / "job.yaml", tmp_path / "logs", port, 0,
        inject=("user@payload.training.heldout:report:1", message),
    )  # fmt: skip
    other = Worker(tmp_path / "job.yaml", tmp_path / "logs", port, 1)
    results = _ended([chief, other], "a user error on the chief", 0, "user")
    lines = []
    for code, err in results:
        assert code == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert len(error_lines(err)) == 1, err[-3000:]
        lines += error_lines(err)
    assert lines[0] == lines[1] == f"error: process 0 of the slice: {message}", lines
    assert "train: waiting for process 0's export" not in results[1][1]  # it was in a gather
    assert not shared.is_complete(job)


def test_a_bug_on_one_host_mid_training_ends_every_host(prepared, tmp_path) -> None:  # noqa: F811
    """An exception that is not a user error on one host (a bug, device out of memory):
    every host exits 1 with the same line naming the host, at once (the others were
    waiting at the chunk's agreement, for up to an hour); the host's own traceback stays."""
    copy_job(prepared, tmp_path, steps=5000)
    port = _free_port()
    message = "injected: a bug only process 1 has"
    chief = Worker(tmp_path / "job.yaml", tmp_path / "logs", port, 0)
    other = Worker(
        tmp_path / "job.yaml", tmp_path / "logs", port, 1,
        inject=("bug@payload.training.shared:Meter.record_steps:2", message),
    )  # fmt: skip
    (code0, err0), (code1, err1) = _ended([chief, other], "a bug on process 1", 1, "bug")
    line = (
        f"error: process 1 of the slice failed: RuntimeError: {message} (not a user error: "
        "its traceback is in process 1's log)"
    )
    assert code0 == code1 == 1, (err0[-3000:], err1[-3000:])
    assert error_lines(err0) == error_lines(err1) == [line], (err0[-3000:], err1[-3000:])
    assert "Traceback" not in err0, err0[-3000:]
    assert f"RuntimeError: {message}" in err1.split("Traceback", 1)[1]


# ------------------------------------------------------------- one process, a TPU's rules


def _train(job_file: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = child_env(**env)
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
    job = copy_job(prepared, tmp_path / "same", steps=8)
    every = {
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # tiny programs: cache all
        # The CPU's oneDNN training chunk cannot be cached (program.py CPU_TRAIN_OPTIONS); a
        # TPU's or GPU's can, as the CPU's without oneDNN.
        "TPU_PAYLOAD_CPU_ONEDNN": "0",
    }
    first = _train(tmp_path / "same" / "job.yaml", **every)
    assert first.returncode == 0, first.stderr[-3000:]
    directory, loaded, compiled = _cache_counts(first.stderr)
    assert directory == f"{job.output}/compilation-cache" and compiled > 0 and loaded == 0
    again = _train(tmp_path / "same" / "job.yaml", "--force", **every)
    assert again.returncode == 0, again.stderr[-3000:]
    _, loaded, compiled_again = _cache_counts(again.stderr)
    assert compiled_again == 0 and loaded >= compiled, again.stderr[-3000:]

    changed = copy_job(prepared, tmp_path / "changed", steps=8, global_batch_size=8)
    shutil.copytree(directory, f"{changed.output}/compilation-cache")
    other = _train(tmp_path / "changed" / "job.yaml", **every)
    assert other.returncode == 0, other.stderr[-3000:]
    assert _cache_counts(other.stderr)[2] > 0  # another batch: other programs


def test_sigterm_during_an_evaluation_stops_it_at_once(prepared, tmp_path) -> None:  # noqa: F811
    """A SIGTERM while the in-loop evaluation runs: the evaluation is cut short at its next
    group of batches (a group lasts at most about a chunk: here, chunks bounded in seconds
    through CHUNK_SECONDS_ENV, one batch), the step is saved and the run exits 143; it
    does not finish the evaluation and train one more chunk first."""
    job = copy_job(prepared, tmp_path, steps=5000, eval_every=8, global_batch_size=4)
    point = "before:payload.backends.jax.train:_TrainLoop._evaluation_stop:1"
    env = child_env(**TINY_CHUNKS)
    with PausedCli(
        tmp_path / "logs", point, "train", "--job", str(tmp_path / "job.yaml"), env=env
    ) as run:
        assert run.wait_paused() == f"paused at {point}"  # after the first group of batches
        run.signal(signal.SIGTERM)
        code, _, err = run.finish()
    assert code == SIGTERM_EXIT, err[-3000:]
    assert f"stopped by signal {int(signal.SIGTERM)} at step 8;" in err, err[-3000:]
    assert "eval step 8/" not in err, err[-3000:]
    assert sorted(
        int(p.name) for p in Path(job.paths.checkpoints).iterdir() if p.name.isdigit()
    ) == [8]


def test_evaluation_micro_batches_never_exceed_training_rows() -> None:
    assert micro_batch_count(16, 16) == 1
    assert micro_batch_count(16, 2) == 8  # grad_accum_steps 8: 2 rows per device per pass
    assert micro_batch_count(12, 5) == 3  # 12 rows, at most 5 at once: 3 passes of 4
    assert micro_batch_count(7, 2) == 7  # a prime: one row at a time
    assert micro_batch_count(3, 8) == 1
