"""Stage 2: corpus -> packed fixed-length token sequences -> sharded TFRecords + manifest.

Encoding is a pure function of the documents: the same documents give the same shards and
the same manifest from any runner (``data.runner: local`` here, ``beam`` in
``payload/encode_beam.py``), any worker count and any input format (a text paragraph, a JSON
line and a Parquet row are each one document). Every step below depends only on the
documents, the tokenizer and the ``data`` settings, never on who computed it or when.

Groups. The reader (``corpus.iter_groups``) cuts each file's documents into groups of about
1 MiB of text, ending at the file's end; groups are in a global order: (source, file,
group number). Each group is tokenized on its own (``GroupTokenizer``), by a worker process
here or by a Beam worker.

Token streams (no padding anywhere):

* ``mlm``: each document is ``d [SEP]`` (or ``d </s>`` in RoBERTa style); a stream is cut
  into windows of ``seq_length - 1`` tokens and every sequence is ``[CLS] + window``.
* ``clm``: each document is ``<s> d </s>``; a stream is cut into windows of ``seq_length``.

Packing is within each group: the group's training documents, concatenated in order, are
cut into windows, and the remainder shorter than a window is dropped and counted
(``dropped_tokens``; about half a window per group of ~1 MiB: a few hundredths of a
percent). The held-out documents of the group are packed the same way into their own stream.

Held-out split (``data.eval_fraction``): whole documents, chosen per document from a stable
hash of its text: ``blake2b(text, key=HELD_OUT_SALT)`` read as a number ``u`` in [0, 1); a
document is held out when ``u < f``. ``f`` is ``eval_fraction``, except on a corpus too small
for that share to reach ``eval_min_sequences``: with ``N`` the tokens of the corpus (all
used documents with their separators), ``f = eval_min_sequences * window / N`` (never above
``MAX_EVAL_FRACTION``) when ``N * eval_fraction`` is below that floor. The floor is so aimed
at, not guaranteed (documents fall either way by their hash). Held-out sequences past
``eval_max_sequences`` in the global order are dropped and counted (``eval_dropped_tokens``):
their documents do not go back to training, so on a large corpus lower ``eval_fraction``
rather than lean on the cap. No document contributes a token to both splits. Special tokens
written literally in the corpus (e.g. "[MASK]") are encoded as plain text.

Token budget (``data.max_tokens``): with unweighted sources (or plain ``corpus.paths``) one
budget for the whole corpus, consumed in corpus order; with weighted sources, source ``i``
gets ``floor(max_tokens * weight_i / sum of weights)``, consumed in that source's order.
Documents are used from the start while their tokens (separators included, both splits),
added up, stay within the budget: the first document that would pass it and every later one
of that budget are not used (its source is "exhausted"), so a budget is never exceeded. Tokens used,
documents, budget and whether it was exhausted are reported per source in status.json and
manifest.json. The reader still reads an exhausted source to its end (counted in the reading
statistics); its later groups are not packed.

Shards: sequences in the global order (source, file, group, window) fill
``shard-00000-of-000NN.tfrecord`` files of ``records_per_shard`` sequences each (the held-out
ones ``eval-*.tfrecord``); ``manifest.json`` is written last, create-only.

Local runner: the main process reads groups and hands them to ``data.workers`` processes
(spawned, so they never import TensorFlow; each runs the Rust tokenizer's
``encode_batch_fast`` single-threaded); at most ``2 * workers`` groups are in flight, so
memory does not grow with the corpus; results are used in group order. Shards are written to
a staging directory (inside the data directory for local output; a local temp directory for
gs://), renamed/uploaded to their names, and the manifest is written last. A run that was
killed leaves no manifest: the next run removes what it left and encodes again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from payload import corpus, records, storage
from payload import manifest as mf
from payload.errors import CorpusError, DataError
from payload.spec import MASKED_OBJECTIVES, MAX_EVAL_FRACTION, JobSpec
from payload.tokenizer import WordLimit, max_word_length_of, tokenizer_json

if TYPE_CHECKING:
    from payload.status import StatusWriter

STAGE = "encode"
STAGE_FILE = "stage.json"
# The held-out draw's key: fixed, so a document's split never changes between runs. A new
# value would re-split every corpus (and is a new format of the split, documented as such).
HELD_OUT_SALT = b"tpu-pretrain/held-out/v1"
HELD_OUT_RULE = "blake2b(document utf-8, key=HELD_OUT_SALT, 8 bytes) / 2**64 < fraction"


def packing_description(objective: str) -> str:
    if objective in MASKED_OBJECTIVES:  # rtd (ELECTRA) packs as mlm
        return (
            f"{objective}: [CLS] + (seq_length-1) tokens of each group's stream "
            "'doc [SEP] doc [SEP] ...' (remainder of each group dropped)"
        )
    return (
        "clm: seq_length tokens of each group's stream '<s> doc </s> <s> doc </s> ...'"
        " (remainder of each group dropped)"
    )


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


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """Everything the pure encoding functions need (picklable: sent to every worker)."""

    objective: str
    token_dtype: str
    first_id: int  # mlm: separator after each document; clm: BOS before each document
    last_id: int  # clm: EOS after each document (-1 for mlm)
    width: int  # tokens of a stream per sequence
    lead: int | None  # mlm: [CLS] at position 0 of every sequence
    seq_length: int
    records_per_shard: int
    eval_fraction: float
    eval_min_sequences: int
    eval_max_sequences: int
    # A longer document is tokenized in pieces (corpus.document_pieces) kept together.
    max_document_bytes: int = corpus.MAX_DOCUMENT_BYTES

    @property
    def floor_tokens(self) -> int:
        return self.eval_min_sequences * self.width


@dataclass(frozen=True)
class Prepared:
    """The tokenizer and what the manifest records about it, checked against the job."""

    plan: Plan
    tokenizer_text: str
    tokenizer_sha: str
    vocab_size: int
    special_ids: dict[str, int]


def prepare(job: JobSpec) -> Prepared:
    """Load and check the tokenizer; DataError when it does not fit the job."""
    tokenizer_bytes = tokenizer_json(job.paths.tokenizer)
    tokenizer_text = tokenizer_bytes.decode("utf-8")
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_str(tokenizer_text)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    trained_limit = max_word_length_of(tok)
    if trained_limit != job.tokenizer.max_word_length:
        raise DataError(
            f"tokenizer in {job.paths.tokenizer} was trained with max_word_length "
            f"{trained_limit or 'unlimited'} (job: tokenizer.max_word_length="
            f"{job.tokenizer.max_word_length}); re-run `tpu-payload tokenizer --force`"
        )
    token_dtype = records.token_dtype_for(vocab_size)
    found = {role: tok.token_to_id(token) for role, token in job.special_roles.items()}
    if any(i is None for i in found.values()):
        raise DataError(
            f"tokenizer in {job.paths.tokenizer} lacks special tokens {found}; "
            "re-run `tpu-payload tokenizer --force`"
        )
    special_ids = {role: int(i) for role, i in found.items()}
    data = job.data
    if data.objective in MASKED_OBJECTIVES:  # rtd (ELECTRA) packs as mlm
        first, last, width, lead = special_ids["sep"], -1, data.seq_length - 1, special_ids["cls"]
    else:
        first, last, width, lead = special_ids["bos"], special_ids["eos"], data.seq_length, None
    plan = Plan(
        objective=data.objective,
        token_dtype=token_dtype,
        first_id=first,
        last_id=last,
        width=width,
        lead=lead,
        seq_length=data.seq_length,
        records_per_shard=data.records_per_shard,
        eval_fraction=data.eval_fraction,
        eval_min_sequences=data.eval_min_sequences,
        eval_max_sequences=data.eval_max_sequences,
        max_document_bytes=corpus.MAX_DOCUMENT_BYTES,
    )
    return Prepared(
        plan=plan,
        tokenizer_text=tokenizer_text,
        tokenizer_sha=hashlib.sha256(tokenizer_bytes).hexdigest(),
        vocab_size=vocab_size,
        special_ids=special_ids,
    )


# --------------------------------------------------------------------------- pure steps

GroupKey = tuple[int, int, int]  # (source, file number in reading order, group in file)


@dataclass
class TokenizedGroup:
    """One group's documents as token ids (with their separators) and their held-out draws."""

    key: GroupKey
    source: int
    ids: np.ndarray  # every document's ids, concatenated in order
    lengths: np.ndarray  # tokens of each document (int64); they add up to len(ids)
    draws: np.ndarray  # each document's held-out draw u in [0, 1) (float64)
    long_words: int

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def documents(self) -> int:
        return len(self.lengths)


