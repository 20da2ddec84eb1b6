"""The JAX backend's device mesh and sharding rules: the one place where they are decided.

The mesh has two axes, `data` x `fsdp` (MaxText's names), over every device of every process,
built by `jax.make_mesh` (which orders TPU devices by their physical topology):
- `data`: data parallelism. Each device holds the whole training state and its rows of the
  batch; XLA all-reduces the gradients.
- `fsdp`: fully sharded data parallelism (ZeRO-3). Each weight and its optimizer slots are
  split over the `fsdp` devices along one dimension (`partition_spec`); XLA gathers a
  weight when a layer needs it and reduce-scatters its gradient. The batch is split over
  BOTH axes, so an FSDP step computes what a data-parallel step computes.

`train.sharding` picks the mesh (`plan`): `data` = (N, 1), `fsdp` = (1, N) (MaxText's
"recommended sharding strategy for small-scale training", `ici_fsdp_parallelism: -1`), and
`auto` = `data` while the state fits a chip with room for activations, else `fsdp`.

The rule of a weight (`partition_spec`) is data, not code scattered through the trainer (the
tables and constants live in payload/model/sharding.py, framework-free, which the plan reads too):
- a family's table (sharding.FAMILY_RULES) names, by the variable's path, the axis of each
  weight that is split over `fsdp`, and takes precedence;
- otherwise (the families without a table: BERT, RoBERTa, GPT-2, and a table's axis that
  the `fsdp` size does not divide) the generic rule: an array of rank >= 2 is split along
  its largest dimension that the axis size divides (the first such on ties);
- vectors (biases, norm scales), scalars (the step counter) and arrays no dimension of
  which divides stay replicated: they are a rounding error of the state; so do the norm
  scales stacked over the decoder's layers [L, H] (the table says REPLICATED);
- weights stacked over the decoder's layers (Llama's [L, ...], models.LlamaLayers) never
  split their layer axis: each layer's slice is split as one layer's weight would be, so
  the scan over layers gathers one layer at a time (MaxText's `layers` axis has no mesh
  axis either).
An optimizer slot has its weight's shape and its weight's path in its own (Keras names it
`<weight path with / as _>_<slot>`), hence its weight's rule.

Llama's table follows MaxText's logical axis rules (AI-Hypercomputer/maxtext
MaxText/configs/base.yml `logical_axis_rules`: `embed` -> `fsdp`, while `vocab`, `mlp` and
`heads` go to the `tensor` axis, which this mesh does not have): every weight is split along
its hidden-size (`embed`) dimension: the embedding table [V, H] and the untied LM head
[H, V] on H, q/k/v/gate/up kernels [L, H, out] on their input, o/down kernels [L, in, H] on
their output. Why not the generic rule's largest dimension: the vocabulary, which the user's
tokenizer sets (GPT-2's 50,257 is odd), would decide whether the two largest
matrices are split at all, and the split axis would differ from weight to weight; H of every
preset is a multiple of 64, so one rule covers the family up to 64-way FSDP.
Variables are created sharded (`sharded_distribution`, a Keras distribution whose layouts
follow the rule): Keras jit-compiles a large weight's initializer with the weight's sharding as its
output, so no chip holds a replicated copy first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from payload.core.errors import SpecError
from payload.model.sharding import (
    AXES,
    BATCH,
    DATA_PARALLEL_STATE_SHARE,
    REPLICATED,
    SHARDINGS,
    STATE_BYTES_PER_PARAMETER,
    family_axis,
    stacked_layers,
)


@dataclass(frozen=True)
class MeshPlan:
    """The mesh shape a run uses and why."""

    sharding: str  # data | fsdp
    data: int
    fsdp: int
    reason: str

    @property
    def devices(self) -> int:
        return self.data * self.fsdp

    def describe(self) -> dict[str, Any]:
        return {"sharding": self.sharding, "data": self.data, "fsdp": self.fsdp}


def state_bytes(parameters: int) -> int:
    return parameters * STATE_BYTES_PER_PARAMETER


def device_memory(device: Any) -> int | None:
    """A device's memory in bytes as its runtime reports it (TPU, GPU); None on CPU."""
    try:
        stats = device.memory_stats()
    except Exception:  # some PJRT plugins do not implement it
        return None
    if not stats:
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def plan(setting: str, *, parameters: int, devices: int, memory: int | None) -> MeshPlan:
    """The mesh for `train.sharding: setting`, a model of `parameters` and `devices` chips
    of `memory` bytes each (None: unknown, as on CPU)."""
    if setting not in SHARDINGS:
        raise SpecError(f"train.sharding: {setting!r} is not one of {', '.join(SHARDINGS)}")
    need = state_bytes(parameters)
    gib = (
        f"{need / 2**30:.2f} GiB of state "
        f"({parameters:,} parameters x {STATE_BYTES_PER_PARAMETER} B)"
    )
    if setting == "data":
        return MeshPlan("data", devices, 1, f"train.sharding: data; {gib} on every device")
    if setting == "fsdp":
        return MeshPlan(
            "fsdp", 1, devices, f"train.sharding: fsdp; {gib} split over {devices} devices"
        )
    if memory is None:
        return MeshPlan("data", devices, 1, f"auto: device memory unknown; {gib} on every device")
    share = f"{DATA_PARALLEL_STATE_SHARE:.0%} of a device's {memory / 2**30:.1f} GiB"
    if need <= DATA_PARALLEL_STATE_SHARE * memory:
        return MeshPlan("data", devices, 1, f"auto: {gib} fits {share}")
    if devices == 1:
        return MeshPlan("data", 1, 1, f"auto: {gib} exceeds {share}, and one device has no peer")
    return MeshPlan(
        "fsdp", 1, devices, f"auto: {gib} exceeds {share}: split over {devices} devices"
    )


