"""The multi-replica code path (global batch split, all-reduce, global loss normalisation).

No TPU or GPUs here: two logical CPU devices under MirroredStrategy (with a GPU VM's
plan) run the same train step as a GPU VM's GPUs or a TPU pod slice would (per-replica
batches from one host pipeline, all-reduced unnormalised gradients divided by the global
number of predicted tokens). One step on two
replicas must equal one step on one replica with the same global batch.
Logical devices must be configured before TensorFlow initialises, hence a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from train_helpers import copy_prepared, job_document, prepare_data, write_corpus, write_job

SCRIPT = textwrap.dedent(
    """
    import shutil, sys
    import numpy as np
    import payload
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    from transformers import TFAutoModelForMaskedLM
    from payload.backends.tf import strategy, train
    from payload.spec import load_job
    from payload.core.status import StatusWriter

    weights = {}
    for name, replicas in (("one", 1), ("two", 2)):
        job = load_job(sys.argv[1 if replicas == 1 else 2])
        if replicas == 1:
            runtime = strategy.Runtime(strategy.decide("cpu", "fp32"), tf.distribute.get_strategy())
        else:
            mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
            # The plan of a GPU VM in float32 (P100/P4, or `precision: fp32`; XLA): the
            # GPU path is MirroredStrategy over the local devices with this very plan.
            plan = strategy.decide("gpu", "auto", gpu_policy="float32")
            assert (plan.policy, plan.jit_compile) == ("float32", True), plan
            runtime = strategy.Runtime(plan, mirrored)
        stats = train.train(job, StatusWriter(job.paths.status, job.name), runtime=runtime)
        assert stats["step"] == job.train.steps, stats
        model = TFAutoModelForMaskedLM.from_pretrained(job.paths.export)
        weights[name] = [w.numpy() for w in model.weights]
        print(name, runtime.num_replicas, stats["loss"])
    pairs = zip(weights["one"], weights["two"], strict=True)
    worst = max(float(np.abs(a - b).max()) for a, b in pairs)
    print("max_abs_diff", worst)
    """
)


def test_two_replicas_match_one_replica(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    doc = job_document(
        tmp_path, corpus, "mlm", steps=3, warmup_steps=1, checkpoint_every=3, log_every=1
    )
    doc["model"]["config"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    one = write_job(tmp_path / "one", {**doc, "output": str(tmp_path / "one" / "out")})
    prepare_data(one)
    two_root = tmp_path / "two"
    copy_prepared(one, two_root, doc)
    (tmp_path / "check.py").write_text(SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "check.py"),
            str(tmp_path / "one" / "job.yaml"),
            str(two_root / "job.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["one"].split()[0] == "1" and lines["two"].split()[0] == "2"
    # Same data, same masks, same global normalisation: the same weights after 3 steps.
    assert float(lines["max_abs_diff"]) < 1e-4, result.stdout
