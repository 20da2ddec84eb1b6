"""The JAX backend's checkpoints: one `ckpt-<step>.npz` per checkpoint in `checkpoints/`.

A checkpoint holds every array of the training state (model weights, the non-trainable
state such as the dropout seed generator's, and the optimizer's slots and `iterations`, which
IS the step counter) plus the Keras variable paths and shapes they belong to. Like the TF
backend's, it holds nothing of the input pipeline: the pipeline is a pure function of
(seed, batch index), so the step says where to resume (payload/data.py), and a resumed
run computes exactly what an uninterrupted one does (tests/payload/test_jax_train.py).

Why our own format and not Orbax: the state is replicated (data parallelism), so process 0
holds all of it and one file per checkpoint is enough; numpy + the payload's storage layer
write it locally or to gs:// atomically (a local file is renamed into place, a GCS object
appears only when its upload is complete), with no extra dependency in the TPU VM's
environment. Only process 0 writes. `run.json` (payload/identity.py) records what the
checkpoints are valid for, as for the TF backend, with `backend: jax`.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from payload import storage
from payload.errors import DataError

_NAME = re.compile(r"^ckpt-(\d+)\.npz$")
_GROUPS = ("trainable", "non_trainable", "optimizer")


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


def path_of(directory: str, step: int) -> str:
    return storage.join(directory, f"ckpt-{step}.npz")


def steps_in(directory: str) -> list[int]:
    """The steps of the complete checkpoints in `directory`, oldest first."""
    if not storage.is_dir(directory):
        return []
    found = [_NAME.match(name) for name in storage.listdir(directory)]
    return sorted(int(m.group(1)) for m in found if m)


def save(
    directory: str, step: int, layout: Layout, arrays: dict[str, list[Any]], *, keep: int
) -> str:
    """Write ckpt-<step>.npz (atomically), then delete all but the newest `keep`."""
    payload: dict[str, Any] = {
        "__layout__": np.frombuffer(json.dumps(layout.groups).encode(), dtype=np.uint8)
    }
    for group in _GROUPS:
        for i, value in enumerate(arrays[group]):
            payload[f"{group}/{i}"] = np.asarray(value)
    buffer = io.BytesIO()
    np.savez(buffer, **payload)
    path = path_of(directory, step)
    storage.write_bytes(path, buffer.getvalue())
    for old in steps_in(directory)[:-keep]:
        storage.remove(path_of(directory, old))
    return path


def load(directory: str, step: int, layout: Layout) -> dict[str, list[np.ndarray]]:
    """The arrays of ckpt-<step>.npz, checked against this run's variables (DataError if the
    checkpoint was written for other variables)."""
    path = path_of(directory, step)
    with np.load(io.BytesIO(storage.read_bytes(path)), allow_pickle=False) as data:
        saved = json.loads(bytes(data["__layout__"]).decode())
        expected = json.loads(json.dumps(layout.groups))
        if saved != expected:
            raise DataError(
                f"{path} holds other variables than this run's model and optimizer "
                f"({_first_difference(saved, expected)}): use a new output directory, or "
                "--force to start over"
            )
        return {
            group: [data[f"{group}/{i}"] for i in range(len(layout.groups[group]))]
            for group in _GROUPS
        }


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
