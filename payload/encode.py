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

Held-out split (``data.eval_fraction``): whole documents are routed either to the training
stream or to a separate held-out stream, packed the same way into ``eval-*.tfrecord``
shards with their own records, bytes and sha256 in the manifest. No document contributes a
token to both. The choice is a deterministic running quota over the documents in corpus
order: a document goes to the held-out stream while that stream holds less than its share
of all tokens seen so far, so held-out documents are spread evenly through the corpus. The
share is ``eval_fraction``, raised to reach ``eval_min_sequences`` and lowered to stay at
``eval_max_sequences`` (both judged against the corpus size estimated from the tokens per
byte seen so far, never above half of the corpus); held-out sequences past the cap are
dropped and counted. Like the shards, the split does not depend on the worker count.
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
from payload.spec import MASKED_OBJECTIVES, MAX_EVAL_FRACTION, DataSpec, JobSpec
from payload.tokenizer import WordLimit, max_word_length_of, tokenizer_json

if TYPE_CHECKING:
    from payload.status import StatusWriter

STAGE = "encode"
STAGE_FILE = "stage.json"


def packing_description(objective: str) -> str:
    if objective in MASKED_OBJECTIVES:  # rtd (ELECTRA) packs as mlm
        return f"{objective}: [CLS] + (seq_length-1) tokens of the stream 'doc [SEP] doc [SEP] ...'"
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


def _init_worker(tokenizer_text: str, plan: _Plan, parent: int | None = None) -> None:
    if parent is not None:
        _die_with_parent(parent)
    # One Rust thread per worker: the parallelism comes from the worker processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_str(tokenizer_text)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True  # corpus text "[MASK]" is text, not the mask token
    _WORKER.update(tokenizer=tok, plan=plan, word_limit=WordLimit(tok))


@dataclass(frozen=True)
class _Encoded:
    """One chunk's token stream (with separators) and where its documents lie in it."""

    ids: np.ndarray
    lengths: np.ndarray  # tokens of each document piece, in order; they add up to len(ids)
    continues_previous: bool  # the first piece is the rest of the previous chunk's document
    counts: dict[str, int]
    nbytes: int


def _encode_chunk(chunk: corpus.Chunk) -> _Encoded:
    plan = _WORKER["plan"]
    text = corpus.split_documents(chunk, plan.on_bad_input)
    encodings, text.stats.long_words = _WORKER["word_limit"].encode(text.documents)
    flat: list[int] = []
    lengths: list[int] = []
    last = len(encodings) - 1
    if plan.objective == "mlm":
        for i, enc in enumerate(encodings):
            start = len(flat)
            flat.extend(enc.ids)
            if i != last or not text.continues:
                flat.append(plan.first_id)
            lengths.append(len(flat) - start)
    else:
        for i, enc in enumerate(encodings):
            start = len(flat)
            if i != 0 or chunk.starts_document:
                flat.append(plan.first_id)
            flat.extend(enc.ids)
            if i != last or not text.continues:
                flat.append(plan.last_id)
            lengths.append(len(flat) - start)
    ids = np.array(flat, dtype=np.dtype(plan.token_dtype))
    return _Encoded(
        ids=ids,
        lengths=np.array(lengths, dtype=np.int64),
        continues_previous=not chunk.starts_document,
        counts=text.stats.as_dict(),
        nbytes=len(chunk.data),
    )


class _HeldOutQuota:
    """Decides, document by document, whether a document goes to the held-out stream."""

    def __init__(self, spec: DataSpec, width: int, total_bytes: int):
        self.fraction = spec.eval_fraction
        self.floor_tokens = spec.eval_min_sequences * width
        self.cap_tokens = spec.eval_max_sequences * width
        self.total_bytes = max(total_bytes, 1)
        self.seen_tokens = self.seen_bytes = self.eval_tokens = 0
        self.eval_documents = 0
        self.current = False  # where the document being continued went

    @property
    def enabled(self) -> bool:
        return self.fraction > 0

    def share(self, chunk_tokens: int, chunk_bytes: int) -> float:
        """The held-out share for this chunk, judged against the estimated corpus size."""
        tokens = self.seen_tokens + chunk_tokens
        estimated_total = tokens * self.total_bytes / max(self.seen_bytes + chunk_bytes, 1)
        share = self.fraction
        if estimated_total > 0:
            share = max(share, self.floor_tokens / estimated_total)
            share = min(share, self.cap_tokens / estimated_total)
        return min(share, MAX_EVAL_FRACTION)

    def split(self, encoded: _Encoded) -> tuple[np.ndarray, np.ndarray]:
        """(training ids, held-out ids) of one chunk, documents kept whole and in order."""
        ids = encoded.ids
        if not self.enabled:
            self.seen_tokens += len(ids)
            self.seen_bytes += encoded.nbytes
            return ids, ids[:0]
        share = self.share(len(ids), encoded.nbytes)
        to_eval = np.zeros(len(ids), dtype=bool)
        start = 0
        for i, length in enumerate(encoded.lengths.tolist()):
            if not (i == 0 and encoded.continues_previous):
                self.current = (
                    self.eval_tokens < self.cap_tokens
                    and self.eval_tokens < share * self.seen_tokens
                )
                self.eval_documents += int(self.current)
            if self.current:
                to_eval[start : start + length] = True
                self.eval_tokens += length
            self.seen_tokens += length
            start += length
        self.seen_bytes += encoded.nbytes
        return ids[~to_eval], ids[to_eval]


