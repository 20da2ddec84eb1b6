"""SIGKILL or SIGTERM during `tpu-payload train` at a step the test picks; reruns resume.

Every test runs on both training backends (`train.backend: tf` and `jax`): the same job,
the same pause points (payload/training/shared.py's Meter is shared), the same outcomes. The JAX
backend trains in a child process (the real CLI): Keras 3 picks its backend at import.
The resume and SIGTERM tests also run ELECTRA's objective (rtd, JAX only): its generator's
samples are drawn from (train.seed, step), so a resumed run draws what the other drew.

The JAX backend's resumed = uninterrupted test is also its no-TensorFlow test: the runs that
stop at a checkpoint and resume (train, evaluate, checkpoint, resume, export) run with
TensorFlow unimportable (no_tensorflow/sitecustomize.py, as on a JAX VM), and the
uninterrupted run, where TensorFlow is installed, must not import it."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file
from train_helpers import (
    PausedCli,
    copy_prepared,
    job_document,
    prepare_data,
    run_cli,
    tensorflow_env,
    write_corpus,
    write_job,
)

from payload.backends.tf import train
from payload.core.status import StatusWriter
from payload.spec import load_job
from payload.training import export as export_lib

CHECKPOINT_EVERY = 20
BACKENDS = pytest.mark.parametrize("backend", ["tf", "jax"])
IMPORTED = "no_tensorflow: tensorflow was imported"  # no_tensorflow/sitecustomize.py
# (backend, objective): the MLM cases of both backends and ELECTRA's rtd (JAX only).
OBJECTIVES = pytest.mark.parametrize(
    ("backend", "objective"), [("tf", "mlm"), ("jax", "mlm"), ("jax", "rtd")]
)
# Resumed = uninterrupted: the TF backend's MLM and the JAX backend's rtd, whose step also
# restores the generator's sample keys; the JAX input position and masking are the same
# input.make_batches as MLM's (JAX MLM resumes: test_jax_sharding.py, test_jax_multihost.py).
RESUMED = pytest.mark.parametrize(("backend", "objective"), [("tf", "mlm"), ("jax", "rtd")])
# Both backends log through payload.training.shared.Meter: pause after its N-th log line.
LOG_POINT = "after:payload.training.shared:Meter.log:{}"


def _latest_step(checkpoint_dir: str, backend: str = "tf") -> int | None:
    if backend == "jax":
        # Orbax's step directories; an unfinished write is <step>.orbax-checkpoint-tmp.
        steps = sorted(int(p.name) for p in Path(checkpoint_dir).glob("*") if p.name.isdigit())
        return steps[-1] if steps else None
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    return int(latest.rsplit("-", 1)[1]) if latest else None


def _checkpoint_name(step: int, backend: str) -> str:
    return str(step) if backend == "jax" else f"ckpt-{step}"


def _train(job_file: Path, backend: str, tensorflow: str | None = None) -> dict:
    """Train to the end: in this process (TF) or through the real CLI (JAX), there with
    TensorFlow blocked or watched (`tensorflow`: train_helpers.tensorflow_env's mode)."""
    if backend == "tf":
        job = load_job(str(job_file))
        return train.train(job, StatusWriter(job.paths.status, job.name))
    env = tensorflow_env(tensorflow) if tensorflow else None
    result = run_cli("train", "--job", str(job_file), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert IMPORTED not in result.stderr, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("train: complete ("))
    resumed = re.search(r"resumed_from=(\d+)", line)
    status = json.loads(Path(load_job(str(job_file)).paths.status).read_text())
    return {
        "resumed_from": int(resumed.group(1)) if resumed else None,
        "step": int(re.search(r"\bstep=(\d+)", line).group(1)),
        "eval_loss": status["stages"]["train"]["metrics"]["eval_loss"],  # 6 decimals
    }


def _exported_weights(job) -> dict[str, np.ndarray]:
    """The export's PyTorch weights: the same file from either backend (ELECTRA: both
    parts', by part/name)."""
    parts = export_lib.EXPORT_PARTS.get(job.model.family)
    if parts is None:
        return load_file(str(Path(job.paths.export, export_lib.PT_WEIGHTS)))
    return {
        f"{part}/{name}": value
        for part in parts
        for name, value in load_file(
            str(Path(job.paths.export, part, export_lib.PT_WEIGHTS))
        ).items()
    }


def _logged_steps(stderr: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+)/\d+ ", stderr, flags=re.MULTILINE)]


@pytest.mark.slow
@BACKENDS
def test_sigkill_then_rerun_resumes_from_last_checkpoint(tmp_path: Path, backend: str) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt")
    doc = job_document(
        tmp_path,
        corpus,
        "mlm",
        steps=5000,
        checkpoint_every=CHECKPOINT_EVERY,
        log_every=10,
        backend=backend,
    )
    job = write_job(tmp_path, doc)
    prepare_data(job)
    job_file = str(tmp_path / "job.yaml")

    # Killed between checkpoints: step 30 is logged, the last checkpoint is step 20's.
    point = LOG_POINT.format(3)
    with PausedCli(tmp_path / "first-run", point, "train", "--job", job_file) as first:
        assert first.wait_paused() == f"paused at {point}"
        first.wait_while_paused(  # the kill lands after checkpoint 20 is committed
            lambda: _latest_step(job.paths.checkpoints, backend) == CHECKPOINT_EVERY,
            f"commit of checkpoint {CHECKPOINT_EVERY}",
        )
        first.signal(signal.SIGKILL)
        code, _, first_log = first.finish()
    assert code == -signal.SIGKILL
    assert _logged_steps(first_log) == [10, 20, 30]
    kept = _latest_step(job.paths.checkpoints, backend)
    assert kept == CHECKPOINT_EVERY  # the work of steps 21-30 is lost
    assert not train.is_complete(job)
    status = json.loads(Path(job.paths.status).read_text())
    assert status["stage"] == "train" and status["state"] == "running"

    # Rerun with a reachable end: the step counter continues from the checkpoint.
    doc["train"]["steps"] = kept + 2 * CHECKPOINT_EVERY
    write_job(tmp_path, doc)
    result = run_cli("train", "--job", job_file)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = f"{job.paths.checkpoints}/{_checkpoint_name(kept, backend)} at step {kept}"
    assert f"resumed from {resumed}" in result.stderr
    logged = _logged_steps(result.stderr)
    assert logged[0] == kept + 10 and logged[-1] == kept + 2 * CHECKPOINT_EVERY, logged
    assert _latest_step(job.paths.checkpoints, backend) == kept + 2 * CHECKPOINT_EVERY
    assert train.is_complete(job)
    # Goodput over both starts (payload/training/goodput.py): the killed one and the resumed
    # one, the steps after the checkpoint trained twice counted as lost, the categories
    # adding up to the wall time (test_goodput.py has the JAX run in detail).
    good = json.loads(Path(job.paths.status).read_text())["goodput"]
    assert [s["end"] for s in good["starts"]] == ["killed", "finished"], good
    assert good["starts"][1]["restored_step"] == kept
    assert good["categories"]["lost"] > 0 and good["categories"]["productive"] > 0
    total = sum(good["categories"].values())
    assert abs(total - good["wall_s"]) <= 0.05 * good["wall_s"], good


@BACKENDS
def test_cli_train_mismatch_is_one_line_exit_2(tmp_path: Path, backend: str) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = job_document(tmp_path, corpus, "clm", steps=5, backend=backend)
    job = write_job(tmp_path, doc)
    prepare_data(job)
    doc["data"]["seq_length"] = 64
    write_job(tmp_path, doc)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "has seq_length 32 but the job says data.seq_length: 64" in errors[0]
    assert not train.is_complete(job)
    assert _latest_step(job.paths.checkpoints, backend) is None


@RESUMED
def test_resumed_run_equals_uninterrupted_run(tmp_path: Path, backend: str, objective: str) -> None:
    """Model, optimizer state, step counter and input position are all restored exactly."""

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    # No dropout and a schedule that does not depend on the total: runs are comparable.
    doc = job_document(
        tmp_path, corpus, objective, steps=16, decay="constant", warmup_steps=0, backend=backend
    )
    doc["train"].update(checkpoint_every=8, log_every=4, shuffle_buffer=50, eval_every=4)
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    doc["model"]["config"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    straight = write_job(
        tmp_path / "straight", {**doc, "output": str(tmp_path / "straight" / "out")}
    )
    prepare_data(straight)
    _train(tmp_path / "straight" / "job.yaml", backend, tensorflow="watch")

    # Where a run stopped after checkpoint 8 would be: the straight run's checkpoint 8 (and
    # run.json) beside the same tokenizer and data, nothing of steps 9-16.
    resumed = copy_prepared(straight, tmp_path / "resumed", doc)
    _keep_checkpoint(straight.paths.checkpoints, resumed.paths.checkpoints, 8, backend)
    stats = _train(tmp_path / "resumed" / "job.yaml", backend, tensorflow="block")
    assert stats["resumed_from"] == 8 and stats["step"] == 16

    a, b = _exported_weights(straight), _exported_weights(resumed)
    assert sorted(a) == sorted(b)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst < 1e-5, worst

    # The held-out numbers at the same step are the same, resumed or not.
    straight_eval, resumed_eval = _eval_scalars(straight), _eval_scalars(resumed)
    assert set(straight_eval) == {4, 8, 12, 16} and set(resumed_eval) == {12, 16}
    for step in (12, 16):
        for tag in ("loss", "perplexity", "accuracy"):
            a, b = straight_eval[step][tag], resumed_eval[step][tag]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (step, tag, a, b)
    assert stats["eval_loss"] == pytest.approx(straight_eval[16]["loss"], rel=1e-5)


def _keep_checkpoint(source: str, target: str, step: int, backend: str) -> None:
    """Copy checkpoint `step` of `source` (and its run.json) into an empty `target`: what a
    run that stopped right after writing it leaves behind."""
    Path(target).mkdir(parents=True)
    shutil.copy(Path(source, "run.json"), target)
    if backend == "jax":
        shutil.copytree(Path(source, str(step)), Path(target, str(step)))
        return
    for part in Path(source).glob(f"ckpt-{step}.*"):
        shutil.copy(part, target)
    # TF's own record of its checkpoints (CheckpointManager reads it to find the latest).
    tf.compat.v1.train.update_checkpoint_state(target, f"ckpt-{step}")
    assert _latest_step(target) == step


def _eval_scalars(job) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for path in sorted(Path(job.paths.logs, "eval").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                out.setdefault(int(event.step), {})[value.tag] = float(
                    tf.make_ndarray(value.tensor)
                )
    return out


@OBJECTIVES
def test_sigterm_checkpoints_the_current_step_and_exits_143(
    tmp_path: Path, backend: str, objective: str
) -> None:
    """A preempted VM's shutdown sends SIGTERM: nothing since the last chunk is lost."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    doc = job_document(
        tmp_path, corpus, objective, steps=5000, checkpoint_every=1000, log_every=5,
        backend=backend,
    )  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    # SIGTERM while step 5's log line is being written. TF: the chunk ends there. JAX:
    # chunks end only at checkpoints, evaluations and the last step (8 steps per call on a
    # CPU), and the chunk of steps 9-16 was dispatched before step 5's line was written:
    # the stop comes after it, with its log lines.
    stopped, logged = (5, [5]) if backend == "tf" else (16, [5, 10, 15])
    point = LOG_POINT.format(1)
    with PausedCli(tmp_path / "run", point, "train", "--job", str(tmp_path / "job.yaml")) as run:
        run.wait_paused()
        run.signal(signal.SIGTERM)
        code, _, output = run.finish()
    assert code == 128 + signal.SIGTERM, output[-3000:]
    # No interval checkpoint was due (every 1000): this one is the interruption's.
    assert _latest_step(job.paths.checkpoints, backend) == stopped, output[-3000:]
    assert _logged_steps(output) == logged
    assert f"stopped by signal {int(signal.SIGTERM)} at step {stopped}" in output
    status = json.loads(Path(job.paths.status).read_text())
    assert status["state"] == "failed" and "rerun to resume" in status["last_error"]["error"]
    assert not train.is_complete(job)
