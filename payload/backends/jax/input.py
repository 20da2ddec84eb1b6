"""The JAX backend's input pipeline, without TensorFlow: shards -> Grain -> numpy batches.

One input pipeline (a host's share of the shard files, payload/data/input_order.py's plan) is a
Grain `MapDataset` of batch indices (`grain.MapDataset.range`): element k is batch k of the
run, computed from k alone (payload/data/input_order.py's EpochOrder: which records, in which
order) by reading the records it needs and masking them (payload/data/numpy_masking.py). Grain's
`to_iter_dataset(ReadOptions)` computes the next batches on a thread pool ahead of the
trainer. Its position is the step: a resumed run starts the range at the checkpoint's step
(the checkpoint holds no iterator state; the trainer reads batches ahead of the step it
saves, so an iterator's state would be the wrong position anyway).

Records are read by byte range through payload/core/storage.py (a `pread` locally, a ranged GET
on gs://), never a whole file: a corpus larger than the VM's disk streams. A shard's records
have one fixed size, so record i of a shard is at byte i * stride; `records.decode_framed`
checks every length header and both CRCs. Reads go by shuffle window (`train.shuffle_buffer`
records, the blocks of one window read in parallel); the window after the one in use is
read ahead on a background thread.
"""

from __future__ import annotations

import collections
import sys
import threading
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grain
import numpy as np

from payload.core import records, storage
from payload.core.errors import DataError
from payload.data.input_order import (
    EpochOrder,
    PipelinePlan,
    Span,
    masking_ratios,
    plan_pipeline,
    spans_of,
)
from payload.data.numpy_masking import Masker, causal_labels
from payload.schema import manifest as manifest_lib
from payload.schema.manifest import special_ids_of

if TYPE_CHECKING:
    from collections.abc import Iterator

    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec

# Grain's threads compute whole batches (read, decode, mask); a few are enough on a host
# whose devices take milliseconds per step, and they share the GIL with the trainer.
BATCH_THREADS = 2
PREFETCH_BATCHES = 16
# Parallel ranged reads of one window's blocks (gs:// latency); windows kept decoded: at
# least this many, and enough for every batch Grain prefetches.
READ_THREADS = 8
KEEP_WINDOWS = 4
_ENDLESS = sys.maxsize


class Windows:
    """The decoded, permuted records of each (epoch, window), read once, the next window
    read ahead; at most KEEP_WINDOWS kept."""

    def __init__(
        self,
        order: EpochOrder,
        *,
        seq_length: int,
        token_dtype: str,
        repeat: bool,
        keep: int = KEEP_WINDOWS,
    ):
        self.order, self.repeat, self.keep = order, repeat, max(KEEP_WINDOWS, keep)
        self.seq_length, self.token_dtype = int(seq_length), token_dtype
        self.stride = records.record_stride(seq_length, token_dtype)
        self.count = -(-order.length // order.window)
        self._lock = threading.Lock()
        self._windows: collections.OrderedDict[tuple[int, int], futures.Future[np.ndarray]] = (
            collections.OrderedDict()
        )
        self._loader = futures.ThreadPoolExecutor(2, thread_name_prefix="input-window")
        self._reader = futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="input-read")

    def get(self, epoch: int, w: int) -> np.ndarray:
        with self._lock:
            found = self._submit(epoch, w)
            following = (epoch, w + 1) if w + 1 < self.count else (epoch + 1, 0)
            if following[0] == epoch or self.repeat:
                self._submit(*following)
        return found.result()

    def _submit(self, epoch: int, w: int) -> futures.Future[np.ndarray]:
        key = (epoch, w)
        if key in self._windows:
            self._windows.move_to_end(key)
            return self._windows[key]
        future = self._loader.submit(self._load, epoch, w)
        self._windows[key] = future
        while len(self._windows) > self.keep:
            self._windows.popitem(last=False)
        return future

    def _load(self, epoch: int, w: int) -> np.ndarray:
        lo, hi = self.order.window_bounds(w)
        pieces = self.order.pieces(epoch, lo, hi)
        parts = list(self._reader.map(self._read_piece, pieces))
        ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
        permuted = self.order.window_permutation(epoch, w)
        return ids if permuted is None else ids[permuted]

    def _read_piece(self, piece: Any) -> np.ndarray:
        span: Span = self.order.spans[piece.span]
        first = span.first + span.stride * piece.start
        last = first + span.stride * (piece.count - 1)
        data = storage.read_range(span.path, first * self.stride, (last - first + 1) * self.stride)
        if span.stride > 1:
            usable = len(data) - len(data) % self.stride
            frames = np.frombuffer(data[:usable], np.uint8).reshape(-1, self.stride)
            data = frames[:: span.stride].tobytes()
        if len(data) != piece.count * self.stride:
            raise DataError(
                f"{span.path}: the file ends before record {last} ({len(data)} of "
                f"{piece.count * self.stride} bytes from record {first}): it is shorter than "
                "its manifest says"
            )
        return records.decode_framed(
            data,
            self.seq_length,
            self.token_dtype,
            where=span.path,
            first=first,
            step=span.stride,
        )

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)


