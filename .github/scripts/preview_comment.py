#!/usr/bin/env python3
"""Turns the text output of `pulumi preview` into a pull-request comment (Markdown), and keeps
ONE such comment per stack on the pull request, edited in place on every push. A preview that
failed gets one too: pulumi/actions comments only after a successful command, so a policy
violation or an error would otherwise leave the pull request without a word.

    preview_comment.py render --stack v6e-euw4 --exit-code 255 [--log-url URL] \
        [--costs costs.md] preview.txt > comment.md
    preview_comment.py publish --stack v6e-euw4 --repo owner/name --pr 7 comment.md

`render` names every policy violation (rule, enforcement level, resource type and name,
message) and every error line, then shows the whole output, folded, trimmed from the front
with a line that says so when the comment would pass GitHub's limit on a comment body
(65,536 characters; measured here in UTF-8 bytes, which are never fewer). It ends with a
hidden marker naming the stack. `--costs` adds what the grant does not pay above the output:
the Markdown table of `python -m infra.commands.costs --markdown` (docs/operating.md, "What
the grant does not pay"), as the workflow's Costs step wrote it. The violation lines follow
the Pulumi CLI's own rendering (pulumi/pulumi pkg/backend/display/progress.go printPolicies
and diff.go renderDiffPolicyViolationEvent):

    Policies:
        ❌ <pack>@v<version> (local: <path>)
            - [mandatory]  <policy>  (<type>: <resource name>)
              <message lines>

`publish` (GH_TOKEN; GITHUB_API_URL, default https://api.github.com) lists the pull request's
comments (GitHub REST "List issue comments", paginated), edits the first one a bot wrote that
carries this stack's marker ("Update an issue comment") and creates one only when there is
none ("Create an issue comment"): docs.github.com/en/rest/issues/comments.

Standard library only: runs on the runner's system Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

GITHUB_LIMIT = 65_536  # GitHub refuses a comment body longer than this
MAX_COMMENT = 60_000  # what render() writes at most, in UTF-8 bytes: a margin below the limit
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


def marker(stack: str) -> str:
    """The hidden line that identifies this stack's comment (Markdown does not show it)."""
    return f"<!-- tpu-pretrain preview comment: stack={stack} -->"


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _fit(lines: list[str], budget: int, what: str) -> list[str]:
    """The first lines that fit in `budget` bytes, and a line naming how many were left out."""
    kept: list[str] = []
    used = 0
    for index, line in enumerate(lines):
        if used + _size(line) + 1 > budget:
            left = len(lines) - index
            return [*kept, f"… {left} more {what} trimmed: see the job log."]
        kept.append(line)
        used += _size(line) + 1
    return kept


