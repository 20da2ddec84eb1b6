"""The training backends, behind one small protocol the pipeline looks up by `train.backend`.

    tf   payload/backends/tf/    TensorFlow's TPU build + tf_keras (the frozen line: one host,
                                 TPU v2-v5, GPU, CPU)
    jax  payload/backends/jax/   Keras 3 on JAX (every TPU generation, slices, GPU, CPU;
                                 sharded state, Orbax checkpoints)

Everything before and after training (the job checks, run identity, chunk boundaries, stop
handling, evaluation report, export writing and model card) is shared and framework-free
(payload/training/: shared.py, identity.py, heldout.py, export.py, modelcard.py); a backend module
is imported only when a job trains on it, so the other framework is never loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from payload.core.status import StatusWriter
    from payload.spec import JobSpec

# train.backend -> the module that implements it.
MODULES = {"tf": "payload.backends.tf.train", "jax": "payload.backends.jax.train"}


class Backend(Protocol):
    """What the pipeline needs of a backend's train module."""

    BACKEND: str

    def train(self, job: JobSpec, status: StatusWriter) -> dict[str, Any]:
        """Train (or resume from the newest checkpoint) and export; the run's figures."""
        ...


def load(name: str) -> Backend:
    """The backend module of `name` (one of MODULES), imported now."""
    module: Any = importlib.import_module(MODULES[name])
    return module


def loaded() -> bool:
    """Whether any backend's train module was imported in this process."""
    import sys  # noqa: PLC0415

    return any(name in sys.modules for name in MODULES.values())
