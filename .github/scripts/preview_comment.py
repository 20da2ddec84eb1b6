#!/usr/bin/env python3
"""Turns the text output of `pulumi preview` into a pull-request comment (Markdown on
stdout), for a preview that passed and, above all, for one that failed: pulumi/actions
comments only after a successful command, so a policy violation or an error would otherwise
leave the pull request without a word.

    preview_comment.py --stack v6e-euw4 --exit-code 255 preview.txt > comment.md

The comment names every policy violation (rule, enforcement level, resource type and name,
message) and every error line, then shows the whole output, folded. The violation lines
follow the Pulumi CLI's own rendering (pulumi/pulumi pkg/backend/display/progress.go
printPolicies and diff.go renderDiffPolicyViolationEvent):

    Policies:
        ❌ <pack>@v<version> (local: <path>)
            - [mandatory]  <policy>  (<type>: <resource name>)
              <message lines>

Standard library only: runs on the runner's system Python.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_COMMENT = 60_000  # GitHub refuses comments over 65,536 characters
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
VIOLATION = re.compile(
    r"^(?P<indent>\s*)- \[(?P<level>mandatory|advisory|disabled)\]"
    r"(?: \[severity: (?P<severity>[^\]]+)\])?\s+(?P<policy>\S+)"
    r"(?:\s+\((?P<type>[^():\s]+(?::[^():\s]+)*): (?P<resource>.+)\))?\s*$"
)
ERROR = re.compile(r"^\s*error: (?P<message>.+)$")


@dataclass(frozen=True)
class Violation:
    level: str
    policy: str
    resource_type: str
    resource: str
    message: str


def violations(text: str) -> list[Violation]:
    found = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = VIOLATION.match(line)
        if not match:
            continue
        message = []
        depth = len(match["indent"]) + 2  # the message is indented under the "- "
        for follow in lines[index + 1 :]:
            if not follow.strip() or len(follow) - len(follow.lstrip()) < depth:
                break
            if VIOLATION.match(follow):
                break
            message.append(follow.strip())
        found.append(
            Violation(
                level=match["level"],
                policy=match["policy"],
                resource_type=match["type"] or "",
                resource=match["resource"] or "(the stack)",
                message=" ".join(message),
            )
        )
    return found


def errors(text: str) -> list[str]:
    seen: list[str] = []
    for line in text.splitlines():
        match = ERROR.match(line)
        if match and match["message"] not in seen:
            seen.append(match["message"])
    return seen


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(stack: str, exit_code: int, output: str) -> str:
    text = ANSI.sub("", output)
    found = violations(text)
    failed = exit_code != 0
    mandatory = [v for v in found if v.level == "mandatory"]
    if not failed:
        headline = f"#### ✅ `pulumi preview` of stack `{stack}` passed"
    elif mandatory:
        headline = (
            f"#### ❌ `pulumi preview` of stack `{stack}`: {len(mandatory)} policy violation(s)"
        )
    else:
        headline = f"#### ❌ `pulumi preview` of stack `{stack}` failed (exit code {exit_code})"
    parts = [headline, ""]
    if found:
        parts += [
            "| rule | level | resource | type | message |",
            "|---|---|---|---|---|",
        ]
        parts += [
            f"| `{_cell(v.policy)}` | {v.level} | `{_cell(v.resource)}` | "
            f"`{_cell(v.resource_type)}` | {_cell(v.message)} |"
            for v in found
        ]
        parts.append("")
    problems = errors(text) if failed else []
    if problems:
        parts.append("Errors:")
        parts += [f"- {_cell(problem)}" for problem in problems]
        parts.append("")
    if failed and not found and not problems:
        parts += ["The preview failed without a policy violation or an error line; see below.", ""]
    body = text.strip()
    if len(body) > MAX_COMMENT:
        body = "… (trimmed) …\n" + body[-MAX_COMMENT:]
    parts += [
        "<details><summary>Full preview output</summary>",
        "",
        "```",
        body.replace("```", "`\u200b``"),
        "```",
        "</details>",
    ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True)
    parser.add_argument("--exit-code", required=True, type=int)
    parser.add_argument("output", type=Path, help="the captured output of pulumi preview")
    args = parser.parse_args(argv)
    try:
        output = args.output.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        print(f"error: cannot read the preview output {args.output}: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(args.stack, args.exit_code, output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
