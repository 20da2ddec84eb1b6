"""The meter's log lines from a chunk's per-step metrics (the JAX backend's chunks do not
end at log boundaries): one line per `log_every` boundary inside a chunk and at the last
step, each with the mean of the steps since the previous line and its own step's norm."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from train_helpers import job_document, write_job

from payload.training import shared


def test_log_lines_inside_a_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = job_document(tmp_path, tmp_path / "corpus.txt", steps=10, log_every=3)
    job = write_job(tmp_path, doc)
    status = shared.UnwrittenStatus(job.paths.status, job.name)
    meter = shared.Meter(
        job,
        SimpleNamespace(seq_length=32),
        status,
        chief=False,  # no TensorBoard file
        learning_rate=lambda step: 1e-3,
    )
    loss = [float(step) for step in range(1, 11)]  # step s has loss s
    accuracy = [step / 100 for step in range(1, 11)]
    norm = [10.0 * step for step in range(1, 11)]
    meter.record_steps(0, loss[:8], accuracy[:8], norm[:8], log_every=3)  # steps 1-8
    assert meter.first_loss == 2.0  # the mean of steps 1-3
    meter.record_steps(8, loss[8:], accuracy[8:], norm[8:], log_every=3)  # steps 9-10
    meter.close()
    lines = re.findall(
        r"^step (\d+)/10  loss ([0-9.]+)  acc ([0-9.]+)", capsys.readouterr().err, re.M
    )
    assert lines == [
        ("3", "2.0000", "0.020"),
        ("6", "5.0000", "0.050"),
        ("9", "8.0000", "0.080"),
        ("10", "10.0000", "0.100"),  # the last step closes a window of one
    ]
    assert meter.loss == 10.0 and meter.first_loss == 2.0
    metrics = status.document["stages"]["train"]["metrics"]
    assert metrics["step"] == 10 and metrics["loss"] == 10.0 and metrics["accuracy"] == 0.1


def test_chunks_before_and_after_a_step_is_timed() -> None:
    """A runtime bounded in seconds runs FIRST_CHUNK_STEPS until a step has been timed (the
    first chunk compiles; the next is timed from its end), then what fits the bound; after
    a pause (checkpoint, evaluation) the last measure stands; no bound: steps_per_execution."""
    now = [0.0]
    timer = shared.ChunkTimer(5.0, clock=lambda: now[0])
    assert timer.steps_per_chunk(64) == shared.FIRST_CHUNK_STEPS == 1
    now[0] = 120.0  # compiling, then one step
    timer.chunk_done(1)
    assert timer.steps_per_chunk(64) == 1  # only the clock is set
    now[0] += 0.25
    timer.chunk_done(1)
    assert timer.step_seconds == 0.25 and timer.steps_per_chunk(64) == 20
    assert timer.steps_per_chunk(8) == 8
    timer.pause()
    now[0] += 300.0  # an evaluation
    timer.chunk_done(20)
    assert timer.steps_per_chunk(64) == 20  # the pause is not step time
    now[0] += 20 * 10.0  # 10 s a step: longer than the bound, still one step
    timer.chunk_done(20)
    assert timer.steps_per_chunk(64) == 1
    assert shared.ChunkTimer(None).steps_per_chunk(8) == 8


def test_sigterm_is_taken_back_from_a_handler_installed_in_c() -> None:
    """training.take_sigterm_back sees a handler installed below Python (libtpu installs its
    own with sigaction when the TPU backend starts; `signal.getsignal` still names Python's)
    and installs the recording handler again; the handler only records a signal."""
    import ctypes
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    try:
        shared.stop_at_once_on_sigterm()
        assert shared.take_sigterm_back() is None  # nothing replaced it
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(signal.SIGTERM), ctypes.c_void_p(1))  # SIG_IGN, behind Python's back
        assert signal.getsignal(signal.SIGTERM) == shared.STOP.record  # Python cannot tell
        found = shared.take_sigterm_back()
        assert found is not None and "installed in C" in found, found
        assert shared.take_sigterm_back() is None
        signal.raise_signal(signal.SIGTERM)  # recorded, not raised: the test goes on
        assert shared.STOP.signum == signal.SIGTERM and shared.STOP.at_once()
    finally:
        signal.signal(signal.SIGTERM, previous)
        shared.STOP.signum = None
