"""Hosts of a JAX slice stop and fail together: two JAX processes on 127.0.0.1 (one CPU
device each, `jax.distributed`), each the real `tpu-payload train` as a slice worker runs it
(multihost.py's helpers).

- SIGTERM to the NON-chief only, in the first chunks, the hosts told different chunk
  budgets: both processes checkpoint the same step (the chunks are agreed and bounded
  before any step is timed) and exit 143; then a SIGTERM to the non-chief inside a garbage
  collection during its data checks, after its handler was replaced as the backend started
  (libtpu does): a stop on both, nothing published as a bug; and a rerun resumes from the
  checkpoint and finishes;
- a run.json of another run: exit 2 on both, with the same one line.

Nothing depends on the machine's speed: the signal lands while worker 1 provably waits at
a pause (train_helpers.PausedCli) or at a fixed call (drivers/error_driver.py), and every wait is
bounded by a guard only a hung process reaches.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from conftest import _free_port
from multihost import (
    TINY_CHUNKS,
    Worker,
    copy_job,
    error_lines,
    exits_seen,
    injected_at,
    prepared,  # noqa: F401  (a fixture)
    worker_env,
)
from train_helpers import (
    PausedCli,
)

from payload.spec import JobSpec
from payload.training import shared

pytestmark = pytest.mark.slow
SIGTERM_EXIT = 128 + signal.SIGTERM
# The JAX backend runs 8 steps per call on a CPU (backends/jax/runtime.py STEPS_PER_CALL).
STEPS_PER_CALL = 8


def _both(
    job_file: Path, logs: Path, extra: dict[int, dict[str, str]] | None = None
) -> list[tuple[int, str]]:
    port = _free_port()
    workers = [Worker(job_file, logs, port, w, **(extra or {}).get(w, {})) for w in (0, 1)]
    try:
        return [w.finish() for w in workers]
    finally:
        for w in workers:
            w.kill()


def _steps(directory: str) -> list[int]:
    """The finished Orbax checkpoints' steps (a step directory is renamed into place last)."""
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def stopped(prepared, tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, list]:  # noqa: F811
    """A two-process run whose worker 1 (not the chief), told a chunk budget worker 0 is not
    told, got SIGTERM while it wrote its first log line (step 1, the first chunk's)."""
    root = tmp_path_factory.mktemp("stopped")
    job = copy_job(prepared, root, steps=5000, log_every=1)
    port = _free_port()
    chief = Worker(root / "job.yaml", root / "logs", port, 0)
    try:
        point = "after:payload.training.shared:Meter.log:1"
        train = ("train", "--job", str(root / "job.yaml"))
        env = worker_env(port, 1, **TINY_CHUNKS)
        with PausedCli(root / "logs-1", point, *train, env=env) as other:
            assert other.wait_paused() == f"paused at {point}"
            other.signal(signal.SIGTERM)
            code1, _, err1 = other.finish()
        code0, err0 = chief.finish()
    finally:
        chief.kill()
    return job, [(code0, err0), (code1, err1)]


# The step both stop at: chunks are agreed at one step (worker 1's budget) and are bounded
# before any step is timed, and the second chunk was dispatched before worker 1 wrote step
# 1's line: the processes agree to stop after it. (Chunks of 8 before the first two were
# timed stopped this run at step 16.)
STOPPED_AT = 2


def test_sigterm_to_the_non_chief_stops_both_at_the_same_step(prepared, stopped, tmp_path):  # noqa: F811
    """Then a SIGTERM to worker 1 during its data checks, delivered inside a garbage
    collection (a raise from the handler there would be lost) after its SIGTERM handler was
    replaced as the backend started (as libtpu does): a stop on both hosts, nothing
    published as a bug; then a rerun of both resumes and finishes, each told another chunk
    budget."""
    job, results = stopped
    for code, err in results:
        assert code == SIGTERM_EXIT, err[-3000:]
        assert f"stopped by signal {int(signal.SIGTERM)} at step {STOPPED_AT};" in err, err[-3000:]
    assert _steps(job.paths.checkpoints) == [STOPPED_AT]
    status = json.loads(Path(job.paths.status).read_text())
    assert status["state"] == "failed" and "rerun to resume" in status["last_error"]["error"]
    assert not shared.is_complete(job)

    rerun = copy_job(prepared, tmp_path, steps=STOPPED_AT + STEPS_PER_CALL)
    shutil.rmtree(rerun.paths.checkpoints, ignore_errors=True)
    shutil.copytree(job.paths.checkpoints, rerun.paths.checkpoints)
    port = _free_port()
    inject = (
        "default-sigterm@payload.backends.jax.runtime:checked_devices:1,"
        "gc-sigterm@payload.schema.manifest:verify_shards:1",
        "-",
    )
    workers = [
        Worker(tmp_path / "job.yaml", tmp_path / "logs-checks", port, 0),
        Worker(tmp_path / "job.yaml", tmp_path / "logs-checks", port, 1, inject=inject),
    ]
    try:
        exits = exits_seen([w.proc for w in workers])
    finally:
        for w in workers:
            w.kill()
    (code0, _), (code1, _) = exits
    err0, err1 = workers[0].stderr, workers[1].stderr
    signalled = injected_at(err1, "gc-sigterm")
    ended = max(t for _, t in exits) - signalled
    print(f"SIGTERM in worker 1's data checks: both processes ended {ended:.1f} s after it")
    assert code1 == SIGTERM_EXIT, err1[-3000:]
    assert code0 == SIGTERM_EXIT, err0[-3000:]
    assert "SIGTERM's handler was replaced by" in err1 and "taken back" in err1, err1[-3000:]
    assert f"train: stopped by signal {int(signal.SIGTERM)} outside the training loop" in err1
    assert f"train: process 1 of the slice stopped by signal {int(signal.SIGTERM)}" in err0
    for err in (err0, err1):
        assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
        assert "failed its data checks" not in err and not error_lines(err), err[-3000:]
    assert _steps(rerun.paths.checkpoints) == [STOPPED_AT]

    # A rerun of both resumes from that checkpoint and finishes.
    (code0, err0), (code1, err1) = _both(tmp_path / "job.yaml", tmp_path / "logs", {1: TINY_CHUNKS})
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    for err in (err0, err1):
        assert f"resumed from {rerun.paths.checkpoints}/{STOPPED_AT} at step {STOPPED_AT}" in err
        assert f"step {STOPPED_AT + STEPS_PER_CALL}/{STOPPED_AT + STEPS_PER_CALL}" in err
    assert shared.is_complete(rerun)


def test_a_run_json_of_another_run_exits_2_on_both(prepared, stopped, tmp_path) -> None:  # noqa: F811
    job, _ = stopped
    other = copy_job(prepared, tmp_path, steps=5000, seed=7)
    shutil.copytree(job.paths.checkpoints, other.paths.checkpoints)
    results = _both(tmp_path / "job.yaml", tmp_path / "logs")
    lines = []
    for code, err in results:
        assert code == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert len(error_lines(err)) == 1, err[-3000:]
        lines += error_lines(err)
        # Worker 1 leaves with the chief's error from the checks' agreement and says so: the
        # chief does not wait out ABORT_ACK_TIMEOUT_S for it (it did, 60 s, before).
        assert "did not read this process's abort" not in err, err[-3000:]
    assert lines[0] == lines[1], lines
    assert "belong to a different run (seed: 0 -> 7)" in lines[0], lines
    assert _steps(other.paths.checkpoints) == [STOPPED_AT]
