"""What `make smoke` says of the run's speed: steps/s and MFU measured on the stack's hardware
beside the plan's, and one profile window captured (infra/commands/smoke.py calls this).

The plan is the payload's (`python -m payload.plan --job <the smoke job as rendered> --accelerator
<type> --json`, as infra/jobfit.py runs it: infra never imports the payload). Its hours are
``train.steps x global batch x seq_length x FLOPs per token / (chips x peak x MFU)``
(payload/plan/estimate.py), so the plan's steps/s is ``train.steps / (hours x 3600)`` and the
run's MFU is its measured steps/s (status.json's train metrics) times the same FLOPs per step
over the chips' peak. A tiny model is far below a large one's MFU: the figures are recorded
(ok), never judged against the plan's assumption.

The profile window (`train.profile`, JAX backend only: the TF backend refuses it) is added to
the run's copy of the smoke job when the stack's backend is jax; the verdict lists what the
trainer wrote under runs/<job>/profile/ (docs/first-real-run.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from infra import jobfit, jobspec
from infra.config.types import GpuConfig, StackConfig

# After the warm-up (30 steps), the first log lines and the step-100 checkpoint of
# stacks/jobs/smoke.yaml (300 steps): ten steps of steady training.
PROFILE_WINDOW = {"start_step": 151, "steps": 10}
OK, FAILED, UNKNOWN = "ok", "FAILED", "unknown"
Row = tuple[str, str, str, str]  # check, expected, seen, verdict (smoke.Report.add)


def add_profile(job_file: Path, backend: str) -> bool:
    """Add PROFILE_WINDOW to the run's job file when `backend` (the stack's) is jax."""
    if backend != "jax":
        return False
    job = yaml.safe_load(job_file.read_text(encoding="utf-8"))
    job.setdefault("train", {})["profile"] = dict(PROFILE_WINDOW)
    job_file.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return True


@dataclass(frozen=True)
class Speed:
    """The stack's plan of the smoke job, and the rows that put the run beside it."""

    spec_json: str
    accelerator: str
    backend: str

    @classmethod
    def of(cls, cfg: StackConfig) -> Speed:
        spec = jobspec.render_job_spec(jobspec.load_template(cfg.job_file), cfg.bucket.name)
        spec.get("data", {}).pop("runner", None)
        spec.get("data", {}).pop("beam", None)
        if cfg.backend == "tf":  # as infra/config/job.py check_job_fits plans a TF job
            spec["train"] = {**spec["train"], "sharding": "data"}
        acc = cfg.accelerator
        if isinstance(acc, GpuConfig):
            name = jobfit.plan_accelerator("gpu", "", acc.gpu_type, acc.count)
        else:
            name = jobfit.plan_accelerator("tpu", acc.accelerator_type, "", 1)
        return cls(jobspec.to_json(spec), name, cfg.backend)

    def rows(self, status: Mapping[str, Any], profile_files: list[str]) -> list[Row]:
        metrics = (status.get("stages", {}).get("train", {}) or {}).get("metrics", {})
        plan = plan_of(self.spec_json, self.accelerator)
        speed = speed_rows(plan, metrics.get("steps_per_second"))
        return [*speed, profile_row(self.backend, profile_files)]


def speed_rows(plan: Mapping[str, Any] | None, measured: float | None) -> list[Row]:
    """steps/s and MFU, measured beside the plan's."""
    if plan is None:
        seen = str(measured)
        return [("steps/s", "(plan not available)", seen, OK if measured else UNKNOWN)]
    acc = plan["accelerator"]
    step_flops = plan["global_batch_size"] * plan["seq_length"] * plan["flops_per_token"]
    planned = plan["steps"] / (plan["hours"] * 3600)
    expected_speed = f"{planned:.2f} (plan, at {plan['mfu']:.0%} MFU)"
    if not measured:
        return [("steps/s", expected_speed, "not recorded", UNKNOWN),
                ("MFU", f"{plan['mfu']:.0%} (plan)", "not recorded", UNKNOWN)]  # fmt: skip
    mfu = measured * step_flops / (acc["chips"] * acc["peak_flops"])
    return [
        ("steps/s", expected_speed, f"{measured:.2f} ({measured / planned:.0%} of plan)", OK),
        ("MFU", f"{plan['mfu']:.0%} (plan)", f"{mfu:.2%}", OK),
    ]


def profile_row(backend: str, files: list[str]) -> Row:
    window = (
        PROFILE_WINDOW["start_step"],
        PROFILE_WINDOW["start_step"] + PROFILE_WINDOW["steps"] - 1,
    )
    if backend != "jax":
        return ("profile", "(JAX backend only)", f"not taken: the stack trains on {backend}", OK)
    traces = [f for f in files if f.endswith(".xplane.pb")]
    expected = f"steps {window[0]}-{window[1]} in profile/"
    if not traces:
        return ("profile", expected, "no .xplane.pb written", FAILED)
    names = ", ".join(sorted(f.rsplit("/", 1)[-1] for f in traces))
    return ("profile", expected, f"{len(traces)} host trace(s): {names}", OK)


def profile_files(
    run_root: str, gcloud: Callable[..., subprocess.CompletedProcess[str]]
) -> list[str]:
    listed = gcloud("storage", "ls", f"{run_root}/profile/**")
    return listed.stdout.split() if listed.returncode == 0 else []


@cache
def plan_of(spec_json: str, accelerator: str) -> dict[str, Any] | None:
    """The payload's plan as JSON (None when it printed none: the row says so)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(jobfit.REPO_ROOT), os.environ.get("PYTHONPATH")) if p
    )}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tpu-pretrain-smoke-plan-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(spec_json, encoding="utf-8")
        result = subprocess.run(
            [*jobfit.PLAN_COMMAND, "--job", str(job), "--accelerator", accelerator, "--json"],
            capture_output=True, text=True, timeout=jobfit.TIMEOUT_S, check=False,
            cwd=jobfit.REPO_ROOT, env=env,
        )  # fmt: skip
    try:
        plan = json.loads(result.stdout) if result.returncode == 0 else None
    except ValueError:
        return None
    return plan if isinstance(plan, dict) else None