def held_out_draw(document: str) -> float:
    """The document's number in [0, 1): a keyed blake2b of its UTF-8 text (HELD_OUT_SALT)."""
    digest = hashlib.blake2b(document.encode("utf-8"), digest_size=8, key=HELD_OUT_SALT).digest()
    return int.from_bytes(digest, "big") / float(1 << 64)


class GroupTokenizer:
    """Tokenizes groups (in an encoder worker: local process or Beam worker)."""

    def __init__(self, tokenizer_text: str, plan: Plan):
        # One Rust thread per worker: the parallelism comes from the worker processes.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_str(tokenizer_text)
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = True  # corpus text "[MASK]" is text, not the mask token
        self.plan = plan
        self.word_limit = WordLimit(tok)

    def __call__(self, key: GroupKey, group: corpus.Group) -> TokenizedGroup:
        plan = self.plan
        texts: list[str] = []
        pieces: list[int] = []  # how many texts each document was tokenized as
        for document in group.documents:
            parts = corpus.document_pieces(document, plan.max_document_bytes)
            texts += parts
            pieces.append(len(parts))
        encodings, long_words = self.word_limit.encode(texts)
        flat: list[int] = []
        lengths: list[int] = []
        at = 0
        for count in pieces:
            start = len(flat)
            if plan.objective == "clm":
                flat.append(plan.first_id)
            for enc in encodings[at : at + count]:
                flat.extend(enc.ids)
            at += count
            flat.append(plan.last_id if plan.objective == "clm" else plan.first_id)
            lengths.append(len(flat) - start)
        return TokenizedGroup(
            key=key,
            source=group.source,
            ids=np.array(flat, dtype=np.dtype(plan.token_dtype)),
            lengths=np.array(lengths, dtype=np.int64),
            draws=np.array([held_out_draw(doc) for doc in group.documents], dtype=np.float64),
            long_words=long_words,
        )


