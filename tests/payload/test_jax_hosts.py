"""Hosts of a JAX slice stop, fail and finish together: two JAX processes on 127.0.0.1 (one
CPU device each, `jax.distributed`), each the real `tpu-payload train` as a slice worker
runs it (test_jax_multihost.py's helpers).

- SIGTERM to the NON-chief only: both processes checkpoint the same step and exit 143, and
  a rerun resumes from that checkpoint;
- a run.json of another run: exit 2 on both, with the same one line;
- a slow export (the chief waits at a gate the test opens, backends/jax/train.py
  EXPORT_GATE_ENV): the other process waits for it instead of exiting, then both exit 0
  with the export complete.

Nothing depends on the machine's speed: the signal lands while worker 1 provably waits at
a pause (train_helpers.PausedCli), the export is held until the test opens the gate, and
every wait is bounded by a guard only a hung process reaches.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import _free_port
from test_jax_multihost import HANG_GUARD_S, _env
from train_helpers import (
    PausedCli,
    copy_prepared,
    job_document,
    prepare_data,
    write_corpus,
    write_job,
)

from payload import training
from payload.spec import JobSpec

pytestmark = pytest.mark.slow
SIGTERM_EXIT = 128 + signal.SIGTERM
# The JAX backend runs 8 steps per call on a CPU (backends/jax/runtime.py STEPS_PER_CALL).
STEPS_PER_CALL = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, dict]:
    root = tmp_path_factory.mktemp("jax-hosts")
    corpus = write_corpus(root / "corpus.txt", lines=600)
    doc = job_document(root, corpus, "mlm", steps=8, checkpoint_every=1000, backend="jax")
    doc["data"].update(records_per_shard=40, eval_fraction=0.1, eval_min_sequences=16)
    job = write_job(root, doc)
    prepare_data(job)
    return job, doc


def _job(prepared: tuple[JobSpec, dict], root: Path, **train: object) -> JobSpec:
    source, doc = prepared
    doc = json.loads(json.dumps(doc))
    doc["train"].update(train)
    doc["output"] = str(root / "out")
    return copy_prepared(source, root, doc)


def _worker_env(port: int, worker: int, **extra: str) -> dict[str, str]:
    return _env(
        TPU_PAYLOAD_JAX_DISTRIBUTED=f"127.0.0.1:{port},2,{worker}",
        TPU_PRETRAIN_WORKER=str(worker),
        **extra,
    )


class _Worker:
    """`tpu-payload train` as one worker of the two, output in files."""

    def __init__(self, job_file: Path, logs: Path, port: int, worker: int, **extra: str):
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / f"{worker}.out", logs / f"{worker}.err"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "payload", "train", "--job", str(job_file)],
                stdout=out,
                stderr=err,
                env=_worker_env(port, worker, **extra),
                start_new_session=True,
            )

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def finish(self) -> tuple[int, str]:
        return self.proc.wait(timeout=HANG_GUARD_S), self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _both(job_file: Path, logs: Path, **extra: str) -> list[tuple[int, str]]:
    port = _free_port()
    workers = [_Worker(job_file, logs, port, w, **extra) for w in (0, 1)]
    try:
        return [w.finish() for w in workers]
    finally:
        for w in workers:
            w.kill()


def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds; only a hung process reaches the guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_GUARD_S} s (hung?)"
        time.sleep(0.05)


def _steps(directory: str) -> list[int]:
    """The finished Orbax checkpoints' steps (a step directory is renamed into place last)."""
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def stopped(prepared, tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, list]:
    """A two-process run whose worker 1 (not the chief) got SIGTERM while it wrote its
    first log line (step 5, inside the first chunk, steps 1-8)."""
    root = tmp_path_factory.mktemp("stopped")
    job = _job(prepared, root, steps=5000)
    port = _free_port()
    chief = _Worker(root / "job.yaml", root / "logs", port, 0)
    try:
        point = "after:payload.training:Meter.log:1"
        train = ("train", "--job", str(root / "job.yaml"))
        with PausedCli(root / "logs-1", point, *train, env=_worker_env(port, 1)) as other:
            assert other.wait_paused() == f"paused at {point}"
            other.signal(signal.SIGTERM)
            code1, _, err1 = other.finish()
        code0, err0 = chief.finish()
    finally:
        chief.kill()
    return job, [(code0, err0), (code1, err1)]


