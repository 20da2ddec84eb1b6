"""The JAX backend's input pipeline (Grain, no TensorFlow) over real shards + manifest:
shapes, epochs, the seeded order, resume at any batch, hosts' shares, masks as a function of
(seed, step, row), corrupt shards, and gs:// through the storage emulator."""

from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from shard_helpers import SEQ, SPECIAL, record_ids, write_data

from payload.backends.jax import input as input_lib
from payload.core import records, storage
from payload.core.errors import DataError
from payload.data.numpy_masking import Masker


def _originals(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The uncorrupted ids of a masked batch (its labels put back)."""
    if "masked_lm_ids" not in batch:
        return batch["input_ids"]
    ids = batch["input_ids"].copy()
    used = batch["masked_lm_weights"] > 0
    rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], used.shape)
    ids[rows[used], batch["masked_lm_positions"][used]] = batch["masked_lm_ids"][used]
    return ids


def _take(job, manifest, n: int, **kwargs) -> list[dict[str, np.ndarray]]:
    batches = input_lib.make_batches(job, manifest, **kwargs)
    try:
        return [next(batches) for _ in range(n)]
    finally:
        batches.close()


def _ids(batches: list[dict[str, np.ndarray]]) -> list[int]:
    return [r for b in batches for r in record_ids(_originals(b))]


def test_mlm_and_clm_batches_have_static_shapes(tmp_path: Path) -> None:
    job, manifest = write_data(tmp_path / "mlm", "mlm", (40, 40, 30))
    (batch,) = _take(job, manifest, 1, batch_size=8, seed=0)
    slots = job.data.max_predictions
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "input_ids": ((8, SEQ), "int32"),
        "attention_mask": ((8, SEQ), "int32"),
        "masked_lm_positions": ((8, slots), "int32"),
        "masked_lm_ids": ((8, slots), "int32"),
        "masked_lm_weights": ((8, slots), "float32"),
    }
    used = batch["masked_lm_weights"] > 0
    assert used.any(axis=1).all()
    assert not np.isin(batch["masked_lm_ids"][used], list(SPECIAL.values())).any()

    job, manifest = write_data(tmp_path / "clm", "clm", (50,))
    (batch,) = _take(job, manifest, 1, batch_size=5, seed=0)
    assert batch["labels"].shape == (5, SEQ)
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert (batch["label_weights"][:, -1] == 0).all()


def test_a_masked_objective_needs_the_mask_token(tmp_path: Path) -> None:
    """The one check both backends' pipelines make (input_plan.masking_ratios): BERT's split
    for mlm, ELECTRA's for rtd, no masking for clm, and a vocabulary without [MASK] refused
    in one line before anything is read."""
    from payload.data.input_order import masking_ratios
    from payload.model import configs

    assert masking_ratios("clm", {}, "d") is None
    assert masking_ratios("mlm", SPECIAL, "d") == {}
    assert masking_ratios("rtd", SPECIAL, "d") == {
        "mask_token_ratio": configs.ELECTRA_MASK_TOKEN_RATIO,
        "random_token_ratio": configs.ELECTRA_RANDOM_TOKEN_RATIO,
    }
    job, manifest = write_data(tmp_path, "mlm", (10,))
    no_mask = dataclasses.replace(
        manifest, special_ids={k: v for k, v in SPECIAL.items() if k != "mask"}
    )
    with pytest.raises(DataError) as error:
        input_lib.make_batches(job, no_mask, batch_size=2, seed=0)
    assert str(error.value).startswith(f"manifest in {job.paths.data} has no mask token")
    assert "mlm needs one" in str(error.value) and "\n" not in str(error.value)


def test_every_epoch_sees_each_record_once_in_its_own_seeded_order(tmp_path: Path) -> None:
    # 3 files, 120 records, a window of 20 (train.shuffle_buffer): 15 batches of 8 per epoch.
    job, manifest = write_data(tmp_path, "clm", (40, 30, 50), shuffle_buffer=20)
    stream = _ids(_take(job, manifest, 30, batch_size=8, seed=3))
    first, second = stream[:120], stream[120:]
    assert sorted(first) == sorted(second) == list(range(120))
    assert first != second  # a new order each epoch
    assert first != sorted(first)  # shuffled at all
    assert _ids(_take(job, manifest, 15, batch_size=8, seed=3)) == first
    assert _ids(_take(job, manifest, 15, batch_size=8, seed=4)) != first
    # Each file is one block (records of 48 bytes): a window of 20 consecutive positions
    # holds records of at most two files, permuted.
    files = [{bisect.bisect_right([40, 70], r) for r in first[i : i + 20]} for i in (0, 60, 100)]
    assert all(len(f) <= 2 for f in files)


def test_resuming_at_any_batch_reproduces_the_uninterrupted_stream(tmp_path: Path) -> None:
    job, manifest = write_data(tmp_path, "mlm", (20, 20, 10), shuffle_buffer=7)  # 12 per epoch
    full = _take(job, manifest, 30, batch_size=4, seed=7)
    for start in (1, 11, 12, 13, 25):
        resumed = _take(job, manifest, 5, batch_size=4, seed=7, start_batch=start)
        for a, b in zip(full[start : start + 5], resumed, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


def test_evaluation_reads_in_file_order_once(tmp_path: Path) -> None:
    job, manifest = write_data(tmp_path, "clm", (10, 11))
    batches = input_lib.make_batches(
        job, manifest, batch_size=4, seed=0, training=False, repeat=False
    )
    seen = _ids(list(batches))
    batches.close()
    assert seen == list(range(20))  # 5 whole batches of the 21 records, in order
    with pytest.raises(ValueError, match="past the end"):
        input_lib.make_batches(job, manifest, batch_size=4, seed=0, repeat=False, start_batch=5)


def test_pipelines_read_their_own_files_or_every_nth_record(tmp_path: Path) -> None:
    job, manifest = write_data(tmp_path / "files", "clm", (12, 12, 12, 12))
    shares = [
        set(_ids(_take(job, manifest, 6, batch_size=4, seed=0, num_pipelines=2, pipeline_id=p)))
        for p in (0, 1)
    ]
    # Pipeline p reads files p and p + 2 (records 0-11 and 24-35 for p = 0).
    assert shares[0] == set(range(12)) | set(range(24, 36))
    assert shares[1] == set(range(12, 24)) | set(range(36, 48))

    job, manifest = write_data(tmp_path / "records", "clm", (25,))  # 1 file, 2 pipelines
    shares = [
        set(_ids(_take(job, manifest, 3, batch_size=4, seed=0, num_pipelines=2, pipeline_id=p)))
        for p in (0, 1)
    ]
    assert all(r % 2 == p for p, share in enumerate(shares) for r in share)
    assert len(shares[0]) == len(shares[1]) == 12


def test_masks_are_a_function_of_seed_step_and_row(tmp_path: Path) -> None:
    """The masks of a row of the global batch do not depend on which pipeline (host) built
    it: two pipelines' batches equal one masking of the stacked global batch."""
    job, manifest = write_data(tmp_path, "mlm", (16, 16, 16, 16))
    parts = [
        _take(job, manifest, 3, batch_size=4, seed=5, num_pipelines=2, pipeline_id=p)
        for p in (0, 1)
    ]
    masker = Masker(
        vocab_size=int(manifest.vocab_size),
        special_ids=SPECIAL.values(),
        mask_id=SPECIAL["mask"],
        pad_id=SPECIAL["pad"],
        max_predictions=job.data.max_predictions,
        mask_probability=job.data.mask_probability,
    )
    for step in range(3):
        global_ids = np.concatenate([_originals(parts[p][step]) for p in (0, 1)])
        expected = masker(global_ids, seed=5, step=step)
        for key, value in expected.items():
            np.testing.assert_array_equal(
                np.concatenate([parts[p][step][key] for p in (0, 1)]), value, err_msg=key
            )
    # Another seed or step masks differently.
    other = masker(global_ids, seed=6, step=2)
    assert not np.array_equal(other["masked_lm_positions"], expected["masked_lm_positions"])


def test_a_corrupt_or_cut_shard_is_a_data_error_naming_it(tmp_path: Path) -> None:
    job, manifest = write_data(tmp_path, "clm", (20, 20))
    shard = Path(job.paths.data, manifest.shards[1].name)
    intact = shard.read_bytes()
    data = bytearray(intact)
    stride = records.record_stride(SEQ, manifest.token_dtype)
    data[5 * stride + 20] ^= 0xFF  # a token of record 5
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{shard.name}: record 5 is corrupt \(data CRC"):
        _take(job, manifest, 10, batch_size=4, seed=0, training=False, repeat=False)

    shard.write_bytes(intact[: 12 * stride + 7])
    with pytest.raises(
        DataError, match=r"ends before record 15 \(\d+ of 192 bytes from record 12\)"
    ):
        _take(job, manifest, 10, batch_size=4, seed=0, training=False, repeat=False)


def test_decode_framed_checks_the_length_header(tmp_path: Path) -> None:
    rows = np.arange(3 * SEQ).reshape(3, SEQ) % 300
    framed = records.frame_records(rows, "uint16")
    np.testing.assert_array_equal(records.decode_framed(framed, SEQ, "uint16", where="x"), rows)
    longer = records.frame_records(np.zeros((3, 24), np.int64), "uint16")  # 192 = 4 x 48 bytes
    with pytest.raises(DataError, match="length header of 48 bytes"):
        records.decode_framed(longer, SEQ, "uint16", where="x")


@pytest.mark.emulator
def test_gs_shards_stream_through_the_storage_layer(tmp_path: Path, gcs_root: str) -> None:
    """The same batches from gs:// (ranged reads through google-cloud-storage, against
    fake-gcs-server) as from the local copy."""
    job, manifest = write_data(tmp_path, "mlm", (30, 30), shuffle_buffer=16)
    local = _take(job, manifest, 10, batch_size=4, seed=1)
    gcs_job = dataclasses.replace(job, output=storage.join(gcs_root, "out"))
    storage.upload_tree(job.paths.data, gcs_job.paths.data)
    remote = _take(gcs_job, manifest, 10, batch_size=4, seed=1)
    for a, b in zip(local, remote, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
