"""When a run ends, against the grant's end: tokens done of train.steps x global batch x
sequence length, at a rate, and the time that leaves.

One estimate for two callers: the trainer (payload/training/report.py, at each log line, at
the rate it measures: status.json's ``eta``, the status page's progress bar) and
``tpu-payload plan`` (payload/plan/estimate.py, before anything is created, at the rate of
the plan's hours). The grant's end is the job's ``grant_ends`` (the stack's
``tpu-pretrain:grantEnds``), a date: the grant is taken to last to the end of that day, UTC.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import date, datetime, timedelta, timezone
from typing import Any


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def grant_end(grant_ends: str | None) -> datetime | None:
    """The grant's last moment: the end of its date (YYYY-MM-DD), UTC."""
    if not grant_ends:
        return None
    day = date.fromisoformat(grant_ends)
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1)


@dataclass(frozen=True)
class Eta:
    tokens_done: int
    tokens_total: int
    tokens_per_s: float | None
    remaining_s: float | None
    eta: str | None
    grant_ends: str | None
    past_grant: bool
    warning: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    *,
    step: int,
    steps: int,
    tokens_per_step: int,
    tokens_per_s: float | None,
    now: datetime,
    grant_ends: str | None = None,
) -> Eta:
    """The estimate at `step` of `steps`, at `tokens_per_s` (None or 0: not measured yet,
    no ETA)."""
    total = steps * tokens_per_step
    done = min(step, steps) * tokens_per_step
    remaining = eta = None
    if done >= total:
        remaining, eta = 0.0, now
    elif tokens_per_s and tokens_per_s > 0:
        remaining = (total - done) / tokens_per_s
        eta = now + timedelta(seconds=remaining)
    end = grant_end(grant_ends)
    past = bool(end is not None and eta is not None and eta > end)
    warning = None
    if past and end is not None and eta is not None:
        late = (eta - end).total_seconds()
        warning = (
            f"at {tokens_per_s:,.0f} tokens/s the run ends {_iso(eta)}, {late / 3600:,.1f} h "
            f"after the grant's end ({_iso(end)}): shorten train.steps, or ask for an extension"
        )
    return Eta(
        tokens_done=done,
        tokens_total=total,
        tokens_per_s=None if tokens_per_s is None else round(float(tokens_per_s), 3),
        remaining_s=None if remaining is None else round(remaining, 1),
        eta=None if eta is None else _iso(eta),
        grant_ends=None if end is None else _iso(end),
        past_grant=past,
        warning=warning,
    )


def plan_text(estimated: Eta) -> str:
    """The plan's lines about the ETA (``tpu-payload plan``)."""
    hours = (estimated.remaining_s or 0.0) / 3600
    lines = [
        f"ETA if it started now: {estimated.eta} ({hours:,.1f} hours at "
        f"{estimated.tokens_per_s or 0:,.0f} tokens/s)"
    ]
    if estimated.grant_ends:
        lines.append(f"grant ends {estimated.grant_ends}")
    if estimated.warning:
        lines.append(f"warning: {estimated.warning}")
    return "\n".join(lines) + "\n"


def of_plan(plan: Any, grant_ends: str | None, now: datetime | None = None) -> Eta:
    """The estimate before anything is created (``tpu-payload plan``): the plan's hours
    (payload/plan/estimate.py Plan) for the whole run, from now."""
    tokens_per_step = plan.global_batch_size * plan.seq_length
    hours = float(plan.hours)
    return estimate(
        step=0,
        steps=plan.steps,
        tokens_per_step=tokens_per_step,
        tokens_per_s=plan.steps * tokens_per_step / (hours * 3600) if hours > 0 else None,
        now=now or datetime.now(timezone.utc),
        grant_ends=grant_ends,
    )
