"""What each input pipeline reads, and (for the JAX backend's input) in which order.

`plan_pipeline` splits the shards between input pipelines (hosts) and sizes the epoch, for
both backends (payload/backends/tf/input.py's tf.data pipeline and payload/backends/jax/input.py);
`masking_ratios` is the dynamic masking both apply for a masked objective.

The JAX backend's order is a pure function of (seed, pipeline, epoch), computed without
reading anything, so that batch k of a run can be found without reading batches 0..k-1
(step-addressed: the step in the checkpoint is the input's position):

 1. the pipeline's records are its spans (whole shard files, or every P-th record of the
    shards when there are fewer files than pipelines) cut into blocks of consecutive
    records of about `BLOCK_BYTES` (one ranged read on gs://);
 2. each training epoch puts the blocks in a seeded random order (every block of every
    file of the pipeline, not just the file order) and cuts the sequence into windows of
    `train.shuffle_buffer` records; inside each window the records are permuted (seeded):
    tf.data's shuffle buffer, made random-access;
 3. batch i of the epoch is positions [i B, (i + 1) B) of that sequence; the last partial
    batch is dropped, so every epoch has `batches_per_epoch` batches. Evaluation reads the
    blocks in file order without permutations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from payload.core.errors import DataError
from payload.data.numpy_masking import permutation
from payload.model.configs import ELECTRA_MASK_TOKEN_RATIO, ELECTRA_RANDOM_TOKEN_RATIO
from payload.spec import MASKED_OBJECTIVES

# A block is one read: ~256 KiB amortises a gs:// request (tens of ms) and is still small
# next to a shuffle window of 10,000 records of 128 tokens (2.7 MB).
BLOCK_BYTES = 256 << 10
# Hash-stream tags of the order (numpy_masking.hash64 keys).
_BLOCKS, _WINDOW = 11, 12


@dataclass(frozen=True)
class PipelinePlan:
    """What one input pipeline reads: its files, its share of records, its epoch length."""

    files: tuple[str, ...]
    records: int
    batch_size: int
    batches_per_epoch: int
    record_shard: tuple[int, int] | None  # (num_shards, index) when files cannot be split


def masking_ratios(
    objective: str, special: Mapping[str, int], data_dir: str
) -> dict[str, float] | None:
    """The masking arguments for `objective` (None: no masking; {}: BERT's default split), or
    DataError (one line) when the vocabulary has no mask token. rtd: ELECTRA's masking (85%
    [MASK], 15% unchanged: model.ELECTRA_MASK_TOKEN_RATIO); the generator's samples then
    replace every chosen position inside the train step."""
    if objective not in MASKED_OBJECTIVES:
        return None
    if "mask" not in special:
        raise DataError(
            f"manifest in {data_dir} has no mask token among its special ids "
            f"({', '.join(sorted(special))}); {objective} needs one"
        )
    if objective != "rtd":
        return {}
    return {
        "mask_token_ratio": ELECTRA_MASK_TOKEN_RATIO,
        "random_token_ratio": ELECTRA_RANDOM_TOKEN_RATIO,
    }


def plan_pipeline(
    paths: list[str],
    shard_records: list[int],
    *,
    batch_size: int,
    num_pipelines: int = 1,
    pipeline_id: int = 0,
) -> PipelinePlan:
    """Split the shards between input pipelines (hosts) and size the epoch."""
    if num_pipelines > 1 and len(paths) >= num_pipelines:
        mine = list(range(pipeline_id, len(paths), num_pipelines))
        files = tuple(paths[i] for i in mine)
        count = sum(shard_records[i] for i in mine)
        record_shard = None
    else:
        files = tuple(paths)
        count = sum(shard_records) // num_pipelines
        record_shard = (num_pipelines, pipeline_id) if num_pipelines > 1 else None
    batches = count // batch_size
    if batches == 0:
        raise DataError(
            f"the data has {sum(shard_records)} sequences, fewer than one batch of "
            f"{batch_size} per input pipeline; lower train.global_batch_size or add corpus"
        )
    return PipelinePlan(files, count, batch_size, batches, record_shard)


@dataclass(frozen=True)
class Span:
    """Records first, first + stride, ... (count of them) of one shard file."""

    path: str
    first: int
    stride: int
    count: int


def spans_of(paths: list[str], shard_records: list[int], plan: PipelinePlan) -> tuple[Span, ...]:
    """The records `plan`'s pipeline reads: its whole files, or, when the records are split
    (`record_shard` (P, p)), record r of the concatenated files for every r = p mod P."""
    records = dict(zip(paths, shard_records, strict=True))
    if plan.record_shard is None:
        return tuple(Span(path, 0, 1, records[path]) for path in plan.files)
    pipelines, index = plan.record_shard
    spans, offset = [], 0
    for path in plan.files:
        n = records[path]
        first = (index - offset) % pipelines
        if first < n:
            spans.append(Span(path, first, pipelines, (n - first + pipelines - 1) // pipelines))
        offset += n
    return tuple(spans)


@dataclass(frozen=True)
class Piece:
    """`count` consecutive records of a span, from the span's record `start`."""

    span: int
    start: int
    count: int


