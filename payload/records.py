"""The one definition of the TFRecord schema: writer (pure Python) and reader (TensorFlow).

Each record is a serialized ``tf.train.Example`` with a single bytes feature
``input_ids`` holding exactly ``seq_length`` token ids, packed little-endian as
``uint16`` (vocabularies up to 65,536) or ``uint32``. At sequence length 128 a uint16
record costs 256 payload bytes + 10 bytes of proto + 16 bytes of TFRecord framing,
about 2.2 bytes per token, against 3.3+ for an ``int64_list`` feature.

The writer hand-encodes the protobuf and the TFRecord framing (length, masked CRC32C)
so encoder workers never import TensorFlow; ``tests/payload/test_records.py`` checks the
bytes against TensorFlow's own ``tf.train.Example`` and ``tf.io.TFRecordWriter``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import google_crc32c
import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

FEATURE = "input_ids"
TOKEN_DTYPES = ("uint16", "uint32")
_MASK_DELTA = 0xA282EAD8


def token_dtype_for(vocab_size: int) -> str:
    """Smallest unsigned little-endian dtype that holds every id of the vocabulary."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _numpy_dtype(token_dtype: str) -> np.dtype:
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {TOKEN_DTYPES}, got {token_dtype!r}")
    return np.dtype(token_dtype).newbyteorder("<")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload_len: int) -> bytes:
    """Tag and length of a length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(payload_len)


def example_prefix(payload_bytes: int) -> bytes:
    """Serialized ``Example`` bytes that precede a packed payload of ``payload_bytes``.

    Example{features(1): Features{feature(1): MapEntry{key(1), value(2): Feature{
    bytes_list(1): BytesList{value(1): payload}}}}}. The prefix depends only on the
    payload length, so a shard of fixed-length sequences shares one prefix.
    """
    key = FEATURE.encode()
    bytes_list_len = len(_field(1, payload_bytes)) + payload_bytes
    feature_len = len(_field(1, bytes_list_len)) + bytes_list_len
    entry_len = len(_field(1, len(key))) + len(key) + len(_field(2, feature_len)) + feature_len
    features_len = len(_field(1, entry_len)) + entry_len
    return (
        _field(1, features_len)
        + _field(1, entry_len)
        + _field(1, len(key))
        + key
        + _field(2, feature_len)
        + _field(1, bytes_list_len)
        + _field(1, payload_bytes)
    )


def encode_example(ids: np.ndarray, token_dtype: str) -> bytes:
    """One serialized ``tf.train.Example`` holding ``ids`` packed as ``token_dtype``."""
    payload = np.ascontiguousarray(ids, dtype=_numpy_dtype(token_dtype)).tobytes()
    return example_prefix(len(payload)) + payload


def encode_examples(rows: np.ndarray, token_dtype: str) -> list[bytes]:
    """Serialized examples for each row of a ``[n, seq_length]`` array."""
    packed = np.ascontiguousarray(rows, dtype=_numpy_dtype(token_dtype))
    prefix = example_prefix(packed.shape[1] * packed.itemsize)
    return [prefix + row.tobytes() for row in packed]


def masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_records(rows: np.ndarray, token_dtype: str) -> bytes:
    """TFRecord-framed bytes of one example per row, ready to append to a shard file.

    Every record of a fixed-length shard has the same length, so the length header and
    its CRC are computed once; only the data CRC is per record.
    """
    packed = np.ascontiguousarray(rows, dtype=_numpy_dtype(token_dtype))
    count, width = packed.shape[0], packed.shape[1] * packed.itemsize
    prefix = example_prefix(width)
    record_len = len(prefix) + width
    header = struct.pack("<Q", record_len)
    head = header + struct.pack("<I", masked_crc32c(header)) + prefix
    frame = np.empty((count, len(head) + width + 4), dtype=np.uint8)
    frame[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    frame[:, len(head) : len(head) + width] = packed.view(np.uint8).reshape(count, width)
    records = frame[:, len(header) + 4 : len(head) + width]
    crcs = np.fromiter(
        (masked_crc32c(record.tobytes()) for record in records), dtype="<u4", count=count
    )
    frame[:, len(head) + width :] = crcs.view(np.uint8).reshape(count, 4)
    return frame.tobytes()


class TFRecordWriter:
    """Pure-Python TFRecord writer (same bytes as ``tf.io.TFRecordWriter``, no compression)."""

    def __init__(self, file: IO[bytes]):
        self._file = file
        self.records = 0
        self.bytes = 0

    def write(self, record: bytes) -> None:
        header = struct.pack("<Q", len(record))
        chunk = (
            header
            + struct.pack("<I", masked_crc32c(header))
            + record
            + struct.pack("<I", masked_crc32c(record))
        )
        self._file.write(chunk)
        self.records += 1
        self.bytes += len(chunk)

    def write_framed(self, framed: bytes, records: int) -> None:
        """Append the output of :func:`frame_records`."""
        self._file.write(framed)
        self.records += records
        self.bytes += len(framed)

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.flush()


def iter_records(file: IO[bytes]) -> Iterator[bytes]:
    """Read TFRecord-framed records, checking both CRCs (pure Python; for tools and tests)."""
    while True:
        header = file.read(8)
        if not header:
            return
        if len(header) != 8:
            raise ValueError("truncated TFRecord length header")
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", file.read(4))
        if header_crc != masked_crc32c(header):
            raise ValueError("corrupt TFRecord length header (crc mismatch)")
        record = file.read(length)
        footer = file.read(4)
        if len(record) != length or len(footer) != 4:
            raise ValueError("truncated TFRecord record")
        if struct.unpack("<I", footer)[0] != masked_crc32c(record):
            raise ValueError("corrupt TFRecord record (crc mismatch)")
        yield record


def decode_example(record: bytes, token_dtype: str) -> np.ndarray:
    """Inverse of :func:`encode_example` for records this module wrote (tests, tools)."""
    dtype = _numpy_dtype(token_dtype)
    for width in range(0, len(record) + 1, dtype.itemsize):
        prefix = example_prefix(width)
        if len(prefix) + width == len(record) and record.startswith(prefix):
            return np.frombuffer(record[len(prefix) :], dtype=dtype).astype(np.int64)
    raise ValueError("record is not an input_ids example written by payload.records")


def parse_batch(serialized: Any, seq_length: int, token_dtype: str) -> tf.Tensor:
    """Parse a BATCH of serialized examples into int32 ``[batch, seq_length]`` token ids.

    Call after ``Dataset.batch``: one ``parse_example`` per batch is an order of
    magnitude faster than ``parse_single_example`` per record.
    """
    import tensorflow as tf  # noqa: PLC0415  (TF only where records are read)

    # DecodeRaw has no uint32; ids < 2**31 have the same little-endian bytes as int32.
    out_type = {"uint16": tf.uint16, "uint32": tf.int32}[token_dtype]
    itemsize = _numpy_dtype(token_dtype).itemsize
    features = tf.io.parse_example(serialized, {FEATURE: tf.io.FixedLenFeature([], tf.string)})
    ids = tf.io.decode_raw(
        features[FEATURE], out_type, little_endian=True, fixed_length=seq_length * itemsize
    )
    batch = serialized.shape[0] if getattr(serialized, "shape", None) is not None else None
    return tf.ensure_shape(tf.cast(ids, tf.int32), [batch, seq_length])
