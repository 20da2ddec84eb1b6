"""Resumable training state: tf.train.CheckpointManager plus the identity of the run.

A checkpoint holds the model, the optimizer (its slots and `iterations`, which IS the step
counter) and nothing about the input pipeline: the pipeline is a pure function of (seed,
batch index), so the step alone says where to resume (see data.py).

Next to the checkpoints, `run.json` records what the checkpoints are only valid for (model
config, tokenizer, sequence length, objective, global batch size, seed). Resuming with a
different value would silently mix two runs, so it is a one-line error instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from payload import storage
from payload.errors import DataError

RUN_IDENTITY = "run.json"
# tf.train.CheckpointManager names checkpoints ckpt-<step>; TF writes each into
# ckpt-<step>_temp/ and merges it into place ("on failure ... an orphaned temporary directory
# can be safely removed": tensorflow/python/checkpoint/functional_saver.py).
_INTERRUPTED_WRITE = re.compile(r"^ckpt-\d+_temp$")
_ANY_CHECKPOINT = re.compile(r"^ckpt-\d+\.(index|npz)$")


def identity(
    job: Any, manifest: Any, model_config: Mapping[str, Any], *, backend: str
) -> dict[str, Any]:
    """What the checkpoints of a job (payload.spec.JobSpec) trained on `manifest`'s data
    with `backend` are valid for (run.json)."""
    ignored = {"transformers_version", "architectures", "torch_dtype", "dtype", "_name_or_path"}
    return {
        "backend": backend,
        "family": job.model.family,
        "objective": job.data.objective,
        "seq_length": int(manifest.seq_length),
        "tokenizer_sha256": manifest.tokenizer_sha256,
        "global_batch_size": int(job.train.global_batch_size),
        "seed": int(job.train.seed),
        "model_config": {k: v for k, v in sorted(model_config.items()) if k not in ignored},
    }


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def any_checkpoints(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` holds a checkpoint of either backend (TF's ckpt-N.index,
    the JAX backend's ckpt-N.npz): a run of the other backend must not start over there."""
    if not storage.is_dir(checkpoint_dir):
        return False
    return any(_ANY_CHECKPOINT.match(name) for name in storage.listdir(checkpoint_dir))


def check_identity(checkpoint_dir: str, current: dict[str, Any], *, has_checkpoint: bool) -> None:
    """Write run.json for a fresh run; for a resumed run, DataError if anything changed
    (also when the checkpoints there are the other backend's, which this one cannot read)."""
    path = storage.join(checkpoint_dir, RUN_IDENTITY)
    has_checkpoint = has_checkpoint or any_checkpoints(checkpoint_dir)
    if not has_checkpoint or not storage.exists(path):
        storage.write_text(path, json.dumps(current, indent=2, sort_keys=True) + "\n")
        return
    previous = json.loads(storage.read_text(path))
    previous.setdefault("backend", "tf")  # run.json of releases with one backend
    changed = _differences(previous, json.loads(json.dumps(current)))
    if changed:
        raise DataError(
            f"the checkpoints in {checkpoint_dir} belong to a different run ("
            + "; ".join(changed[:3])
            + (f"; +{len(changed) - 3} more" if len(changed) > 3 else "")
            + "): use a new output directory, or --force to start over"
        )


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
