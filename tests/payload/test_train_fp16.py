"""float16 with dynamic loss scaling: the precision `auto` gives a T4 or V100 (no bfloat16).

No GPU here: the GPU plan runs on the CPU (XLA CPU computes in float16 too), in a
subprocess because the mixed-precision policy is process-global. The loss scale's
mechanics are what a GPU would run: a scale so large that float16 gradients overflow makes
the step skip (weights untouched) and the scale halve, until the steps apply.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from train_helpers import copy_prepared, job_document, prepare_data, write_corpus, write_job

from payload.spec import JobSpec

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import payload
    import tensorflow as tf
    import tf_keras
    from payload.backends.tf import strategy, train
    from payload.spec import load_job
    from payload.core.status import StatusWriter

    plan = strategy.decide("gpu", "auto", gpu_policy="mixed_float16")
    assert plan.policy == "mixed_float16" and plan.loss_scaling, plan
    tf_keras.mixed_precision.set_global_policy(plan.policy)
    # argv: job.yaml initial-scale pairs, trained one after the other in this process.
    for path, initial in zip(sys.argv[1::2], sys.argv[2::2]):
        job = load_job(path)
        train.LOSS_SCALE_INITIAL = float(initial)
        tf_keras.backend.clear_session()
        runtime = strategy.Runtime(plan, tf.distribute.get_strategy())
        stats = train.train(job, StatusWriter(job.paths.status, job.name), runtime=runtime)
        reader = tf.train.load_checkpoint(job.paths.checkpoints)
        names = reader.get_variable_to_shape_map()
        scale = [reader.get_tensor(n) for n in names if "loss_scale/current_loss_scale" in n]
        print(json.dumps({"step": stats["step"], "loss": stats["loss"],
                          "first_loss": stats["first_loss"],
                          "scale": [float(s) for s in scale]}), flush=True)
    """
)


STEPS = 8


def _prepared(tmp_path: Path) -> tuple[JobSpec, dict]:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = job_document(tmp_path, corpus, "mlm", steps=STEPS, warmup_steps=1, checkpoint_every=4)
    job = write_job(tmp_path / "first", {**doc, "output": str(tmp_path / "first" / "out")})
    prepare_data(job)
    (tmp_path / "fp16.py").write_text(SCRIPT)
    return job, doc


def _train(tmp_path: Path, runs: dict[str, float]) -> list[dict]:
    """Train each prepared job (name: its initial loss scale) in one process (one import of
    TensorFlow), in order; their reports."""
    args = [
        a for name, scale in runs.items() for a in (str(tmp_path / name / "job.yaml"), str(scale))
    ]
    result = subprocess.run(
        [sys.executable, str(tmp_path / "fp16.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(runs), result.stdout[-2000:]
    return reports


def test_float16_trains_with_dynamic_loss_scaling(tmp_path: Path) -> None:
    first, doc = _prepared(tmp_path)
    copy_prepared(first, tmp_path / "overflow", doc)
    huge = 2.0**40
    normal, overflow = _train(tmp_path, {"first": 2.0**15, "overflow": huge})
    assert normal["step"] == STEPS
    assert normal["loss"] < normal["first_loss"], normal  # it learns in float16
    # The scale is checkpointed with the optimizer (a resumed run continues with it); it
    # only went down from its start while the first steps' gradients overflowed.
    assert len(normal["scale"]) == 1 and 1.0 <= normal["scale"][0] <= 2.0**15, normal
    # A scale so large that every step's float16 gradients overflow: each step is skipped
    # (it still counts) and halves the scale, exactly once per step.
    assert overflow["step"] == STEPS
    assert overflow["scale"] == [huge / 2**STEPS], overflow
    # Skipped steps leave the weights alone: the loss does not move.
    assert abs(overflow["loss"] - overflow["first_loss"]) < 0.05, overflow
