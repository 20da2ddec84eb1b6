"""The encode stage's outputs, the same from every runner: shard names, stage.json, the
manifest, the figures in status.json, and whether the stage is complete.

Shards: sequences in the global order (source, file, group, window) fill
``shard-00000-of-000NN.tfrecord`` files of ``records_per_shard`` sequences each (the held-out
ones ``eval-*.tfrecord``); ``manifest.json`` is written last, create-only.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from payload.core import storage
from payload.core.errors import DataError
from payload.data import corpus
from payload.data.encode.rules import HELD_OUT_RULE, Prepared, packing_description
from payload.data.tokenizer import tokenizer_json
from payload.schema import manifest as mf
from payload.spec import JobSpec

if TYPE_CHECKING:
    from payload.core.status import StatusWriter

STAGE = "encode"
STAGE_FILE = "stage.json"


def is_complete(job: JobSpec) -> bool:
    return storage.exists(mf.manifest_path(job.paths.data))


def check_current(job: JobSpec, manifest: mf.Manifest) -> None:
    """DataError when complete data was made with another tokenizer or other data settings.

    Reads manifests of every readable format (``mf.READABLE_VERSIONS``)."""
    current = hashlib.sha256(tokenizer_json(job.paths.tokenizer)).hexdigest()
    problems = []
    if manifest.tokenizer_sha256 != current:
        problems.append("a different tokenizer")
    if manifest.seq_length != job.data.seq_length:
        problems.append(f"seq_length {manifest.seq_length} (job: {job.data.seq_length})")
    if manifest.objective != job.data.objective:
        problems.append(f"objective {manifest.objective} (job: {job.data.objective})")
    if problems:
        raise DataError(
            f"data in {job.paths.data} was encoded with {', '.join(problems)}; "
            "re-run with --force to rebuild it"
        )


@dataclass
class SourceUse:
    """What one source gave: the manifest's and status.json's per-source report."""

    budget: int | None = None
    tokens: int = 0
    documents: int = 0
    exhausted: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "tokens": self.tokens,
            "documents": self.documents,
            "exhausted": self.exhausted,
        }


def shard_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i:05d}-of-{count:05d}.tfrecord" for i in range(count)]


def shard_count(records: int, per_shard: int) -> int:
    return math.ceil(records / per_shard)


# --------------------------------------------------------------------------- manifest


@dataclass
class Totals:
    """What the manifest says about the corpus, the split and the sources."""

    stats: corpus.CorpusStats
    sources: list[SourceUse]
    fraction: float
    dropped_tokens: int = 0
    eval_documents: int = 0
    eval_dropped_tokens: int = 0


def build_manifest(
    job: JobSpec,
    prepared: Prepared,
    train: Sequence[mf.Shard],
    held_out: Sequence[mf.Shard],
    totals: Totals,
    *,
    files: Sequence[str],
) -> mf.Manifest:
    """The manifest of a finished shard set (the same from every runner); ``files`` are the
    corpus's files (the commits of Hub datasets among them are recorded)."""
    total_records = sum(s.records for s in train)
    eval_records = sum(s.records for s in held_out)
    counts = {
        **totals.stats.as_dict(),
        "dropped_tokens": totals.dropped_tokens,
        "eval_documents": totals.eval_documents,
        "eval_dropped_tokens": totals.eval_dropped_tokens,
        "max_word_length": job.tokenizer.max_word_length,
    }
    # Documents used (a budget may leave some out); `documents` above counts those read.
    counts["used_documents"] = sum(s.documents for s in totals.sources)
    counts["used_tokens"] = sum(s.tokens for s in totals.sources)
    return mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        objective=job.data.objective,
        seq_length=job.data.seq_length,
        vocab_size=prepared.vocab_size,
        token_dtype=prepared.plan.token_dtype,
        tokenizer_sha256=prepared.tokenizer_sha,
        special_ids=prepared.special_ids,
        shards=tuple(train),
        total_records=total_records,
        total_tokens=total_records * job.data.seq_length,
        corpus=counts,
        packing=packing_description(job.data.objective),
        eval_shards=tuple(held_out),
        eval_records=eval_records,
        eval_tokens=eval_records * job.data.seq_length,
        held_out={"rule": HELD_OUT_RULE, "fraction": totals.fraction},
        sources=tuple(s.as_dict() for s in totals.sources),
        hub_revisions=corpus.hub_revisions(list(files)),
    )


def write_stage_and_manifest(job: JobSpec, manifest: mf.Manifest) -> None:
    """stage.json, then manifest.json last and create-only: the commit point of the data."""
    data_dir = job.paths.data
    stage = {"stage": STAGE, "job": job.to_dict(), "manifest": mf.MANIFEST_NAME}
    storage.write_text(
        storage.join(data_dir, STAGE_FILE), json.dumps(stage, indent=2, ensure_ascii=False) + "\n"
    )
    mf.write_manifest(data_dir, manifest)


def source_status(sources: Sequence[SourceUse]) -> dict[str, int | str]:
    """Per-source figures as flat status.json metrics (source<i>_tokens, ...)."""
    out: dict[str, int | str] = {}
    for i, use in enumerate(sources):
        out[f"source{i}_tokens"] = use.tokens
        out[f"source{i}_documents"] = use.documents
        out[f"source{i}_budget"] = "none" if use.budget is None else use.budget
        out[f"source{i}_exhausted"] = "yes" if use.exhausted else "no"
    return out


def complete_status(
    status: StatusWriter, manifest: mf.Manifest, job: JobSpec, **extra: Any
) -> None:
    status.update(
        stage=STAGE,
        state="complete",
        message=(
            f"{manifest.total_records} sequences, {len(manifest.shards)} shards "
            f"(held out: {manifest.eval_records} sequences) in {job.paths.data}"
        ),
        **status_metrics(
            records=manifest.total_records,
            shards=len(manifest.shards),
            eval_records=manifest.eval_records,
            **manifest.corpus,
            **source_status([SourceUse(**s) for s in manifest.sources]),
            **extra,
        ),
    )


def status_metrics(**figures: Any) -> dict[str, Any]:
    """status.json metrics as one mapping (figures computed under names of their own)."""
    return figures