def test_sigterm_to_the_non_chief_stops_both_at_the_same_step(prepared, stopped, tmp_path):
    job, results = stopped
    # Chunks do not end at log lines, and the second chunk (steps 9-16) was dispatched
    # before worker 1 wrote step 5's line: the processes agree to stop after it.
    step = 2 * STEPS_PER_CALL
    for code, err in results:
        assert code == SIGTERM_EXIT, err[-3000:]
        assert f"stopped by signal {int(signal.SIGTERM)} at step {step};" in err, err[-3000:]
    assert _steps(job.paths.checkpoints) == [step]
    status = json.loads(Path(job.paths.status).read_text())
    assert status["state"] == "failed" and "rerun to resume" in status["last_error"]["error"]
    assert not training.is_complete(job)

    # A rerun of both resumes from that checkpoint and finishes.
    rerun = _job(prepared, tmp_path, steps=step + STEPS_PER_CALL)
    shutil.rmtree(rerun.paths.checkpoints, ignore_errors=True)
    shutil.copytree(job.paths.checkpoints, rerun.paths.checkpoints)
    (code0, err0), (code1, err1) = _both(tmp_path / "job.yaml", tmp_path / "logs")
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    assert f"resumed from {rerun.paths.checkpoints}/{step} at step {step}" in err0
    assert f"resumed from {rerun.paths.checkpoints}/{step} at step {step}" in err1
    assert training.is_complete(rerun)


def test_a_run_json_of_another_run_exits_2_on_both(prepared, stopped, tmp_path) -> None:
    job, _ = stopped
    other = _job(prepared, tmp_path, steps=5000, seed=7)
    shutil.copytree(job.paths.checkpoints, other.paths.checkpoints)
    results = _both(tmp_path / "job.yaml", tmp_path / "logs")
    lines = []
    for code, err in results:
        assert code == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert len(_errors(err)) == 1, err[-3000:]
        lines += _errors(err)
    assert lines[0] == lines[1], lines
    assert "belong to a different run (seed: 0 -> 7)" in lines[0], lines
    assert _steps(other.paths.checkpoints) == [2 * STEPS_PER_CALL]


def test_the_other_process_waits_for_a_slow_export(prepared, tmp_path: Path) -> None:
    job = _job(prepared, tmp_path, steps=STEPS_PER_CALL)
    gate = tmp_path / "export-gate"
    port = _free_port()
    extra = {"TPU_PAYLOAD_TEST_EXPORT_GATE": str(gate)}
    workers = [_Worker(tmp_path / "job.yaml", tmp_path / "logs", port, w, **extra) for w in (0, 1)]
    chief, other = workers
    try:
        # The chief holds its export at the gate; the other has finished training.
        waiting = Path(f"{gate}.waiting")
        _until(lambda: waiting.exists() or chief.proc.poll() is not None, "chief at the gate")
        assert waiting.exists(), chief.stderr[-3000:]
        line = "train: waiting for process 0's export"
        _until(lambda: line in other.stderr or other.proc.poll() is not None, "worker 1 waits")
        assert line in other.stderr, other.stderr[-3000:]
        assert other.proc.poll() is None, other.stderr[-3000:]  # waiting, not gone
        assert not training.is_complete(job)
        gate.touch()
        (code0, err0), (code1, err1) = chief.finish(), other.finish()
    finally:
        for w in workers:
            w.kill()
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    assert training.is_complete(job)
