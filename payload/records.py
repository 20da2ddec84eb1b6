"""The one definition of the TFRecord schema: writer (pure Python) and reader (TensorFlow).

Each TFRecord record is exactly ``seq_length`` token ids packed little-endian as
``uint16`` (vocabularies up to 65,536) or ``uint32``: no ``tf.train.Example`` around
them. At length 128 that is 256 payload bytes + 16 bytes of TFRecord framing = 2.125
bytes per token. Wrapping the same bytes in a one-feature ``tf.train.Example`` adds 26
bytes of proto per record (2.33 bytes per token); an ``int64_list`` feature costs 3.3+.
The schema is not self-describing by design: ``manifest.json`` next to the shards
records the dtype, the sequence length and the tokenizer, and the reader refuses data
it does not describe.
(``FEATURE`` names the tensor the reader produces.)

The writer hand-encodes the TFRecord framing (length, masked CRC32C) so encoder workers
never import TensorFlow; ``tests/payload/test_records.py`` checks the bytes against
``tf.io.TFRecordWriter`` and reads them back through ``tf.data``.
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


def encode_record(ids: np.ndarray, token_dtype: str) -> bytes:
    """One record: ``ids`` packed little-endian as ``token_dtype`` (no proto around it)."""
    return np.ascontiguousarray(ids, dtype=_numpy_dtype(token_dtype)).tobytes()


def encode_records(rows: np.ndarray, token_dtype: str) -> list[bytes]:
    """One record per row of a ``[n, seq_length]`` array."""
    packed = np.ascontiguousarray(rows, dtype=_numpy_dtype(token_dtype))
    return [row.tobytes() for row in packed]


def masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_records(rows: np.ndarray, token_dtype: str) -> bytes:
    """TFRecord-framed bytes of one record per row, ready to append to a shard file.

    Every record of a fixed-length shard has the same length, so the length header and
    its CRC are computed once; only the data CRC is per record.
    """
    packed = np.ascontiguousarray(rows, dtype=_numpy_dtype(token_dtype))
    count, width = packed.shape[0], packed.shape[1] * packed.itemsize
    header = struct.pack("<Q", width)
    head = header + struct.pack("<I", masked_crc32c(header))
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


def decode_record(record: bytes, token_dtype: str) -> np.ndarray:
    """Inverse of :func:`encode_record` (tests, tools)."""
    dtype = _numpy_dtype(token_dtype)
    if len(record) % dtype.itemsize:
        raise ValueError(f"record of {len(record)} bytes is not a whole number of {token_dtype}")
    return np.frombuffer(record, dtype=dtype).astype(np.int64)


def parse_batch(serialized: Any, seq_length: int, token_dtype: str) -> tf.Tensor:
    """Decode a BATCH of records into int32 ``[batch, seq_length]`` token ids.

    Call after ``Dataset.batch``: one ``decode_raw`` per batch. A record of another size
    (a shard from another seq_length) is an error here, never padded or truncated
    (``decode_raw``'s ``fixed_length`` would silently do either).
    """
    import tensorflow as tf  # noqa: PLC0415  (TF only where records are read)

    # DecodeRaw has no uint32; ids < 2**31 have the same little-endian bytes as int32.
    out_type = {"uint16": tf.uint16, "uint32": tf.int32}[token_dtype]
    ids = tf.io.decode_raw(serialized, out_type, little_endian=True)
    batch = serialized.shape[0] if getattr(serialized, "shape", None) is not None else None
    return tf.ensure_shape(tf.cast(ids, tf.int32), [batch, seq_length])