class BatchMaker:
    """Batch k of one pipeline: records of the epoch's positions, masked for step k."""

    def __init__(
        self,
        job: JobSpec,
        manifest: Manifest,
        plan: PipelinePlan,
        spans: tuple[Span, ...],
        *,
        seed: int,
        pipeline_id: int,
        training: bool,
        repeat: bool,
    ):
        self.batch, self.batches_per_epoch = plan.batch_size, plan.batches_per_epoch
        self.seed = int(seed)
        self.first_row = pipeline_id * plan.batch_size  # rows of the global batch before ours
        seq_length, token_dtype = int(manifest.seq_length), manifest.token_dtype
        order = EpochOrder(
            spans,
            record_bytes=records.record_stride(seq_length, token_dtype),
            window=int(job.train.shuffle_buffer) if training else plan.batch_size,
            seed=seed,
            pipeline_id=pipeline_id,
            shuffle=training,
        )
        # The windows the prefetched batches span, the one read ahead and one to spare.
        keep = -(-PREFETCH_BATCHES * plan.batch_size // order.window) + 3
        self.windows = Windows(
            order, seq_length=seq_length, token_dtype=token_dtype, repeat=repeat, keep=keep
        )
        self.order = order
        special = special_ids_of(manifest)
        self.pad_id = special.get("pad")
        self.masker: Masker | None = None
        ratios = masking_ratios(manifest.objective, special, str(job.paths.data))
        if ratios is not None:
            self.masker = Masker(
                vocab_size=int(manifest.vocab_size),
                special_ids=special.values(),
                mask_id=special["mask"],
                pad_id=self.pad_id,
                max_predictions=int(job.data.max_predictions),
                mask_probability=float(job.data.mask_probability),
                **ratios,
            )

    def ids(self, k: int) -> np.ndarray:
        """The token ids [B, S] of batch k (the shard's dtype)."""
        epoch, index = divmod(int(k), self.batches_per_epoch)
        start, stop = index * self.batch, (index + 1) * self.batch
        parts = []
        for w in self.order.windows(start, stop):
            lo, _ = self.order.window_bounds(w)
            window = self.windows.get(epoch, w)
            parts.append(window[max(start, lo) - lo : stop - lo])
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __call__(self, k: int) -> dict[str, np.ndarray]:
        ids = self.ids(k)
        if self.masker is not None:
            return self.masker(ids, seed=self.seed, step=int(k), first_row=self.first_row)
        return causal_labels(ids, pad_id=self.pad_id)


class Batches:
    """One pipeline's batches from `start_batch` on: an iterator of feature dicts."""

    def __init__(self, maker: BatchMaker, *, start_batch: int, repeat: bool):
        stop = _ENDLESS if repeat else maker.batches_per_epoch
        if start_batch >= stop:
            raise ValueError(
                f"start_batch={start_batch} is past the end of a non-repeating dataset"
            )
        self.maker = maker
        dataset = grain.MapDataset.range(int(start_batch), stop).map(maker)
        options = grain.ReadOptions(
            num_threads=BATCH_THREADS, prefetch_buffer_size=PREFETCH_BATCHES
        )
        self._iterator = iter(dataset.to_iter_dataset(options))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def close(self) -> None:
        self._iterator.close()
        self.maker.windows.close()


def make_batches(
    job: JobSpec,
    manifest: Manifest,
    *,
    batch_size: int,
    seed: int,
    training: bool = True,
    repeat: bool = True,
    start_batch: int = 0,
    num_pipelines: int = 1,
    pipeline_id: int = 0,
    split: str = "train",
) -> Batches:
    """Batches of model inputs of pipeline `pipeline_id` of `num_pipelines` (the features of
    payload/data/numpy_masking.py); `start_batch` is the step to start at (resume). `split="eval"`
    reads the held-out shards, in file order."""
    paths = manifest_lib.shard_paths(job.paths.data, manifest, split=split)
    counts = [s.records for s in (manifest.eval_shards if split == "eval" else manifest.shards)]
    plan = plan_pipeline(
        paths, counts, batch_size=batch_size, num_pipelines=num_pipelines, pipeline_id=pipeline_id
    )
    maker = BatchMaker(
        job,
        manifest,
        plan,
        spans_of(paths, counts, plan),
        seed=seed,
        pipeline_id=pipeline_id,
        training=training,
        repeat=repeat,
    )
    return Batches(maker, start_batch=start_batch, repeat=repeat)
