"""The one definition of the TFRecord schema: writer (pure Python) and readers (TensorFlow's
``parse_batch`` for tf.data; numpy's ``decode_framed`` for the JAX backend's Grain input).

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

Every record of a shard has the same length, so a shard is an array of fixed-size frames
(``record_stride`` bytes each: 12 bytes of length + CRC, the ids, 4 bytes of CRC) and record
``i`` starts at byte ``i * stride``: ``decode_framed`` reads any run of whole frames without
TensorFlow, checking every length header and both CRCs as TensorFlow's reader does.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import google_crc32c
import numpy as np

from payload.core.errors import DataError

if TYPE_CHECKING:
    import tensorflow as tf

FEATURE = "input_ids"
TOKEN_DTYPES = ("uint16", "uint32")
_MASK_DELTA = 0xA282EAD8
HEADER_BYTES = 12  # uint64 length + its masked CRC32C
FOOTER_BYTES = 4  # the data's masked CRC32C


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


def record_stride(seq_length: int, token_dtype: str) -> int:
    """Bytes of one framed record of a shard: header, ``seq_length`` ids, footer."""
    return HEADER_BYTES + int(seq_length) * _numpy_dtype(token_dtype).itemsize + FOOTER_BYTES


def _masked(crcs: np.ndarray) -> np.ndarray:
    """TFRecord's CRC mask (``masked_crc32c``) over an array of raw CRC32C values."""
    crcs = crcs.astype(np.uint64)
    return ((((crcs >> 15) | (crcs << 17)) + _MASK_DELTA) & 0xFFFFFFFF).astype(np.uint32)


def decode_framed(
    data: bytes, seq_length: int, token_dtype: str, *, where: str, first: int = 0, step: int = 1
) -> np.ndarray:
    """The ids ``[n, seq_length]`` (the shard's dtype) of ``n`` whole framed records.

    Checks what TensorFlow's reader checks, and that every record has this length: a cut
    frame, a length header of another record length, or a CRC mismatch is a DataError
    naming ``where`` (the shard) and the record (frame i is record ``first + step * i`` of
    the shard), never a shorter or padded result.
    """
    dtype = _numpy_dtype(token_dtype)
    width = int(seq_length) * dtype.itemsize
    stride = HEADER_BYTES + width + FOOTER_BYTES
    if len(data) % stride:
        raise DataError(
            f"{where}: {len(data)} bytes are not whole records of {stride} bytes "
            f"(seq_length {seq_length}, {token_dtype}): the shard is cut or of another length"
        )
    frames = np.frombuffer(data, dtype=np.uint8).reshape(-1, stride)
    header = struct.pack("<Q", width)
    expected = np.frombuffer(header + struct.pack("<I", masked_crc32c(header)), np.uint8)
    bad = np.flatnonzero((frames[:, :HEADER_BYTES] != expected).any(axis=1))
    if bad.size:
        (length,) = struct.unpack("<Q", frames[bad[0], :8].tobytes())
        raise DataError(
            f"{where}: record {first + step * int(bad[0])} has a length header of {length} "
            f"bytes (or a corrupt header CRC), not the {width} bytes of seq_length {seq_length}"
        )
    payload = frames[:, HEADER_BYTES : HEADER_BYTES + width]
    # One C call per record (google_crc32c); the mask and the comparison are vectorised.
    crcs = np.fromiter(
        (google_crc32c.value(row.tobytes()) for row in payload), np.uint32, count=len(frames)
    )
    stored = np.ascontiguousarray(frames[:, HEADER_BYTES + width :]).view("<u4")[:, 0]
    bad = np.flatnonzero(_masked(crcs) != stored)
    if bad.size:
        raise DataError(
            f"{where}: record {first + step * int(bad[0])} is corrupt (data CRC mismatch)"
        )
    return np.ascontiguousarray(payload).view(dtype).reshape(len(frames), int(seq_length))


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
