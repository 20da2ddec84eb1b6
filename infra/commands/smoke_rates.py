"""The smoke run's rows about speed (infra/commands/smoke.py): the measured rate and its MFU
beside the plan's, and the JAX profiler window's trace (train.profile,
docs/operating.md#profile) captured on the stack's hardware."""

from __future__ import annotations

import subprocess

from infra.commands.smoke_job import PROFILE_WINDOW
from infra.jobfit import JobFit

OK, FAILED, UNKNOWN = "ok", "FAILED", "unknown"  # smoke.py's verdicts
PROFILE_CHECK = "profile (train.profile, JAX profiler)"
PLAN_CHECK = "steps/s and MFU vs the plan"


def against_plan(fit: JobFit, speed: float) -> tuple[str, str, str, str]:
    """(check, expected, seen, verdict): the measured steps/s and the MFU it is by the plan's
    formula, beside the plan's (`make plan`'s figures for this job on this accelerator).
    Reported, not judged: the plan's MFU is an assumption."""
    planned = f"{fit.steps_per_second:.2f} steps/s at {fit.mfu:.0%} MFU (plan)"
    if not speed or not fit.steps_per_second:
        return PLAN_CHECK, planned, "not measured", UNKNOWN
    seen = (
        f"{speed:.2f} steps/s at {fit.mfu_at(speed):.1%} MFU "
        f"({speed / fit.steps_per_second:.2f}x the plan)"
    )
    return PLAN_CHECK, planned, seen, OK


def profile_row(
    backend: str, listed: subprocess.CompletedProcess[str] | None, run_root: str
) -> tuple[str, str, str, str]:
    """(check, expected, seen, verdict): the trace `gcloud storage ls <run>/profile/**` found."""
    start, count = PROFILE_WINDOW["start_step"], PROFILE_WINDOW["steps"]
    want = f"steps {start + 1}-{start + count} in profile/"
    if backend != "jax" or listed is None:
        return PROFILE_CHECK, want, f"the {backend} backend: no JAX profiler", UNKNOWN
    traces = [u for u in listed.stdout.split() if u.endswith(".xplane.pb")]
    if not traces:
        return PROFILE_CHECK, want, "no trace written", FAILED
    return PROFILE_CHECK, want, traces[0].removeprefix(f"{run_root}/"), OK
