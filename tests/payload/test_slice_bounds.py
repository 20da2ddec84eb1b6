"""Every wait of a slice has a bound, and a stop keeps what was trained: three and four JAX
processes on 127.0.0.1 (one CPU device each, `jax.distributed`), each the real `tpu-payload
train` as a slice worker runs it (multihost.py's workers), one process tree per scenario:

- a host SIGKILLed under the trainer while a checkpoint is in flight (its write held in
  Orbax's background thread): the others end within the coordination service's heartbeat
  bound, the checkpoint is not committed, and the restart resumes from the last committed
  one; then the coordinator SIGKILLed mid-chunk: the others end at once;
- a stall on one host (progress.STALL_ENV): the progress watchdog ends every host within
  its bound (progress.HANG_ENV) with HUNG_EXIT, every thread's stack in each host's log,
  status.json `hung` with the phase;
- a SIGTERM after the loop's last agreement (the final checkpoint in flight): every host
  exits 143 and the final checkpoint is committed;
- a SIGTERM during the in-loop evaluation: every host stops at the next group of batches,
  the step saved, exit 143; one in the final evaluation (one process) stops it the same way,
  and the restart repeats only the evaluation, then exports;
- worker 0 failing before `jax.distributed.initialize` (its lease): every other host names
  worker 0 within the join's bound (joining.ENV), exit 1.

docs/pod-slices.md's table of the ways a host leaves names these tests (test_progress.py
checks it). Nothing depends on the machine's speed: a signal or a kill lands while a process
provably waits at a pause (train_helpers.PausedCli), every bound a test sets is far above a
healthy step of these tiny jobs, and every wait is bounded by a guard only a hung process
reaches. Each test prints how long its slice took to end (`-s`); the bounds asserted are the
documented ones plus SLACK_S.
"""

from __future__ import annotations

import json
import re
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

from payload.backends.jax import checkpoint, distributed, joining, progress
from payload.spec import JobSpec
from payload.training import export, shared

pytestmark = pytest.mark.slow
SIGTERM_EXIT = 128 + signal.SIGTERM
# What a loaded 2-core machine may add to a documented bound (processes scheduled late, a
# shutdown barrier passed): a margin for the machine, never a figure the code promises.
SLACK_S = 60.0
# Divisible by 3 and 4 processes (one replica each), and small enough for several held-out
# batches (an evaluation in groups).
BATCH = 12


def _slice(
    job_file: Path, logs: Path, port: int, processes: int, paused: dict[int, str], **extra: str
) -> tuple[list[Worker], dict[int, PausedCli]]:
    """Every worker of a slice of `processes`: those in `paused` held at their point."""
    train = ("train", "--job", str(job_file))
    held = {}
    for w, point in paused.items():
        # The pause driver imports its point's module first: Keras must find its backend
        # already chosen (the trainer unit sets it too).
        env = worker_env(port, w, processes, KERAS_BACKEND="jax", **extra)
        held[w] = PausedCli(logs / f"paused-{w}", point, *train, env=env)
    plain = [
        Worker(job_file, logs, port, w, processes=processes, **extra)
        for w in range(processes)
        if w not in paused
    ]
    return plain, held


def _procs(plain: list[Worker], held: dict[int, PausedCli], processes: int) -> list:
    """Every worker's process, by index (a Worker's log is `<index>.err`)."""
    found = {int(w.err_path.stem): w.proc for w in plain}
    found.update({index: paused.proc for index, paused in held.items()})
    return [found[i] for i in range(processes)]


def _stderr(plain: list[Worker], held: dict[int, PausedCli], index: int) -> str:
    if index in held:
        return held[index].stderr
    return next(w.stderr for w in plain if int(w.err_path.stem) == index)


def _close(plain: list[Worker], held: dict[int, PausedCli]) -> None:
    for w in plain:
        w.kill()
    for paused in held.values():
        paused.__exit__(None, None, None)


def _committed(job: JobSpec) -> list[int]:
    """The steps a restart can resume from: Orbax's own test of a finished checkpoint."""
    return checkpoint.finished_steps(job.paths.checkpoints)


def _resumed_from(stderr: str) -> int:
    found = re.search(r"^train: resumed from \S+/(\d+) at step (\d+)$", stderr, re.M)
    assert found, stderr[-3000:]
    assert found.group(1) == found.group(2)
    return int(found.group(1))


