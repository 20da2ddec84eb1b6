"""The tf.data input pipeline over real TFRecord shards + manifest (records/manifest modules)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from shard_helpers import SEQ, SPECIAL
from shard_helpers import record_ids as _record_ids
from shard_helpers import write_data as _write_data

from payload.backends.tf import input as data_lib
from payload.core.errors import DataError


def test_mlm_batches_have_static_shapes(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "mlm", (40, 40, 30))
    ds = data_lib.make_dataset(job, manifest, batch_size=8, seed=0)
    slots = job.data.max_predictions
    spec = ds.element_spec
    assert spec["input_ids"].shape.as_list() == [8, SEQ]
    assert spec["attention_mask"].shape.as_list() == [8, SEQ]
    for key in ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights"):
        assert spec[key].shape.as_list() == [8, slots]
    batch = next(iter(ds))
    assert batch["masked_lm_weights"].numpy().sum() > 0
    # No prediction slot points at a special token of the original sequence.
    used = batch["masked_lm_weights"].numpy() > 0
    assert not np.isin(batch["masked_lm_ids"].numpy()[used], list(SPECIAL.values())).any()


def test_clm_batches_and_shifted_labels(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "clm", (50,))
    ds = data_lib.make_dataset(job, manifest, batch_size=5, seed=0)
    assert ds.element_spec["labels"].shape.as_list() == [5, SEQ]
    batch = {k: v.numpy() for k, v in next(iter(ds)).items()}
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert (batch["label_weights"][:, -1] == 0).all() and (
        batch["label_weights"][:, :-1] == 1
    ).all()


def test_an_epoch_sees_every_record_once_in_a_seeded_order(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "clm", (30, 30, 27))
    epoch_batches = 87 // 4

    def epoch(seed: int, epoch_index: int = 0) -> list[int]:
        ds = data_lib.make_dataset(
            job, manifest, batch_size=4, seed=seed, start_batch=epoch_index * epoch_batches
        )
        seen: list[int] = []
        for batch in ds.take(epoch_batches):
            seen += _record_ids(batch["input_ids"].numpy())
        return seen

    first = epoch(seed=1)
    assert len(first) == len(set(first)) == epoch_batches * 4  # drop_remainder: 3 left out
    assert set(first) <= set(range(87))
    assert first != sorted(first)
    assert epoch(seed=1) == first
    assert epoch(seed=2) != first
    assert epoch(seed=1, epoch_index=1) != first  # reshuffled every epoch


def test_resuming_at_a_batch_reproduces_the_uninterrupted_stream(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "mlm", (20, 20, 10))  # 12 batches of 4 per epoch
    full = list(data_lib.make_dataset(job, manifest, batch_size=4, seed=7).take(30))
    for start in (5, 12, 17):  # inside the first epoch, at an epoch boundary, inside the second
        resumed = list(
            data_lib.make_dataset(job, manifest, batch_size=4, seed=7, start_batch=start).take(6)
        )
        for a, b in zip(full[start : start + 6], resumed, strict=True):
            for key in a:
                np.testing.assert_array_equal(
                    a[key].numpy(), b[key].numpy(), err_msg=f"{key} @ {start}"
                )


def test_non_repeating_dataset_ends_after_one_epoch(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "clm", (10, 11))
    ds = data_lib.make_dataset(job, manifest, batch_size=4, seed=0, training=False, repeat=False)
    seen = [r for b in ds for r in _record_ids(b["input_ids"].numpy())]
    assert len(seen) == 20 and len(set(seen)) == 20


def test_input_pipelines_split_the_shards(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "clm", (12, 12, 12, 12))
    seen = []
    for pipeline in range(2):
        ctx = tf.distribute.InputContext(
            num_input_pipelines=2, input_pipeline_id=pipeline, num_replicas_in_sync=2
        )
        ds = data_lib.make_dataset(job, manifest, batch_size=4, seed=0, input_context=ctx)
        seen.append({r for b in ds.take(6) for r in _record_ids(b["input_ids"].numpy())})
    assert len(seen[0]) == len(seen[1]) == 24
    assert not seen[0] & seen[1]


def test_too_little_data_for_one_batch_is_a_data_error(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "clm", (3,))
    with pytest.raises(DataError, match=r"3 sequences, fewer than one batch of 8"):
        data_lib.make_dataset(job, manifest, batch_size=8, seed=0)


def test_host_batch_is_masked_once_then_split_per_replica(tmp_path: Path) -> None:
    job, manifest = _write_data(tmp_path, "mlm", (40, 40))
    host = next(iter(data_lib.make_dataset(job, manifest, batch_size=8, seed=3)))
    replicas = list(
        data_lib.make_dataset(job, manifest, batch_size=4, seed=3, replicas_per_pipeline=2).take(2)
    )
    assert replicas[0]["input_ids"].shape == (4, SEQ)
    for key in host:
        np.testing.assert_array_equal(host[key].numpy()[:4], replicas[0][key].numpy())
        np.testing.assert_array_equal(host[key].numpy()[4:], replicas[1][key].numpy())
