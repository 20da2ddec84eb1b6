"""The JAX backend's learning rate (linear warm-up, then linear / cosine decay, or constant)
and AdamW (Keras 3): the TF backend's rules (payload/backends/tf/schedule.py), the same
schedule as training.learning_rate_at.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import keras

if TYPE_CHECKING:
    from payload.spec import TrainSpec

# Weight decay is not applied to LayerNorm scales/offsets or biases (the TF backend's rule,
# schedule.NO_DECAY_NAMES); Keras 3 matches these against each variable's own name.
NO_DECAY_NAMES = ("gamma", "beta", "bias")


class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """training.learning_rate_at in keras.ops (traced inside the compiled step)."""

    def __init__(self, spec: TrainSpec):
        self.peak = float(spec.learning_rate)
        self.warmup = float(max(spec.warmup_steps, 0))
        self.span = float(max(spec.steps - spec.warmup_steps, 1))
        self.decay = spec.decay
        self.end = float(spec.end_learning_rate_ratio)

    def __call__(self, step: Any) -> Any:
        step = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((step - self.warmup) / self.span, 0.0, 1.0)
        if self.decay == "linear":
            factor = 1.0 - (1.0 - self.end) * progress
        elif self.decay == "cosine":
            factor = self.end + (1.0 - self.end) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        else:
            factor = jnp.ones_like(progress)
        decayed = self.peak * factor
        if self.warmup > 0:
            warm = self.peak * jnp.minimum((step + 1.0) / self.warmup, 1.0)
            return jnp.where(step < self.warmup, warm, decayed)
        return decayed

    def get_config(self) -> dict[str, Any]:
        return {"peak": self.peak, "warmup": self.warmup, "span": self.span}


def create_optimizer(spec: TrainSpec) -> keras.optimizers.AdamW:
    """AdamW with the TF backend's hyper-parameters, schedule, decay exclusions and global
    norm clipping (train.clip_norm; 0 disables it)."""
    optimizer = keras.optimizers.AdamW(
        learning_rate=WarmupDecay(spec),
        weight_decay=spec.weight_decay,
        beta_1=spec.adam_beta1,
        beta_2=spec.adam_beta2,
        epsilon=spec.adam_epsilon,
        global_clipnorm=float(spec.clip_norm) if spec.clip_norm > 0 else None,
        name="adamw",
    )
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return optimizer
