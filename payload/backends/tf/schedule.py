"""Learning rate: linear warm-up, then linear / cosine decay (or constant), and AdamW."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf
import tf_keras

# Weight decay is not applied to normalisation scales or biases (BERT, GPT-2 practice).
NO_DECAY_NAMES = ("LayerNorm", "layer_norm", "ln_", "bias")


class WarmupDecay(tf_keras.optimizers.schedules.LearningRateSchedule):
    """peak * step/warmup during warm-up, then decays to peak * end_ratio at total_steps."""

    def __init__(
        self,
        peak: float,
        total_steps: int,
        warmup_steps: int = 0,
        decay: str = "linear",
        end_ratio: float = 0.0,
    ):
        super().__init__()
        if decay not in ("linear", "cosine", "constant"):
            raise ValueError(f"decay must be linear, cosine or constant, got {decay!r}")
        self.peak = float(peak)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.end_ratio = float(end_ratio)

    def __call__(self, step: Any) -> tf.Tensor:
        step = tf.cast(step, tf.float32)
        peak = tf.constant(self.peak, tf.float32)
        warmup = float(max(self.warmup_steps, 0))
        span = float(max(self.total_steps - self.warmup_steps, 1))
        progress = tf.clip_by_value((step - warmup) / span, 0.0, 1.0)
        if self.decay == "linear":
            factor = 1.0 - (1.0 - self.end_ratio) * progress
        elif self.decay == "cosine":
            factor = self.end_ratio + (1.0 - self.end_ratio) * 0.5 * (
                1.0 + tf.cos(math.pi * progress)
            )
        else:
            factor = tf.ones_like(progress)
        decayed = peak * factor
        if warmup > 0:
            # step + 1: the first update already uses a non-zero rate.
            warm = peak * tf.minimum((step + 1.0) / warmup, 1.0)
            return tf.where(step < warmup, warm, decayed)
        return decayed

    def get_config(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
            "end_ratio": self.end_ratio,
        }


def learning_rate_schedule(train: Any) -> WarmupDecay:
    """The schedule of a TrainSpec."""
    return WarmupDecay(
        train.learning_rate,
        train.steps,
        train.warmup_steps,
        train.decay,
        train.end_learning_rate_ratio,
    )


def create_optimizer(train: Any, *, jit_compile: bool) -> tf_keras.optimizers.AdamW:
    """AdamW from a TrainSpec. Clipping is done by the train step (after the all-reduce)."""
    optimizer = tf_keras.optimizers.AdamW(
        learning_rate=learning_rate_schedule(train),
        weight_decay=train.weight_decay,
        beta_1=train.adam_beta1,
        beta_2=train.adam_beta2,
        epsilon=train.adam_epsilon,
        jit_compile=jit_compile,
    )
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return optimizer
