"""The TF backend's resumable training state: tf.train.CheckpointManager (run.json: identity.py).

A checkpoint holds the model, the optimizer (its slots and `iterations`, which IS the step
counter) and nothing about the input pipeline: the pipeline is a pure function of (seed,
batch index), so the step alone says where to resume (see data.py).
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from payload.core import storage

# tf.train.CheckpointManager names checkpoints ckpt-<step>; TF writes each into
# ckpt-<step>_temp/ and merges it into place ("on failure ... an orphaned temporary directory
# can be safely removed": tensorflow/python/checkpoint/functional_saver.py).
_INTERRUPTED_WRITE = re.compile(r"^ckpt-\d+_temp$")


def remove_interrupted_writes(checkpoint_dir: str) -> list[str]:
    """Delete the ``ckpt-*_temp`` directories of checkpoint writes that never finished."""
    if not storage.is_dir(checkpoint_dir):
        return []
    leftovers = [
        storage.join(checkpoint_dir, name)
        for name in storage.listdir(checkpoint_dir)
        if _INTERRUPTED_WRITE.match(name)
    ]
    for path in leftovers:
        storage.remove_tree(path)
    return leftovers


def make_manager(
    model: Any, optimizer: Any, checkpoint_dir: str, *, keep: int
) -> tuple[tf.train.Checkpoint, tf.train.CheckpointManager]:
    remove_interrupted_writes(checkpoint_dir)
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(
        ckpt, checkpoint_dir, max_to_keep=keep, step_counter=optimizer.iterations
    )
    require_space(
        checkpoint_dir,
        [*model.variables, *optimizer.variables],
        keep=keep,
        kept=len(manager.checkpoints),
    )
    return ckpt, manager


def checkpoint_bytes(variables: list[Any]) -> int:
    """About the size of one checkpoint: the bytes of every variable it saves (model and
    optimizer slots), each once."""
    seen: dict[int, int] = {}
    for variable in variables:
        seen[id(variable)] = int(variable.shape.num_elements() or 0) * variable.dtype.size
    return sum(seen.values())


def require_space(checkpoint_dir: str, variables: list[Any], *, keep: int, kept: int) -> None:
    """DiskFullError before training when the checkpoints to come do not fit (local paths).

    TF writes a new checkpoint before it deletes the oldest of ``keep``, so up to ``keep + 1``
    exist at once; ``kept`` of them are there already (their space is taken, not free).
    """
    one = checkpoint_bytes(variables)
    more = max(keep + 1 - kept, 1)
    storage.require_space(
        checkpoint_dir,
        one * more,
        f"{more} more checkpoints of {storage.human_bytes(one)} (train.keep_checkpoints={keep})",
        ", lower train.keep_checkpoints",
    )


def restore_latest(ckpt: tf.train.Checkpoint, manager: tf.train.CheckpointManager) -> int | None:
    """Restore the newest checkpoint (model and optimizer must already be built)."""
    latest = manager.latest_checkpoint
    if latest is None:
        return None
    ckpt.restore(latest).assert_existing_objects_matched()
    return int(ckpt.optimizer.iterations.numpy())