def build_mesh(mesh_plan: MeshPlan, devices: Sequence[Any] | None = None) -> Mesh:
    """The (data, fsdp) mesh over `devices` (default: every device of every process)."""
    return jax.make_mesh(
        (mesh_plan.data, mesh_plan.fsdp),
        AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=devices,
    )


def partition_spec(
    shape: Sequence[int], fsdp: int, *, path: str = "", family: str | None = None
) -> P:
    """The PartitionSpec of a weight (or its optimizer slot) of `shape` at `path` of a
    `family` model on a mesh whose `fsdp` axis has `fsdp` devices (the rules in the module's
    docstring)."""
    if fsdp <= 1 or len(shape) < 2:
        return P()
    axis = family_axis(family, path)
    if axis == REPLICATED:
        return P()
    if axis is not None and axis < len(shape) and shape[axis] % fsdp == 0:
        table: list[Any] = [None] * len(shape)
        table[axis] = "fsdp"
        return P(*table)
    # A stack over the decoder's layers never splits its layer axis (axis 0).
    first = 1 if stacked_layers(family, path) else 0
    candidates = [
        (int(size), -axis) for axis, size in enumerate(shape) if axis >= first and size % fsdp == 0
    ]
    if not candidates:
        return P()
    _, negative_axis = max(candidates)
    spec: list[Any] = [None] * len(shape)
    spec[-negative_axis] = "fsdp"
    return P(*spec)


def sharding_of(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(shape, int(mesh.shape["fsdp"])))


def batch_sharding(mesh: Mesh, *, chunk: bool) -> NamedSharding:
    """A batch [B, ...] (or a chunk of batches [K, B, ...]) split over both axes."""
    return NamedSharding(mesh, P(None, BATCH) if chunk else P(BATCH))


