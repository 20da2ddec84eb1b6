"""The PR comment of a preview (.github/scripts/preview_comment.py): a failed preview still
gets one, naming each violated rule and its resource, or the error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def comment(stack: str, code: int, output: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "preview.txt"
    path.write_text(output)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--stack", stack, "--exit-code", str(code), str(path)],
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
        "    error: tpu-pretrain:tpuZone: 'mars-1a' is not a zone in infra/catalog.yaml\n"
        "    error: an unhandled error occurred: Program exited with non-zero exit code: 2\n"
    )
    text = comment("v2-usc1", 255, "\x1b[31m" + output + "\x1b[0m", tmp_path).stdout
    assert text.startswith("#### \u274c `pulumi preview` of stack `v2-usc1` failed (exit code 255)")
    assert "- tpu-pretrain:tpuZone: 'mars-1a' is not a zone in infra/catalog.yaml\n" in text
    assert "| rule |" not in text
    assert "\x1b[" not in text  # colours stripped


def test_a_passing_preview_is_a_short_success(tmp_path):
    output = "Previewing update (v3-euw4):\nResources:\n    42 unchanged\n"
    text = comment("v3-euw4", 0, output, tmp_path).stdout
    assert text.startswith("#### \u2705 `pulumi preview` of stack `v3-euw4` passed\n")
    assert "Errors:" not in text and "| rule |" not in text


def test_a_huge_output_is_trimmed_from_the_front(tmp_path):
    output = "x" * 100_000 + "\nResources:\n    + 1 to create\n"
    text = comment("v3-euw4", 0, output, tmp_path).stdout
    assert len(text) < 65_536
    assert "\u2026 (trimmed) \u2026" in text and text.rstrip().endswith("```\n</details>")
    assert "+ 1 to create" in text


def test_a_missing_output_file_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--stack", "s", "--exit-code", "1", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: cannot read the preview output ")
    assert len(result.stderr.strip().splitlines()) == 1
