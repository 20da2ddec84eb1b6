"""What the trainer tells about its run, beside where it is: the goodput ledger (goodput.py),
the history and the ETA in status.json, and its events (payload/core/events.py).

Both backends hold one :class:`RunReport` per start and feed it through the same hooks:
:meth:`RunReport.during` / :meth:`RunReport.enter` (what the main thread does: restore,
compile, input, productive, evaluation, checkpoint, export), :meth:`RunReport.restored`,
:meth:`RunReport.chunk_done`, :meth:`RunReport.logged` (the Meter's log lines: history, ETA,
the ledger's write), :meth:`RunReport.finished` (the export written) and
:meth:`RunReport.ended_by` (how a start ends: preempted by a signal, stopped by a user error,
failed) or :meth:`RunReport.hung` (the JAX backend's stall watchdog). Only the chief writes
and emits.

The history's ``mfu`` is drawn on a TPU host only (:func:`mfu_per_token_s`): tokens/s x
the plan's FLOPs per token over the chips' peak.

The trainer's events: ``hung``, ``finished``, ``eta-past-grant`` (once per run: the first
time the ETA passes the grant's end; kept in status.json's ``eta`` across restarts) and
``stopped`` for a user error, unless the VM's trainer unit runs it (UNIT_ENV is set): the
unit writes ``stopped`` itself when the trainer exits 2 (infra/render/templates/tpu.sh
``trainer_stopped``), so the two never write the same stop twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from payload.core import events, hosts
from payload.core.errors import TrainingInterrupted, UserError
from payload.plan import eta as eta_lib
from payload.training.goodput import Ledger

if TYPE_CHECKING:
    from payload.core.status import StatusWriter
    from payload.spec import JobSpec

# Set by the VMs' trainer and data units (infra/render/templates/tpu.sh, gpu.sh): there the
# unit reports a stop for good (exit 2) as a `stopped` event itself.
UNIT_ENV = "TPU_PRETRAIN_HOST_FACTS"
# The JAX backend's progress phases (backends/jax/progress.py PHASES) as the ledger's.
WATCH_PHASES = {
    "compile": "compile",
    "restore": "restore",
    "train": "productive",
    "evaluate": "evaluation",
    "checkpoint": "checkpoint",
    "export": "export",
}


def mfu_per_token_s(job: JobSpec) -> float | None:
    """The MFU one token a second is on this TPU host (the one the trainer unit names,
    core/hosts.py): the plan's FLOPs per token over the slice's chips x peak FLOP/s
    (payload/plan/estimate.py, whose hours assume an MFU the same way); None on another
    host or an accelerator type the plan has no figures for."""
    host = hosts.expected_tpu()
    if host is None:
        return None
    from payload.plan import estimate  # noqa: PLC0415  (the model shapes: only on a TPU)

    try:
        acc = estimate.accelerator(host.accelerator_type)
        flops_per_token = estimate.plan_job(job, acc).flops_per_token
    except Exception:  # a figure on the page must never stop a run
        return None
    return flops_per_token / (acc.chips * acc.peak_flops)


class RunReport:
    def __init__(
        self,
        job: JobSpec,
        status: StatusWriter,
        *,
        chief: bool,
        environ: Mapping[str, str] = os.environ,
        ledger: Ledger | None = None,
    ):
        self.job, self.status, self.chief = job, status, chief
        self.environ = environ
        self.ledger = ledger or Ledger(job.paths.root, chief=chief)
        self.tokens_per_step = job.train.global_batch_size * job.data.seq_length
        self.cache_counts: Any = None  # the JAX backend's compile_cache.CacheCounts
        self._rate: float | None = None
        self._mfu_per_token_s = mfu_per_token_s(job)
        previous = status.document.get("eta") or {}
        self._past_grant_reported = previous.get("past_grant_event_at")
        self._ended = False

    # ---------------------------------------------------------------- the main thread's time

    def enter(self, phase: str) -> None:
        self.ledger.enter(phase)

    def during(self, phase: str) -> contextlib.AbstractContextManager[None]:
        return self.ledger.during(phase)

    def follow(self, watch_phase: str | None) -> None:
        """The JAX progress watchdog's phase (progress.Watch.on_phase) as the ledger's."""
        self.ledger.enter(WATCH_PHASES.get(watch_phase or "", "other"))

    def restored(self, step: int | None) -> None:
        """The start's step: the checkpoint restored (None: a fresh start). The history after
        it is trained again, so it goes."""
        self.ledger.restored(step)
        self.status.trim_history(step or 0)
        self.save(force=True)

    def chunk_done(self, step: int) -> None:
        """A chunk ending at `step` finished (the first after a start ends the compile)."""
        self.ledger.chunk_done(step)

    def steps_done(self, step: int) -> None:
        """The steps up to `step` are trained (the phase is the JAX watch's to change)."""
        self.ledger.steps_done(step)

    # ---------------------------------------------------------------- status.json

    def logged(self, step: int, loss: float, steps_per_s: float) -> None:
        """A log line at `step`: the history's points, the ETA, the ledger's record."""
        self.status.add_point("train", step, loss)
        if steps_per_s > 0:
            self._rate = steps_per_s * self.tokens_per_step
            self.status.add_point("tokens_per_s", step, self._rate)
            if self._mfu_per_token_s is not None:
                self.status.add_point("mfu", step, self._rate * self._mfu_per_token_s)
        self._note_eta(step)
        self.save()

    def _note_eta(self, step: int) -> None:
        estimated = eta_lib.estimate(
            step=step,
            steps=self.job.train.steps,
            tokens_per_step=self.tokens_per_step,
            tokens_per_s=self._rate,
            now=datetime.now(timezone.utc),
            grant_ends=self.job.grant_ends,
        )
        doc = estimated.to_dict()
        if estimated.past_grant and not self._past_grant_reported:
            self._past_grant_reported = estimated.eta
            self.event(
                "eta-past-grant",
                estimated.warning or "the ETA is past the grant's end",
                eta=estimated.eta,
                grant_ends=estimated.grant_ends,
            )
        doc["past_grant_event_at"] = self._past_grant_reported
        self.status.note("eta", doc)

    def save(self, *, force: bool = False) -> None:
        """The ledger's record (the chief's; goodput.Ledger.write) and status.json's
        ``goodput``."""
        if self.cache_counts is not None:
            self.ledger.note_compile_cache(self.cache_counts.describe())
        self.ledger.write(force=force)
        if self.chief:
            self.status.note("goodput", self.ledger.summary())

    def event(self, name: str, message: str, **fields: Any) -> None:
        """Emit one of the trainer's events (the chief's) and keep it in status.json."""
        if not self.chief:
            return
        payload = events.emit(
            name,
            run_root=self.job.paths.root,
            job=self.job.name,
            message=message,
            environ=self.environ,
            **fields,
        )
        self.status.note_event(payload)

    # ---------------------------------------------------------------- how a start ends

    def _end(self, how: str) -> None:
        if self._ended:
            return
        self._ended = True
        self.ledger.end(how)
        self.save(force=True)
        self.status.flush(milestone=True)

    def finished(self, step: int) -> None:
        """The export is written: the `finished` event, the start's end."""
        self.event(
            "finished",
            f"the export is written: {self.job.paths.export}",
            step=step,
            export=self.job.paths.export,
        )
        self._end("finished")

    def hung(self, phase: str, line: str) -> None:
        """The stall watchdog ends this start (from the slice guard's thread)."""
        self.event("hung", line, phase=phase, step=self.ledger.record.get("last_step"))
        self._end("hung")

    def ended_by(self, error: BaseException) -> None:
        """A start that ends with `error`: by a signal (preempted: it resumes), a user error
        (stopped for good: the event unless the trainer unit writes it) or anything else
        (failed: the unit restarts it)."""
        if isinstance(error, TrainingInterrupted | KeyboardInterrupt):
            self._end("preempted")
        elif isinstance(error, UserError):
            if not self.environ.get(UNIT_ENV):
                message = " ".join(str(error).split()) or type(error).__name__
                self.event("stopped", message, reason="user-error")
            self._end("stopped")
        else:
            self._end("failed")
