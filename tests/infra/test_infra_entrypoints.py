"""The two ways in: infra/__main__.py (what the Pulumi CLI runs) and
`python -m infra.commands.plan`."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pulumi
import pytest
from harness import run_offline

from infra import wgkeys

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "infra" / "__main__.py"


def _run_main() -> None:
    runpy.run_path(str(MAIN), run_name="__main__")


def test_main_registers_the_same_resources_as_the_harness():
    via_main = run_offline("v4-usc2", entry=_run_main)
    via_harness = run_offline("v4-usc2")
    assert sorted((r.type_, r.name) for r in via_main.resources) == sorted(
        (r.type_, r.name) for r in via_harness.resources
    )
    assert via_main.exports["tpuName"] == "tp-v4-usc2-tpu"


def test_main_reports_config_errors_without_a_traceback():
    # pulumi.RunError is printed by the CLI as the message alone.
    with pytest.raises(pulumi.RunError) as caught:
        run_offline("v4-usc2", {"tpu-pretrain:tpuArchitecture": "node"}, entry=_run_main)
    assert str(caught.value).startswith("tpu-pretrain:tpuArchitecture: 'node' asks for a TPU Node")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infra.commands.plan", *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_prints_resources_scripts_and_job_spec_but_no_secrets():
    result = plan("--stack", "v6e-euw4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    run = run_offline("v6e-euw4")
    custom = [r for r in run.resources if not r.type_.startswith("tpu-pretrain:")]
    # 12 components: the spot stack adds TpuAutoRecovery (preemption watchdog).
    assert f"Stack v6e-euw4: {len(custom)} resources in 12 components" in out
    for resource in custom:
        assert f"{resource.type_} " in out and f" {resource.name} " in out
    assert 'acceleratorType="v6e-8"' in out
    assert 'schedulingConfig={"preemptible":false,"spot":true}' in out
    # The TPU VM's and the controller's loaders, the scripts they run (bucket objects), the
    # hop's startup script, and the watchdog the controller installs.
    assert out.count("#!/bin/bash") == 6
    assert out.count("startup loader, rendered by infra/render/render.py") == 2
    assert "==== watchdog installed by startup-controller-script ====" in out
    assert "==== job pointer gs://tpu-pretrain-test-v6e-euw4-tpu-pretrain/jobs/current.json" in out
    assert "compute tpus tpu-vm create" in out
    assert (
        "==== job spec gs://tpu-pretrain-test-v6e-euw4-tpu-pretrain/jobs/gpt2-small-clm.json" in out
    )
    assert "vpnClientConfig: [secret]" in out
    for seed in [r.outputs["base64"] for r in run.resources if "base64" in r.outputs]:
        assert seed not in out
        assert wgkeys.private_key(seed) not in out


def test_plan_errors_are_one_line_with_exit_2():
    unknown = plan("--stack", "nope")
    assert unknown.returncode == 2
    assert unknown.stderr == (
        "error: --stack 'nope': no stacks/Pulumi.nope.yaml; stacks: a100x4-usc1, l4x2-use1, "
        "t4-usc1, v2-usc1, v3-euw4, v4-32-usc2, v4-usc2, v5e-16-euw4, v5e-euw4, "
        "v6e-euw4\n"
    )
    bad = plan("--stack", "v3-euw4", "--set", "tpu-pretrain:acceleratorType=v5p-8")
    assert bad.returncode == 2
    assert bad.stderr == (
        "error: tpu-pretrain:acceleratorType: 'v5p-8' is not offered in europe-west4-a; "
        "offered there: v2-8, v3-8, v6e-1, v6e-4, v6e-8\n"
    )
    assert bad.stdout == ""


def _fake_tpu_python(tmp_path: Path, code: int, line: str = "") -> Path:
    """An interpreter that records how it was run (`-m payload compile --job J --accelerator
    T`) and the job spec it was given, prints a report line and exits with `code`."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > {tmp_path}/argv\n'
        f'cp "$5" {tmp_path}/job.json\n'
        'echo "job ... on $7: compiled"\n'
        + (f'echo "error: {line}" >&2\n' if line else "")
        + f"exit {code}\n"
    )
    python.chmod(0o755)
    return python


def test_plan_compile_runs_tpu_payload_compile_on_the_rendered_job(tmp_path):
    """`make plan COMPILE=1`: after the plan, the payload's `compile` of the job the stack
    uploads, for the stack's TPU type, with the TPU environment's interpreter."""
    result = plan("--stack", "v6e-euw4", "--compile", str(_fake_tpu_python(tmp_path, 0)))
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:4] == ["-m", "payload", "compile", "--job"] and argv[5:] == [
        "--accelerator",
        "v6e-8",
    ]
    spec = json.loads((tmp_path / "job.json").read_text())
    assert spec["output"].startswith("gs://") and spec["model"]["family"] == "gpt2"
    assert "job ... on v6e-8: compiled" in result.stdout
    assert "compile: gpt2-small-clm for v6e-8 with" in result.stdout


def test_plan_compile_fails_with_the_payloads_line_and_skips_what_it_cannot_compile(tmp_path):
    refused = plan(
        "--stack", "v6e-euw4", "--compile", str(_fake_tpu_python(tmp_path, 2, "does not fit"))
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == "error: compile: does not fit"
    # The TF backend (a v5e stack's auto) and a GPU stack: nothing of the JAX trainer's to
    # compile here, said in a line.
    tf = plan("--stack", "v5e-euw4", "--compile", str(_fake_tpu_python(tmp_path, 2, "no")))
    assert tf.returncode == 0 and "backend; compile builds the JAX trainer's programs" in tf.stdout
    gpu = plan("--stack", "l4x2-use1", "--compile", str(_fake_tpu_python(tmp_path, 2, "no")))
    assert gpu.returncode == 0 and "the GPU compiler needs a GPU (skipped)" in gpu.stdout
