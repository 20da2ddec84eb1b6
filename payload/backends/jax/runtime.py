"""The devices of a run on the Keras 3 / JAX backend, and the rules that follow from them:
the accelerator and its chip (payload/model/kernels.py: what attention kernel it has), the
precision (`train.precision: auto` is mixed bfloat16 where the chip computes bfloat16
natively: TPUs and NVIDIA GPUs of compute capability 8.0+), the optimizer steps per compiled
call and the device mesh (mesh.py). The TF backend's twin is payload/backends/tf/strategy.py.

On a declared TPU/GPU VM (payload/core/hosts.py) a host without its accelerator is a one-line
error, not a CPU run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from payload.backends.jax import attention as attention_lib
from payload.backends.jax import distributed
from payload.backends.jax import mesh as mesh_lib
from payload.core import hosts
from payload.core.errors import SliceError, SpecError
from payload.model import kernels

BACKEND = "jax"
# Optimizer steps per compiled call: on a TPU a host round trip costs more than a small
# step (the TF backend's steps_per_execution); on CPU/GPU 8 (bench/bench_jax_steps.py).
STEPS_PER_CALL = {"tpu": 64, "gpu": 8, "cpu": 8}
# A chunk also ends once it holds this many seconds of measured steps: a stop signal is
# acted on at the end of the chunk after the one running when it arrived (the next is
# dispatched before the host agrees on stopping), and Compute Engine's preemption notice
# leaves about 30 s for that and the checkpoint (docs/preemption.md). None on the CPU: the
# tests' chunks must not depend on the machine's speed (CHUNK_SECONDS_ENV sets one there).
CHUNK_SECONDS: dict[str, float | None] = {"tpu": 5.0, "gpu": 5.0, "cpu": None}
CHUNK_SECONDS_ENV = "TPU_PAYLOAD_CHUNK_SECONDS"
# A test hook, nothing else: the bytes of memory this process's devices report. CPU devices
# report none (memory_stats() is None), so the tests give each process of a two-process
# "slice" its own figure to show that every process plans the same mesh
# (tests/payload/test_jax_slice.py).
MEMORY_ENV = "TPU_PAYLOAD_TEST_DEVICE_MEMORY"


@dataclass(frozen=True)
class Facts:
    """What a run's programs depend on about its devices, as explicit values: read from the
    real devices (`read_facts`, the trainer) or stated for a target that is not here
    (payload/backends/jax/aot.py: a TPU type's figures from payload/plan/accelerators.yaml).
    `runtime_of` and the programs (program.py) are pure functions of these."""

    platform: str  # tpu | gpu | cpu
    device_kind: str  # what JAX calls the chip, e.g. "TPU v5 lite"
    local_devices: int  # this process's devices
    device_memory: int | None  # bytes per device every process plans with (None: unknown)
    memory_source: str = ""  # where device_memory comes from, when not this device itself
    process_index: int = 0
    process_count: int = 1
    gpu_bf16: bool = False  # a declared GPU VM whose GPUs train in bfloat16 (payload/core/hosts.py)
    # What the kernels table (payload/model/kernels.py) reads of the chip: read_facts takes it from
    # the real device (chip_of); None: the platform and device_kind's (a TPU or the CPU; a
    # GPU's facts must state its vendor and compute capability, else no kernel is assumed).
    chip: kernels.Chip | None = None

    def __post_init__(self) -> None:
        if self.chip is None:
            chip = kernels.device_chip(self.platform, "", self.device_kind, None)
            object.__setattr__(self, "chip", chip)


@dataclass(frozen=True)
class Runtime:
    """The devices of this run as JAX sees them, and the rules that follow."""

    accelerator: str  # tpu | gpu | cpu
    policy: str  # Keras dtype policy: float32 | mixed_bfloat16
    steps_per_execution: int
    chunk_seconds: float | None
    mesh: Mesh
    mesh_plan: mesh_lib.MeshPlan
    process_index: int
    process_count: int
    facts: Facts
    # The attention kernel of the model (attention.choose, once the model's config is known).
    attention: attention_lib.Attention | None = None

    @property
    def chip(self) -> kernels.Chip:
        """What the kernels table (payload/model/kernels.py) reads of the accelerator
        (Facts.chip)."""
        return self.facts.chip or kernels.CPU  # never None after Facts.__post_init__

    @property
    def num_replicas(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def is_chief(self) -> bool:
        return self.process_index == 0

    @property
    def compute_dtype(self) -> str:
        return "bfloat16" if self.policy == "mixed_bfloat16" else "float32"

    def describe(self) -> dict[str, Any]:
        facts = self.facts
        return {
            "backend": BACKEND,
            "accelerator": self.accelerator,
            "replicas": self.num_replicas,
            "hosts": self.process_count,
            "policy": self.policy,
            "jit_compile": True,
            "steps_per_execution": self.steps_per_execution,
            "chunk_seconds": self.chunk_seconds,
            "devices": (
                f"{facts.local_devices} x {facts.device_kind}" if facts.local_devices else "none"
            ),
            "chip": self.chip.describe(),
            "mesh": self.mesh_plan.describe(),
            "sharding_reason": self.mesh_plan.reason,
            "jax": jax.__version__,
            **({"attention": self.attention.describe()} if self.attention else {}),
        }


def _platform(device: Any) -> str:
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else str(device.platform)


def chip_of(device: Any) -> kernels.Chip:
    """The chip of a JAX device (kernels.device_chip): a GPU's vendor from its client's
    platform_version ("cuda ..." / "rocm ..."), an NVIDIA GPU's compute_capability."""
    client = getattr(device, "client", None)
    return kernels.device_chip(
        str(device.platform),
        str(getattr(client, "platform_version", "") or ""),
        str(device.device_kind),
        getattr(device, "compute_capability", None),
    )


def policy_for(precision: str, chip: kernels.Chip, managed_bf16: bool = False) -> str:
    """The Keras policy of `train.precision` on `chip`: mixed bfloat16 for bf16, and for
    auto where the chip computes bfloat16 natively (or a managed GPU VM's catalog says so:
    `managed_bf16`, Facts.gpu_bf16); float32 otherwise."""
    bf16 = kernels.compute_dtype(precision, chip) == "bfloat16"
    return "mixed_bfloat16" if bf16 or (precision == "auto" and managed_bf16) else "float32"


def runtime(precision: str, sharding: str = "auto", parameters: int = 0) -> Runtime:
    """Detect the devices; on a declared TPU/GPU VM (payload/core/hosts.py) a host without them
    is a one-line error, not a CPU run. The mesh follows `train.sharding` for a model of
    `parameters` (mesh.plan). Reading the devices (`read_facts`) is all that happens here;
    the rest is `runtime_of`, which `tpu-payload compile` calls with a target's facts."""
    devices = checked_devices()
    facts = read_facts(devices)
    rt = runtime_of(facts, devices, precision=precision, sharding=sharding, parameters=parameters)
    check_same_mesh(rt.mesh_plan)
    return dataclasses.replace(rt, chunk_seconds=_chunk_seconds(rt.accelerator))


def read_facts(devices: list[Any]) -> Facts:
    """The facts of this process's real devices (`devices`: every device of every process,
    checked_devices); on a slice, the device memory every process agrees on."""
    local = jax.local_devices()
    memory, memory_source = planning_memory()
    gpu = hosts.expected_gpu()
    return Facts(
        platform=_platform(devices[0]),
        device_kind=str(local[0].device_kind) if local else "none",
        local_devices=len(local),
        device_memory=memory,
        memory_source=memory_source,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        gpu_bf16=gpu is not None and gpu.policy == "mixed_bfloat16",
        chip=chip_of(local[0] if local else devices[0]),
    )


def runtime_of(
    facts: Facts, devices: Sequence[Any], *, precision: str, sharding: str, parameters: int
) -> Runtime:
    """The runtime on `devices` (real ones, or a TPU topology's compile-only devices) with
    these `facts`: a pure function of its arguments (no device is queried)."""
    mesh_plan = mesh_lib.plan(
        sharding, parameters=parameters, devices=len(devices), memory=facts.device_memory
    )
    if facts.memory_source:
        mesh_plan = dataclasses.replace(
            mesh_plan, reason=f"{mesh_plan.reason} ({facts.memory_source})"
        )
    kind = facts.platform
    return Runtime(
        accelerator=kind,
        policy=policy_for(precision, facts.chip or kernels.CPU, facts.gpu_bf16),
        steps_per_execution=STEPS_PER_CALL[kind],
        chunk_seconds=CHUNK_SECONDS[kind],
        mesh=mesh_lib.build_mesh(mesh_plan, devices),
        mesh_plan=mesh_plan,
        process_index=facts.process_index,
        process_count=facts.process_count,
        facts=facts,
    )


def planning_memory() -> tuple[int | None, str]:
    """(the device memory every process plans the mesh with, where it comes from): this
    process's own first device (`jax.local_devices()`: `memory_stats()` works only on an
    addressable device, and global device 0 belongs to process 0 alone), the smallest over
    every process of the slice, so that every host plans the same mesh and compiles the same
    program."""
    local = jax.local_devices()
    injected = os.environ.get(MEMORY_ENV, "")
    mine = int(injected) if injected else mesh_lib.device_memory(local[0]) if local else None
    if jax.process_count() == 1:
        return mine, ""
    agreed = distributed.agree_on_minimum("device-memory", mine)
    return agreed, f"the smallest of {jax.process_count()} processes' device memory"


def check_same_mesh(mesh_plan: mesh_lib.MeshPlan) -> None:
    """Every process plans the same mesh, or every process stops with the same one line (a
    host that plans another mesh compiles another program, and the first collective hangs:
    e.g. a host running another payload version)."""
    mine = json.dumps(mesh_plan.describe(), sort_keys=True)
    plans = distributed.gather_strings("mesh-plan", mine)
    if len(set(plans)) > 1:
        listed = "; ".join(f"process {i}: {p}" for i, p in enumerate(plans))
        raise SliceError(
            f"the processes of this slice planned different meshes ({listed}); every host "
            "must run the same payload and job"
        )


def _chunk_seconds(kind: str) -> float | None:
    raw = os.environ.get(CHUNK_SECONDS_ENV, "")
    if not raw:
        return CHUNK_SECONDS[kind]
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SpecError(f"{CHUNK_SECONDS_ENV}: {raw!r} must be a positive number of seconds")
    return value


def checked_devices() -> list[Any]:
    """Every device of every process; on a declared TPU/GPU VM without them, one line."""
    tpu, gpu = hosts.expected_tpu(), hosts.expected_gpu()
    try:
        devices = jax.devices()
    except RuntimeError as exc:  # JAX_PLATFORMS=tpu (the TPU VM's unit) and no TPU backend
        if tpu is None:
            raise
        raise tpu_init_failure(tpu, exc, attached_tpu_chips()) from None
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


def attached_tpu_chips() -> int:
    """The TPU chips on this host's PCI bus, as JAX itself counts them before it loads libtpu
    (jax 0.10.2 jax/_src/hardware_utils.py `num_available_tpu_chips_and_device_id`: Google's
    PCI vendor id and the TPU device ids under /sys/bus/pci/devices)."""
    from jax._src import hardware_utils  # noqa: PLC0415  (no public API counts them)

    return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])


def tpu_init_failure(tpu: hosts.TpuHost, exc: RuntimeError, chips: int) -> Exception:
    """What JAX's RuntimeError on a TPU VM is (jax 0.10.2 xla_bridge.backends: "Unable to
    initialize backend 'tpu': <libtpu's error>", whatever libtpu raised): no TPU chip on the
    PCI bus is a VM without its TPU (TpuNotFoundError, a user error: another accelerator
    type or runtime is needed); chips there that libtpu could not open is a transient
    failure (TpuUnavailableError: another process holding the TPU, a slice whose hosts are
    not all up, a driver not ready), which the unit restarts and, if it lasts, its
    failure count stops (infra/render/templates/tpu.sh `trainer_stopped`)."""
    detail = " ".join(str(exc).split())[:300]
    if chips == 0:
        return hosts.tpu_not_found(
            tpu,
            f"no TPU chip on this VM's PCI bus and JAX {jax.__version__} could not initialise "
            f"it ({detail})",
        )
    return hosts.tpu_unavailable(
        tpu, chips, f"JAX {jax.__version__} could not initialise them ({detail})"
    )


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
