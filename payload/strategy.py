"""The one place for accelerator, distribution and XLA rules.

    accelerator  strategy                                   precision (auto)  jit_compile
    TPU VM       TPUStrategy(TPUClusterResolver("local"))   mixed_bfloat16    never (the TPU
                                                                              compiles the
                                                                              whole step)
    GPU(s)       MirroredStrategy                           float32           True
    CPU          default strategy                           float32           True

`precision: bf16` forces mixed_bfloat16 anywhere (slow on most CPUs, but allowed);
`precision: fp32` forces float32 anywhere. `decide()` is pure and unit-tested for every
accelerator; `connect()` can only be exercised for real on the matching hardware.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf
import tf_keras

ACCELERATORS = ("tpu", "gpu", "cpu")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class RuntimePlan:
    accelerator: str  # tpu | gpu | cpu
    policy: str  # tf_keras mixed-precision policy: float32 | mixed_bfloat16
    jit_compile: bool  # XLA-compile the train step with tf.function(jit_compile=True)
    steps_per_execution: int  # train steps per host->device call


@dataclass(frozen=True)
class Runtime:
    plan: RuntimePlan
    strategy: tf.distribute.Strategy

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)


def decide(accelerator: str, precision: str) -> RuntimePlan:
    """The rules, as a pure function of the accelerator kind and the requested precision."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    bf16 = precision == "bf16" or (precision == "auto" and accelerator == "tpu")
    return RuntimePlan(
        accelerator=accelerator,
        policy="mixed_bfloat16" if bf16 else "float32",
        # XLA on TPU is implicit; jit_compile=True there breaks TPUStrategy's own compilation.
        jit_compile=accelerator != "tpu",
        # On a TPU each host->device round trip costs more than a small step: run many
        # steps per call. On CPU/GPU the loop overhead is negligible.
        steps_per_execution=64 if accelerator == "tpu" else 8,
    )


def tpu_present() -> bool:
    """True on a Cloud TPU VM: TPU device files (v2-v4 /dev/accel*, v5+ vfio) and libtpu."""
    dev = Path("/dev")
    devices = list(dev.glob("accel*")) or list(dev.glob("vfio/[0-9]*"))
    return bool(devices) and importlib.util.find_spec("libtpu") is not None


def detect() -> str:
    if tpu_present():
        return "tpu"
    if tf.config.list_physical_devices("GPU"):
        return "gpu"
    return "cpu"


def connect(accelerator: str) -> tf.distribute.Strategy:
    """The distribution strategy for the accelerator (initialises the TPU system)."""
    if accelerator == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver("local")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    if accelerator == "gpu":
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def setup(precision: str, accelerator: str | None = None) -> Runtime:
    """Detect the accelerator (unless given), connect, and set the global precision policy.

    Must run before any model is built; build the model and optimizer inside
    `runtime.strategy.scope()`.
    """
    plan = decide(accelerator or detect(), precision)
    strategy = connect(plan.accelerator)
    tf_keras.mixed_precision.set_global_policy(plan.policy)
    return Runtime(plan=plan, strategy=strategy)


def describe(runtime: Runtime) -> dict[str, Any]:
    return {
        "accelerator": runtime.plan.accelerator,
        "replicas": runtime.num_replicas,
        "policy": runtime.plan.policy,
        "jit_compile": runtime.plan.jit_compile,
        "steps_per_execution": runtime.plan.steps_per_execution,
    }
