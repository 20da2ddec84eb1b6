"""Stand-ins for GitHub: its REST API on 127.0.0.1 (the issue comments of one repository;
test_preview_comment.py, test_workflows.py), and the OIDC token claims it mints for a job
(oidc_claims; test_bootstrap.py runs them through the bootstrap's Workload Identity
provider)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

CREDENTIAL = "test-credential"  # what the stand-in API expects as the bearer token


def oidc_claims(
    repository: str,
    workflow: str,
    event: str,
    ref: str,
    *,
    repository_id: str,
    owner_id: str,
    environment: str | None = None,
) -> dict[str, str]:
    """The claims of the OIDC token GitHub mints for a job of `workflow` (a path such as
    ".github/workflows/preview.yml") run by `event` at `ref`, as GitHub's "OIDC token claims"
    reference describes them: the subject names the environment of a job that has one, else
    `pull_request` for a pull request's run, else the ref; `workflow_ref` is
    "<repository>/<workflow>@<ref>", and so is `job_workflow_ref` for a job that calls no
    reusable workflow."""
    if environment is not None:
        subject = f"repo:{repository}:environment:{environment}"
    elif event == "pull_request":
        subject = f"repo:{repository}:pull_request"
    else:
        subject = f"repo:{repository}:ref:{ref}"
    claims = {
        "iss": "https://token.actions.githubusercontent.com",
        "sub": subject,
        "repository": repository,
        "repository_id": repository_id,
        "repository_owner": repository.split("/", maxsplit=1)[0],
        "repository_owner_id": owner_id,
        "event_name": event,
        "ref": ref,
        "ref_type": "branch",
        "workflow_ref": f"{repository}/{workflow}@{ref}",
        "job_workflow_ref": f"{repository}/{workflow}@{ref}",
    }
    if environment is not None:
        claims["environment"] = environment
    return claims


class FakeGitHub:
    """Issue comments of one repository, served as GitHub's REST API serves them (List issue
    comments with per_page and a Link rel="next" header, Create, Update an issue comment);
    every request is recorded as (method, path)."""

    def __init__(self, repo: str = "owner/repo", per_page_max: int = 100) -> None:
        self.repo = repo
        self.per_page_max = per_page_max
        self.comments: dict[int, list[dict]] = {}
        self.requests: list[tuple[str, str]] = []
        self.tokens: set[str] = set()
        self._next_id = 1000
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, payload, link: str = "") -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if link:
                    self.send_header("Link", link)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                fake.requests.append((method, url.path))
                fake.tokens.add(self.headers.get("Authorization", ""))
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                prefix = f"/repos/{fake.repo}/issues/"
                rest = url.path.removeprefix(prefix).split("/")
                if not url.path.startswith(prefix):
                    return self._send(404, {"message": "Not Found"})
                if len(rest) == 2 and rest[1] == "comments" and method == "GET":
                    query = parse_qs(url.query)
                    per_page = min(int(query.get("per_page", ["30"])[0]), fake.per_page_max)
                    page = int(query.get("page", ["1"])[0])
                    items = fake.comments.get(int(rest[0]), [])
                    chunk = items[(page - 1) * per_page : page * per_page]
                    link = ""
                    if page * per_page < len(items):
                        base = f"http://127.0.0.1:{fake.port}{url.path}"
                        link = f'<{base}?per_page={per_page}&page={page + 1}>; rel="next"'
                    return self._send(200, chunk, link)
                if len(rest) == 2 and rest[1] == "comments" and method == "POST":
                    fake._next_id += 1
                    new = {"id": fake._next_id, "body": body["body"], "user": fake.bot}
                    fake.comments.setdefault(int(rest[0]), []).append(new)
                    return self._send(201, new)
                if rest[0] == "comments" and len(rest) == 2 and method == "PATCH":
                    for items in fake.comments.values():
                        for item in items:
                            if item["id"] == int(rest[1]):
                                item["body"] = body["body"]
                                return self._send(200, item)
                return self._send(404, {"message": "Not Found"})

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    bot: ClassVar[dict] = {"login": "github-actions[bot]", "type": "Bot"}
    human: ClassVar[dict] = {"login": "someone", "type": "User"}

    def add(self, pr: int, body: str, user: dict) -> int:
        self._next_id += 1
        self.comments.setdefault(pr, []).append({"id": self._next_id, "body": body, "user": user})
        return self._next_id

    def __enter__(self) -> FakeGitHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
