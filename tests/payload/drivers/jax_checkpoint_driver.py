"""Run by test_jax_checkpoint.py in a fresh process with 8 virtual CPU devices (XLA_FLAGS):
the JAX backend's Orbax checkpoints on a synthetic training state, without a model.

 1. a state sharded over 8 devices (weights split on their first axis, a replicated seed
    and step counter) is saved at steps 1..4 with keep=2;
 2. a new Checkpoints object restores step 4 onto a 4-device mesh, replicated, and onto a
    2 x 4 (data, fsdp) mesh with the weights split over `fsdp` on their second axis;
 3. a layout with another shape is refused, a Llama's of one variable per layer in its own
    line;
 4. the space check (require_space) against the size of a written checkpoint.
Prints one JSON line with what the test checks.

argv: checkpoint_dir
"""

import json
import sys
from pathlib import Path

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from payload.backends.jax import checkpoint as checkpoints  # noqa: E402
from payload.backends.jax import steps  # noqa: E402
from payload.core import storage  # noqa: E402
from payload.core.errors import DataError, DiskFullError  # noqa: E402

directory = sys.argv[1]
devices = jax.devices()
assert len(devices) == 8, devices
rng = np.random.default_rng(0)
layout = checkpoints.Layout(
    {
        "trainable": [("dense/kernel", (256, 64)), ("dense/bias", (64,))],
        "non_trainable": [("seed_generator/state", (2,))],
        "optimizer": [("adamw/iterations", ()), ("adamw/kernel_m", (256, 64))],
    }
)
host = steps.TrainState(
    [rng.standard_normal((256, 64)).astype("float32"), rng.standard_normal(64).astype("float32")],
    [np.array([7, 1], "uint32")],
    [np.array(0, "int32"), rng.standard_normal((256, 64)).astype("float32")],
)


def placed(state: steps.TrainState, shardings: steps.TrainState) -> steps.TrainState:
    return jax.tree.map(jax.device_put, state, shardings)


eight = Mesh(np.asarray(devices), ("fsdp",))
split, whole = NamedSharding(eight, P("fsdp")), NamedSharding(eight, P())
saved_shardings = steps.TrainState([split, split], [whole], [whole, split])
store = checkpoints.Checkpoints(directory, layout, keep=2)
saved = {}
for step in range(1, 5):
    host.optimizer[0] = np.array(step, "int32")
    host.trainable[0] = host.trainable[0] + 1.0
    state = placed(host, saved_shardings)
    store.save(step, state)
    saved[step] = jax.device_get(state)
assert all(len(x.sharding.device_set) == 8 for x in state.trainable)
store.close()
on_disk = sorted(p.name for p in Path(directory).iterdir())


def bitwise_equal(a: steps.TrainState, b: steps.TrainState) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in pairs
    )


def like(shardings: steps.TrainState) -> steps.TrainState:
    zeros = jax.tree.map(np.zeros_like, host)
    return placed(zeros, shardings)


four = Mesh(np.asarray(devices[:4]), ("data",))
replicated = NamedSharding(four, P())
two_by_four = Mesh(np.asarray(devices).reshape(2, 4), ("data", "fsdp"))
columns, rest = NamedSharding(two_by_four, P(None, "fsdp")), NamedSharding(two_by_four, P())
targets = {
    "replicated_on_4": steps.TrainState([replicated] * 2, [replicated], [replicated] * 2),
    "fsdp_columns_on_2x4": steps.TrainState([columns, rest], [rest], [rest, columns]),
}
reader = checkpoints.Checkpoints(directory, layout, keep=2)
restored = {}
for name, shardings in targets.items():
    state = reader.restore(4, like(shardings))
    restored[name] = {
        "bitwise_equal": bitwise_equal(state, saved[4]),
        "shardings_as_asked": all(
            x.sharding == s
            for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
        ),
        "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(state)}),
    }
other = checkpoints.Layout(
    {**layout.groups, "trainable": [("dense/kernel", (256, 32)), ("dense/bias", (64,))]}
)
try:
    checkpoints.Checkpoints(directory, other, keep=2).restore(4, like(targets["replicated_on_4"]))
    refused = ""
except DataError as exc:
    refused = str(exc)
steps_found = reader.steps()
reader.close()

# A Llama of earlier releases (one variable per decoder layer) vs today's stacked layers:
# its own line (the layout is checked before any array is read).
per_layer = checkpoints.Layout(
    {**layout.groups, "trainable": [("llama/layers_0/input_layernorm/gamma", (64,))]}
)
old_store = checkpoints.Checkpoints(f"{directory}-llama", per_layer, keep=1)
old_store.save(1, host)
old_store.close()
stacked = checkpoints.Layout(
    {**layout.groups, "trainable": [("llama/layers/input_layernorm_gamma", (2, 64))]}
)
try:
    checkpoints.Checkpoints(f"{directory}-llama", stacked, keep=1).restore(1, host)
    refused_llama = ""
except DataError as exc:
    refused_llama = str(exc)

written = sum(p.stat().st_size for p in Path(directory, "4").rglob("*") if p.is_file())
storage.free_bytes = lambda path: 2 * layout.nbytes()  # room for two checkpoints
checkpoints.require_space(directory, layout, keep=2, kept=1)  # 2 more fit
try:
    checkpoints.require_space(directory, layout, keep=2, kept=0)
    disk_full = ""
except DiskFullError as exc:
    disk_full = str(exc)
print(
    json.dumps(
        {
            "on_disk": on_disk,
            "steps": steps_found,
            "restored": restored,
            "refused": refused,
            "refused_llama": refused_llama,
            "written_over_estimate": written / layout.nbytes(),
            "disk_full": disk_full,
        }
    )
)
