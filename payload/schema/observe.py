"""How a run is watched, as job settings: `train.tracker` (where the scalars go besides the
log and status.json) and `train.profile` (a window of steps traced by the JAX profiler).

The values and their checks live here, beside the job's dataclasses (payload/schema/job.py),
so payload/spec.py only takes the keys; docs/payload.md documents them, docs/operating.md says
how to turn them on. No I/O, no framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from payload.core.errors import SpecError

# tensorboard: the event files under logs/ only (always written). wandb: those and the same
# scalars to a Weights & Biases run (the `wandb` extra: payload/training/tracker.py).
TRACKERS = ("tensorboard", "wandb")
TRACKER_FILE = "tracker.json"  # in the run's directory, beside checkpoints/: the W&B run id
PROFILE_DIR = "profile"  # in the run's directory: train.profile's trace
PROFILE_KEYS = ("start_step", "steps")
# A trace of more steps than this is too large for TensorBoard's profile plugin to open
# comfortably; a window is for looking at a few steps, not the run.
MAX_PROFILE_STEPS = 1000


@dataclass(frozen=True, kw_only=True)
class ProfileSpec:
    """Steps start_step + 1 .. start_step + steps (1-based optimizer steps, as logged) traced
    by the JAX profiler into runs/<job>/profile/."""

    start_step: int
    steps: int

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


def _count(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{key}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"{key}: {value} is out of range (allowed: {lo} to {hi})")
    return value


def profile_window(key: str, value: Any, *, steps: int) -> ProfileSpec:
    """`train.profile: {start_step, steps}` checked against the run's `train.steps`."""
    if not isinstance(value, Mapping):
        raise SpecError(
            f"{key}: expected a mapping with {' and '.join(PROFILE_KEYS)}, got {value!r}"
        )
    unknown = sorted(str(name) for name in value if name not in PROFILE_KEYS)
    if unknown:
        raise SpecError(f"{key}.{unknown[0]}: unknown key (allowed: {', '.join(PROFILE_KEYS)})")
    for name in PROFILE_KEYS:
        if name not in value:
            raise SpecError(f"{key}.{name} is required")
    start = _count(f"{key}.start_step", value["start_step"], 0, steps)
    count = _count(f"{key}.steps", value["steps"], 1, MAX_PROFILE_STEPS)
    if start + count > steps:
        raise SpecError(
            f"{key}: steps {start + 1}-{start + count} end past train.steps: {steps} "
            f"(allowed: start_step + steps <= {steps})"
        )
    return ProfileSpec(start_step=start, steps=count)


def tf_profile_refusal(profile: ProfileSpec | None) -> str | None:
    """The TF backend has no JAX profiler: a job that asks for a trace is refused there."""
    if profile is None:
        return None
    return (
        "train.profile: the trace is the JAX profiler's, which the TF backend does not run; "
        "use train.backend: jax, or remove train.profile"
    )
