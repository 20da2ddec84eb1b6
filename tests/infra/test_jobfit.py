"""The stack's job must fit its accelerator (infra/jobfit.py runs the payload's plan as a
subprocess, infra never imports the payload): every stack's job fits, a job that cannot is
a one-line config error naming what would fit, before any resource exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import config_error, run_offline, stack_names

ROOT = Path(__file__).resolve().parents[2]
K = "tpu-pretrain:"
TOO_BIG = "tests/infra/data/llama-3b-data.yaml"

CLOSURE = """
import contextlib, io, json, sys
before = set(sys.modules)
import payload.plan.estimate
with contextlib.redirect_stdout(io.StringIO()):
    code = payload.plan.estimate.main(["--job", "stacks/jobs/gpt2-small-clm.yaml", "--accelerator",
    "v6e-8"])
roots = {m.split(".")[0] for m in set(sys.modules) - before}
print(json.dumps([code, sorted(r for r in roots if r not in sys.stdlib_module_names)]))
"""


def test_the_plans_import_closure_loads_here() -> None:
    """payload.plan.estimate loads and plans a job in the Pulumi program's environment (this one)
    with the standard library, PyYAML and pure payload modules only."""
    result = subprocess.run(
        [sys.executable, "-c", CLOSURE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    code, roots = json.loads(result.stdout)
    assert code == 0
    # PyYAML's C loader (_yaml) is Cython-built: it registers cython_runtime and _cython_<ver>.
    cython = {r for r in roots if r == "cython_runtime" or r.startswith("_cython_")}
    assert set(roots) - cython <= {"payload", "yaml", "_yaml"}


@pytest.mark.parametrize("stack", stack_names())
def test_every_stacks_job_fits(stack: str) -> None:
    run = run_offline(stack)
    assert " fits " in run.exports["jobPlan"], run.exports["jobPlan"]


def test_a_job_that_cannot_fit_is_refused_before_any_resource() -> None:
    message = config_error("v5e-euw4", {K + "job": TOO_BIG})
    assert message.startswith(
        f"{K}job: {TOO_BIG!r}: plan: llama 3b (2.92B parameters) does not fit v5litepod-8 "
        "with train.sharding: data"
    ), message
    assert "would fit: train.sharding: fsdp" in message


def test_a_gpu_stack_is_planned_per_gpu() -> None:
    run = run_offline("l4x2-use1")
    assert "fits nvidia-l4x2" in run.exports["jobPlan"]