def source_budgets(job: JobSpec) -> list[int | None]:
    """Each source's token budget (None: no budget): see the module docstring."""
    members = job.corpus.members
    budget = job.data.max_tokens
    if budget is None:
        return [None] * len(members)
    weights = [m.weight for m in members]
    if any(w is None for w in weights):
        return [budget] * len(members)  # one budget shared in corpus order: budget_key()
    total = sum(w for w in weights if w is not None)
    return [int(budget * (w or 0.0) / total) for w in weights]


def budget_key(job: JobSpec, source: int) -> int:
    """Which budget a source draws from: its own when weighted, else the corpus's (0)."""
    members = job.corpus.members
    weighted = job.data.max_tokens is not None and all(m.weight is not None for m in members)
    return source if weighted else 0


def within_budget(group: TokenizedGroup, tokens_before: int, budget: int | None) -> int:
    """How many of the group's documents are used: those whose running sum of tokens over
    every document of their budget so far (``tokens_before``: all documents of the groups
    before this one, used or not) stays within the budget."""
    if budget is None:
        return group.documents
    through_each = tokens_before + np.cumsum(group.lengths)
    return int(np.count_nonzero(through_each <= budget))  # a prefix: the sums only grow


def truncated(group: TokenizedGroup, keep: int) -> TokenizedGroup:
    if keep == group.documents:
        return group
    return TokenizedGroup(
        key=group.key,
        source=group.source,
        ids=group.ids[: int(group.lengths[:keep].sum())],
        lengths=group.lengths[:keep],
        draws=group.draws[:keep],
        long_words=group.long_words,
    )


def held_out_fraction(plan: Plan, total_tokens: int) -> float:
    """``f`` of the held-out rule for a corpus of ``total_tokens`` (module docstring)."""
    if plan.eval_fraction <= 0:
        return 0.0
    if reaches_floor(plan, total_tokens):
        return plan.eval_fraction
    return min(plan.floor_tokens / max(total_tokens, 1), MAX_EVAL_FRACTION)


def reaches_floor(plan: Plan, tokens: int) -> bool:
    """True when ``eval_fraction`` of ``tokens`` reaches the floor: f is then decided."""
    return tokens * plan.eval_fraction >= plan.floor_tokens


