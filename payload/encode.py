"""Stage 2: corpus -> packed fixed-length token sequences -> sharded TFRecords + manifest.

Packing (no padding anywhere):

* ``mlm``: the corpus becomes one token stream ``d1 [SEP] d2 [SEP] d3 ...`` (documents in
  corpus order, each followed by the separator: ``[SEP]``, or ``</s>`` in RoBERTa style).
  The stream is cut into windows of ``seq_length - 1`` tokens and every sequence is
  ``[CLS] + window``, so position 0 always holds ``[CLS]`` and document boundaries are marked
  by ``[SEP]`` wherever they fall.
* ``clm``: each document is ``<s> d </s>`` (exactly what the tokenizer's post-processor
  produces); the concatenation is cut into windows of ``seq_length`` tokens.

A final window shorter than a sequence is dropped (counted as ``dropped_tokens``).
Special tokens written literally in the corpus (e.g. "[MASK]") are encoded as plain text.

Parallelism: the main process reads the corpus as ~1 MiB chunks cut at document boundaries
and hands them to ``data.workers`` processes (spawned, so they never import TensorFlow;
each runs the Rust tokenizer's ``encode_batch_fast`` single-threaded). At most
``2 * workers`` chunks are in flight, so memory does not grow with the corpus. Results come
back in chunk order and chunk boundaries do not depend on the worker count: the output is
byte-for-byte deterministic.

Writing: shards are written to a staging directory (inside the data directory for local
output; a local temp directory for gs://), renamed/uploaded to
``shard-00000-of-000NN.tfrecord``, and ``manifest.json`` is written last, create-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from payload import corpus, records, storage
from payload import manifest as mf
from payload.errors import CorpusError, DataError
from payload.spec import JobSpec
from payload.tokenizer import WordLimit, max_word_length_of, tokenizer_json

if TYPE_CHECKING:
    from payload.status import StatusWriter

STAGE = "encode"
STAGE_FILE = "stage.json"


def packing_description(objective: str) -> str:
    if objective == "mlm":
        return "mlm: [CLS] + (seq_length-1) tokens of the stream 'doc [SEP] doc [SEP] ...'"
    return "clm: seq_length tokens of the stream '<s> doc </s> <s> doc </s> ...'"


def is_complete(job: JobSpec) -> bool:
    return storage.exists(mf.manifest_path(job.paths.data))


def check_current(job: JobSpec, manifest: mf.Manifest) -> None:
    """DataError when complete data was made with another tokenizer or other data settings."""
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


# --------------------------------------------------------------------------- workers

_WORKER: dict[str, Any] = {}


@dataclass(frozen=True)
class _Plan:
    objective: str
    on_bad_input: str
    token_dtype: str
    first_id: int  # mlm: separator after each document; clm: BOS before each document
    last_id: int  # clm: EOS after each document


def _init_worker(tokenizer_text: str, plan: _Plan) -> None:
    # One Rust thread per worker: the parallelism comes from the worker processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_str(tokenizer_text)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True  # corpus text "[MASK]" is text, not the mask token
    _WORKER.update(tokenizer=tok, plan=plan, word_limit=WordLimit(tok))


def _encode_chunk(chunk: corpus.Chunk) -> tuple[np.ndarray, dict[str, int], int]:
    """Token stream of one chunk (with separators), its document counts, its byte size."""
    plan = _WORKER["plan"]
    text = corpus.split_documents(chunk, plan.on_bad_input)
    encodings, text.stats.long_words = _WORKER["word_limit"].encode(text.documents)
    flat: list[int] = []
    last = len(encodings) - 1
    if plan.objective == "mlm":
        for i, enc in enumerate(encodings):
            flat.extend(enc.ids)
            if i != last or not text.continues:
                flat.append(plan.first_id)
    else:
        for i, enc in enumerate(encodings):
            if i != 0 or chunk.starts_document:
                flat.append(plan.first_id)
            flat.extend(enc.ids)
            if i != last or not text.continues:
                flat.append(plan.last_id)
    ids = np.array(flat, dtype=np.dtype(plan.token_dtype))
    return ids, text.stats.as_dict(), len(chunk.data)


# --------------------------------------------------------------------------- shards


class _ShardSet:
    """Appends fixed-length rows to numbered shards in a local staging directory."""

    def __init__(self, staging: Path, records_per_shard: int, token_dtype: str):
        self.staging = staging
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
        while len(rows):
            if self._file is None:
                self._path = self.staging / f"shard-{len(self.done):05d}.tmp"
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
    tokenizer_bytes = tokenizer_json(job.paths.tokenizer)
    tokenizer_sha = hashlib.sha256(tokenizer_bytes).hexdigest()
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
    special_ids = {role: tok.token_to_id(token) for role, token in job.special_roles.items()}
    if any(i is None for i in special_ids.values()):
        raise DataError(
            f"tokenizer in {job.paths.tokenizer} lacks special tokens {special_ids}; "
            "re-run `tpu-payload tokenizer --force`"
        )
    if job.data.objective == "mlm":
        plan = _Plan("mlm", job.corpus.on_bad_input, token_dtype, special_ids["sep"], -1)
        width, lead = job.data.seq_length - 1, special_ids["cls"]
    else:
        plan = _Plan(
            "clm", job.corpus.on_bad_input, token_dtype, special_ids["bos"], special_ids["eos"]
        )
        width, lead = job.data.seq_length, None

    files = corpus.resolve_files(job.corpus)
    total = corpus.total_bytes(files)
    workers = job.data.workers or os.cpu_count() or 1
    status.update(
        stage=STAGE,
        progress=0.0,
        message=f"encoding {len(files)} files ({total / 1e6:.1f} MB) with {workers} workers",
    )
    storage.remove_tree(data_dir)  # leftovers of an unfinished run (there is no manifest)
    if storage.is_gcs(data_dir):
        staging = Path(tempfile.mkdtemp(prefix="payload-encode-"))
    else:
        staging = Path(data_dir, f".staging-{uuid.uuid4().hex[:8]}")
        staging.mkdir(parents=True)
    try:
        stats, shards, dropped = _encode_to(
            staging,
            files,
            job=job,
            plan=plan,
            tokenizer_text=tokenizer_text,
            workers=workers,
            width=width,
            lead=lead,
            total=total,
            status=status,
        )
        corpus.require_text(stats, job.corpus)
        if not shards.done:
            raise CorpusError(
                f"corpus too small: {dropped} tokens do not fill one sequence of "
                f"data.seq_length={job.data.seq_length}"
            )
        manifest = _publish(
            data_dir,
            shards,
            job=job,
            stats=stats,
            dropped=dropped,
            vocab_size=vocab_size,
            token_dtype=token_dtype,
            tokenizer_sha=tokenizer_sha,
            special_ids=special_ids,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    status.update(
        stage=STAGE,
        state="complete",
        message=f"{manifest.total_records} sequences, {len(manifest.shards)} shards in {data_dir}",
        records=manifest.total_records,
        shards=len(manifest.shards),
        **stats.as_dict(),
    )
    return manifest


def _encode_to(
    staging: Path,
    files: list[str],
    *,
    job: JobSpec,
    plan: _Plan,
    tokenizer_text: str,
    workers: int,
    width: int,
    lead: int | None,
    total: int,
    status: StatusWriter,
) -> tuple[corpus.CorpusStats, _ShardSet, int]:
    stats = corpus.CorpusStats()
    shards = _ShardSet(staging, job.data.records_per_shard, plan.token_dtype)
    dtype = np.dtype(plan.token_dtype)
    carry = np.empty(0, dtype=dtype)
    done_bytes = 0
    started = time.monotonic()
    tokens = 0

    def consume(result: tuple[np.ndarray, dict[str, int], int]) -> None:
        nonlocal carry, done_bytes, tokens
        ids, counts, nbytes = result
        stats.documents += counts["documents"]
        stats.skipped_documents += counts["skipped_documents"]
        stats.long_words += counts["long_words"]
        tokens += len(ids)
        stream = np.concatenate([carry, ids]) if len(carry) else ids
        rows = len(stream) // width
        block = stream[: rows * width].reshape(rows, width)
        if lead is not None:
            block = np.concatenate([np.full((rows, 1), lead, dtype=dtype), block], axis=1)
        shards.add(block)
        carry = stream[rows * width :].copy()
        done_bytes += nbytes
        bar.update(nbytes)
        bar.set_postfix_str(f"{tokens / max(time.monotonic() - started, 1e-9) / 1e3:.0f}k tok/s")
        status.update(
            stage=STAGE,
            progress=done_bytes / max(total, 1),
            records=shards.total_records,
            tokens=tokens,
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
            initargs=(tokenizer_text, plan),
        ) as pool,
    ):
        pending: deque[Future[tuple[np.ndarray, dict[str, int], int]]] = deque()
        chunks = corpus.iter_chunks(files, job.corpus.on_bad_input, stats)
        for submitted, chunk in enumerate(chunks):
            # With spawn, each of the first `workers` submits starts one worker.
            with _sigint_ignored(submitted < workers):
                pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= max_in_flight:
                consume(pending.popleft().result())
        while pending:
            consume(pending.popleft().result())
    shards.close()
    return stats, shards, len(carry)


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


def _publish(
    data_dir: str,
    shards: _ShardSet,
    *,
    job: JobSpec,
    stats: corpus.CorpusStats,
    dropped: int,
    vocab_size: int,
    token_dtype: str,
    tokenizer_sha: str,
    special_ids: dict[str, int],
) -> mf.Manifest:
    count = len(shards.done)
    entries = []
    for i, (path, n_records, n_bytes, sha) in enumerate(shards.done):
        name = f"shard-{i:05d}-of-{count:05d}.tfrecord"
        if storage.is_gcs(data_dir):
            storage.upload_file(str(path), storage.join(data_dir, name))
        else:
            path.replace(Path(data_dir, name))
        entries.append(mf.Shard(name=name, records=n_records, bytes=n_bytes, sha256=sha))
    total_records = sum(s.records for s in entries)
    manifest = mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        objective=job.data.objective,
        seq_length=job.data.seq_length,
        vocab_size=vocab_size,
        token_dtype=token_dtype,
        tokenizer_sha256=tokenizer_sha,
        special_ids=special_ids,
        shards=tuple(entries),
        total_records=total_records,
        total_tokens=total_records * job.data.seq_length,
        corpus={
            **stats.as_dict(),
            "dropped_tokens": dropped,
            "max_word_length": job.tokenizer.max_word_length,
        },
        packing=packing_description(job.data.objective),
    )
    stage = {"stage": STAGE, "job": job.to_dict(), "manifest": mf.MANIFEST_NAME}
    storage.write_text(
        storage.join(data_dir, STAGE_FILE), json.dumps(stage, indent=2, ensure_ascii=False) + "\n"
    )
    mf.write_manifest(data_dir, manifest)
    return manifest
