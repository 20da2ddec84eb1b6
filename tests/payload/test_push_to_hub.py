"""`tpu-payload export --push-to-hub REPO` up to the HTTP calls, against a local stand-in.

The real Hub cannot be reached here. A small HTTP server on 127.0.0.1 (HF_ENDPOINT) answers
the three calls huggingface_hub's `create_repo` + `upload_folder` make (create, preupload,
commit) and records them: the test checks the repo is created private, every export file
arrives byte for byte, the token is sent as a bearer token and never printed. What the
real Hub does beyond these answers (LFS/Xet storage of large files, auth rules) is not
tested.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from train_helpers import run_cli, write_corpus

from payload.training import export as export_lib

TOKEN = "hf_test_secret_token_value"  # noqa: S105
REPO_ID = "someone/tiny-bert"


class _Hub(BaseHTTPRequestHandler):
    calls: list[dict[str, Any]]
    fail_commit = False

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self.calls.append(
            {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        )
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path == "/api/repos/create":
            self._reply(200, {"url": f"{base}/{REPO_ID}", "name": REPO_ID})
        elif self.path == "/api/validate-yaml":  # the model card's YAML header
            self._reply(200, {"errors": [], "warnings": []})
        elif "/preupload/" in self.path:
            files = json.loads(body)["files"]
            self._reply(
                200,
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in files
                    ]
                },
            )
        elif "/commit/" in self.path and not self.fail_commit:
            self._reply(200, {"commitUrl": f"{base}/{REPO_ID}/commit/abc", "commitOid": "abc"})
        else:
            self._reply(500, {"error": f"refused {self.path}"})


@pytest.fixture
def hub() -> Any:
    handler = type("Hub", (_Hub,), {"calls": [], "fail_commit": False})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _finished_export(tmp_path: Path) -> tuple[Path, Path]:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    job = tmp_path / "job.yaml"
    job.write_text(
        json.dumps(
            {
                "name": "push",
                "output": str(tmp_path / "out"),
                "corpus": {"paths": [str(corpus)]},
                "tokenizer": {"kind": "wordpiece", "vocab_size": 400},
                "data": {"objective": "mlm", "seq_length": 32},
                "model": {"family": "bert"},
                "train": {"steps": 1},
            }
        )
    )
    export = tmp_path / "out" / "export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (export / "config.json").write_text('{"architectures": ["BertForMaskedLM"]}\n')
    (export / "README.md").write_text("---\nlibrary_name: transformers\n---\n# push\n")
    (export / export_lib.EXPORT_MARKER).write_text("{}\n")
    return job, export


def _env(monkeypatch: pytest.MonkeyPatch, endpoint: str, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_push_uploads_every_export_file_with_the_token(tmp_path, hub, monkeypatch) -> None:
    handler, endpoint = hub
    job, export = _finished_export(tmp_path)
    _env(monkeypatch, endpoint, tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    result = run_cli("export", "--job", str(job), "--push-to-hub", REPO_ID, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert TOKEN not in result.stdout + result.stderr
    paths = [c["path"] for c in handler.calls]
    assert paths[0] == "/api/repos/create" and "/api/validate-yaml" in paths
    assert json.loads(handler.calls[0]["body"])["private"] is True
    assert any("/preupload/" in p for p in paths) and "commit" in paths[-1]
    assert {c["auth"] for c in handler.calls} == {f"Bearer {TOKEN}"}
    # The commit carries each file, byte for byte; the completion marker stays private.
    lines = [json.loads(x) for x in handler.calls[-1]["body"].decode().splitlines() if x]
    files = {x["value"]["path"]: x["value"]["content"] for x in lines if x["key"] == "file"}
    assert set(files) == {"model.safetensors", "config.json", "README.md"}
    for name, content in files.items():
        assert base64.b64decode(content) == (export / name).read_bytes()


def test_push_errors_are_one_line_and_never_show_the_token(tmp_path, hub, monkeypatch) -> None:
    handler, endpoint = hub
    job, _ = _finished_export(tmp_path)
    _env(monkeypatch, endpoint, tmp_path)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    result = run_cli("export", "--job", str(job), "--push-to-hub", REPO_ID, timeout=120)
    assert result.returncode == 2
    assert "error: --push-to-hub needs a Hugging Face token in the environment" in result.stderr
    assert handler.calls == []

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    handler.fail_commit = True
    result = run_cli("export", "--job", str(job), "--push-to-hub", REPO_ID, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert errors == [f"error: upload to {REPO_ID} failed: HTTP 500"]
    assert TOKEN not in result.stdout + result.stderr and "Traceback" not in result.stderr

    result = run_cli("export", "--job", str(job), "--push-to-hub", "not a repo", timeout=120)
    assert result.returncode == 2 and "is not a Hub repo id" in result.stderr

    (Path(job).parent / "out" / "export" / export_lib.EXPORT_MARKER).unlink()
    result = run_cli("export", "--job", str(job), "--push-to-hub", REPO_ID, timeout=120)
    assert result.returncode == 2 and "no finished export in" in result.stderr
