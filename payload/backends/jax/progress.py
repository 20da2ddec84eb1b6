"""The progress watchdog: every phase of a run on the JAX backend that waits on the devices
or on storage has a bound, and a host that makes no progress within it ends itself (and, on
a slice, every other host) with HUNG_EXIT, which the trainer unit restarts.

Why: if a chip or an ICI collective stalls, every host blocks inside a device wait (the
chunk's `device_get`), where no agreement's timeout reaches it; nobody acts, and the slice
bills idle. The main thread marks its progress here (`Watch.enter` at each phase,
`Watch.finished` at each finished chunk or group of evaluation batches); the slice's guard
thread (distributed.SliceGuard, on every host, also a single one) reads `Watch.overdue`
every 0.1 s and, past the bound, writes every thread's Python stack to the log
(faulthandler), status.json's state `hung` with the phase (the chief's), publishes the
hang to the other hosts and ends the process (distributed.SliceGuard._hung).

The bounds (docs/pod-slices.md "When a host leaves"):
- train, evaluate: STEP_FACTOR x the longest chunk this run has timed (the time between two
  finished chunks), at least the floor (HANG_ENV, default STEP_FLOOR_S: above storage's
  retries of a status or TensorBoard write, RETRY_DEADLINE_S, and a slow input read);
- compile (tracing and compiling the programs, up to the first finished chunk): COMPILE_S;
- restore, checkpoint (a save that waits for the write before it, the final write): the
  state's bytes per host at IO_BYTES_PER_S, at least IO_FLOOR_S;
- export (the gathers, the chief's write and upload; the others wait for it): the whole
  state's bytes at IO_BYTES_PER_S, at least IO_FLOOR_S.
No bound is below the floor that HANG_ENV sets: raising it raises every bound. The
start-up's checks (manifest, checksums) are outside the watched phases: each read there is
bounded by storage's retries, each agreement by distributed.AGREE_TIMEOUT_S.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from payload.core.errors import UserError

# A distinct exit code for a host that hung (sysexits' EX_TEMPFAIL, "a temporary failure:
# retry"): not 1 (a bug), 2 (a user error: never restarted) or 128 + a signal. The trainer
# unit restarts it (Restart=on-failure) and its ExecStopPost helper counts it like any
# failure (5 in a row without a newer checkpoint stop the unit: a host that hangs again at
# every start is a host to replace, infra/render/templates/tpu.sh trainer_stopped).
HUNG_EXIT = 75
HANG_ENV = "TPU_PAYLOAD_HANG_S"
STEP_FLOOR_S = 300.0
STEP_FACTOR = 10.0
COMPILE_S = 1800.0
IO_FLOOR_S = 900.0
# A pessimistic write or read speed per host to Cloud Storage: a hundredth of the 1 GB/s the
# stop-cost table assumes (payload/plan/stopping.py), so only a stalled transfer passes it.
IO_BYTES_PER_S = 10e6
PHASES = ("compile", "restore", "train", "evaluate", "checkpoint", "export")
# A test hook, nothing else: with this variable set to a step, the process blocks for ever
# (on its main thread, in `stall_point`) before it dispatches the chunk that starts at that
# step, as a host whose chip stalled sees it (tests/payload/test_slice_bounds.py).
STALL_ENV = "TPU_PAYLOAD_TEST_STALL_STEP"


@dataclass(frozen=True)
class Bounds:
    """Each phase's bound, in seconds (the module's docstring says how they are derived)."""

    floor_s: float
    compile_s: float
    io_s: float
    export_s: float

    @classmethod
    def of(cls, state_bytes: int, hosts: int, environ: Mapping[str, str] = os.environ) -> Bounds:
        """The bounds of a run whose training state holds `state_bytes` over `hosts`."""
        floor = floor_from(environ)
        io = max(IO_FLOOR_S, state_bytes / max(hosts, 1) / IO_BYTES_PER_S)
        export = max(IO_FLOOR_S, state_bytes / IO_BYTES_PER_S)
        return cls(
            floor_s=floor,
            compile_s=max(COMPILE_S, floor),
            io_s=max(io, floor),
            export_s=max(export, floor),
        )

    def describe(self) -> dict[str, float]:
        return {
            "step_floor_s": self.floor_s,
            "step_factor": STEP_FACTOR,
            "compile_s": self.compile_s,
            "restore_s": self.io_s,
            "checkpoint_s": self.io_s,
            "export_s": self.export_s,
        }


def floor_from(environ: Mapping[str, str]) -> float:
    """The floor of every bound: HANG_ENV's seconds, or STEP_FLOOR_S."""
    raw = environ.get(HANG_ENV, "")
    if not raw:
        return STEP_FLOOR_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{HANG_ENV}: {raw!r} must be a positive number of seconds")
    return value


