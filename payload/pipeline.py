"""The stages in order (tokenizer -> encode -> train), each skipped when its output is complete.

Completion markers, each written last by its stage:
``tokenizer/tokenizer.json``, ``data/manifest.json`` (create-only) and the export marker of
the backend's train module (payload/backends). ``force=True`` deletes a stage's outputs
before running it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from payload import backends
from payload.core import storage
from payload.core.status import StatusWriter
from payload.data import tokenizer
from payload.data.encode import stage as encode
from payload.schema.observe import PROFILE_DIR
from payload.spec import JobSpec
from payload.training import shared, tracker

STAGES = ("tokenizer", "encode", "train")
Printer = Callable[[str], None]


def _train_module(job: JobSpec) -> backends.Backend:
    """The training backend (imported only for training), per `train.backend`."""
    return backends.load(shared.resolve_backend(job))


def is_complete(job: JobSpec, stage: str) -> bool:
    if stage == "tokenizer":
        return tokenizer.is_complete(job)
    if stage == "encode":
        return encode.is_complete(job)
    return shared.is_complete(job)


def outputs(job: JobSpec, stage: str) -> dict[str, str]:
    """Where a stage's outputs are, for the user."""
    paths = job.paths
    if stage == "tokenizer":
        return {"tokenizer": paths.tokenizer}
    if stage == "encode":
        return {"data": paths.data, "manifest": storage.join(paths.data, "manifest.json")}
    return {
        "checkpoints": paths.checkpoints,
        "tensorboard": f"{paths.logs}  (tensorboard --logdir {paths.logs})",
        "export": paths.export,
    }


def clear(job: JobSpec, stage: str) -> None:
    """Delete a stage's outputs (for --force)."""
    paths = job.paths
    targets = {
        "tokenizer": [paths.tokenizer],
        "encode": [paths.data],
        "train": [
            paths.checkpoints,
            paths.logs,
            paths.export,
            storage.join(paths.root, PROFILE_DIR),
        ],
    }[stage]
    for target in targets:
        storage.remove_tree(target)
    if stage == "train":
        tracker.forget(job)


def run_stage(
    job: JobSpec,
    stage: str,
    status: StatusWriter,
    *,
    force: bool = False,
    echo: Printer = print,
    before_train: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run one stage (or skip it when complete); returns a summary for printing.
    `before_train` runs just before the train stage does (not when it is skipped)."""
    if force:
        clear(job, stage)
    elif is_complete(job, stage):
        if stage == "encode":
            encode.check_current(job, encode.mf.load_manifest(job.paths.data))
        status.update(stage=stage, state="skipped", message="complete")
        echo(f"{stage}: skipped: complete")
        _echo_outputs(job, stage, echo)
        return {"skipped": True}
    if stage == "train":
        before_train()
    status.update(stage=stage, state="running", progress=0.0, message="starting")
    try:
        summary = _run(job, stage, status)
    except Exception as exc:
        full = storage.as_disk_full(exc, _full_path(job, stage))
        if full is None:
            raise
        raise full from exc
    details = ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items())
    status.update(stage=stage, state="complete", message=details or "complete")
    status.flush(milestone=True)
    echo(f"{stage}: complete ({details})" if details else f"{stage}: complete")
    _echo_outputs(job, stage, echo)
    return summary


def _run(job: JobSpec, stage: str, status: StatusWriter) -> dict[str, Any]:
    if stage == "tokenizer":
        tokenizer.train_tokenizer(job, status)
        loaded = tokenizer.load_tokenizer(job.paths.tokenizer)
        summary: dict[str, Any] = {"vocab_size": len(loaded)}
    elif stage == "encode":
        manifest = encode.encode(job, status)
        summary = {
            "sequences": manifest.total_records,
            "shards": len(manifest.shards),
            "tokens": manifest.total_tokens,
            **dict(manifest.corpus),
        }
    else:
        tracker.require(job)  # train.tracker: wandb where wandb is not installed: one line
        summary = dict(_train_module(job).train(job, status) or {})
    return summary


def _full_path(job: JobSpec, stage: str) -> str:
    """Where a stage found the disk full when the error names no file (TensorFlow's errors
    name no path we rely on): the stage's output."""
    paths = job.paths
    return {"tokenizer": paths.tokenizer, "encode": paths.data}.get(stage, paths.checkpoints)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _echo_outputs(job: JobSpec, stage: str, echo: Printer) -> None:
    for name, where in outputs(job, stage).items():
        echo(f"  {name}: {where}")


def run(
    job: JobSpec,
    status: StatusWriter,
    *,
    force: bool = False,
    echo: Printer = print,
    before_train: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, Any]]:
    """All stages in order; complete ones are skipped unless ``force``."""
    results = {}
    for stage in STAGES:
        results[stage] = run_stage(
            job, stage, status, force=force, echo=echo, before_train=before_train
        )
    status.update(stage="run", state="complete", message="all stages complete")
    status.flush(milestone=True)
    echo(f"status: {job.paths.status}")
    return results
