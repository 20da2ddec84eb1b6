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

Two facts of the TPU VM's environment (tensorflow-tpu, requirements/tpu-vm.txt) live here
too: that TensorFlow build has no XLA CPU backend (`jit_compile=True` on the host fails
with "could not find registered transfer manager for platform Host"), so jit is turned off
on a CPU without XLA, with a log line; and on a TPU VM (`expect_tpu()`, set by the CLI from
the trainer unit's environment) a missing TPU is a one-line `TpuNotFoundError` instead of
a silent run on the host CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf
import tf_keras

from payload.errors import UserError

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


class TpuNotFoundError(UserError):
    """This is a TPU VM, but TensorFlow finds no TPU: training on its CPU would be useless."""


@dataclass(frozen=True)
class TpuHost:
    """What the TPU VM's trainer unit says this host is (catalog names)."""

    accelerator_type: str  # e.g. v5litepod-8
    runtime_version: str  # the base image, e.g. v2-alpha-tpuv5-lite


_expected_tpu: TpuHost | None = None


def expect_tpu(host: TpuHost | None) -> None:
    """Declare that this host is a TPU VM (the CLI calls it from the unit's environment):
    then `setup()` trains on its TPU or fails with `TpuNotFoundError`, never on the CPU."""
    global _expected_tpu  # noqa: PLW0603  (set once by the CLI, the edge that reads env)
    _expected_tpu = host


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def decide(accelerator: str, precision: str, *, host_xla: bool = True) -> RuntimePlan:
    """The rules, as a pure function of the accelerator kind and the requested precision.

    `host_xla`: whether this TensorFlow build can XLA-compile on the host CPU (tensorflow-tpu
    cannot); without it a CPU plan does not jit_compile."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    bf16 = precision == "bf16" or (precision == "auto" and accelerator == "tpu")
    return RuntimePlan(
        accelerator=accelerator,
        policy="mixed_bfloat16" if bf16 else "float32",
        # XLA on TPU is implicit; jit_compile=True there breaks TPUStrategy's own compilation.
        jit_compile=accelerator == "gpu" or (accelerator == "cpu" and host_xla),
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
    if _expected_tpu is not None:
        _require_tpu_files(_expected_tpu)
        return "tpu"
    if tpu_present():
        return "tpu"
    if tf.config.list_physical_devices("GPU"):
        return "gpu"
    return "cpu"


def _tpu_not_found(host: TpuHost, reason: str) -> TpuNotFoundError:
    return TpuNotFoundError(
        f"TPU not found: runtime {host.runtime_version} on accelerator {host.accelerator_type}: "
        f"{reason}; not training on the host CPU (check the VM's accelerator and runtime "
        "against infra/catalog.yaml, and `journalctl -t tpu-pretrain` on the VM)"
    )


def _require_tpu_files(host: TpuHost) -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise _tpu_not_found(host, "libtpu is not installed in this environment")
    if not tpu_present():
        raise _tpu_not_found(host, "no TPU device files (/dev/accel*, /dev/vfio/*)")


def tpu_devices() -> list[str]:
    return [device.name for device in tf.config.list_logical_devices("TPU")]


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


def _connect_tpu_or_fail() -> tf.distribute.Strategy:
    """Connect to the TPU; on a declared TPU VM any failure is one `TpuNotFoundError` line."""
    host = _expected_tpu
    try:
        strategy = connect("tpu")
    except (tf.errors.OpError, ValueError, RuntimeError) as exc:
        if host is None:
            raise
        detail = " ".join(str(exc).split())[:300]
        raise _tpu_not_found(
            host, f"TensorFlow could not initialise it ({type(exc).__name__}: {detail})"
        ) from None
    devices = tpu_devices()
    if not devices:
        if host is not None:
            raise _tpu_not_found(host, "TensorFlow lists no TPU devices after initialising")
        raise RuntimeError("TPUStrategy connected but TensorFlow lists no TPU devices")
    _log(f"strategy: {len(devices)} TPU devices: {', '.join(devices)}")
    return strategy


@functools.cache
def host_xla_available() -> bool:
    """Whether this TensorFlow build can XLA-compile on the host CPU. tensorflow-tpu cannot
    (no XLA CPU backend is linked in): probed once with a one-op function."""

    @tf.function(jit_compile=True)
    def double(x: tf.Tensor) -> tf.Tensor:
        return x * 2.0

    try:
        with tf.device("/CPU:0"):
            double(tf.constant(1.0))
    except (tf.errors.NotFoundError, tf.errors.UnimplementedError, tf.errors.InternalError):
        return False
    return True


def setup(precision: str, accelerator: str | None = None) -> Runtime:
    """Detect the accelerator (unless given), connect, and set the global precision policy.

    Must run before any model is built; build the model and optimizer inside
    `runtime.strategy.scope()`.
    """
    kind = accelerator or detect()
    plan = decide(kind, precision, host_xla=kind != "cpu" or host_xla_available())
    if kind == "cpu" and not plan.jit_compile and decide(kind, precision).jit_compile:
        _log(
            f"strategy: jit_compile off: this TensorFlow build ({tf.__version__}) has no XLA "
            "CPU backend (the TPU VM's tensorflow-tpu); the CPU runs the step without XLA"
        )
    strategy = _connect_tpu_or_fail() if kind == "tpu" else connect(kind)
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
