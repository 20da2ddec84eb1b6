"""The PR comment of a preview (.github/scripts/preview_comment.py): a failed preview still
gets one, naming each violated rule and its resource, or the error; it stays below GitHub's
limit on a comment, and there is one per stack, edited in place (against a stand-in for
GitHub's REST API on 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fake_github import CREDENTIAL, FakeGitHub

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".github" / "scripts" / "preview_comment.py"

# What `pulumi preview --diff --color never` prints for two mandatory violations and an
# advisory one, in the layout of pulumi/pulumi's pkg/backend/display/progress.go
# (printPolicies) and diff.go (renderDiffPolicyViolationEvent; types as tokens.DisplayName).
VIOLATED = """\
Previewing update (v6e-euw4):
    pulumi:pulumi:Stack: (same)
    + gcp:storage:Bucket: (create)
        [urn=urn:pulumi:v6e-euw4::tpu-pretrain::gcp:storage/bucket:Bucket::training-bucket-bucket]
        uniformBucketLevelAccess: false
Policies:
    \u274c tpu-pretrain-guardrails@v0.1.0 (local: policy)
        - [mandatory]  bucket-uniform-access  (gcp:storage:Bucket: training-bucket-bucket)
          Buckets must use uniform bucket-level access:
          set uniformBucketLevelAccess=true.
        - [mandatory] [severity: high]  no-world-ssh  (gcp:compute:Firewall: network-allow-ssh)
          SSH from 0.0.0.0/0 is not allowed.
        - [advisory]  tpu-region
          Values unknown during preview.

Resources:
    + 1 to create
    1 unchanged

Diagnostics:
  pulumi:pulumi:Stack (tpu-pretrain-v6e-euw4):
    error: preview failed