# Orbax's background thread of a save (orbax-checkpoint 0.12.8
# _src/checkpointers/async_checkpointer.py): it waits for this process's writes, then for
# every process's at a barrier, and process 0 then commits the checkpoint. Held before it
# starts, this process's shards of that checkpoint are never finished.
IN_FLIGHT = (
    "orbax.checkpoint._src.checkpointers.async_checkpointer:_background_wait_for_commit_futures"
)


def test_a_host_killed_mid_checkpoint_then_mid_chunk_ends_the_slice_and_it_resumes(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """Three processes, a checkpoint every 4 steps. Run 1: process 1 is SIGKILLed while its
    shards of checkpoint 8 are unwritten (its save's background thread held); the others
    block in their next save (Orbax waits for the one before) and the coordination service
    ends them within HEARTBEAT_TIMEOUT_S (XLA's client aborts: SIGABRT); 8 is not committed,
    4 is. Run 2 resumes from 4; process 0, the coordinator, is SIGKILLed mid-chunk after
    checkpoint 12's save began (so 8 is committed): the others end at once (their client
    loses the service). No host waits for an agreement's hour."""
    job = copy_job(prepared, tmp_path, steps=5000, checkpoint_every=4, global_batch_size=BATCH)
    job_file, processes = tmp_path / "job.yaml", 3

    plain, held = _slice(
        job_file, tmp_path / "logs-1", _free_port(), processes, {1: f"before:{IN_FLIGHT}:2"}
    )
    try:
        assert held[1].wait_paused() == f"paused at before:{IN_FLIGHT}:2"
        held[1].signal(signal.SIGKILL)
        killed = time.time()
        exits = exits_seen(_procs(plain, held, processes))
        errs = [_stderr(plain, held, i) for i in range(processes)]
    finally:
        _close(plain, held)
    ended = max(t for _, t in exits) - killed
    print(f"SIGKILL of process 1 mid-checkpoint: every process ended {ended:.1f} s after it")
    assert exits[1][0] == -signal.SIGKILL
    for index in (0, 2):
        code, _ = exits[index]
        assert code == -signal.SIGABRT, errs[index][-3000:]
        assert "stopped sending heartbeats" in errs[index], errs[index][-3000:]
    assert ended < distributed.HEARTBEAT_TIMEOUT_S + SLACK_S
    assert _committed(job) == [4]
    assert any(p.name.startswith("8.") for p in Path(job.paths.checkpoints).iterdir())  # half

    mid_chunk = "before:payload.backends.jax.train:_TrainLoop._report:10"
    plain, held = _slice(
        job_file, tmp_path / "logs-2", _free_port(), processes, {0: mid_chunk}, **TINY_CHUNKS
    )
    try:
        assert held[0].wait_paused() == f"paused at {mid_chunk}"
        held[0].signal(signal.SIGKILL)
        killed = time.time()
        exits = exits_seen(_procs(plain, held, processes))
        errs = [_stderr(plain, held, i) for i in range(processes)]
    finally:
        _close(plain, held)
    ended = max(t for _, t in exits) - killed
    print(f"SIGKILL of process 0 mid-chunk: every process ended {ended:.1f} s after it")
    for index in range(processes):
        assert _resumed_from(errs[index]) == 4  # the last committed checkpoint
    assert exits[0][0] == -signal.SIGKILL
    for index in (1, 2):
        assert exits[index][0] == -signal.SIGABRT, errs[index][-3000:]
    assert ended < distributed.HEARTBEAT_TIMEOUT_S + SLACK_S
    # 1-step chunks from step 4: report 10 is the chunk to step 14, after 12's save began
    # (which waited for 8's commit); whether 12 was committed when the coordinator died is
    # a race. The next restart resumes from the newest of these.
    assert _committed(job)[:2] == [4, 8]


def test_a_stall_on_one_host_ends_every_host_within_the_watchdogs_bound(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """Four processes; process 2 stalls before the chunk from step 16 (progress.STALL_ENV:
    its main thread never comes back, as if its chip had stalled). The others wait for it
    at the chunk's agreement. Its progress watchdog (a 30 s floor here; the others' 300 s,
    so that the host that stalled is the one named, however loaded the machine) writes every
    thread's stack to its log, tells the others and exits HUNG_EXIT; they leave with its line
    and exit code and their own stacks; status.json says `hung` in `train`."""
    job = copy_job(prepared, tmp_path, steps=5000, global_batch_size=BATCH)
    port, processes, stalled, floor = _free_port(), 4, 2, 30.0
    extra = {w: {progress.HANG_ENV: str(floor if w == stalled else 10 * floor)} for w in range(4)}
    extra[stalled][progress.STALL_ENV] = "16"  # after a chunk finished: the train phase
    workers = [
        Worker(tmp_path / "job.yaml", tmp_path / "logs", port, w, processes=processes, **extra[w])
        for w in range(processes)
    ]
    try:
        exits = exits_seen([w.proc for w in workers])
    finally:
        for w in workers:
            w.kill()
    errs = [w.stderr for w in workers]
    found = re.search(r"stalled before step 17 at ([0-9.]+)$", errs[stalled], re.M)
    assert found, errs[stalled][-3000:]
    ended = max(t for _, t in exits) - float(found.group(1))
    print(f"a stall on process {stalled}: every process ended {ended:.1f} s after it")
    line = next(x for x in error_lines(errs[stalled]) if " hung: " in x)
    assert line.startswith(f"error: process {stalled} of the slice hung: no progress in train")
    for index, ((code, _), err) in enumerate(zip(exits, errs, strict=True)):
        assert code == progress.HUNG_EXIT, err[-3000:]
        assert line in err, err[-3000:]
        assert "(most recent call first)" in err, err[-3000:]  # the stacks (faulthandler)
        assert "Traceback" not in err, err[-3000:]
        if index == stalled:
            assert "in _stalled_here" in err, err[-3000:]
    assert ended < floor + 2 * SLACK_S  # four processes on a loaded 2-core machine
    status = json.loads(Path(job.paths.status).read_text())
    assert (status["state"], status["last_error"]["phase"]) == ("hung", "train"), status
    assert status["last_error"]["error"] == line
    [hung] = [e for e in status["events"] if e["event"] == "hung"]  # the chief's, once
    assert (hung["phase"], hung["source"], hung["message"]) == ("train", "trainer", line)
    assert status["goodput"]["starts"][-1]["end"] == "hung"


def test_a_sigterm_after_the_last_agreement_commits_the_final_checkpoint(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """Three processes, 8 steps, no periodic checkpoint: process 1 is held after the loop's
    last agreement, once its final save has started (the write in flight), and gets SIGTERM
    there. The write is a deferred stop like the loop's: every process agrees on the stop
    once it is written, exits 143 at step 8, and checkpoint 8 is committed (before, the
    signal stopped "outside the training loop": the guard ended every process within
    GUARD_GRACE_S, and a write still in flight was lost)."""
    job = copy_job(prepared, tmp_path, steps=8, global_batch_size=BATCH)
    point = "after:payload.backends.jax.checkpoint:Checkpoints.save:1"
    processes = 3
    plain, held = _slice(
        tmp_path / "job.yaml", tmp_path / "logs", _free_port(), processes, {1: point}
    )
    try:
        assert held[1].wait_paused() == f"paused at {point}"
        held[1].signal(signal.SIGTERM)
        sent = time.time()
        held[1].release()
        exits = exits_seen(_procs(plain, held, processes))
        errs = [_stderr(plain, held, i) for i in range(processes)]
    finally:
        _close(plain, held)
    ended = max(t for _, t in exits) - sent
    print(f"SIGTERM after the last agreement: every process ended {ended:.1f} s after it")
    for (code, _), err in zip(exits, errs, strict=True):
        assert code == SIGTERM_EXIT, err[-3000:]
        assert f"stopped by signal {int(signal.SIGTERM)} at step 8;" in err, err[-3000:]
        assert "Traceback" not in err and not error_lines(err), err[-3000:]
    assert _committed(job) == [8]
    assert not shared.is_complete(job)


def test_a_sigterm_during_the_evaluation_on_a_slice_stops_every_host_at_once(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """Three processes evaluate at step 4 in groups of one batch (1-step chunks: TINY_CHUNKS);
    process 2 gets SIGTERM after the first group: every process stops at the next group's
    agreement, step 4 is saved, all exit 143; nobody finishes the evaluation or trains on."""
    job = copy_job(prepared, tmp_path, steps=5000, eval_every=4, global_batch_size=3)
    point = "before:payload.backends.jax.train:_TrainLoop._evaluation_stop:1"
    processes = 3
    plain, held = _slice(
        tmp_path / "job.yaml", tmp_path / "logs", _free_port(), processes, {2: point}, **TINY_CHUNKS
    )
    try:
        assert held[2].wait_paused() == f"paused at {point}"
        held[2].signal(signal.SIGTERM)
        sent = time.time()
        held[2].release()
        exits = exits_seen(_procs(plain, held, processes))
        errs = [_stderr(plain, held, i) for i in range(processes)]
    finally:
        _close(plain, held)
    ended = max(t for _, t in exits) - sent
    print(f"SIGTERM in the evaluation: every process ended {ended:.1f} s after it")
    for (code, _), err in zip(exits, errs, strict=True):
        assert code == SIGTERM_EXIT, err[-3000:]
        assert f"stopped by signal {int(signal.SIGTERM)} at step 4;" in err, err[-3000:]
        assert "eval step 4/" not in err, err[-3000:]
        assert "step 5/" not in err, err[-3000:]
    assert _committed(job) == [4]


def test_a_sigterm_in_the_final_evaluation_stops_it_and_the_restart_repeats_only_it(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """One process (the final evaluation's stop is the in-loop one's agreement, which one
    process asks as every host does): SIGTERM once the final evaluation has begun stops it
    at its next group of batches, exit 143 at step 8 with checkpoint 8 committed; the
    restart trains nothing, repeats only the evaluation, exports (the marker last) and leaves
    no scratch directory."""
    job = copy_job(prepared, tmp_path, steps=8, global_batch_size=4)
    point = "before:payload.backends.jax.evaluate:Evaluator.evaluate:1"  # no in-loop one
    train = ("train", "--job", str(tmp_path / "job.yaml"))
    env = child_env(KERAS_BACKEND="jax", **TINY_CHUNKS)  # groups of one batch
    with PausedCli(tmp_path / "logs", point, *train, env=env) as run:
        assert run.wait_paused() == f"paused at {point}"
        run.signal(signal.SIGTERM)
        code, _, err = run.finish()
    assert code == SIGTERM_EXIT, err[-3000:]
    assert f"stopped by signal {int(signal.SIGTERM)} at step 8;" in err, err[-3000:]
    assert "eval step 8/" not in err, err[-3000:]
    assert _committed(job) == [8] and not shared.is_complete(job)

    again = subprocess.run(
        [sys.executable, "-m", "payload", *train],
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=False, env=child_env(),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert _resumed_from(again.stderr) == 8
    assert "eval step 8/8" in again.stderr
    assert not re.search(r"^step \d+/8 ", again.stderr, re.M), again.stderr[-3000:]  # no training
    assert shared.is_complete(job)
    assert not export.scratch_path(job).exists()


def test_a_failure_on_worker_0_before_it_joins_is_named_by_every_host(
    prepared,  # noqa: F811
    tmp_path,
) -> None:
    """Four processes; worker 0's lease fails (a user error, before its trainer calls
    `jax.distributed.initialize`): it exits 2. Each other host waits in the join, and once
    the join's bound passes (joining.ENV: 20 s here) says that worker 0, the coordinator,
    is not up, and exits 1, instead of aborting after JAX's 300 s naming nobody."""
    copy_job(prepared, tmp_path, steps=8, global_batch_size=BATCH)
    port, processes, bound = _free_port(), 4, 20.0
    message = "injected: worker 0's lease cannot be written"
    chief = Worker(
        tmp_path / "job.yaml", tmp_path / "logs", port, 0, processes=processes,
        inject=("user@payload.core.lease:hold:1", message),
    )  # fmt: skip
    others = [
        Worker(
            tmp_path / "job.yaml",
            tmp_path / "logs",
            port,
            w,
            processes=processes,
            **{joining.ENV: str(bound)},
        )
        for w in range(1, processes)
    ]
    joining_seen: dict[int, float] = {}

    def all_joining() -> bool:
        for index, w in enumerate(others, 1):
            if index not in joining_seen and "train: joining the slice" in w.stderr:
                joining_seen[index] = time.time()
        return len(joining_seen) == len(others) or any(w.proc.poll() is not None for w in others)

    try:
        wait_until(all_joining, "every other host joining")
        exits = exits_seen([chief.proc] + [w.proc for w in others])
    finally:
        for w in [chief, *others]:
            w.kill()
    injected_at(chief.stderr, "user")
    assert exits[0][0] == 2 and error_lines(chief.stderr) == [f"error: {message}"]
    for index, w in enumerate(others, 1):
        code, when = exits[index]
        err = w.stderr
        assert code == joining.EXIT, err[-3000:]
        lines = error_lines(err)
        assert len(lines) == 1 and lines[0].startswith(
            f"error: process {index} of the slice could not join it within 20 s "
            f"({joining.ENV}): process 0 (worker 0, the coordinator at 127.0.0.1:{port}) is "
            "not up"
        ), err[-3000:]
        waited = when - joining_seen[index]
        print(f"worker 0 missing: process {index} named it {waited:.1f} s after it began to join")
        assert bound <= waited + 1 and waited < bound + SLACK_S