@dataclass(frozen=True)
class Late:
    """A phase that made no progress within its bound."""

    phase: str
    bound_s: float
    waited_s: float
    how: str  # how the bound was derived, for the line

    def line(self, process: int, processes: int) -> str:
        who = f"process {process} of the slice" if processes > 1 else "this process"
        return (
            f"error: {who} hung: no progress in {self.phase} for {self.waited_s:.0f} s (its "
            f"bound: {self.bound_s:.0f} s, {self.how}); every thread's stack is in process "
            f"{process}'s log; exit {HUNG_EXIT}: the trainer unit restarts it"
        )


class Watch:
    """The main thread's progress, read by the guard thread. Each change is one assignment
    of a tuple, so the guard never reads half of one."""

    def __init__(self, bounds: Bounds, clock: Callable[[], float] = time.monotonic):
        self.bounds = bounds
        self._clock = clock
        self._current: tuple[str, float] | None = None  # (phase, since)
        self.longest_chunk_s = 0.0
        # Told each phase the main thread enters (None: idle): the goodput ledger's clock
        # (payload/training/report.py RunReport.follow).
        self.on_phase: Callable[[str | None], None] | None = None

    def _tell(self, phase: str | None) -> None:
        if self.on_phase is not None:
            self.on_phase(phase)

    @property
    def phase(self) -> str | None:
        current = self._current
        return current[0] if current else None

    def enter(self, phase: str) -> None:
        """The main thread starts `phase` now (its clock starts again)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._current = (phase, self._clock())
        self._tell(phase)

    def finished(self) -> None:
        """A chunk (or a group of evaluation batches) finished: the clock starts again; the
        first finished chunk ends the compile phase, and each later one's time is what the
        step bound is derived from."""
        current, now = self._current, self._clock()
        if current is None:
            return
        phase, since = current
        if phase == "compile":
            phase = "train"
            self._tell(phase)
        elif phase == "train":
            self.longest_chunk_s = max(self.longest_chunk_s, now - since)
        self._current = (phase, now)

    def idle(self) -> None:
        """Nothing watched (between phases, once training is over)."""
        self._current = None
        self._tell(None)

    @contextlib.contextmanager
    def during(self, phase: str, then: str | None = None) -> Iterator[None]:
        """`phase` for the block, then `then` (its clock started again) or nothing."""
        self.enter(phase)
        try:
            yield
        finally:
            if then is None:
                self.idle()
            else:
                self.enter(then)

    def bound(self, phase: str) -> tuple[float, str]:
        """(the bound of `phase` now, how it was derived)."""
        b = self.bounds
        if phase in ("train", "evaluate"):
            derived, longest = STEP_FACTOR * self.longest_chunk_s, self.longest_chunk_s
            if derived > b.floor_s:
                return derived, f"{STEP_FACTOR:.0f} x the longest chunk, {longest:.1f} s"
            return b.floor_s, f"the floor, {HANG_ENV} or {STEP_FLOOR_S:.0f} s"
        if phase == "compile":
            return b.compile_s, f"the compile bound, {COMPILE_S:.0f} s or the floor"
        rate = f"{IO_BYTES_PER_S / 1e6:.0f} MB/s, at least {IO_FLOOR_S:.0f} s"
        if phase == "export":
            return b.export_s, f"the state's bytes at {rate}"
        return b.io_s, f"the state's bytes per host at {rate}"

    def overdue(self) -> Late | None:
        """The phase that has made no progress within its bound, if any."""
        current = self._current
        if current is None:
            return None
        phase, since = current
        waited = self._clock() - since
        bound, how = self.bound(phase)
        return Late(phase, bound, waited, how) if waited > bound else None


def dump_stacks() -> None:
    """Every thread's Python stack to stderr (the run's log: the trainer unit's journal)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # a closed stderr: nothing to write to
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()


def stall_point(step: int, environ: Mapping[str, str] = os.environ) -> None:
    """The test hook STALL_ENV: block for ever before the chunk that starts at `step`."""
    raw = environ.get(STALL_ENV, "")
    if raw and int(raw) == step:
        _stalled_here(step)


def _stalled_here(step: int) -> None:
    print(
        f"train: {STALL_ENV}: stalled before step {step + 1} at {time.time():.3f}",
        file=sys.stderr,
        flush=True,
    )
    while True:
        time.sleep(1.0)