# --------------------------------------------------------------------------- shards


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
    if job.data.objective in MASKED_OBJECTIVES:  # the "mlm" packing serves rtd too
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
    staging_root, need = _check_space(tok, files, job, total, token_dtype)
    staging = _make_staging(data_dir)
    try:
        stats, train, held_out, quota = _encode_to(
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
        if not train.shards.done:
            raise CorpusError(
                f"corpus too small: {train.dropped_tokens} tokens do not fill one sequence of "
                f"data.seq_length={job.data.seq_length}"
            )
        manifest = _publish(
            data_dir,
            train.shards,
            held_out.shards,
            job=job,
            corpus_counts={
                **stats.as_dict(),
                "dropped_tokens": train.dropped_tokens,
                "eval_documents": quota.eval_documents,
                "eval_dropped_tokens": held_out.dropped_tokens,
                "max_word_length": job.tokenizer.max_word_length,
            },
            vocab_size=vocab_size,
            token_dtype=token_dtype,
            tokenizer_sha=tokenizer_sha,
            special_ids=special_ids,
        )
    except OSError as exc:
        if not storage.is_disk_full(exc):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # first: the message counts what is free
        raise storage.disk_full(exc, staging_root, need=need) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    status.update(
        stage=STAGE,
        state="complete",
        message=(
            f"{manifest.total_records} sequences, {len(manifest.shards)} shards "
            f"(held out: {manifest.eval_records} sequences) in {data_dir}"
        ),
        records=manifest.total_records,
        shards=len(manifest.shards),
        eval_records=manifest.eval_records,
        **stats.as_dict(),
    )
    return manifest


def _check_space(
    tok: Any, files: list[str], job: JobSpec, total: int, token_dtype: str
) -> tuple[str, int]:
    """DiskFullError unless the staging directory has room for the estimated shards.

    Shards are staged in full before they are published: locally in data/, for gs:// in this
    machine's temp directory. That is where the space must be. Returns (where, need).
    """
    data_dir = job.paths.data
    staging_root = tempfile.gettempdir() if storage.is_gcs(data_dir) else data_dir
    need = estimate_output_bytes(tok, files, job, total, token_dtype)
    hint = " (or point TMPDIR elsewhere)" if storage.is_gcs(data_dir) else ""
    storage.require_space(staging_root, need, f"the shards of {total / 1e6:.1f} MB of corpus", hint)
    return staging_root, need


def _make_staging(data_dir: str) -> Path:
    if storage.is_gcs(data_dir):
        return Path(tempfile.mkdtemp(prefix="payload-encode-"))
    staging = Path(data_dir, f".staging-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    return staging


SAMPLE_BYTES = 256 << 10
RECORD_FRAMING = 16  # TFRecord: length (8) + its CRC (4) + the data's CRC (4) per record


def estimate_output_bytes(
    tok: Any, files: list[str], job: JobSpec, total: int, token_dtype: str
) -> int:
    """About how many bytes the shards of the whole corpus take (training + held out).

    Tokens per corpus byte measured on the first ``SAMPLE_BYTES`` of the corpus (plus one
    separator per document), times the corpus size; each sequence of ``seq_length`` ids costs
    ``seq_length * itemsize + 16`` bytes (2.125 bytes per token at length 128, uint16).
    """
    chunks = corpus.iter_chunks(
        files, job.corpus.on_bad_input, corpus.CorpusStats(), chunk_bytes=SAMPLE_BYTES
    )
    try:
        first = next(chunks, None)
    finally:
        chunks.close()
    if first is None or not first.data:
        return 0
    documents = corpus.split_documents(first, job.corpus.on_bad_input).documents
    # One document at a time: encode_batch would start the Rust thread pool in this process.
    tokens = sum(len(tok.encode(doc, add_special_tokens=False).ids) + 1 for doc in documents)
    seq_length = job.data.seq_length
    width = seq_length - 1 if job.data.objective in MASKED_OBJECTIVES else seq_length
    row_bytes = seq_length * np.dtype(token_dtype).itemsize + RECORD_FRAMING
    return int(tokens / len(first.data) * total / width * row_bytes)


class _Packer:
    """Cuts one token stream into fixed-length rows and appends them to a shard set."""

    def __init__(self, shards: _ShardSet, width: int, lead: int | None, dtype: np.dtype):
        self.shards, self.width, self.lead, self.dtype = shards, width, lead, dtype
        self.carry = np.empty(0, dtype=dtype)

    def add(self, ids: np.ndarray) -> None:
        stream = np.concatenate([self.carry, ids]) if len(self.carry) else ids
        rows = len(stream) // self.width
        block = stream[: rows * self.width].reshape(rows, self.width)
        if self.lead is not None:
            lead = np.full((rows, 1), self.lead, dtype=self.dtype)
            block = np.concatenate([lead, block], axis=1)
        self.shards.add(block)
        self.carry = stream[rows * self.width :].copy()

    @property
    def dropped_tokens(self) -> int:
        """The unfinished last window plus rows refused past the shard set's cap."""
        return len(self.carry) + self.shards.overflow_records * self.width


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
) -> tuple[corpus.CorpusStats, _Packer, _Packer, _HeldOutQuota]:
    stats = corpus.CorpusStats()
    dtype = np.dtype(plan.token_dtype)
    train = _Packer(
        _ShardSet(staging, job.data.records_per_shard, plan.token_dtype), width, lead, dtype
    )
    held_out = _Packer(
        _ShardSet(
            staging,
            job.data.records_per_shard,
            plan.token_dtype,
            prefix="eval",
            max_records=job.data.eval_max_sequences,
        ),
        width,
        lead,
        dtype,
    )
    quota = _HeldOutQuota(job.data, width, total)
    done_bytes = 0
    started = time.monotonic()
    tokens = 0

    def consume(encoded: _Encoded) -> None:
        nonlocal done_bytes, tokens
        stats.documents += encoded.counts["documents"]
        stats.skipped_documents += encoded.counts["skipped_documents"]
        stats.long_words += encoded.counts["long_words"]
        tokens += len(encoded.ids)
        train_ids, eval_ids = quota.split(encoded)
        train.add(train_ids)
        if len(eval_ids):
            held_out.add(eval_ids)
        done_bytes += encoded.nbytes
        bar.update(encoded.nbytes)
        bar.set_postfix_str(f"{tokens / max(time.monotonic() - started, 1e-9) / 1e3:.0f}k tok/s")
        status.update(
            stage=STAGE,
            progress=done_bytes / max(total, 1),
            records=train.shards.total_records,
            eval_records=held_out.shards.total_records,
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
            initargs=(tokenizer_text, plan, os.getpid()),
        ) as pool,
    ):
        pending: deque[Future[_Encoded]] = deque()
        chunks = corpus.iter_chunks(files, job.corpus.on_bad_input, stats)
        for submitted, chunk in enumerate(chunks):
            # With spawn, each of the first `workers` submits starts one worker.
            with _sigint_ignored(submitted < workers):
                pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= max_in_flight:
                consume(pending.popleft().result())
        while pending:
            consume(pending.popleft().result())
    train.shards.close()
    held_out.shards.close()
    return stats, train, held_out, quota


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
    eval_shards: _ShardSet,
    *,
    job: JobSpec,
    corpus_counts: dict[str, int],
    vocab_size: int,
    token_dtype: str,
    tokenizer_sha: str,
    special_ids: dict[str, int],
) -> mf.Manifest:
    def place(shard_set: _ShardSet, prefix: str) -> tuple[mf.Shard, ...]:
        count = len(shard_set.done)
        entries = []
        for i, (path, n_records, n_bytes, sha) in enumerate(shard_set.done):
            name = f"{prefix}-{i:05d}-of-{count:05d}.tfrecord"
            if storage.is_gcs(data_dir):
                storage.upload_file(str(path), storage.join(data_dir, name))
            else:
                path.replace(Path(data_dir, name))
            entries.append(mf.Shard(name=name, records=n_records, bytes=n_bytes, sha256=sha))
        return tuple(entries)

    entries = place(shards, "shard")
    eval_entries = place(eval_shards, "eval")
    total_records = sum(s.records for s in entries)
    eval_records = sum(s.records for s in eval_entries)
    manifest = mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        objective=job.data.objective,
        seq_length=job.data.seq_length,
        vocab_size=vocab_size,
        token_dtype=token_dtype,
        tokenizer_sha256=tokenizer_sha,
        special_ids=special_ids,
        shards=entries,
        total_records=total_records,
        total_tokens=total_records * job.data.seq_length,
        corpus=corpus_counts,
        packing=packing_description(job.data.objective),
        eval_shards=eval_entries,
        eval_records=eval_records,
        eval_tokens=eval_records * job.data.seq_length,
    )
    stage = {"stage": STAGE, "job": job.to_dict(), "manifest": mf.MANIFEST_NAME}
    storage.write_text(
        storage.join(data_dir, STAGE_FILE), json.dumps(stage, indent=2, ensure_ascii=False) + "\n"
    )
    mf.write_manifest(data_dir, manifest)
    return manifest