@dataclass
class PackedGroup:
    """One group's training and held-out sequences ([n, seq_length] each) and its counts."""

    key: GroupKey
    train: np.ndarray
    held_out: np.ndarray
    train_dropped_tokens: int
    eval_dropped_tokens: int
    eval_documents: int


def windows(ids: np.ndarray, plan: Plan) -> tuple[np.ndarray, int]:
    """(sequences of a stream, tokens of the remainder dropped)."""
    rows = len(ids) // plan.width
    block = ids[: rows * plan.width].reshape(rows, plan.width)
    if plan.lead is not None:
        lead = np.full((rows, 1), plan.lead, dtype=ids.dtype)
        block = np.concatenate([lead, block], axis=1)
    return block, len(ids) - rows * plan.width


def pack_group(group: TokenizedGroup, fraction: float, plan: Plan) -> PackedGroup:
    """Split the group's documents by their draws and cut each stream into sequences."""
    to_eval = group.draws < fraction
    mask = np.repeat(to_eval, group.lengths)
    train, train_rest = windows(group.ids[~mask], plan)
    held_out, eval_rest = windows(group.ids[mask], plan)
    return PackedGroup(
        key=group.key,
        train=train,
        held_out=held_out,
        train_dropped_tokens=train_rest,
        eval_dropped_tokens=eval_rest,
        eval_documents=int(np.count_nonzero(to_eval)),
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
        **_metrics(
            records=manifest.total_records,
            shards=len(manifest.shards),
            eval_records=manifest.eval_records,
            **manifest.corpus,
            **source_status([SourceUse(**s) for s in manifest.sources]),
            **extra,
        ),
    )


def _metrics(**figures: Any) -> dict[str, Any]:
    """status.json metrics as one mapping (figures computed under names of their own)."""
    return figures


# --------------------------------------------------------------------------- local runner

_WORKER: dict[str, Any] = {}

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """End this worker when the encoding process is gone, however it ended (SIGKILL, OOM).

    Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process when the thread
    that spawned it exits (the pool spawns workers from the thread that submits, the main
    one). A parent that died before that call is caught by the ``getppid`` check after it
    (we were re-parented). Elsewhere only the check runs. Without this, a worker blocks on
    its task queue forever, and the resource tracker, which waits for every holder of its
    pipe, with it.
    """
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def _init_worker(tokenizer_text: str, plan: Plan, parent: int | None = None) -> None:
    if parent is not None:
        _die_with_parent(parent)
    _WORKER["tokenize"] = GroupTokenizer(tokenizer_text, plan)


def _tokenize(key: GroupKey, group: corpus.Group) -> TokenizedGroup:
    tokenized: TokenizedGroup = _WORKER["tokenize"](key, group)
    return tokenized


class _ShardSet:
    """Appends fixed-length rows to numbered shards in a local staging directory."""

    def __init__(
        self,
        staging: Path,
        records_per_shard: int,
        token_dtype: str,
        *,
        prefix: str = "shard",
        max_records: int | None = None,
    ):
        self.staging = staging
        self.prefix = prefix
        self.max_records = max_records
        self.overflow_records = 0  # rows refused past max_records
        self.records_per_shard = records_per_shard
        self.token_dtype = token_dtype
        self.done: list[tuple[Path, int, int, str]] = []  # path, records, bytes, sha256
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._records = 0
        self._bytes = 0
        self._sha = hashlib.sha256()

    @property
    def total_records(self) -> int:
        return sum(d[1] for d in self.done) + self._records

    def add(self, rows: np.ndarray) -> None:
        if self.max_records is not None:
            room = max(self.max_records - self.total_records, 0)
            self.overflow_records += max(len(rows) - room, 0)
            rows = rows[:room]
        while len(rows):
            if self._file is None:
                self._path = self.staging / f"{self.prefix}-{len(self.done):05d}.tmp"
                self._file = self._path.open("wb")
                self._records, self._bytes, self._sha = 0, 0, hashlib.sha256()
            take = rows[: self.records_per_shard - self._records]
            framed = records.frame_records(take, self.token_dtype)
            self._file.write(framed)
            self._sha.update(framed)
            self._records += len(take)
            self._bytes += len(framed)
            rows = rows[len(take) :]
            if self._records == self.records_per_shard:
                self.close()

    def close(self) -> None:
        if self._file is None or self._path is None:
            return
        self._file.close()
        self.done.append((self._path, self._records, self._bytes, self._sha.hexdigest()))
        self._file = None


