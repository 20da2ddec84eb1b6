"""`train.profile: {start_step, steps}`: a JAX profiler trace of steps start_step + 1 ..
start_step + steps, written to runs/<job>/profile/ for TensorBoard's profile plugin
(`plugins/profile/<run>/<host>.xplane.pb`) or Perfetto (`perfetto_trace.json.gz`, opened at
ui.perfetto.dev).

The training loop cuts its chunks at the window's two edges (`cut`), so the trace holds
exactly the window's steps: `at(step, state)` before each chunk starts the trace at
start_step, and stops it at the end step once the devices have finished the window's last
chunk (`jax.block_until_ready`); `close()`, as the loop ends, stops a window that ends at
train.steps or one that a stop by signal or an error left open. Only the chief traces (one
trace per run, like the event files). The profiler writes to a local directory
(jax.profiler.start_trace); a gs:// run's trace is uploaded through payload/core/storage.py
once it is stopped. A restart inside the window traces the rest of it again, into a run
directory of its own (plugins/profile/<time>/).
"""

from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING, Any

import jax

from payload.core import storage
from payload.schema.observe import PROFILE_DIR
from payload.training import shared as training

if TYPE_CHECKING:
    from payload.spec import JobSpec


def profile_dir(job: JobSpec) -> str:
    return storage.join(job.paths.root, PROFILE_DIR)


class ProfileWindow:
    def __init__(self, job: JobSpec, *, chief: bool):
        self.window = job.train.profile if chief else None
        self.dest = profile_dir(job)
        self._local: str | None = None  # the directory being traced into
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        self._first = 0
        self.done = False

    def cut(self, step: int) -> int:
        """Steps from `step` to the window's next edge (a chunk must end there); a large
        number where no edge is ahead."""
        if self.window is None or self.done:
            return 1 << 62
        edges = [e for e in (self.window.start_step, self.window.end_step) if e > step]
        return edges[0] - step if edges else 1 << 62

    def at(self, step: int, state: Any) -> None:
        """Before the chunk that starts after `step` (and once after the loop)."""
        window = self.window
        if window is None or self.done:
            return
        if self._local is None and window.start_step <= step < window.end_step:
            if storage.is_gcs(self.dest):
                self._temp = tempfile.TemporaryDirectory(prefix="tpu-payload-profile-")
                self._local = self._temp.name
            else:
                storage.makedirs(self.dest)
                self._local = self.dest
            self._first = step
            jax.profiler.start_trace(self._local, create_perfetto_trace=True)
        elif self._local is not None and step >= window.end_step:
            self._stop(step, state)

    def close(self) -> None:
        """After the loop: a window that ends at train.steps (the loop's last chunk was
        waited for by its checkpoint), or one a stop by signal or an error left open."""
        if self._local is not None:
            self._stop(None, None)

    def _stop(self, step: int | None, state: Any) -> None:
        if state is not None:
            jax.block_until_ready(state)  # the window's last chunk, finished on the devices
        jax.profiler.stop_trace()
        local, self._local, self.done = self._local, None, True
        if self._temp is not None and local is not None:
            storage.upload_tree(local, self.dest)
            self._temp.cleanup()
            self._temp = None
        last = step if step is not None else "the loop's end"
        training.log(
            f"train: profile of steps {self._first + 1}-{last} written to {self.dest} "
            "(TensorBoard's profile plugin, or perfetto_trace.json.gz in ui.perfetto.dev)"
        )
