"""docs/llama-recipe.md as a user follows it: every local command on the page runs as written
and exits 0, on a tiny shape; the output pasted on the page is what its command prints; the
local job is the stack's template with an output and local paths, nothing else.

What "as written" means here: the page's fenced `sh` lines, each run by bash in a copy of the
checkout's layout (a temporary directory holding examples/, stacks/jobs/ and links to the
environments) whose recipe jobs are shrunk by the size knobs the page names (SIZE_KNOBS) and
nothing else; `make plan` runs in the checkout itself (the Makefile and the real stack file),
with `-o` on the environments' stamps so that make uses them as they are. The `python` blocks
run in the PyTorch environment (.venv-pt) from the same directory. A command that reaches
GCP (pulumi, gcloud, a gs:// path, make preview or smoke) is not run; a line that is neither
fails the test, so a new command on the page is sorted on purpose."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pt_runner import require_pt_python

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "llama-recipe.md"
TEMPLATES = ("stacks/jobs/llama-125m-clm.yaml", "stacks/jobs/llama-1b-clm.yaml")
LOCAL_JOB = "examples/llama-125m.yaml"
# The size knobs the page names; the tiny shape is these and nothing else.
SIZE_KNOBS: dict[str, Any] = {
    "model.size": "tiny",
    "data.seq_length": 128,
    "tokenizer.vocab_size": 512,
    "train.global_batch_size": 32,
    "train.steps": 20,
    "train.warmup_steps": 2,
}
LOCAL = ("tpu-payload ", ".venv-tpu-jax/bin/tpu-payload ", "make plan ")
CLOUD = ("pulumi ", "gcloud ", "sudo ", "make preview ", "make smoke ")
# The environments' stamps: make uses the environments as they are (tests/payload runs where
# `make test` has built them; a make here must not rebuild one under another test).
STAMPS = (".venv-infra/.installed", ".venv-tpu-jax/.installed")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
OUTPUT_OF = re.compile(
    r"^<!-- output of: (.+?) -->\n```text\n(.*?)^```\n", re.MULTILINE | re.DOTALL
)


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def commands(text: str) -> list[str]:
    """Every command of the page's sh blocks, comments dropped, continuations joined."""
    found = []
    for body in blocks(text, "sh"):
        for raw in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", raw).strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def kind(command: str) -> str:
    """local (the test runs it), cloud (it reaches GCP) or unknown."""
    if command.startswith(CLOUD) or "$(pulumi" in command or "gs://" in command:
        return "cloud"
    if command.startswith(LOCAL):
        return "local"
    return "unknown"


def shrink(document: dict[str, Any]) -> dict[str, Any]:
    shrunk = yaml.safe_load(yaml.safe_dump(document))
    for dotted, value in SIZE_KNOBS.items():
        section, key = dotted.split(".")
        shrunk[section][key] = value
    return shrunk


def _load(path: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / path).read_text(encoding="utf-8"))


def test_every_command_on_the_page_is_local_or_cloud() -> None:
    text = PAGE.read_text(encoding="utf-8")
    found = commands(text)
    assert [c for c in found if kind(c) == "unknown"] == []
    local = [c for c in found if kind(c) == "local"]
    verbs = [c.split()[1] for c in local if "tpu-payload" in c.split()[0]]
    assert sorted(set(verbs)) == [
        "compile",
        "encode",
        "export",
        "plan",
        "tokenizer",
        "train",
        "validate",
    ]
    assert any(c.startswith("make plan STACK=") for c in local)
    assert blocks(text, "python"), "the page loads and generates in Python"
    for dotted, value in SIZE_KNOBS.items():
        assert f"`{dotted}: {value}`" in text, f"the page does not name the size knob {dotted}"