class _Assembler:
    """Takes tokenized groups in the global order and does what needs that order: budgets,
    the held-out fraction (decided once the floor is reached or the corpus ends), packing
    and the shard layout. The Beam pipeline computes the same from side inputs."""

    def __init__(self, job: JobSpec, plan: Plan, staging: Path):
        self.job, self.plan = job, plan
        self.budgets = source_budgets(job)
        self.spent: dict[int, int] = {}
        self.sources = [SourceUse(budget=b) for b in self.budgets]
        self.train = _ShardSet(staging, plan.records_per_shard, plan.token_dtype)
        self.held_out = _ShardSet(
            staging,
            plan.records_per_shard,
            plan.token_dtype,
            prefix="eval",
            max_records=plan.eval_max_sequences,
        )
        self.fraction: float | None = 0.0 if plan.eval_fraction <= 0 else None
        self.waiting: list[TokenizedGroup] = []  # until the fraction is decided
        self.used_tokens = 0
        self.tokens = 0  # every token tokenized (for the rate shown)
        self.long_words = 0
        self.dropped_tokens = 0
        self.eval_dropped_tokens = 0
        self.eval_documents = 0

    def exhausted(self, source: int) -> bool:
        return self.sources[source].exhausted

    def add(self, group: TokenizedGroup) -> None:
        self.tokens += group.tokens
        key = budget_key(self.job, group.source)
        budget = self.budgets[group.source]
        spent = self.spent.get(key, 0)
        keep = within_budget(group, spent, budget)
        # Every document counts toward the budget's running sum, used or not: once one does
        # not fit, no later one does (the sums only grow), as Beam's positions say too.
        self.spent[key] = spent + group.tokens
        if keep < group.documents:
            for i, _ in enumerate(self.sources):
                if budget_key(self.job, i) == key:
                    self.sources[i].exhausted = True
        if not keep:
            return  # as if never read: the local runner may not even tokenize such a group
        self.long_words += group.long_words  # of a used group (cut words are not per document)
        group = truncated(group, keep)
        use = self.sources[group.source]
        use.tokens += group.tokens
        use.documents += group.documents
        self.used_tokens += group.tokens
        if self.fraction is None:
            self.waiting.append(group)
            if reaches_floor(self.plan, self.used_tokens):
                self._decide()
            return
        self._pack(group)

    def _decide(self) -> None:
        self.fraction = held_out_fraction(self.plan, self.used_tokens)
        waiting, self.waiting = self.waiting, []
        for group in waiting:
            self._pack(group)

    def _pack(self, group: TokenizedGroup) -> None:
        packed = pack_group(group, self.fraction or 0.0, self.plan)
        self.train.add(packed.train)
        self.held_out.add(packed.held_out)
        self.dropped_tokens += packed.train_dropped_tokens
        self.eval_dropped_tokens += packed.eval_dropped_tokens
        self.eval_documents += packed.eval_documents

    def finish(self, stats: corpus.CorpusStats) -> Totals:
        if self.fraction is None:
            self._decide()
        self.train.close()
        self.held_out.close()
        stats.long_words = self.long_words
        return Totals(
            stats=stats,
            sources=self.sources,
            fraction=float(self.fraction or 0.0),
            dropped_tokens=self.dropped_tokens,
            eval_documents=self.eval_documents,
            eval_dropped_tokens=self.eval_dropped_tokens
            + self.held_out.overflow_records * self.plan.width,
        )


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(
        total=total,
        desc="encode",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        mininterval=0.5,
        smoothing=0.1,
    )