def render(stack: str, exit_code: int, output: str, log_url: str = "", costs: str = "") -> str:
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
    log = f"the job log ({log_url})" if log_url else "the job log (the Preview step)"
    # The table and the error list are what a reader needs: they get up to half the budget
    # (thousands of violations would otherwise crowd out the output); the output the rest.
    parts = [headline, ""]
    if found:
        rows = [
            f"| `{_cell(v.policy)}` | {v.level} | `{_cell(v.resource)}` | "
            f"`{_cell(v.resource_type)}` | {_cell(v.message)} |"
            for v in found
        ]
        parts += ["| rule | level | resource | type | message |", "|---|---|---|---|---|"]
        parts += _fit(rows, MAX_COMMENT // 4, "violations")
        parts.append("")
    problems = errors(text) if failed else []
    if problems:
        parts.append("Errors:")
        parts += _fit([f"- {_cell(problem)}" for problem in problems], MAX_COMMENT // 4, "errors")
        parts.append("")
    if failed and not found and not problems:
        parts += ["The preview failed without a policy violation or an error line; see below.", ""]
    if costs.strip():
        table = ANSI.sub("", costs).strip().replace("```", "`\u200b``").splitlines()
        parts += _fit(table, MAX_COMMENT // 8, "cost lines")
        parts.append("")
    head = "\n".join(parts) + "\n"
    opening = ["<details><summary>Full preview output</summary>", "", "```"]
    closing = ["```", "</details>", "", marker(stack)]
    frame = _size(head) + _size("\n".join(opening + closing)) + 2
    body = text.strip().replace("```", "`\u200b``")
    room = MAX_COMMENT - frame
    if _size(body) > room:
        lines = body.count("\n") + 1
        notice = (
            "\u2026 trimmed: the first {} of "
            f"{lines} lines of the output are not shown; the full output is in {log}."
        )
        room -= _size(notice.format(lines)) + 1
        tail = body.encode("utf-8")[-room:].decode("utf-8", errors="ignore")
        tail = tail.split("\n", 1)[1] if "\n" in tail else tail  # from a whole line
        body = notice.format(lines - (tail.count("\n") + 1)) + "\n" + tail
    return head + "\n".join([*opening, body, *closing]) + "\n"


class GitHubError(Exception):
    pass


def _request(method: str, url: str, token: str, payload: dict | None = None):
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    # main() accepts only an http(s) API address: no file: or other scheme reaches here.
    request = urllib.request.Request(url, data=data, method=method)  # noqa: S310
    request.add_header("Accept", "application/vnd.github+json")
    request.add_header("X-GitHub-Api-Version", "2022-11-28")
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            return json.loads(response.read() or b"null"), response.headers.get("Link", "")
    except urllib.error.HTTPError as error:
        detail = " ".join(error.read().decode("utf-8", errors="replace").split())[:500]
        raise GitHubError(f"{method} {url}: HTTP {error.code}: {detail}") from None
    except urllib.error.URLError as error:
        raise GitHubError(f"{method} {url}: {error.reason}") from None


def _next_page(link: str) -> str | None:
    for part in link.split(","):
        match = re.match(r'\s*<([^>]+)>;\s*rel="next"', part)
        if match:
            return match[1]
    return None


def publish(api: str, token: str, *, repo: str, pr: int, stack: str, body: str) -> str:
    """Edit this stack's comment on the pull request, or create it: 'updated <id>' / 'created
    <id>'."""
    tag = marker(stack)
    url: str | None = f"{api}/repos/{repo}/issues/{pr}/comments?per_page=100"
    while url:
        comments, link = _request("GET", url, token)
        for comment in comments:
            user = comment.get("user") or {}
            if user.get("type") == "Bot" and tag in (comment.get("body") or ""):
                _request(
                    "PATCH",
                    f"{api}/repos/{repo}/issues/comments/{comment['id']}",
                    token,
                    {"body": body},
                )
                return f"updated {comment['id']}"
        url = _next_page(link)
    created, _ = _request("POST", f"{api}/repos/{repo}/issues/{pr}/comments", token, {"body": body})
    return f"created {created['id']}"


def _publish_main(args: argparse.Namespace, text: str) -> int:
    if marker(args.stack) not in text:
        print(
            f"error: {args.comment} is not the rendered comment of stack {args.stack} "
            f"(no line {marker(args.stack)})",
            file=sys.stderr,
        )
        return 2
    if _size(text) > GITHUB_LIMIT:
        print(
            f"error: {args.comment} has {_size(text)} bytes; GitHub takes at most {GITHUB_LIMIT}",
            file=sys.stderr,
        )
        return 2
    token = os.environ.get("GH_TOKEN") or os.environ.get("GITHUB_TOKEN")
    if not token:
        print("error: GH_TOKEN is not set (the workflow passes github.token)", file=sys.stderr)
        return 2
    api = os.environ.get("GITHUB_API_URL", "https://api.github.com").rstrip("/")
    if not api.startswith(("https://", "http://")):
        print(f"error: GITHUB_API_URL {api!r} is not an http(s) address", file=sys.stderr)
        return 2
    try:
        print(publish(api, token, repo=args.repo, pr=args.pr, stack=args.stack, body=text))
    except GitHubError as error:
        print(f"error: GitHub API: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render_args = commands.add_parser("render", help="the comment, on stdout")
    render_args.add_argument("--stack", required=True)
    render_args.add_argument("--exit-code", required=True, type=int)
    render_args.add_argument("--log-url", default="", help="where the full output is")
    render_args.add_argument(
        "--costs", type=Path, help="the cost table (python -m infra.commands.costs --markdown)"
    )
    render_args.add_argument("output", type=Path, help="the captured output of pulumi preview")
    publish_args = commands.add_parser("publish", help="create or edit the stack's PR comment")
    publish_args.add_argument("--stack", required=True)
    publish_args.add_argument("--repo", required=True, help="owner/name")
    publish_args.add_argument("--pr", required=True, type=int)
    publish_args.add_argument("comment", type=Path, help="the rendered comment")
    args = parser.parse_args(argv)
    path = args.output if args.command == "render" else args.comment
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        what = "the preview output" if args.command == "render" else "the comment"
        print(f"error: cannot read {what} {path}: {error}", file=sys.stderr)
        return 2
    if args.command == "publish":
        return _publish_main(args, text)
    costs = ""
    if args.costs is not None:
        try:
            costs = args.costs.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            print(f"error: cannot read the cost table {args.costs}: {error}", file=sys.stderr)
            return 2
    sys.stdout.write(render(args.stack, args.exit_code, text, args.log_url, costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
