"""JAX's persistent compilation cache for the trainer's programs, and what it did.

A preempted slice restarts into the same job: without a cache every restart compiles the
train and evaluation programs again (minutes for a 1-3B model on a TPU). JAX keys each
compiled program by its HLO, the compile options, the devices and the jaxlib/XLA version
(jax/_src/cache_key.py), so a changed job, a changed mesh or another JAX compiles anew and
a restart of the same job loads. The directory may be on gs:// (JAX writes through
`etils.epath`, jax/_src/lru_cache.py; etils comes with orbax-checkpoint) or on local disk.

JAX counts what the cache did through its monitoring events (jax/_src/compiler.py
`/jax/compilation_cache/cache_hits`, `compile_time_saved_sec`; jax/_src/compilation_cache.py
`/jax/compilation_cache/cache_misses`): `CacheCounts` listens to them, and the trainer logs
and records the counts (status.json `runtime.compilation_cache`).

Only programs that took at least `jax_persistent_cache_min_compile_time_secs` (JAX's
default 1 s) to compile are written: small helper programs are not worth a round trip to a
bucket. Its environment variable (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS) still applies.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax

# JAX reads this variable itself: a caller who sets it (the tests' one cache for a whole
# run, an operator) keeps it.
ENV = "JAX_COMPILATION_CACHE_DIR"
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"


class CacheCounts:
    """Programs loaded from the cache, compiled (and then cached if slow enough), and the
    compile seconds the loads saved, since `listen()`."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.saved_s = 0.0
        self._lock = threading.Lock()

    def _event(self, event: str, **kwargs: Any) -> None:
        with self._lock:
            if event == HITS:
                self.hits += 1
            elif event == MISSES:
                self.misses += 1

    def _duration(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == SAVED:
            with self._lock:
                self.saved_s += float(duration_secs)

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"loaded": self.hits, "compiled": self.misses, "saved_s": round(self.saved_s, 1)}


_COUNTS: CacheCounts | None = None


def enable(directory: str) -> tuple[str, CacheCounts]:
    """Use the persistent compilation cache in `directory` (unless ENV names another) and
    count what it does from now on; returns (the directory used, the counts). Call before the
    first compilation of the run's programs."""
    global _COUNTS  # noqa: PLW0603  (JAX's listeners are process-wide; one set per process)
    chosen = os.environ.get(ENV) or directory
    jax.config.update("jax_compilation_cache_dir", chosen)
    if _COUNTS is None:
        _COUNTS = CacheCounts()
        jax.monitoring.register_event_listener(_COUNTS._event)
        jax.monitoring.register_event_duration_secs_listener(_COUNTS._duration)
    return chosen, _COUNTS


@contextlib.contextmanager
def not_written() -> Iterator[None]:
    """Programs compiled inside are not written to the persistent cache (JAX still looks
    them up): JAX's minimum compile time for a write (jax/_src/compiler.py _cache_write) is
    infinite meanwhile. For an executable XLA cannot serialize (program.py
    CPU_TRAIN_OPTIONS), whose write would fail with a warning."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    try:
        yield
    finally:
        jax.config.update(name, before)
