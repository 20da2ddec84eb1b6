"""The JAX backend's checkpoints: Orbax (`orbax-checkpoint`), one step directory per checkpoint.

`checkpoints/<step>/` (Orbax's CheckpointManager layout, no step prefix) holds two items:
 - `state/`: the training state as one pytree {"trainable": [...], "non_trainable": [...],
   "optimizer": [...]} of jax arrays (the model weights, the non-trainable state such as the
   dropout seed generator's, and the optimizer's slots and `iterations`, which IS the step
   counter), written by tensorstore: every process writes the shards it holds (a replicated
   array once, by its first replica), so a state sharded over a slice never passes through
   one host;
 - `layout/`: the Keras variable paths and shapes of each group (JSON), checked before the
   state is read: another model's checkpoint is a one-line DataError, not a shape error deep
   in tensorstore.
Like the TF backend's, a checkpoint holds nothing of the input pipeline: the pipeline is a
pure function of (seed, batch index), so the step says where to resume
(payload/backends/tf/input.py).

Asynchronous: `save()` returns once the state's arrays are copied to host memory; the write
(and the deletion of all but the newest `keep`) continues in a background thread, the next
save waits for it, and `close()` (train.py: before the export, before a SIGTERM exit, on
any error) waits for the last one. Every process calls `save`, `restore` and `close`
(Orbax synchronises them; one process alone would wait forever).

Complete or absent: locally Orbax writes `<step>.orbax-checkpoint-tmp/` and renames it to
`<step>/` when every process has finished; on gs:// (no rename) it writes
`<step>/commit_success.txt` last. Orbax lists only finished steps, so an interrupted write
is never resumed from (orbax 0.12.8, _src/path/atomicity.py, step.py `is_path_finalized`).

Restore onto another mesh: `restore(step, like)` reads each array straight into the
sharding of the corresponding array of `like` (the live state), whatever the mesh it was
saved from: a slice preempted on 32 chips resumes on 16.

A Llama checkpoint of earlier releases (one variable per decoder layer, `llama/layers_<i>/…`,
before the layers' weights were stacked [L, …] for the scan over layers) is refused in one
line too, not restored by stacking the saved layers: as for npz below, a converter would be
code kept for one transition.
The earlier format (`ckpt-<step>.npz`, one file written by process 0) is refused in one line
(`refuse_npz`), not converted: those checkpoints came from the replicated single-file
trainer of earlier releases, which had no users on a slice yet, and a converter would be
code kept for one transition. `run.json` (payload/training/identity.py) records what the checkpoints
are valid for, with `backend: jax`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from payload.backends.jax.steps import TrainState
from payload.core import storage
from payload.core.errors import DataError

_GROUPS = ("trainable", "non_trainable", "optimizer")
_NPZ = re.compile(r"^ckpt-\d+\.npz$")
_PER_LAYER_LLAMA = re.compile(r"^llama/layers_\d+/")
STATE, LAYOUT = "state", "layout"


@dataclass(frozen=True)
class Layout:
    """The variable paths and shapes of each group of the training state, in order."""

    groups: dict[str, list[tuple[str, tuple[int, ...]]]]

    @classmethod
    def of(cls, model: Any, optimizer: Any) -> Layout:
        variables = {
            "trainable": model.trainable_variables,
            "non_trainable": model.non_trainable_variables,
            "optimizer": optimizer.variables,
        }
        return cls(
            {
                g: [(v.path, tuple(int(d) for d in v.shape)) for v in vs]
                for g, vs in variables.items()
            }
        )

    def nbytes(self, itemsize: int = 4) -> int:
        return sum(
            int(np.prod(shape, dtype=np.int64)) * itemsize
            for entries in self.groups.values()
            for _, shape in entries
        )

    def as_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.groups))


def refuse_npz(directory: str) -> None:
    """DataError when `directory` holds checkpoints of the earlier npz format."""
    if not storage.is_dir(directory):
        return
    old = [name for name in storage.listdir(directory) if _NPZ.match(name)]
    if old:
        raise DataError(
            f"{directory} holds checkpoints of the earlier JAX format ({', '.join(old[:3])}"
            f"{', …' if len(old) > 3 else ''}), which this release cannot resume (it writes "
            "Orbax checkpoints): use a new output directory, or --force to start over"
        )


def finished_steps(directory: str) -> list[int]:
    """The steps of the finished checkpoints in `directory`, oldest first, by Orbax's own
    test of a finished step (no manager opened: any process may ask, at any time)."""
    if not storage.is_dir(directory):
        return []
    return sorted(ocp.utils.checkpoint_steps(epath.Path(directory)))


class Checkpoints:
    """The Orbax checkpoints in `directory`, newest `keep` kept. Every process makes one and
    calls every method, in the same order."""

    def __init__(self, directory: str, layout: Layout, *, keep: int):
        self.directory, self.layout = directory, layout
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,  # interrupted writes of an earlier run
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            epath.Path(directory), options=options, item_names=(STATE, LAYOUT)
        )

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def path_of(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def save(self, step: int, state: TrainState) -> str:
        """Start writing the checkpoint of `step` (a no-op when it exists: a stop right after
        a checkpoint boundary); returns once `state` is copied to host memory."""
        if step not in self.manager.all_steps():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE: ocp.args.StandardSave(_tree(state)),
                        LAYOUT: ocp.args.JsonSave(self.layout.as_json()),
                    }
                ),
            )
        return self.path_of(step)

    def restore(self, step: int, like: TrainState) -> TrainState:
        """The state of `step`, each array in the sharding (and dtype) of `like`'s (arrays or
        jax.ShapeDtypeStruct); DataError if the checkpoint was written for other variables."""
        saved = self.manager.restore(
            step, args=ocp.args.Composite(**{LAYOUT: ocp.args.JsonRestore()})
        )[LAYOUT]
        expected = self.layout.as_json()
        if saved != expected and _per_layer_llama(saved):
            raise DataError(
                f"{self.path_of(step)} holds a Llama with one variable per decoder layer "
                "(llama/layers_<i>/..., earlier releases), which this release cannot resume "
                "(it stacks the layers' weights [L, ...] and scans over them): use a new "
                "output directory, or --force to start over"
            )
        if saved != expected:
            raise DataError(
                f"{self.path_of(step)} holds other variables than this run's model and "
                f"optimizer ({_first_difference(saved, expected)}): use a new output "
                "directory, or --force to start over"
            )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _tree(like)
        )
        tree = self.manager.restore(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})
        )[STATE]
        return TrainState(tree["trainable"], tree["non_trainable"], tree["optimizer"])

    def wait(self) -> None:
        """Until the last save is written (and old checkpoints deleted)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last save, then release Orbax's threads."""
        self.manager.close()