def test_the_local_job_is_the_template_with_an_output_and_local_paths() -> None:
    local, template = _load(LOCAL_JOB), _load(TEMPLATES[0])
    for document in (local, template):
        for key in ("name", "output", "corpus"):
            document.pop(key, None)
    assert local == template


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_recipe_job_plans_at_20_tokens_a_parameter(template: str) -> None:
    """The recipe's budget: steps x batch x length within 2% of 20 x the parameters, and a
    warm-up of 1% of the steps (rounded to tens)."""
    from payload.plan import estimate

    job = estimate.load_job(str(REPO / template))
    plan = estimate.plan_job(job, estimate.accelerator("v5litepod-16"))
    tokens = job.train.steps * job.train.global_batch_size * job.data.seq_length
    assert abs(tokens / (20 * plan.parameters) - 1) < 0.02, (tokens, plan.parameters)
    assert abs(job.train.warmup_steps - job.train.steps / 100) <= 5, job.train.warmup_steps


def test_the_pasted_output_is_the_commands() -> None:
    pasted = OUTPUT_OF.findall(PAGE.read_text(encoding="utf-8"))
    assert pasted, "the page pastes no command output"
    for command, expected in pasted:
        assert kind(command) == "local" and command.startswith("tpu-payload plan "), command
        done = subprocess.run(
            [str(REPO / ".venv" / "bin" / "tpu-payload"), *shlex.split(command)[1:]],
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        # The plan's "ETA if it started now" is the clock's: the page pastes one such time.
        now = re.compile(r"^(ETA if it started now: )\S+", re.MULTILINE)
        printed, pasted_at = (
            now.sub(r"\1<now + time>", done.stdout),
            now.sub(r"\1<now + time>", expected),
        )
        assert printed == pasted_at, f"{command} now prints:\n{done.stdout}"
        assert now.search(expected) is None or now.search(done.stdout), done.stdout


def _checkout_copy(root: Path) -> Path:
    """The layout the page's commands name, with the recipe jobs shrunk."""
    (root / "stacks" / "jobs").mkdir(parents=True)
    (root / "examples").mkdir()
    (root / "examples" / "corpus").symlink_to(REPO / "examples" / "corpus")
    for path in (*TEMPLATES, LOCAL_JOB):
        (root / path).write_text(yaml.safe_dump(shrink(_load(path))), encoding="utf-8")
    for environment in (".venv", ".venv-tpu-jax"):
        (root / environment).symlink_to(REPO / environment)
    return root


def _tpu_environment() -> None:
    python = REPO / ".venv-tpu-jax" / "bin" / "python"
    if not python.exists():
        pytest.fail("the recipe's compile needs .venv-tpu-jax: `make venv-tpu-jax` builds it")


def _infra_environment() -> None:
    if not (REPO / ".venv-infra" / "bin" / "python").exists():
        if os.environ.get("CI"):
            pytest.fail("CI must run the recipe's make plan: build .venv-infra (make venv-infra)")
        pytest.skip("no .venv-infra for the recipe's make plan: `make venv-infra` builds it")


@pytest.mark.slow
def test_every_local_command_runs_as_written_on_a_tiny_shape(tmp_path: Path) -> None:
    text = PAGE.read_text(encoding="utf-8")
    local = [c for c in commands(text) if kind(c) == "local"]
    _tpu_environment()
    _infra_environment()
    pt_python = require_pt_python()
    checkout = _checkout_copy(tmp_path / "checkout")
    env = {
        **os.environ,
        "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(REPO),
    }
    # The TPU compiler's own settings, as tests/payload/test_tpu_compile.py gives it.
    compiler_env = {
        k: v for k, v in env.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")
    }
    for command in local:
        if command.startswith("make "):
            make = ["make", "--no-print-directory", *(f"-o{stamp}" for stamp in STAMPS)]
            argv, cwd = make + shlex.split(command)[1:], REPO
        else:
            argv, cwd = ["bash", "-c", command], checkout
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            cwd=cwd,
            env=compiler_env if " compile " in command else env,
            timeout=1800,
        )
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-3000:]}"
    export = checkout / "runs" / "llama-125m" / "export"
    assert (export / "config.json").exists()
    for script in blocks(text, "python"):
        done = subprocess.run(
            [str(pt_python), "-c", script],
            capture_output=True,
            text=True,
            check=False,
            cwd=checkout,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("The TPU"), done.stdout
