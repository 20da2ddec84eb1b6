"""The record schema: our hand-written framing equals TensorFlow's, and TF reads it back."""

from __future__ import annotations

import io

import numpy as np
import pytest

from payload.core import records


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(100, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_token_dtype_for(vocab: int, dtype: str) -> None:
    assert records.token_dtype_for(vocab) == dtype


def _rows(seq_length: int, count: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(count, seq_length), dtype=np.int64)


@pytest.mark.parametrize(("seq_length", "vocab"), [(8, 300), (128, 65536), (100, 70000)])
def test_record_is_the_packed_ids_and_round_trips(seq_length: int, vocab: int) -> None:
    dtype = records.token_dtype_for(vocab)
    for row in _rows(seq_length, 3, vocab):
        ours = records.encode_record(row, dtype)
        assert ours == row.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
        assert len(ours) == seq_length * np.dtype(dtype).itemsize
        np.testing.assert_array_equal(records.decode_record(ours, dtype), row)


def test_bytes_per_token_at_length_128() -> None:
    framed = records.frame_records(_rows(128, 10, 65536), "uint16")
    assert len(framed) / (10 * 128) == 2.125


def test_framing_equals_tf_record_writer(tmp_path) -> None:
    import tensorflow as tf

    rows = _rows(128, 50, 30000, seed=1)
    ours = records.frame_records(rows, "uint16")
    tf_path = tmp_path / "tf.tfrecord"
    with tf.io.TFRecordWriter(str(tf_path)) as writer:
        for record in records.encode_records(rows, "uint16"):
            writer.write(record)
    assert ours == tf_path.read_bytes()

    # The record-at-a-time writer produces the same bytes as the vectorised framing.
    buffer = io.BytesIO()
    with records.TFRecordWriter(buffer) as writer:
        for record in records.encode_records(rows, "uint16"):
            writer.write(record)
    assert buffer.getvalue() == ours
    assert writer.records == 50
    assert writer.bytes == len(ours)


@pytest.mark.parametrize(("vocab", "batch"), [(30000, 7), (100_000, 4)])
def test_tf_dataset_reads_exactly_what_we_wrote(tmp_path, vocab: int, batch: int) -> None:
    import tensorflow as tf

    seq_length = 64
    dtype = records.token_dtype_for(vocab)
    rows = _rows(seq_length, 28, vocab, seed=2)
    rows[0, :3] = [0, vocab - 1, 65535 if vocab > 65535 else 1]
    path = tmp_path / "shard.tfrecord"
    path.write_bytes(records.frame_records(rows, dtype))

    dataset = tf.data.TFRecordDataset([str(path)]).batch(batch, drop_remainder=True)
    dataset = dataset.map(lambda s: records.parse_batch(s, seq_length, dtype))
    assert dataset.element_spec.shape.as_list() == [batch, seq_length]
    assert dataset.element_spec.dtype == tf.int32
    got = np.concatenate([b.numpy() for b in dataset])
    np.testing.assert_array_equal(got, rows)


def test_reader_refuses_records_of_another_length(tmp_path) -> None:
    import tensorflow as tf

    path = tmp_path / "shard.tfrecord"
    path.write_bytes(records.frame_records(_rows(32, 4, 300), "uint16"))
    dataset = tf.data.TFRecordDataset([str(path)]).batch(4)
    dataset = dataset.map(lambda s: records.parse_batch(s, 64, "uint16"))
    with pytest.raises(tf.errors.InvalidArgumentError):
        next(iter(dataset))


def test_iter_records_checks_crc() -> None:
    rows = _rows(16, 3, 500)
    clean = records.frame_records(rows, "uint16")
    framed = bytearray(clean)
    assert len(list(records.iter_records(io.BytesIO(bytes(framed))))) == 3
    framed[40] ^= 0xFF
    with pytest.raises(ValueError, match="crc"):
        list(records.iter_records(io.BytesIO(bytes(framed))))
    with pytest.raises(ValueError, match="truncated"):
        list(records.iter_records(io.BytesIO(clean[:-3])))
