"""Where a run's time went, over every start of the trainer: the goodput ledger.

Definitions (Google's): goodput is "the proportion of TPU usage time spent making productive,
preserved training progress"; badput "the proportion of total time spent on non-productive
activities like startup overhead, I/O stalls, and disruption recovery"; the total elapsed time
is "measured from the time the application starts to either the current time or the time of
job completion" (docs.cloud.google.com/tpu/docs/goodput). The categories follow the badput
breakdown of Google's ML Goodput Measurement library (AI-Hypercomputer/ml-goodput-measurement
README, "Badput Breakdown Details"; MaxText's guide monitor_goodput.md, in the
AI-Hypercomputer/maxtext repository's guides on monitoring and debugging): accelerator
initialisation and program startup, compilation, data loading, checkpoint save and restore,
and "wasted progress due to disruption": "time that was spent on productive training but lost
after restart".

Here, in seconds (CATEGORIES):
- ``capacity_wait``: the controller's watchdog waiting for the accelerator (its status's
  ``capacity_wait_s``, bootstrap/tpu-watch.json or gpu-watch.json), taken out of the time
  between starts (beyond it, before the first start);
- ``boot``: from this process's start (the kernel's: /proc/self/stat) to the trainer's start:
  imports, the lease, and in ``tpu-payload run`` the stages before training; and for a start
  on a host that booted after the previous start ended (a new VM after a preemption), from
  the host's boot (/proc/uptime) to the process: the VM's boot, the startup script's install;
- ``restore``: reading the newest checkpoint;
- ``compile``: from the restore to the end of the first chunk after a start (tracing,
  compiling or loading from JAX's compilation cache: the record says which, ``compile_cache``,
  and the first chunk's own steps);
- ``input``: the main thread reading and transferring batches (the JAX backend; it reads the
  next chunk's batches while the devices run the current one, so this is an upper bound of
  the devices' wait; the TF backend reads inside its compiled chunk, counted as productive);
- ``productive``: training chunks after the first, less ``lost``;
- ``evaluation``: the held-out evaluations;
- ``checkpoint``: checkpoint saves (the JAX backend's async save: the copy to host memory
  and any wait for the previous write);
- ``export``: writing the trained model;
- ``lost``: steps a restart trained again: the previous start's last step minus this start's
  restored step, at the previous start's seconds per step;
- ``down``: between one start's last record and the next start (a VM's shutdown, systemd's
  restart delay), less the new host's boot and the capacity wait;
- ``other``: the rest of a start (start-up checks, the model's build, host work between
  phases).
They add up to ``wall_s``, the first start's process start to now (or to the last start's
end), plus any capacity wait before the first start.

The ledger (one record per start, RECORDS/<process start>-<pid>.json beside status.json, via
payload/core/storage.py: local or gs://) is written by the chief only: at each log line (on
gs:// at most every GCS_MIN_INTERVAL_S) and at a start's restore and end. A start that ends
records how (ENDS); one killed without a word (SIGKILL, a VM taken away) keeps ``running`` in
its file and is shown as ``killed``. Its summary is
status.json's ``goodput`` (:meth:`Ledger.summary`), the status page's breakdown and timeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from payload.core import storage

RECORDS = "goodput"
WATCH_FILES = ("tpu-watch.json", "gpu-watch.json")
CATEGORIES = (
    "capacity_wait",
    "boot",
    "restore",
    "compile",
    "input",
    "productive",
    "evaluation",
    "checkpoint",
    "export",
    "lost",
    "down",
    "other",
)
# What a start's own clock splits (the rest are computed across starts).
PHASES = ("boot", "restore", "compile", "input", "productive", "evaluation", "checkpoint",
          "export", "other")  # fmt: skip
ENDS = ("running", "finished", "preempted", "stopped", "failed", "hung", "killed")
# A record on gs:// is rewritten at most this often (Cloud Storage allows about one write a
# second to one object name: cloud.google.com/storage/quotas), except at a start's restore
# and end; a local one at every log line.
GCS_MIN_INTERVAL_S = 10.0


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def host_uptime() -> float | None:
    """Seconds since this host booted (/proc/uptime, in hundredths: /proc/stat's btime is
    whole seconds); None off Linux."""
    try:
        return float(Path("/proc/uptime").read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def process_start_time() -> float | None:
    """This process's start (seconds since the epoch) from the kernel: /proc/self/stat's
    starttime, clock ticks after the host's boot (proc(5)); None off Linux."""
    uptime = host_uptime()
    try:
        stat = Path("/proc/self/stat").read_text(encoding="ascii")
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22 (fields 3.. after comm)
    except (OSError, ValueError, IndexError):
        return None
    return None if uptime is None else time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def capacity_wait_s(run_root: str) -> float:
    """The watchdog's seconds waiting for capacity (0 where it wrote none)."""
    total = 0.0
    for name in WATCH_FILES:
        try:
            doc = json.loads(storage.read_text(storage.join(run_root, "bootstrap", name)))
        except (FileNotFoundError, ValueError):
            continue
        value = doc.get("capacity_wait_s") if isinstance(doc, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            total += float(value)
    return total


class Ledger:
    """This start's record and the previous starts' (read once, at the start). The main
    thread marks what it does (:meth:`enter`, :meth:`during`); the record is written at
    :meth:`write` (the chief's only)."""

    def __init__(
        self,
        run_root: str,
        *,
        chief: bool,
        clock: Callable[[], float] = time.time,
        process_started: float | None = None,
    ):
        self.run_root = run_root
        self.directory = storage.join(run_root, RECORDS)
        self.chief = chief
        self._clock = clock
        now, uptime = clock(), host_uptime()
        began = process_started if process_started is not None else process_start_time()
        began = min(began, now) if began is not None else now
        self.record: dict[str, Any] = {
            "started_at": iso(began),
            "started_s": began,
            "trainer_started_s": now,
            "ended_s": now,
            "end": "running",
            "first_step": None,
            "last_step": None,
            "restored_step": None,
            "compiled_step": None,  # the first chunk's last step
            "seconds": dict.fromkeys(PHASES, 0.0),
            "compile_cache": None,
            "host_booted_s": None if uptime is None else now - uptime,
        }
        self.record["seconds"]["boot"] = now - began
        self.name = f"{iso(began).replace(':', '')}-{os.getpid()}.json"
        self._phase, self._since = "other", now
        self._written: float | None = None
        self.previous = self._read_previous() if chief else []
        self.capacity_wait_s = capacity_wait_s(run_root) if chief else 0.0

    def _read_previous(self) -> list[dict[str, Any]]:
        if not storage.exists(self.directory):
            return []
        found = []
        for name in storage.listdir(self.directory):
            if not name.endswith(".json") or name == self.name:
                continue
            try:
                record = json.loads(storage.read_text(storage.join(self.directory, name)))
            except (FileNotFoundError, ValueError):
                continue  # a record cut short: left out
            if isinstance(record, dict) and isinstance(record.get("started_s"), (int, float)):
                found.append(record)
        return sorted(found, key=lambda r: float(r["started_s"]))

    # ------------------------------------------------------------------ this start's clock

    def _account(self) -> float:
        now = self._clock()
        self.record["seconds"][self._phase] += max(0.0, now - self._since)
        self._since = now
        self.record["ended_s"] = now
        return now

    @property
    def phase(self) -> str:
        return self._phase

    def enter(self, phase: str) -> None:
        """The main thread does `phase` from now on."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._account()
        self._phase = phase

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """`phase` for the block, then what the thread did before."""
        before = self._phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def restored(self, step: int | None) -> None:
        self.record["restored_step"] = step
        self.record["first_step"] = step or 0

    def steps_done(self, step: int) -> None:
        """The steps up to `step` are trained (while compiling: the first chunk's, whose
        time is the compile's)."""
        self.record["last_step"] = step
        if self.record["first_step"] is None:
            self.record["first_step"] = 0
        if self._phase == "compile":
            self.record["compiled_step"] = step

    def chunk_done(self, step: int) -> None:
        """A chunk ending at `step` finished: the first after a start ends the compile."""
        self.steps_done(step)
        if self._phase == "compile":
            self.enter("productive")

    def note_compile_cache(self, counts: Mapping[str, Any]) -> None:
        self.record["compile_cache"] = dict(counts)

    def end(self, how: str) -> None:
        if how not in ENDS:
            raise ValueError(f"end must be one of {ENDS}, got {how!r}")
        self._account()
        self.record["end"] = how

    def write(self, *, force: bool = False) -> None:
        """This start's record to the run's directory (the chief's; on gs:// at most every
        GCS_MIN_INTERVAL_S unless forced; never raises: the ledger must not stop a run)."""
        now = self._account()
        if not self.chief:
            return
        recent = self._written is not None and now - self._written < GCS_MIN_INTERVAL_S
        if recent and not force and storage.is_gcs(self.directory):
            return
        self._written = now
        try:
            storage.write_text(
                storage.join(self.directory, self.name),
                json.dumps(self.record, sort_keys=True) + "\n",
            )
        except Exception as error:  # an unwritten record costs a figure, not the run
            print(f"warning: goodput record not written ({error}); training goes on")

    # ------------------------------------------------------------------ every start's sum

    def summary(self) -> dict[str, Any]:
        """status.json's ``goodput``: every start's record, this one's as of now."""
        self._account()
        return summarise([*self.previous, self.record], capacity_wait=self.capacity_wait_s)


def _steps_s(record: Mapping[str, Any]) -> float | None:
    """Seconds per step of a start's productive chunks (its first chunk is the compile's)."""
    first, last = record.get("compiled_step", record.get("first_step")), record.get("last_step")
    productive = float(record.get("seconds", {}).get("productive", 0.0))
    if first is None or last is None or last <= first or productive <= 0:
        return None
    return productive / max(1, last - first)


def summarise(records: Sequence[Mapping[str, Any]], *, capacity_wait: float) -> dict[str, Any]:
    """The categories over `records` (oldest first), the wall time and the goodput."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    starts = []
    gaps = 0.0
    previous: Mapping[str, Any] | None = None
    for i, record in enumerate(records):
        seconds = record.get("seconds", {})
        for phase in PHASES:
            totals[phase] += float(seconds.get(phase, 0.0))
        began, ended = float(record["started_s"]), float(record["ended_s"])
        if previous is not None:
            gap = max(0.0, began - float(previous["ended_s"]))
            booted = record.get("host_booted_s")
            if isinstance(booted, (int, float)) and booted > float(previous["ended_s"]):
                # A host that booted after the previous start ended (a new VM after a
                # preemption): from its boot to this process is boot and install.
                vm_boot = min(gap, began - booted)
                totals["boot"] += vm_boot
                gap -= vm_boot
            gaps += gap
            restored = record.get("restored_step") or 0
            last, per_step = previous.get("last_step"), _steps_s(previous)
            if last is not None and per_step is not None and last > restored:
                # The previous start's steps after this one's restored step were thrown away:
                # productive time then, lost now.
                lost = min((last - restored) * per_step, float(previous["seconds"]["productive"]))
                totals["lost"] += lost
                totals["productive"] -= lost
        live = i == len(records) - 1
        end = record.get("end", "running")
        starts.append(
            {
                "started_at": str(record.get("started_at")),
                "ended_at": iso(ended),
                "end": "killed" if end == "running" and not live else end,
                "first_step": record.get("first_step"),
                "last_step": record.get("last_step"),
                "restored_step": record.get("restored_step"),
                "compile_cache": record.get("compile_cache"),
            }
        )
        previous = record
    waited_between = min(capacity_wait, gaps)
    totals["capacity_wait"] = capacity_wait
    totals["down"] = gaps - waited_between
    wall = 0.0
    if records:
        wall = float(records[-1]["ended_s"]) - float(records[0]["started_s"])
        wall += capacity_wait - waited_between  # waited before the first start
    categories = {k: round(v, 3) for k, v in totals.items()}
    return {
        "wall_s": round(wall, 3),
        "categories": categories,
        "goodput": round(totals["productive"] / wall, 4) if wall > 0 else None,
        "starts": starts,
    }