class EpochOrder:
    """Where each position of an epoch's record sequence comes from (module docstring)."""

    def __init__(
        self,
        spans: tuple[Span, ...],
        *,
        record_bytes: int,
        window: int,
        seed: int,
        pipeline_id: int,
        shuffle: bool,
    ):
        self.spans, self.window = spans, max(1, int(window))
        self.seed, self.pipeline_id, self.shuffle = int(seed), int(pipeline_id), shuffle
        per_block = max(1, BLOCK_BYTES // max(1, record_bytes))
        blocks = [
            (s, start, min(per_block, span.count - start))
            for s, span in enumerate(spans)
            for start in range(0, span.count, per_block)
        ]
        self.blocks = np.array(blocks, np.int64).reshape(-1, 3)
        self.length = int(self.blocks[:, 2].sum())
        # The epoch's block order, for the last epochs asked (windows of one epoch share it).
        self._block_order = lru_cache(maxsize=2)(self._compute_block_order)

    @cached_property
    def _file_order_ends(self) -> np.ndarray:
        return np.cumsum(self.blocks[:, 2])

    def _compute_block_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block indices in the epoch's order, their cumulative end positions)."""
        if not self.shuffle:
            return np.arange(len(self.blocks)), self._file_order_ends
        order = permutation(len(self.blocks), self.seed, self.pipeline_id, epoch, _BLOCKS)
        return order, np.cumsum(self.blocks[order, 2])

    def pieces(self, epoch: int, start: int, stop: int) -> list[Piece]:
        """The pieces of blocks that hold sequence positions [start, stop), in order."""
        order, ends = self._block_order(epoch)
        out = []
        first = int(np.searchsorted(ends, start, side="right"))
        for k in range(first, len(order)):
            block_start = int(ends[k] - self.blocks[order[k], 2])
            if block_start >= stop:
                break
            span, offset, count = (int(x) for x in self.blocks[order[k]])
            lo, hi = max(start, block_start), min(stop, block_start + count)
            out.append(Piece(span, offset + lo - block_start, hi - lo))
        return out

    def windows(self, start: int, stop: int) -> range:
        """The windows that hold sequence positions [start, stop)."""
        return range(start // self.window, (stop - 1) // self.window + 1)

    def window_bounds(self, w: int) -> tuple[int, int]:
        return w * self.window, min((w + 1) * self.window, self.length)

    def window_permutation(self, epoch: int, w: int) -> np.ndarray | None:
        """How window w's records are reordered (None: not at all)."""
        if not self.shuffle:
            return None
        lo, hi = self.window_bounds(w)
        return permutation(hi - lo, self.seed, self.pipeline_id, epoch, w, _WINDOW)
