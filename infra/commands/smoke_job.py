"""The smoke run's job (infra/commands/smoke.py): stacks/jobs/smoke.yaml under a name of its
own for each run, with the JAX profiler window on a stack whose trainer runs the JAX backend."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE_JOB = "stacks/jobs/smoke.yaml"
# The window the smoke job traces (train.profile, docs/operating.md#profile): steps after the
# compile and the first checkpoint (100), before the second. The TF backend has no JAX
# profiler: its stacks run the job without it.
PROFILE_WINDOW = {"start_step": 150, "steps": 5}


def run_name(now: datetime) -> str:
    """This run's job name: a fresh gs://<bucket>/runs/<name>/ per run (the bucket is kept on
    destroy, and a name used before would find the last run's export marker and status)."""
    return now.strftime("smoke-%Y%m%d-%H%M%S")


def write_run_job(directory: Path, name: str, *, profile: bool = False) -> Path:
    """stacks/jobs/smoke.yaml under this run's name, written next to the run's report; with
    `profile` (a stack whose trainer runs the JAX backend), its train.profile window."""
    template = yaml.safe_load((REPO_ROOT / SMOKE_JOB).read_text(encoding="utf-8"))
    template["name"] = name
    if profile:
        template["train"] = {**template["train"], "profile": dict(PROFILE_WINDOW)}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"job-{name}.yaml"
    path.write_text(yaml.safe_dump(template, sort_keys=False), encoding="utf-8")
    return path
