"""The training input pipeline: TFRecord shards -> batches of model inputs with static shapes.

Per epoch: the shard list is shuffled (seeded), shards are read in parallel (interleaved,
in blocks of records), records are shuffled in a buffer, batched with drop_remainder, and
only THEN decoded (`records.parse_batch`, one op per batch) and masked (MLM, `masking.py`)
or given next-token targets (CLM). Every epoch has exactly `batches_per_epoch` batches.
Under a distribution strategy one host batch is decoded and masked at once and then split
into the per-replica batches of that host.

Reproducibility and resuming: everything random is a pure function of (seed, epoch, batch
index) -- the shard order, the shuffle buffer's seed and the stateless masking RNG. Batch k
of a run is therefore the same batch whether the run was interrupted or not, and a resumed
run starts with `start_batch=k`: whole epochs are skipped arithmetically and, inside the
current epoch, the remaining batches are skipped *before* parsing (reading only, no
parsing or masking), so the cost of resuming is bounded by one epoch of reading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from payload.backends.tf import masking
from payload.core import records
from payload.data.input_order import PipelinePlan, masking_ratios, plan_pipeline
from payload.schema import manifest as manifest_lib
from payload.schema.manifest import special_ids_of

if TYPE_CHECKING:
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec

_SEED_MIX = 1_000_003
_READ_BLOCK = 128
# A dataset function traced as written (no AutoGraph conversion): make_dataset's own.
_as_written = tf.autograph.experimental.do_not_convert
__all__ = ["PipelinePlan", "make_dataset", "plan_pipeline"]


def make_dataset(
    job: JobSpec,
    manifest: Manifest,
    *,
    batch_size: int,
    seed: int,
    training: bool = True,
    repeat: bool = True,
    start_batch: int = 0,
    replicas_per_pipeline: int = 1,
    input_context: tf.distribute.InputContext | None = None,
    split: str = "train",
) -> tf.data.Dataset:
    """Batches of model inputs for `job.data.objective` (see masking.py for the features).

    `batch_size` is the batch of one replica. With `replicas_per_pipeline` R > 1, records
    are read, parsed and masked as one host batch of R * batch_size (one set of ops
    instead of R) and then split into R consecutive per-replica batches, which is the
    order in which a distributed iterator hands them to the host's replicas.
    `start_batch` skips that many HOST batches, i.e. training steps (resume).
    `split="eval"` reads the held-out shards instead of the training ones.
    """
    paths = manifest_lib.shard_paths(job.paths.data, manifest, split=split)
    split_shards = manifest.eval_shards if split == "eval" else manifest.shards
    num_pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    replicas = int(replicas_per_pipeline)
    host_batch = batch_size * replicas
    plan = plan_pipeline(
        paths,
        [s.records for s in split_shards],
        batch_size=host_batch,
        num_pipelines=num_pipelines,
        pipeline_id=pipeline_id,
    )
    special = special_ids_of(manifest)
    ratios = masking_ratios(manifest.objective, special, str(job.paths.data))
    seq_length = int(manifest.seq_length)
    token_dtype = manifest.token_dtype
    pad_id = special.get("pad")
    max_predictions = int(job.data.max_predictions)
    shuffle_buffer = int(job.train.shuffle_buffer)
    base_seed = int(seed) * _SEED_MIX + pipeline_id

    # The functions below branch on Python values only (the job's, the plan's), never on a
    # tensor: tf.data traces them as they are, without AutoGraph's source conversion, which
    # took most of a tiny job's dataset construction (2.5 s -> 0.9 s of CPU a training
    # process; the same graph, the same batches).
    @_as_written
    def read_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
        files = tf.constant(list(plan.files))
        if training:
            order = tf.random.experimental.stateless_shuffle(
                tf.range(len(plan.files)), seed=tf.stack([tf.constant(base_seed, tf.int64), epoch])
            )
            files = tf.gather(files, order)
        # Shards are read in parallel (hides gs:// latency) in blocks of records: per
        # element, a parallel interleave costs more than reading a 280-byte record.
        ds = tf.data.Dataset.from_tensor_slices(files).interleave(
            lambda f: tf.data.TFRecordDataset(f, buffer_size=1 << 20).batch(_READ_BLOCK),
            cycle_length=min(len(plan.files), 8),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        ds = ds.unbatch()
        if plan.record_shard is not None:
            ds = ds.shard(*plan.record_shard)
        if training:
            ds = ds.shuffle(shuffle_buffer, seed=base_seed * 7919 + epoch)
        ds = ds.batch(host_batch, drop_remainder=True).take(plan.batches_per_epoch)
        return ds.enumerate().map(_as_written(lambda index, serialized: (epoch, index, serialized)))

    first_epoch, skip = divmod(int(start_batch), plan.batches_per_epoch)
    last_epoch = tf.int64.max if repeat else 1
    if first_epoch >= last_epoch:
        raise ValueError(f"start_batch={start_batch} is past the end of a non-repeating dataset")
    ds = tf.data.Dataset.range(first_epoch, last_epoch).flat_map(read_epoch).skip(skip)

    @_as_written
    def to_features(
        epoch: tf.Tensor, index: tf.Tensor, serialized: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        ids = records.parse_batch(serialized, seq_length, token_dtype)
        if ratios is not None:
            return masking.mask_tokens(
                ids,
                seed=tf.stack([base_seed + epoch * _SEED_MIX, index]),
                vocab_size=int(manifest.vocab_size),
                special_ids=special.values(),
                mask_id=special["mask"],
                pad_id=pad_id,
                max_predictions=max_predictions,
                mask_probability=float(job.data.mask_probability),
                **ratios,
            )
        return masking.causal_labels(ids, pad_id=pad_id)

    ds = ds.map(to_features, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if replicas > 1:

        @_as_written
        def per_replica(features: dict[str, tf.Tensor]) -> tf.data.Dataset:
            return tf.data.Dataset.from_tensor_slices(
                {
                    k: tf.reshape(v, [replicas, batch_size, *v.shape[1:]])
                    for k, v in features.items()
                }
            )

        ds = ds.flat_map(per_replica)
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_optimization.map_parallelization = True
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
