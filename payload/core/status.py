"""status.json: where a job is (stage, state, progress, last error), locally or in the bucket.

Writes go through :mod:`payload.core.storage` (atomic locally, google-cloud-storage for gs://)
and are throttled: at most one every ``min_interval_s`` seconds unless the stage or state
changes, so a training loop can call :meth:`StatusWriter.update` every step.

A run that made no progress within its bound ends with state ``hung`` (:meth:`StatusWriter.hung`:
``last_error`` names the phase; the trainer unit restarts it, and the next run's ``running``
replaces it), one that failed with ``failed``.

Beside where the job is, the trainer keeps what the status page draws (payload/training/page.py):
``history`` (series of [step, value]: :meth:`StatusWriter.add_point`, each at most MAX_POINTS,
thinned evenly as it grows), ``events`` (the trainer's events, the last MAX_EVENTS:
:meth:`StatusWriter.note_event`) and whole sections it computes (``goodput``, ``eta``:
:meth:`StatusWriter.note`). ``stages`` and KEPT (``last_error``, ``history``, ``events``,
``eta``, ``goodput``) are kept from the previous status.json of the same job, so a restart
continues them; the trainer cuts the history back to the step it restored
(:meth:`StatusWriter.trim_history`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from payload.core import storage

STATES = ("pending", "running", "complete", "skipped", "failed", "hung")
ENDED = ("complete", "skipped", "failed", "hung")
MAX_POINTS = 500  # per history series: status.json stays small (a few tens of kB)
MAX_EVENTS = 20
KEPT = ("last_error", "history", "events", "eta", "goodput")  # kept from the previous status.json


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class StatusWriter:
    def __init__(self, path: str, job_name: str, *, min_interval_s: float = 10.0):
        self.path = path
        self.job_name = job_name
        self.min_interval_s = min_interval_s
        self._last_write = 0.0
        self._dirty = False
        # Called with the document after each write, and at each milestone (flush's): the
        # status page (payload/training/page.py PageWriter) hangs here; it must not raise.
        self.on_flush: Callable[[dict[str, Any], bool], None] | None = None
        self._doc: dict[str, Any] = {
            "job": job_name,
            "stage": None,
            "state": "pending",
            "progress": None,
            "message": "",
            "metrics": {},
            "last_error": None,
            "updated_at": _now(),
            "stages": {},
        }
        previous = self._read_previous()
        if previous.get("job") == job_name and isinstance(previous.get("stages"), dict):
            self._doc["stages"] = previous["stages"]
            for key in KEPT:
                if previous.get(key) is not None:
                    self._doc[key] = previous[key]

    def _read_previous(self) -> dict[str, Any]:
        try:
            data = json.loads(storage.read_text(self.path))
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def document(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._doc))

    def update(
        self,
        *,
        stage: str,
        state: str = "running",
        progress: float | None = None,
        message: str = "",
        **metrics: float | int | str,
    ) -> None:
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        changed = (stage, state) != (self._doc["stage"], self._doc["state"])
        now = _now()
        history = self._doc["stages"].setdefault(stage, {})
        if changed:
            history["state"] = state
            if state == "running":
                history["started_at"] = now
                history.pop("finished_at", None)
            elif state in ENDED:
                history["finished_at"] = now
        if message:
            history["message"] = message
        if metrics:
            history.setdefault("metrics", {}).update(metrics)
        if changed:
            self._doc["metrics"] = {}
        self._doc.update(
            stage=stage,
            state=state,
            progress=None if progress is None else max(0.0, min(1.0, float(progress))),
            message=message,
            updated_at=now,
        )
        self._doc["metrics"].update(metrics)
        if state == "complete":
            self._doc["progress"] = 1.0
            history["progress"] = 1.0
        elif progress is not None:
            history["progress"] = self._doc["progress"]
        self._dirty = True
        if changed or time.monotonic() - self._last_write >= self.min_interval_s:
            self.flush()

    def note_host_checks(self, checks: list[str]) -> None:
        """Where this host differs from what the catalog expects (the startup script's host
        check, infra/render/templates/facts.sh): kept in status.json until the next run's note."""
        self._doc["host_checks"] = list(checks)
        self._dirty = True

    def note_runtime(self, runtime: dict[str, Any]) -> None:
        """What the trainer runs on: accelerator, the devices (replicas) the backend sees,
        hosts, precision (payload/backends/tf/strategy.py describe)."""
        self._doc["runtime"] = dict(runtime)
        self._dirty = True

    def note(self, section: str, value: dict[str, Any]) -> None:
        """A whole section the trainer computes (``goodput``, ``eta``), written with the next
        write."""
        self._doc[section] = value
        self._dirty = True

    def add_point(self, series: str, step: int, value: float) -> None:
        """One [step, value] of a history series (``train``, ``eval``, ``tokens_per_s``,
        ``mfu``). A series past MAX_POINTS keeps every other point and its newest: the
        points stay spread over the whole run."""
        points = self._doc.setdefault("history", {}).setdefault(series, [])
        if points and points[-1][0] >= step:  # the same step again (a rerun's evaluation)
            points[:] = [p for p in points if p[0] < step]
        points.append([int(step), float(value)])
        if len(points) > MAX_POINTS:
            points[:] = [*points[:-1][::2], points[-1]]
        self._dirty = True

    def trim_history(self, step: int) -> None:
        """Drop the history after `step` (the step a restart restored: the steps after it are
        trained again)."""
        history = self._doc.get("history")
        if isinstance(history, dict):
            for series, points in history.items():
                history[series] = [p for p in points if p[0] <= step]
            self._dirty = True

    def note_event(self, event: dict[str, Any]) -> None:
        """An event this job emitted (payload/core/events.py's jsonPayload); the last
        MAX_EVENTS are kept."""
        events = self._doc.setdefault("events", [])
        events.append(dict(event))
        del events[:-MAX_EVENTS]
        self._dirty = True

    def fail(self, *, stage: str, error: str) -> None:
        self._doc["last_error"] = {"stage": stage, "error": error, "at": _now()}
        self.update(stage=stage, state="failed", message=error)
        self.flush(milestone=True)

    def hung(self, *, stage: str, phase: str, error: str) -> None:
        """The run made no progress in `phase` within its bound (the JAX backend's progress
        watchdog, payload/backends/jax/progress.py) and ends: state `hung`, the phase in
        `last_error`."""
        self._doc["last_error"] = {"stage": stage, "phase": phase, "error": error, "at": _now()}
        self.update(stage=stage, state="hung", message=error)
        self.flush(milestone=True)

    def flush(self, *, milestone: bool = False) -> None:
        """Write status.json if anything changed. A milestone (an evaluation, a checkpoint, a
        stage's end or failure) also tells `on_flush` that it should not wait out its own
        throttle."""
        if self._dirty:
            storage.write_text(self.path, json.dumps(self._doc, indent=2, sort_keys=True) + "\n")
            self._last_write = time.monotonic()
            self._dirty = False
        elif not milestone:
            return
        if self.on_flush is not None:
            self.on_flush(self.document, milestone)
