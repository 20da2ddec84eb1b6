"""The one place for accelerator, distribution and XLA rules.

    accelerator  strategy                                   precision (auto)  jit_compile
    TPU VM       TPUStrategy(TPUClusterResolver("local"))   mixed_bfloat16    never (the TPU
                                                                              compiles the
                                                                              whole step)
    GPU(s)       MirroredStrategy                           per the GPU:      True
                                                            mixed_bfloat16 (Ampere+),
                                                            mixed_float16 + dynamic loss
                                                            scaling (T4, V100), else float32
    CPU          default strategy                           float32           True

`precision: bf16` forces mixed_bfloat16 anywhere (slow on most CPUs, but allowed);
`precision: fp32` forces float32 anywhere. `decide()` is pure and unit-tested for every
accelerator; `connect()` can only be exercised for real on the matching hardware.

One host only (a TPU VM of one host, a GPU VM, a CPU): multi-host TPU slices run the JAX
backend (docs/pod-slices.md), and the CLI refuses `TPU_NAME` naming a slice for this backend.

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

from payload.core import hosts
from payload.core.errors import SpecError

ACCELERATORS = ("tpu", "gpu", "cpu")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class RuntimePlan:
    accelerator: str  # tpu | gpu | cpu
    policy: str  # tf_keras mixed-precision policy: float32 | mixed_bfloat16 | mixed_float16
    jit_compile: bool  # XLA-compile the train step with tf.function(jit_compile=True)
    steps_per_execution: int  # train steps per host->device call

    @property
    def loss_scaling(self) -> bool:
        """float16 needs its loss scaled (and steps with inf/NaN gradients skipped)."""
        return self.policy == "mixed_float16"


@dataclass(frozen=True)
class Runtime:
    plan: RuntimePlan
    strategy: tf.distribute.Strategy

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def num_hosts(self) -> int:
        return num_hosts(self.strategy)

    @property
    def is_chief(self) -> bool:
        return is_chief(self.strategy)


# The host declaration is framework-free (payload/core/hosts.py, shared with the JAX backend);
# its names stay importable from here.
TpuNotFoundError = hosts.TpuNotFoundError
GpuNotFoundError = hosts.GpuNotFoundError
TpuHost = hosts.TpuHost
GpuHost = hosts.GpuHost


# Declared by the CLI from the unit's environment: then `setup()` trains on that accelerator
# or fails with one line, never on the CPU, and precision `auto` follows a declared GPU.
expect_gpu = hosts.expect_gpu
expect_tpu = hosts.expect_tpu


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def decide(
    accelerator: str, precision: str, *, host_xla: bool = True, gpu_policy: str = ""
) -> RuntimePlan:
    """The rules, as a pure function of the accelerator kind and the requested precision.

    `host_xla`: whether this TensorFlow build can XLA-compile on the host CPU (tensorflow-tpu
    cannot); without it a CPU plan does not jit_compile. `gpu_policy`: the GPU's policy from
    the catalog (a declared GPU VM): `auto` takes bfloat16 where it is mixed_bfloat16
    (Ampere and later) and float16 where it is mixed_float16 (T4, V100: no bfloat16 units);
    float16 trains with dynamic loss scaling (`RuntimePlan.loss_scaling`, TF's
    mixed-precision guide: float16 gradients underflow without it)."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    auto_bf16 = accelerator == "tpu" or (accelerator == "gpu" and gpu_policy == "mixed_bfloat16")
    bf16 = precision == "bf16" or (precision == "auto" and auto_bf16)
    fp16 = precision == "auto" and accelerator == "gpu" and gpu_policy == "mixed_float16"
    return RuntimePlan(
        accelerator=accelerator,
        policy="mixed_bfloat16" if bf16 else "mixed_float16" if fp16 else "float32",
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
    gpu, tpu = hosts.expected_gpu(), hosts.expected_tpu()
    if gpu is not None:
        _require_gpus(gpu)
        return "gpu"
    if tpu is not None:
        _require_tpu_files(tpu)
        return "tpu"
    if tpu_present():
        return "tpu"
    if tf.config.list_physical_devices("GPU"):
        return "gpu"
    return "cpu"


_tpu_not_found = hosts.tpu_not_found


def _require_tpu_files(host: TpuHost) -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise _tpu_not_found(host, "libtpu is not installed in this environment")
    if not tpu_present():
        raise _tpu_not_found(host, "no TPU device files (/dev/accel*, /dev/vfio/*)")


def _require_gpus(host: GpuHost) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise GpuNotFoundError(
            f"GPU not found: this VM should have {host.count} × {host.gpu} (image {host.image}) "
            f"but TensorFlow {tf.__version__} lists no GPU (built with CUDA: "
            f"{tf.test.is_built_with_cuda()}); not training on the host CPU (check nvidia-smi "
            "and `journalctl -t tpu-pretrain` on the VM)"
        )
    if len(gpus) != host.count:
        _log(f"strategy: {len(gpus)} GPUs found, {host.count} expected on this VM")


def tpu_devices() -> list[str]:
    return [device.name for device in tf.config.list_logical_devices("TPU")]


def connect(accelerator: str) -> tf.distribute.Strategy:
    """The distribution strategy for the accelerator (initialises this VM's TPU system)."""
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
    host = hosts.expected_tpu()
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
    expected_gpu = hosts.expected_gpu()
    gpu_policy = expected_gpu.policy if expected_gpu is not None else ""
    plan = decide(
        kind, precision, host_xla=kind != "cpu" or host_xla_available(), gpu_policy=gpu_policy
    )
    if plan.loss_scaling:
        _log(
            f"strategy: {expected_gpu.gpu if expected_gpu else 'this GPU'} has no bfloat16: "
            "training in float16 with dynamic loss scaling"
        )
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
        "hosts": runtime.num_hosts,
        "policy": runtime.plan.policy,
        "jit_compile": runtime.plan.jit_compile,
        "steps_per_execution": runtime.plan.steps_per_execution,
    }


def num_hosts(strategy: tf.distribute.Strategy) -> int:
    """Hosts in the cluster (1 for the strategies `setup` builds: this backend runs on one
    host; a caller's multi-worker strategy answers through its cluster resolver)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec()
    jobs = spec.jobs if spec else []
    return max(1, sum(spec.num_tasks(job) for job in jobs if job in ("chief", "worker")))


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True in the one process that writes checkpoints, TensorBoard, status and the export.

    On one host that is this process; a multi-client strategy answers through
    `should_checkpoint`.
    """
    return bool(strategy.extended.should_checkpoint)


def check_global_batch(global_batch_size: int, runtime: Runtime) -> None:
    """SpecError (one line) unless the global batch splits evenly over every replica."""
    replicas, hosts = runtime.num_replicas, runtime.num_hosts
    if global_batch_size % replicas == 0:
        return
    where = f"{hosts} hosts x {replicas // hosts}" if hosts > 1 else str(replicas)
    lower = global_batch_size // replicas * replicas
    raise SpecError(
        f"train.global_batch_size: {global_batch_size} must be a multiple of the {replicas} "
        f"replicas of this {runtime.plan.accelerator} ({where} replicas); e.g. "
        f"{max(lower, replicas)} or {lower + replicas}"
    )