def sharded_distribution(mesh: Mesh, family: str | None = None) -> Any:
    """A Keras distribution that lays every variable of a `family` model (and its optimizer
    slots) out by `partition_spec` on `mesh`:
    variables created in its `scope()` (the model's, the optimizer's slots) are created
    sharded. Keras is imported here, not with this module (whose rules need only JAX)."""
    import keras  # noqa: PLC0415

    # ModelParallel is Keras' public base for a distribution with per-variable layouts; its
    # layout map stays empty: every layout comes from the rule.
    class Sharded(keras.distribution.ModelParallel):
        def __init__(self) -> None:
            device_mesh = keras.distribution.DeviceMesh(
                shape=tuple(mesh.devices.shape),
                axis_names=list(mesh.axis_names),
                devices=mesh.devices,
            )
            super().__init__(
                layout_map=keras.distribution.LayoutMap(device_mesh),
                batch_dim_name="data",
                auto_shard_dataset=False,
            )
            self.fsdp = int(mesh.shape["fsdp"])

        def get_data_layout(self, data_shape: Sequence[int]) -> Any:
            axes: list[Any] = [None] * len(data_shape)
            axes[0] = BATCH
            return keras.distribution.TensorLayout(axes, self.device_mesh)

        def get_variable_layout(self, variable: Any) -> Any:
            if getattr(variable, "_layout", None) is not None:
                return variable._layout
            spec = partition_spec(
                tuple(variable.shape), self.fsdp, path=str(variable.path), family=family
            )
            axes = list(spec) + [None] * (len(variable.shape) - len(spec))
            return keras.distribution.TensorLayout(axes, self.device_mesh)

        def get_tensor_layout(self, path: str) -> Any:
            return None

        def distribute_dataset(self, dataset: Any) -> Any:
            return dataset  # each process feeds its own shard files (payload/backends/tf/input.py)

    return Sharded()


def keep_rows(x: Any, mesh: Mesh | None) -> Any:
    """`x` [B, ...] (an activation) constrained to the batch's layout: its rows split over both
    axes, every other dimension whole. Applied at every block boundary (models/): without it
    XLA's partitioner follows the FSDP-split weights and shards activations along the hidden
    size, then all-gathers and all-reduces whole-batch activations in every layer (the
    collectives `collectives` lists; tests/payload/test_jax_sharding.py reads them from the
    compiled step) where FSDP means gathering weights only. MaxText constrains its
    activations the same way (`activation_batch` -> data, fsdp). A no-op off a mesh, on one
    device, and for a batch the axes do not divide (Keras' symbolic build with one row)."""
    if mesh is None or mesh.size == 1 or not getattr(x, "ndim", 0):
        return x
    if int(x.shape[0]) % mesh.size:
        return x
    spec = P(BATCH, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def whole(x: Any, mesh: Mesh | None) -> Any:
    """`x` constrained to be whole on every device of `mesh` (a no-op off a mesh or on one
    device): an FSDP-split weight gathered once where a loop reads it whole, rather than the
    compiler's choice inside the loop."""
    if mesh is None or mesh.size == 1 or not getattr(x, "ndim", 0):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


# The collectives of a compiled program's HLO text, by op and result shapes: `all-gather`,
# `all-reduce`, `reduce-scatter`, `all-to-all`, `collective-permute` (and their async -start
# forms). The HLO of `compiled.as_text()`: `%name = f32[16,64]{1,0} all-gather(...)`, a tuple
# `(f32[..], ..)` for a combined op.
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r" = (.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]]:
    """[(op, ((dtype, shape), ...)), ...]: every collective instruction of `hlo_text` with the
    arrays it produces, in program order (what a compiled step communicates)."""
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        arrays = tuple(
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(match.group(1))
        )
        found.append((match.group(2), arrays))
    return found


def per_device_state_bytes(shapes: Sequence[Sequence[int]], mesh_plan: MeshPlan) -> int:
    """The fp32 state bytes one device holds for weights of `shapes` under `mesh_plan`:
    the formula docs/backends.md states, for the memory benchmark to compare with."""
    total = 0
    for shape in shapes:
        size = math.prod(int(d) for d in shape) if shape else 1
        sharded = "fsdp" in tuple(partition_spec(shape, mesh_plan.fsdp))
        total += size // mesh_plan.fsdp if sharded else size
    return total * STATE_BYTES_PER_PARAMETER


def shardings_of(tree: Any) -> Any:
    """The pytree of the shardings of a pytree of arrays (the state's, for jit's outputs)."""
    return jax.tree_util.tree_map(lambda x: x.sharding, tree)


def gather(array: Any) -> np.ndarray:
    """The whole value of a (possibly sharded, possibly multi-process) array on this host.
    Every process must call it for the same arrays in the same order (a collective)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
