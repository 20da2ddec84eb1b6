"""The identity of a run: what its checkpoints are valid for (`run.json`), for both backends.

Next to the checkpoints, `run.json` records what the checkpoints are only valid for (backend,
model config, tokenizer, sequence length, objective, global batch size, seed). Resuming with
a different value would silently mix two runs, so it is a one-line error instead. Neither
TensorFlow nor JAX is imported here: every process of a slice checks it before training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from payload.core import storage
from payload.core.errors import DataError

RUN_IDENTITY = "run.json"
# Written into run.json but not part of the identity a resume must match (check_identity).
RECORDED = ("mesh", "attention")
# TF's ckpt-N.index, the JAX backend's Orbax step directories N/ (and its earlier ckpt-N.npz).
_ANY_CHECKPOINT = re.compile(r"^(ckpt-\d+\.(index|npz)|\d+)$")


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
        # Only when on: run.json of runs from before the setting stays valid.
        **({"document_mask": True} if getattr(job.data, "document_mask", False) else {}),
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
    the JAX backend's Orbax step directory N/ or earlier ckpt-N.npz): a run of the other
    backend must not start over there."""
    if not storage.is_dir(checkpoint_dir):
        return False
    return any(_ANY_CHECKPOINT.match(name) for name in storage.listdir(checkpoint_dir))


def check_identity(
    checkpoint_dir: str,
    current: dict[str, Any],
    *,
    has_checkpoint: bool,
    record: Mapping[str, Any] | None = None,
    read_only: bool = False,
) -> None:
    """Write run.json for a fresh run; for a resumed run, DataError if anything changed
    (also when the checkpoints there are the other backend's, which this one cannot read).

    `record` (e.g. the JAX backend's mesh) is written beside the identity but never compared:
    a run may resume on another mesh shape (a preempted v4-32 on a v4-16), and run.json then
    records the shape of the latest start.

    `read_only` (a JAX slice's processes other than the chief): never write; compare only
    when checkpoints exist and run.json is there. On a fresh run the chief may be writing
    run.json at this moment (or replacing a stale one), and there is no run yet to differ
    from; with checkpoints the chief does not write it, so every process reads the same."""
    path = storage.join(checkpoint_dir, RUN_IDENTITY)
    has_checkpoint = has_checkpoint or any_checkpoints(checkpoint_dir)
    recorded = dict(record or {})
    if not has_checkpoint or not storage.exists(path):
        if not read_only:
            _write(path, {**current, **recorded})
        return
    previous = json.loads(storage.read_text(path))
    previous.setdefault("backend", "tf")  # run.json of releases with one backend
    for key in RECORDED:
        previous.pop(key, None)
    changed = _differences(previous, json.loads(json.dumps(current)))
    if changed:
        raise DataError(
            f"the checkpoints in {checkpoint_dir} belong to a different run ("
            + "; ".join(changed[:3])
            + (f"; +{len(changed) - 3} more" if len(changed) > 3 else "")
            + "): use a new output directory, or --force to start over"
        )
    if recorded and not read_only:
        _write(path, {**current, **recorded})


def _write(path: str, document: Mapping[str, Any]) -> None:
    storage.write_text(path, json.dumps(document, indent=2, sort_keys=True) + "\n")
