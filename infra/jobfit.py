"""Does the stack's job fit its accelerator? Asked of the payload, before anything exists.

infra/ never imports the payload: their contract includes the payload's command line, so
this runs `python -m payload.plan --job <rendered spec> --accelerator <type> --json` in a
subprocess, with this interpreter and the repository root on PYTHONPATH. The payload's plan
module loads with the standard library, PyYAML and the payload's pure modules only (the
Pulumi program's environment has no TensorFlow, JAX or transformers;
tests/infra/test_jobfit.py checks its import closure in this environment). The plan mirrors
the JAX trainer's layout (payload/plan/estimate.py); its exit status 2 with one line on stderr is a
job that cannot fit (or a spec the payload refuses), which becomes a one-line ConfigError.

`compile_job` (opt-in: `make plan COMPILE=1`, `make smoke ... COMPILE=1`) goes further: the
payload's `tpu-payload compile` of the same rendered spec for the stack's TPU type, run with
the TPU environment's interpreter (its libtpu compiles for the type's topology here, in
minutes; docs/models.md#what-the-compiler-proves-before-renting).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from infra.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
PLAN_COMMAND = (sys.executable, "-m", "payload.plan")
# A large model's compile takes minutes on a laptop (a 1B Llama for v5e:4x4: ~6 min on a
# loaded 2-core machine, docs/performance.md); this is a guard against a hang, not a limit.
COMPILE_TIMEOUT_S = 3600
# The TPU environment's interpreter, relative to the repository (`make venv-tpu-jax`).
TPU_PYTHON = ".venv-tpu-jax/bin/python"


@dataclass(frozen=True)
class JobFit:
    """The plan's verdict in a line for the stack's outputs, and the figures the cost
    estimate sizes the bucket from (infra/commands/costs.py)."""

    summary: str
    parameters: int = 0
    tokens: int = 0  # train.steps x global batch x sequence length
    hours: float = 0.0  # the plan's training time at its MFU
    steps: int = 0  # train.steps
    mfu: float = 0.0  # the MFU the hours assume

    @property
    def steps_per_second(self) -> float:
        """The plan's rate: train.steps over its hours."""
        return self.steps / (self.hours * 3600) if self.hours > 0 else 0.0

    def mfu_at(self, steps_per_second: float) -> float:
        """The MFU of a measured rate by the plan's own formula (model FLOPs per token x
        tokens/s / (chips x peak), payload/plan/estimate.py): linear in the rate."""
        planned = self.steps_per_second
        return self.mfu * steps_per_second / planned if planned > 0 else 0.0


def plan_accelerator(kind: str, accelerator_type: str, gpu_type: str, count: int) -> str:
    """The accelerator as the payload's plan names it: the TPU type, or <gpu type>x<count>."""
    return accelerator_type if kind == "tpu" else f"{gpu_type}x{count}"


def check_job_fits(key: str, spec_json: str, accelerator: str) -> JobFit:
    """The payload's plan of the rendered job spec on `accelerator`; ConfigError (naming
    `key`, the stack setting of the job) when the job cannot fit or the payload refuses it."""
    return _plan(key, spec_json, accelerator)


@cache
def _plan(key: str, spec_json: str, accelerator: str) -> JobFit:
    with tempfile.TemporaryDirectory(prefix="tpu-pretrain-plan-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(spec_json, encoding="utf-8")
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""),
        }
        try:
            result = subprocess.run(
                [*PLAN_COMMAND, "--job", str(job), "--accelerator", accelerator, "--json"],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                check=False,
                cwd=REPO_ROOT,
                env=env,
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(
                f"{key}: the payload's plan (python -m payload.plan) took over {TIMEOUT_S} s"
            ) from None
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if result.returncode != 0:
        last = lines[-1] if lines else f"exit status {result.returncode}"
        raise ConfigError(f"{key}: {last.removeprefix('error: ')}")
    try:
        plan = json.loads(result.stdout)
        layout = next(
            x
            for x in plan["layouts"]
            if (x["sharding"], x["remat"]) == (plan["sharding"], plan["remat"])
        )
        summary = (
            f"{plan['family']} {plan['size']} ({plan['parameters']:,} parameters) fits "
            f"{accelerator}: train.sharding {plan['sharding']}, train.remat {plan['remat']}, "
            f"{layout['total'] / 2**30:.1f} of {plan['budget_bytes'] / 2**30:.1f} GiB per chip, "
            f"{plan['hours']:.1f} h at {plan['mfu']:.0%} MFU"
        )
        return JobFit(
            summary,
            parameters=int(plan["parameters"]),
            tokens=int(plan["steps"]) * int(plan["global_batch_size"]) * int(plan["seq_length"]),
            hours=float(plan["hours"]),
            steps=int(plan["steps"]),
            mfu=float(plan["mfu"]),
        )
    except (ValueError, KeyError, StopIteration) as error:
        raise ConfigError(
            f"{key}: the payload's plan printed no plan this program reads ({error!r})"
        ) from None


def compile_job(spec_json: str, accelerator: str, python: str) -> tuple[int, str]:
    """`python -m payload compile --job <spec> --accelerator <type>` with `python` (an
    interpreter of the TPU environment) and this repository's payload: its report goes to
    this process's stdout as it is printed; returns (its exit status, its last stderr line
    without "error: ", or "" when it printed none). Exit 2 is the payload's own one-line
    refusal: a job that does not fit (with the largest batch that compiles), a GPU type, no
    libtpu."""
    interpreter = Path(python) if Path(python).is_absolute() else REPO_ROOT / python
    if not interpreter.exists():
        return 2, f"{python}: no such interpreter (`make venv-tpu-jax` builds {TPU_PYTHON})"
    with tempfile.TemporaryDirectory(prefix="tpu-pretrain-compile-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(spec_json, encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        command = [str(interpreter), "-m", "payload", "compile", "--job", str(job)]
        try:
            result = subprocess.run(
                [*command, "--accelerator", accelerator],
                stdout=None,
                stderr=subprocess.PIPE,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
                check=False,
                cwd=REPO_ROOT,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return 2, f"tpu-payload compile took over {COMPILE_TIMEOUT_S} s"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if result.returncode not in (0, 2):
        sys.stderr.write(result.stderr)  # a bug's traceback, as the payload printed it
    return result.returncode, lines[-1].removeprefix("error: ") if lines else ""
