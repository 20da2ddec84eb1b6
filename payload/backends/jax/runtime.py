"""The devices of a run on the Keras 3 / JAX backend, and the rules that follow from them:
the accelerator, the precision (bfloat16 on TPU), the optimizer steps per compiled call and
the device mesh (mesh.py). The TF backend's twin is payload/backends/tf/strategy.py.

On a declared TPU/GPU VM (payload/hosts.py) a host without its accelerator is a one-line
error, not a CPU run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from payload import hosts
from payload.backends.jax import attention as attention_lib
from payload.backends.jax import mesh as mesh_lib
from payload.errors import SpecError

BACKEND = "jax"
# Optimizer steps per compiled call: on a TPU a host round trip costs more than a small
# step (the TF backend's steps_per_execution); on CPU/GPU 8 (bench/bench_jax_steps.py).
STEPS_PER_CALL = {"tpu": 64, "gpu": 8, "cpu": 8}


@dataclass(frozen=True)
class Runtime:
    """The devices of this run as JAX sees them, and the rules that follow."""

    accelerator: str  # tpu | gpu | cpu
    policy: str  # Keras dtype policy: float32 | mixed_bfloat16
    steps_per_execution: int
    mesh: Mesh
    mesh_plan: mesh_lib.MeshPlan
    process_index: int
    process_count: int
    # The attention kernel of the model (attention.choose, once the model's config is known).
    attention: attention_lib.Attention | None = None

    @property
    def num_replicas(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def is_chief(self) -> bool:
        return self.process_index == 0

    def describe(self) -> dict[str, Any]:
        local = jax.local_devices()
        return {
            "backend": BACKEND,
            "accelerator": self.accelerator,
            "replicas": self.num_replicas,
            "hosts": self.process_count,
            "policy": self.policy,
            "jit_compile": True,
            "steps_per_execution": self.steps_per_execution,
            "devices": f"{len(local)} x {local[0].device_kind}" if local else "none",
            "mesh": self.mesh_plan.describe(),
            "sharding_reason": self.mesh_plan.reason,
            "jax": jax.__version__,
            **({"attention": self.attention.describe()} if self.attention else {}),
        }


def _platform(device: Any) -> str:
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else str(device.platform)


def runtime(precision: str, sharding: str = "auto", parameters: int = 0) -> Runtime:
    """Detect the devices; on a declared TPU/GPU VM (payload/hosts.py) a host without them
    is a one-line error, not a CPU run. The mesh follows `train.sharding` for a model of
    `parameters` (mesh.plan)."""
    devices = checked_devices()
    gpu = hosts.expected_gpu()
    kind = _platform(devices[0])
    bf16_gpu = gpu is not None and gpu.policy == "mixed_bfloat16"
    auto_bf16 = kind == "tpu" or (kind == "gpu" and bf16_gpu)
    bf16 = precision == "bf16" or (precision == "auto" and auto_bf16)
    mesh_plan = mesh_lib.plan(
        sharding,
        parameters=parameters,
        devices=len(devices),
        memory=mesh_lib.device_memory(devices[0]),
    )
    return Runtime(
        accelerator=kind,
        policy="mixed_bfloat16" if bf16 else "float32",
        steps_per_execution=STEPS_PER_CALL[kind],
        mesh=mesh_lib.build_mesh(mesh_plan, devices),
        mesh_plan=mesh_plan,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def checked_devices() -> list[Any]:
    """Every device of every process; on a declared TPU/GPU VM without them, one line."""
    tpu, gpu = hosts.expected_tpu(), hosts.expected_gpu()
    try:
        devices = jax.devices()
    except RuntimeError as exc:  # JAX_PLATFORMS=tpu (the TPU VM's unit) and no TPU
        if tpu is None:
            raise
        detail = " ".join(str(exc).split())[:300]
        raise hosts.tpu_not_found(
            tpu, f"JAX {jax.__version__} could not initialise it ({detail})"
        ) from None
    kind = _platform(devices[0])
    seen = ", ".join(sorted({f"{d.platform} ({d.device_kind})" for d in devices}))
    if tpu is not None and kind != "tpu":
        raise hosts.tpu_not_found(
            tpu, f"JAX {jax.__version__} sees only {seen} (JAX_PLATFORMS={_env('JAX_PLATFORMS')})"
        )
    if gpu is not None and kind != "gpu":
        raise hosts.GpuNotFoundError(
            f"GPU not found: this VM should have {gpu.count} × {gpu.gpu} (image {gpu.image}) "
            f"but JAX {jax.__version__} sees only {seen}; not training on the host CPU (check "
            "nvidia-smi and `journalctl -t tpu-pretrain` on the VM)"
        )
    return list(devices)


def _env(name: str) -> str:
    return os.environ.get(name, "") or "unset"


def check_global_batch(global_batch_size: int, rt: Runtime, grad_accum_steps: int = 1) -> None:
    """Every micro-batch (the global batch / train.grad_accum_steps) splits evenly over the
    devices."""
    if global_batch_size % rt.num_replicas:
        raise SpecError(
            f"train.global_batch_size: {global_batch_size} is not divisible by the "
            f"{rt.num_replicas} devices JAX sees ({rt.describe()['devices']} per host, "
            f"{rt.process_count} host(s)); use a multiple of {rt.num_replicas}"
        )
    need = rt.num_replicas * grad_accum_steps
    if global_batch_size % need:
        raise SpecError(
            f"train.global_batch_size: {global_batch_size} does not split into "
            f"train.grad_accum_steps: {grad_accum_steps} micro-batches over the "
            f"{rt.num_replicas} devices JAX sees; use a multiple of {need}"
        )
