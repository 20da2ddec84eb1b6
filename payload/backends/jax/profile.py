"""`train.profile: {start_step, steps}`: a JAX profiler trace of optimizer steps start_step ..
start_step + steps - 1 (the log lines' numbering), in the job's profile/ folder.

How the window maps onto chunks. The JAX backend runs chunks of steps per host call
(train.py): the window's two edges (after step start_step - 1, after its last step) cut the
chunks as checkpoints and evaluations do (`until_edge`), so the trace holds exactly the
window's chunks. The trace starts once the chunk before the window has finished on the
devices (the host waits for it: dispatch is asynchronous) and stops once the window's last
chunk has (the host waits for its metrics), so neither a step before the window nor one after
it runs inside it. A window that starts at step 1 includes the first chunk's tracing and
compile (or its load from the compilation cache); a run resumed past the window's start
traces nothing (the window was there before the restart, or never will be).

Every process traces its own host and devices (a slice's hosts each write
``plugins/profile/<time>/<host>.xplane.pb``, and ``<host>.trace.json.gz``); the chief also
writes ``perfetto_trace.json.gz`` (``create_perfetto_trace``, one file per folder). The trace
is written to a local folder and then copied under profile/ (gs:// on a VM) through
payload/core/storage.py. TensorBoard's profile plugin reads the folder
(`tensorboard --logdir <run>/profile`); Perfetto (ui.perfetto.dev) opens the .json.gz.

JAX API (jax 0.10.2 ``jax/_src/profiler.py``): ``start_trace(log_dir,
create_perfetto_trace=...)`` / ``stop_trace()``, one trace at a time per process; the trace is
written to ``log_dir/plugins/profile/<time>/`` when it stops.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from payload.core import storage
from payload.training import shared as training

if TYPE_CHECKING:
    from payload.spec import JobSpec

NO_EDGE = 1 << 62  # until_edge without a window edge ahead: cuts nothing


class Window:
    """The job's profile window on this process; a no-op without `train.profile`."""

    def __init__(self, job: JobSpec, *, chief: bool):
        self.spec = job.train.profile
        self.dest = job.paths.profile
        self.chief = chief
        self._local: str | None = None  # the local folder of the trace in progress

    def until_edge(self, step: int) -> int:
        """Steps from `step` (steps done) to the window's next edge (NO_EDGE: none ahead)."""
        if self.spec is None:
            return NO_EDGE
        edges = (self.spec.start_step - 1, self.spec.last_step)
        return min((edge - step for edge in edges if edge > step), default=NO_EDGE)

    def run(
        self, chunk: Callable[..., tuple[Any, Any]], step: int, n: int, state: Any, batch: Any
    ) -> tuple[Any, Any]:
        """Dispatch `chunk(state, batch, n)`, the n steps after `step`: the window's first
        chunk starts the trace once `state` (the chunk before's) is ready; its last stops the
        trace once it has run (its metrics are ready)."""
        spec = self.spec
        if spec is not None and step == spec.start_step - 1 and self._local is None:
            jax.block_until_ready(state)
            self._local = tempfile.mkdtemp(prefix="tpu-pretrain-profile-")
            jax.profiler.start_trace(self._local, create_perfetto_trace=self.chief)
        state, metrics = chunk(state, batch, np.int32(n))
        if spec is not None and self._local is not None and step + n >= spec.last_step:
            jax.block_until_ready(metrics)
            self._stop()
            training.log(
                f"train: profile of steps {spec.start_step}-{spec.last_step} written to "
                f"{self.dest}/ (tensorboard --logdir {self.dest}; Perfetto: perfetto_trace.json.gz)"
            )
        return state, metrics

    def close(self) -> None:
        """A stop or an error inside the window: the trace so far is kept."""
        if self._local is not None:
            self._stop()
            training.log(f"train: the run stopped inside the profile window; partial trace in "
                         f"{self.dest}/")  # fmt: skip

    def _stop(self) -> None:
        local, self._local = self._local, None
        if local is None:
            return
        try:
            jax.profiler.stop_trace()
            storage.upload_tree(local, self.dest)
        finally:
            shutil.rmtree(local, ignore_errors=True)