def encode(job: JobSpec, status: StatusWriter) -> mf.Manifest:
    """Encode the corpus into shards + manifest (skips if a manifest already exists)."""
    data_dir = job.paths.data
    if is_complete(job):
        manifest = mf.load_manifest(data_dir)
        check_current(job, manifest)
        return manifest
    if job.data.runner == "beam":
        return _beam_module().encode(job, status)
    prepared = prepare(job)
    sources = corpus.resolve_sources(job.corpus)
    files = [f for files in sources for f in files]
    total = corpus.total_bytes(list(dict.fromkeys(files)))
    workers = job.data.workers or os.cpu_count() or 1
    status.update(
        stage=STAGE,
        progress=0.0,
        message=f"encoding {len(files)} files ({total / 1e6:.1f} MB) with {workers} workers",
    )
    storage.remove_tree(data_dir)  # leftovers of an unfinished run (there is no manifest)
    staging_root, need = _check_space(job, prepared, sources, total)
    staging = _make_staging(data_dir)
    try:
        totals, assembler = _encode_to(
            staging, job=job, prepared=prepared, sources=sources, workers=workers,
            total=total, status=status,
        )  # fmt: skip
        corpus.require_text(totals.stats, job.corpus)
        if not assembler.train.done:
            raise CorpusError(
                f"corpus too small: {totals.dropped_tokens} tokens do not fill one sequence of "
                f"data.seq_length={job.data.seq_length} (sequences are packed within groups "
                f"of about {corpus.GROUP_BYTES >> 20} MiB of text)"
            )
        manifest = _publish(job, prepared, assembler, totals, files)
    except OSError as exc:
        if not storage.is_disk_full(exc):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # first: the message counts what is free
        raise storage.disk_full(exc, staging_root, need=need) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    complete_status(status, manifest, job)
    return manifest


def _beam_module() -> Any:
    """payload.encode_beam (Apache Beam only where asked for: its own environment)."""
    try:
        from payload import encode_beam  # noqa: PLC0415
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("apache_beam"):
            raise
        raise DataError(
            "data.runner: beam needs Apache Beam, which has its own environment: `make "
            "venv-beam`, then run this stage with .venv-beam/bin/python -m payload encode "
            "--job ... (or set data.runner: local)"
        ) from None
    return encode_beam


def _publish(
    job: JobSpec, prepared: Prepared, assembler: _Assembler, totals: Totals, files: list[str]
) -> mf.Manifest:
    """Shards to their names, then stage.json, then the manifest (the commit point)."""
    train = _place(job.paths.data, assembler.train, "shard")
    held_out = _place(job.paths.data, assembler.held_out, "eval")
    manifest = build_manifest(job, prepared, train, held_out, totals, files=files)
    write_stage_and_manifest(job, manifest)
    return manifest


def _place(data_dir: str, shard_set: _ShardSet, prefix: str) -> list[mf.Shard]:
    """Move (or upload) the staged shards to their names."""
    names = shard_names(prefix, len(shard_set.done))
    entries = []
    for name, (path, n_records, n_bytes, sha) in zip(names, shard_set.done, strict=True):
        if storage.is_gcs(data_dir):
            storage.upload_file(str(path), storage.join(data_dir, name))
        else:
            path.replace(Path(data_dir, name))
        entries.append(mf.Shard(name=name, records=n_records, bytes=n_bytes, sha256=sha))
    return entries


def _encode_to(
    staging: Path,
    *,
    job: JobSpec,
    prepared: Prepared,
    sources: list[list[str]],
    workers: int,
    total: int,
    status: StatusWriter,
) -> tuple[Totals, _Assembler]:
    stats = corpus.CorpusStats()
    source_stats = [corpus.CorpusStats() for _ in sources]
    assembler = _Assembler(job, prepared.plan, staging)
    read_bytes = 0
    started = time.monotonic()

    def on_bytes(n: int) -> None:
        nonlocal read_bytes
        read_bytes += n
        bar.update(n)

    def consume(tokenized: TokenizedGroup) -> None:
        assembler.add(tokenized)
        bar.set_postfix_str(
            f"{assembler.tokens / max(time.monotonic() - started, 1e-9) / 1e3:.0f}k tok/s"
        )
        status.update(
            stage=STAGE,
            progress=read_bytes / max(total, 1),
            **_metrics(
                records=assembler.train.total_records,
                eval_records=assembler.held_out.total_records,
                tokens=assembler.tokens,
                bytes_read=read_bytes,
                documents_read=stats.documents,
                **source_status(assembler.sources),
                **{f"source{i}_bytes_read": s.bytes for i, s in enumerate(source_stats)},
            ),
        )

    # A ProcessPoolExecutor, not mp.Pool: a worker that dies (OOM kill, failed spawn)
    # raises BrokenProcessPool here instead of leaving the stage waiting forever.
    max_in_flight = 2 * workers
    with (
        _progress_bar(total) as bar,
        ProcessPoolExecutor(
            workers,
            mp_context=mp.get_context("spawn"),
            initializer=_init_worker,
            initargs=(prepared.tokenizer_text, prepared.plan, os.getpid()),
        ) as pool,
    ):
        pending: deque[Future[TokenizedGroup]] = deque()
        files: dict[tuple[int, str], int] = {}
        groups = corpus.iter_groups(
            job.corpus,
            stats,
            on_bytes=on_bytes,
            group_bytes=corpus.GROUP_BYTES,  # read here, so that tests can make groups small
            sources=sources,
            source_stats=source_stats,
        )
        submitted = 0
        for group in groups:
            file_number = files.setdefault((group.source, group.path), len(files))
            if assembler.exhausted(group.source):
                continue  # read on (counted), but nothing of it can be used
            # With spawn, each of the first `workers` submits starts one worker.
            with _sigint_ignored(submitted < workers):
                key = (group.source, file_number, group.index)
                pending.append(pool.submit(_tokenize, key, group))
            submitted += 1
            if len(pending) >= max_in_flight:
                consume(pending.popleft().result())
        while pending:
            consume(pending.popleft().result())
    return assembler.finish(stats), assembler