"""


GITHUB_LIMIT = 65_536  # GitHub refuses a longer comment body


def comment(
    stack: str, code: int, output: str, tmp_path: Path, *extra: str
) -> subprocess.CompletedProcess:
    path = tmp_path / "preview.txt"
    path.write_text(output)
    command = ["render", "--stack", stack, "--exit-code", str(code), *extra, str(path)]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *command],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_policy_violation_names_the_rule_and_the_resource(tmp_path):
    result = comment("v6e-euw4", 255, VIOLATED, tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(
        "#### \u274c `pulumi preview` of stack `v6e-euw4`: 2 policy violation(s)"
    )
    assert (
        "| `bucket-uniform-access` | mandatory | `training-bucket-bucket` | `gcp:storage:Bucket` "
        "| Buckets must use uniform bucket-level access: set uniformBucketLevelAccess=true. |"
    ) in text
    assert (
        "| `no-world-ssh` | mandatory | `network-allow-ssh` | `gcp:compute:Firewall` "
        "| SSH from 0.0.0.0/0 is not allowed. |"
    ) in text
    assert (
        "| `tpu-region` | advisory | `(the stack)` | `` | Values unknown during preview. |" in text
    )
    assert "- preview failed" in text
    assert "<details><summary>Full preview output</summary>" in text
    assert "uniformBucketLevelAccess: false" in text


def test_an_error_without_violations_is_named(tmp_path):
    output = (
        "Previewing update (v2-usc1):\n\nDiagnostics:\n  pulumi:pulumi:Stack (x):\n"
        "    error: tpu-pretrain:tpuZone: 'mars-1a' is not a zone in infra/catalogs/tpu.yaml\n"
        "    error: an unhandled error occurred: Program exited with non-zero exit code: 2\n"
    )
    text = comment("v2-usc1", 255, "\x1b[31m" + output + "\x1b[0m", tmp_path).stdout
    assert text.startswith("#### \u274c `pulumi preview` of stack `v2-usc1` failed (exit code 255)")
    assert "- tpu-pretrain:tpuZone: 'mars-1a' is not a zone in infra/catalogs/tpu.yaml\n" in text
    assert "| rule |" not in text
    assert "\x1b[" not in text  # colours stripped


def test_a_passing_preview_is_a_short_success(tmp_path):
    output = "Previewing update (v3-euw4):\nResources:\n    42 unchanged\n"
    text = comment("v3-euw4", 0, output, tmp_path).stdout
    assert text.startswith("#### \u2705 `pulumi preview` of stack `v3-euw4` passed\n")
    assert "Errors:" not in text and "| rule |" not in text


def test_the_comment_ends_with_the_stacks_hidden_marker(tmp_path):
    text = comment("v3-euw4", 0, "Resources:\n    1 unchanged\n", tmp_path).stdout
    assert text.endswith("</details>\n\n<!-- tpu-pretrain preview comment: stack=v3-euw4 -->\n")
    assert text.count("<!--") == 1


def test_a_huge_output_is_trimmed_from_the_front(tmp_path):
    lines = [f"    ~ gcp:compute:Instance: (update) vm-{i} — 대한민국" for i in range(4000)]
    output = "\n".join([*lines, "Resources:", "    + 1 to create"]) + "\n"
    url = "https://github.com/o/r/actions/runs/42"
    text = comment("v3-euw4", 0, output, tmp_path, "--log-url", url).stdout
    assert len(text.encode()) <= 60_000 < GITHUB_LIMIT  # bytes: never fewer than characters
    (notice,) = [line for line in text.splitlines() if line.startswith("… trimmed")]
    shown = text.split(notice + "\n", 1)[1].split("\n```\n", 1)[0].splitlines()
    assert notice == (
        f"… trimmed: the first {4002 - len(shown)} of 4002 lines of the output are not "
        f"shown; the full output is in the job log ({url})."
    )
    assert shown[-2:] == ["Resources:", "    + 1 to create"]  # the end survives
    assert shown[0] in lines  # whole lines, from the front
    assert text.rstrip().endswith(
        "</details>\n\n<!-- tpu-pretrain preview comment: stack=v3-euw4 -->"
    )


def test_thousands_of_violations_and_errors_stay_below_the_limit(tmp_path):
    rows = [
        f"        - [mandatory]  rule-{i}  (gcp:compute:Instance: vm-{i})\n"
        f"          {'a long message ' * 20}"
        for i in range(3000)
    ]
    errors = [f"    error: failure number {i} {'x' * 200}" for i in range(3000)]
    output = "Policies:\n" + "\n".join(rows) + "\nDiagnostics:\n" + "\n".join(errors) + "\n"
    text = comment("v6e-euw4", 255, output, tmp_path).stdout
    assert len(text.encode()) <= 60_000
    assert text.startswith("#### ❌ `pulumi preview` of stack `v6e-euw4`: 3000 policy violation(s)")
    assert "| `rule-0` | mandatory | `vm-0` |" in text and "- failure number 0 " in text
    assert "more violations trimmed: see the job log." in text
    assert "more errors trimmed: see the job log." in text
    assert "… trimmed: the first " in text  # and the output itself


def test_a_missing_output_file_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "render",
            "--stack",
            "s",
            "--exit-code",
            "1",
            str(tmp_path / "no"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: cannot read the preview output ")
    assert len(result.stderr.strip().splitlines()) == 1


# --- one comment per stack: a stand-in for GitHub's REST API ------------------------------
def publish(
    stack: str, body_file: Path, api: str, pr: int = 7, **env: str
) -> subprocess.CompletedProcess:
    command = ["publish", "--stack", stack, "--repo", "owner/repo", "--pr", str(pr)]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *command, str(body_file)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={"PATH": os.environ["PATH"], "GITHUB_API_URL": api, **env},
    )


def _rendered(stack: str, tmp_path: Path, output: str) -> Path:
    path = tmp_path / f"{stack}.md"
    path.write_text(comment(stack, 0, output, tmp_path).stdout)
    return path


def test_publish_creates_one_comment_per_stack_then_edits_it(tmp_path):
    with FakeGitHub(per_page_max=2) as github:
        # Earlier comments: people's, one of them quoting the marker; another stack's.
        for i in range(3):
            github.add(7, f"looks good {i}", FakeGitHub.human)
        github.add(7, "quoting <!-- tpu-pretrain preview comment: stack=a -->", FakeGitHub.human)
        other = github.add(7, "x\n<!-- tpu-pretrain preview comment: stack=b -->", FakeGitHub.bot)
        first = publish("a", _rendered("a", tmp_path, "run 1\n"), github.url, GH_TOKEN=CREDENTIAL)
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith("created ")
        posts = [r for r in github.requests if r[0] == "POST"]
        assert posts == [("POST", "/repos/owner/repo/issues/7/comments")]
        # Every page was read (2 per page here) before deciding there was none.
        assert [r for r in github.requests if r[0] == "GET"] == [
            ("GET", "/repos/owner/repo/issues/7/comments")
        ] * 3
        created = int(first.stdout.split()[1])

        github.requests.clear()
        second = publish("a", _rendered("a", tmp_path, "run 2\n"), github.url, GH_TOKEN=CREDENTIAL)
        assert second.returncode == 0, second.stderr
        assert second.stdout.strip() == f"updated {created}"
        assert github.requests[-1] == ("PATCH", f"/repos/owner/repo/issues/comments/{created}")
        assert not [r for r in github.requests if r[0] == "POST"]
        bodies = {c["id"]: c["body"] for c in github.comments[7]}
        assert len(bodies) == 6  # 4 people's, stack b's, stack a's: still one for a
        assert "run 2" in bodies[created] and "run 1" not in bodies[created]
        assert "quoting" in bodies[created - 2]  # a person's comment with the marker: untouched
        assert bodies[other].startswith("x\n")  # the other stack's: untouched
        assert github.tokens == {f"Bearer {CREDENTIAL}"}


def test_publish_refuses_what_is_not_a_rendered_comment_of_that_stack(tmp_path):
    with FakeGitHub() as github:
        wrong = publish("b", _rendered("a", tmp_path, "x\n"), github.url, GH_TOKEN=CREDENTIAL)
        assert wrong.returncode == 2
        assert wrong.stderr.startswith("error: ") and "is not the rendered comment of stack b" in (
            wrong.stderr
        )
        big = tmp_path / "big.md"
        big.write_text("x" * 70_000 + "\n<!-- tpu-pretrain preview comment: stack=a -->\n")
        too_long = publish("a", big, github.url, GH_TOKEN=CREDENTIAL)
        assert too_long.returncode == 2 and "GitHub takes at most 65536" in too_long.stderr
        no_token = publish("a", _rendered("a", tmp_path, "x\n"), github.url)
        assert no_token.returncode == 2 and "GH_TOKEN is not set" in no_token.stderr
        assert github.requests == []


def test_publish_names_the_api_error(tmp_path):
    with FakeGitHub(repo="other/repo") as github:  # not this repository: 404
        failed = publish("a", _rendered("a", tmp_path, "x\n"), github.url, GH_TOKEN=CREDENTIAL)
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: GitHub API: GET ")
    assert "HTTP 404" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1


COSTS = """\
**What the grant does not pay (stack v6e-euw4): list prices in USD read 2026-12-02**

| item | detail | USD | note |
|---|---|---:|---|
| TPU v6e-8 (spot) | europe-west4-a | paid by the grant (TRC) | TPU time |
| controller VM | e2-standard-4, europe-west4-a | $3.22 / day | 4 vCPU x $0.021811/h |
| **per day** | | **$3.22** | the daily lines' sum |
"""


def test_the_cost_table_comes_before_the_output(tmp_path):
    (tmp_path / "costs.md").write_text(COSTS)
    output = "Previewing update (v6e-euw4):\nResources:\n    42 unchanged\n"
    result = comment("v6e-euw4", 0, output, tmp_path, "--costs", str(tmp_path / "costs.md"))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "| TPU v6e-8 (spot) | europe-west4-a | paid by the grant (TRC) | TPU time |" in text
    assert text.index("**per day**") < text.index("<details><summary>Full preview output")
    without = comment("v6e-euw4", 0, output, tmp_path).stdout
    assert "grant" not in without


def test_an_unreadable_cost_table_is_one_line(tmp_path):
    result = comment("v6e-euw4", 0, "Resources:\n", tmp_path, "--costs", str(tmp_path / "no.md"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot read the cost table ")
    assert result.stderr.count("\n") == 1