def _tree(state: TrainState) -> dict[str, list[Any]]:
    return {
        "trainable": list(state.trainable),
        "non_trainable": list(state.non_trainable),
        "optimizer": list(state.optimizer),
    }


def _per_layer_llama(saved: dict[str, Any]) -> bool:
    """Whether a saved layout is a Llama's of earlier releases (models.LlamaBlock per layer)."""
    return any(_PER_LAYER_LLAMA.match(path) for path, _ in saved.get("trainable", []))


def _first_difference(saved: dict[str, Any], expected: dict[str, Any]) -> str:
    for group in _GROUPS:
        old, new = saved.get(group, []), expected.get(group, [])
        if len(old) != len(new):
            return f"{group}: {len(old)} variables saved, {len(new)} now"
        for a, b in zip(old, new, strict=True):
            if a != b:
                return f"{group}: {a[0]} {a[1]} saved, {b[0]} {b[1]} now"
    return "layout differs"


def require_space(directory: str, layout: Layout, *, keep: int, kept: int) -> None:
    """DiskFullError before training when the checkpoints to come do not fit (local paths):
    a new checkpoint is written before the oldest of `keep` is deleted."""
    one = layout.nbytes()
    more = max(keep + 1 - kept, 1)
    storage.require_space(
        directory,
        one * more,
        f"{more} more checkpoints of {storage.human_bytes(one)} (train.keep_checkpoints={keep})",
        ", lower train.keep_checkpoints",
    )