def _check_space(
    job: JobSpec, prepared: Prepared, sources: list[list[str]], total: int
) -> tuple[str, int]:
    """DiskFullError unless the staging directory has room for the estimated shards.

    Shards are staged in full before they are published: locally in data/, for gs:// in this
    machine's temp directory. That is where the space must be. Returns (where, need).
    """
    data_dir = job.paths.data
    staging_root = tempfile.gettempdir() if storage.is_gcs(data_dir) else data_dir
    need = estimate_output_bytes(job, prepared, sources, total)
    hint = " (or point TMPDIR elsewhere)" if storage.is_gcs(data_dir) else ""
    storage.require_space(staging_root, need, f"the shards of {total / 1e6:.1f} MB of corpus", hint)
    return staging_root, need


def _make_staging(data_dir: str) -> Path:
    if storage.is_gcs(data_dir):
        return Path(tempfile.mkdtemp(prefix="payload-encode-"))
    staging = Path(data_dir, f".staging-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    return staging


RECORD_FRAMING = 16  # TFRecord: length (8) + its CRC (4) + the data's CRC (4) per record
SAMPLE_DOCUMENTS = 2000  # of the first group, tokenized for the estimate


def estimate_output_bytes(
    job: JobSpec, prepared: Prepared, sources: list[list[str]], total: int
) -> int:
    """About how many bytes the shards of the whole corpus take (training + held out).

    Tokens per input byte measured on the corpus's first group (its first
    ``SAMPLE_DOCUMENTS`` documents, plus one separator each), times the input size; each
    sequence of ``seq_length`` ids costs ``seq_length * itemsize + 16`` bytes (2.125 bytes
    per token at length 128, uint16).
    """
    groups = corpus.iter_groups(job.corpus, corpus.CorpusStats(), sources=sources)
    try:
        first = next(groups, None)
    finally:
        groups.close()  # type: ignore[attr-defined]
    if first is None or not first.nbytes:
        return 0
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_str(prepared.tokenizer_text)
    sample = first.documents[:SAMPLE_DOCUMENTS]
    sample_bytes = sum(len(d.encode("utf-8")) for d in sample) or 1
    text_bytes = sum(len(d.encode("utf-8")) for d in first.documents) or 1
    # One document at a time: encode_batch would start the Rust thread pool in this process.
    tokens = sum(len(tok.encode(doc, add_special_tokens=False).ids) + 1 for doc in sample)
    tokens_per_input_byte = tokens / sample_bytes * text_bytes / first.nbytes
    plan = prepared.plan
    row_bytes = plan.seq_length * np.dtype(plan.token_dtype).itemsize + RECORD_FRAMING
    return int(tokens_per_input_byte * total / plan.width * row_bytes)


@contextlib.contextmanager
def _sigint_ignored(active: bool) -> Iterator[None]:
    """Ignore SIGINT while workers start: they inherit it (and Python keeps an inherited
    ignore), so a Ctrl-C, which reaches the whole process group, is reported once, here."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
