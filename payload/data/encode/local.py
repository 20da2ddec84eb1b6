"""The encode stage's local runner (``data.runner: local``): worker processes, assembly in the
global order, staging, and the disk check before it starts. It runs the rules of
``payload/data/encode/rules.py`` and writes the outputs of ``payload/data/encode/outputs.py``.

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
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from payload.core import records, storage
from payload.core.errors import CorpusError
from payload.data import corpus
from payload.data.encode.outputs import (
    STAGE,
    SourceUse,
    Totals,
    build_manifest,
    complete_status,
    shard_names,
    source_status,
    status_metrics,
    write_stage_and_manifest,
)
from payload.data.encode.rules import (
    GroupKey,
    GroupTokenizer,
    Plan,
    Prepared,
    TokenizedGroup,
    budget_key,
    held_out_fraction,
    pack_group,
    prepare,
    reaches_floor,
    source_budgets,
    truncated,
    within_budget,
)
from payload.schema import manifest as mf
from payload.spec import JobSpec

if TYPE_CHECKING:
    from payload.core.status import StatusWriter

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
    """Encode the corpus into shards + manifest here, with worker processes (the stage's door,
    ``payload.data.encode.stage.encode``, calls this once it found no manifest)."""
    data_dir = job.paths.data
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
            **status_metrics(
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
