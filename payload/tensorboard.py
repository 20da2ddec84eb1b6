"""TensorBoard scalars for both backends: one writer per run directory, the chief's only.

TensorFlow is imported only when a writer is really opened (the chief's): `tf.summary` is
the reader's format, and the JAX environment has TensorFlow for tf.data anyway. A writer is
flushed by TF itself every `FLUSH_SECONDS` and when closed, never per log line: TF's gs://
file writer uploads the whole event file again on every flush, which on a long run puts
seconds of host work between two chunks of steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FLUSH_SECONDS = 60


class Scalars:
    """`write(step, {name: value})`; a no-op writer when `enabled` is false."""

    def __init__(self, logdir: str, *, enabled: bool = True, flush_seconds: int = FLUSH_SECONDS):
        self._writer: Any = None
        self._tf: Any = None
        if enabled:
            import tensorflow as tf  # noqa: PLC0415  (only where events are really written)

            self._tf = tf
            self._writer = tf.summary.create_file_writer(
                logdir, flush_millis=int(flush_seconds * 1000)
            )

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            for name, value in values.items():
                self._tf.summary.scalar(name, value)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
