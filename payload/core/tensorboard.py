"""TensorBoard scalars for both backends, without TensorFlow: one event file per writer, the
chief's only.

An event file is TFRecord-framed `Event` protos (records.TFRecordWriter's framing), the
first one naming the file version; a scalar is written as `tf.summary.scalar` writes it in
TF 2 (a float32 tensor with the `scalars` plugin's metadata), so TensorBoard and
`tf.compat.v1.train.summary_iterator` read these files as they read TensorFlow's. The proto
classes are the `tensorboard` package's own (`tensorboard.compat.proto`, generated from
TensorFlow's .proto files; no TensorFlow import). Not the package's `EventFileWriter`: it
reaches files through `tensorboard.compat.tf`, which imports TensorFlow whenever it is
installed (tensorboard 2.20 `compat/__init__.py`), and without TensorFlow its gs:// goes
through fsspec appends, which Cloud Storage objects do not have.

Events are buffered and written every `FLUSH_SECONDS` and when closed, never per log line:
locally they are appended to the file; on gs:// (objects cannot be appended to) the whole
file is uploaded again through payload/core/storage.py, as TensorFlow's own gs:// writer does on
each flush, which on a long run is why a flush is rare.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from payload.core import records, storage

FLUSH_SECONDS = 60
FILE_VERSION = "brain.Event:2"
_SERIAL = itertools.count()


def _protos() -> Any:
    from tensorboard.compat.proto import (  # noqa: PLC0415  (only where events are written)
        event_pb2,
        summary_pb2,
        tensor_pb2,
        tensor_shape_pb2,
        types_pb2,
    )

    return event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2


class _Buffer:
    """What records.TFRecordWriter writes to: the framed events not yet flushed."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def flush(self) -> None:
        pass


class Scalars:
    """`write(step, {name: value})`; a no-op writer when `enabled` is false."""

    def __init__(self, logdir: str, *, enabled: bool = True, flush_seconds: int = FLUSH_SECONDS):
        self.path: str | None = None
        self._flush_seconds = flush_seconds
        self._buffer = _Buffer()
        self._records = records.TFRecordWriter(self._buffer)  # type: ignore[arg-type]
        self._written = b""  # gs://: the file's bytes so far (uploaded whole at each flush)
        self._last_flush = time.monotonic()
        if not enabled:
            return
        self._pb = _protos()
        event_pb2 = self._pb[0]
        storage.makedirs(logdir)
        now = time.time()
        name = (
            f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_SERIAL)}.v2"
        )
        self.path = storage.join(logdir, name)
        self._add(event_pb2.Event(wall_time=now, file_version=FILE_VERSION))
        self.flush()

    def _add(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self.path is None:
            return
        event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2 = self._pb
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(
                    tag=name,
                    metadata=metadata,
                    tensor=tensor_pb2.TensorProto(
                        dtype=types_pb2.DT_FLOAT,
                        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                        float_val=[float(value)],
                    ),
                )
                for name, value in values.items()
            ]
        )
        self._add(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
        if time.monotonic() - self._last_flush >= self._flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        self._last_flush = time.monotonic()
        pending = b"".join(self._buffer.chunks)
        self._buffer.chunks.clear()
        if storage.is_gcs(self.path):
            if pending or not self._written:
                self._written += pending
                storage.write_bytes(self.path, self._written)
        elif pending:
            with open(self.path, "ab") as handle:  # noqa: PTH123  (an append-only log)
                handle.write(pending)

    def close(self) -> None:
        if self.path is not None:
            self.flush()
            self.path = None
