"""Accelerator rules (one place), the learning-rate schedule and chunking of the loop.

The TPU branch of `strategy.connect` can only run on a TPU VM; here its decisions are
tested through the pure `decide()` and the real CPU path through `setup()`.
"""

from __future__ import annotations

import itertools
import math

import pytest
import tensorflow as tf
import tf_keras

from payload.backends.tf import schedule
from payload.backends.tf import strategy as strategy_lib
from payload.backends.tf.train import _chunk_length


@pytest.mark.parametrize(
    ("accelerator", "precision", "policy", "jit"),
    [
        ("tpu", "auto", "mixed_bfloat16", False),
        ("tpu", "bf16", "mixed_bfloat16", False),
        ("tpu", "fp32", "float32", False),
        ("gpu", "auto", "float32", True),
        ("gpu", "bf16", "mixed_bfloat16", True),
        ("cpu", "auto", "float32", True),
        ("cpu", "bf16", "mixed_bfloat16", True),
        ("cpu", "fp32", "float32", True),
    ],
)
def test_decide(accelerator: str, precision: str, policy: str, jit: bool) -> None:
    plan = strategy_lib.decide(accelerator, precision)
    assert (plan.policy, plan.jit_compile) == (policy, jit)
    # Never jit_compile on TPU, whatever was asked.
    assert not (plan.accelerator == "tpu" and plan.jit_compile)
    assert plan.steps_per_execution >= 1


def test_decide_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="accelerator"):
        strategy_lib.decide("npu", "auto")
    with pytest.raises(ValueError, match="precision"):
        strategy_lib.decide("cpu", "fp16")


def test_setup_on_this_machine_is_cpu_default_strategy() -> None:
    assert not strategy_lib.tpu_present()
    assert strategy_lib.detect() == "cpu"
    try:
        runtime = strategy_lib.setup("auto")
        assert runtime.plan.accelerator == "cpu" and runtime.plan.jit_compile
        assert runtime.num_replicas == 1
        assert tf_keras.mixed_precision.global_policy().name == "float32"
        assert runtime.strategy is tf.distribute.get_strategy()
        strategy_lib.setup("bf16")
        assert tf_keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def test_schedule_warmup_then_linear_and_cosine_decay() -> None:
    linear = schedule.WarmupDecay(
        1e-3, total_steps=110, warmup_steps=10, decay="linear", end_ratio=0.1
    )
    values = [float(linear(s)) for s in range(111)]
    assert values[0] == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak on the first step
    assert values[9] == pytest.approx(1e-3)
    assert values[10] == pytest.approx(1e-3)
    assert values[60] == pytest.approx(1e-3 * (1 - 0.9 * 0.5))
    assert values[110] == pytest.approx(1e-4)
    assert all(a >= b for a, b in itertools.pairwise(values[10:]))
    cosine = schedule.WarmupDecay(1e-3, total_steps=100, decay="cosine")
    assert float(cosine(0)) == pytest.approx(1e-3)
    assert float(cosine(50)) == pytest.approx(0.5e-3)
    assert float(cosine(100)) == pytest.approx(0.0, abs=1e-9)
    constant = schedule.WarmupDecay(1e-3, total_steps=100, decay="constant")
    assert float(constant(99)) == pytest.approx(1e-3)
    assert math.isfinite(float(schedule.WarmupDecay(1e-3, total_steps=5, warmup_steps=5)(7)))


def test_chunks_stop_at_log_checkpoint_and_final_boundaries() -> None:
    # steps_per_execution 8, log every 5, checkpoint every 20, 42 steps in total.
    step, chunks = 0, []
    while step < 42:
        n = _chunk_length(step, 42, 8, 5, 20)
        chunks.append(n)
        step += n
    ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    assert ends == [5, 10, 15, 20, 25, 30, 35, 40, 42]
    assert _chunk_length(3, 1000, 64, 100, 100) == 64
    assert _chunk_length(96, 1000, 64, 100, 100) == 4
    # Evaluation boundaries stop a chunk too (eval every 48 on a TPU-sized chunk of 64).
    assert _chunk_length(0, 1000, 64, 100, 100, eval_every=48) == 48
    assert _chunk_length(48, 1000, 64, 100, 100, eval_every=48) == 48
    assert _chunk_length(96, 1000, 64, 1000, 1000, eval_every=0) == 64
