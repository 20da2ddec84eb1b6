"""Corpus files in every format the readers take, and a loopback stand-in for the Hugging
Face Hub's API serving one dataset at one commit (test_readers.py, test_encode_formats.py; the
`hub` fixture in conftest.py serves it)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


def jsonl_bytes(docs: list[str], field: str = "text") -> bytes:
    return b"".join(
        json.dumps({"id": i, field: d, "meta": {"n": i}}).encode() + b"\n"
        for i, d in enumerate(docs)
    )


def write_all_formats(directory: Path, docs: list[str]) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "text": directory / "docs.txt",
        "jsonl": directory / "docs.jsonl",
        "jsonl.gz": directory / "docs.jsonl.gz",
        "jsonl.zst": directory / "docs.jsonl.zst",
        "parquet": directory / "docs.parquet",
    }
    paths["text"].write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    paths["jsonl"].write_bytes(jsonl_bytes(docs))
    paths["jsonl.gz"].write_bytes(gzip.compress(jsonl_bytes(docs)))
    # two zstd frames: a file may be several frames end to end
    half = len(docs) // 2
    compressor = zstandard.ZstdCompressor()
    paths["jsonl.zst"].write_bytes(
        compressor.compress(jsonl_bytes(docs[:half]))
        + compressor.compress(jsonl_bytes(docs[half:]))
    )
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, paths["parquet"], row_group_size=7)
    return paths


COMMIT = "5c1a3b7e9d2f4a6b8c0d1e2f3a4b5c6d7e8f9a0b"
REPO = "someone/tiny-corpus"


class Hub(BaseHTTPRequestHandler):
    """The Hub's API as HfFileSystem calls it (huggingface_hub 0.36 hf_api.py: dataset_info
    GET /api/datasets/<repo>/revision/<rev>, list_repo_tree GET /api/datasets/<repo>/tree/
    <rev>[/<path>]?recursive=..., file_download.hf_hub_url GET /datasets/<repo>/resolve/
    <rev>/<file> with a Range header), for one dataset at one commit."""

    root: Path
    requests: list[tuple[str, str | None]]

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.requests.append((path, self.headers.get("Range")))
        api = f"/api/datasets/{REPO}/"
        if path.startswith(api + "revision/"):
            if path != f"{api}revision/{COMMIT}":
                return self._error(404, "RevisionNotFound")
            return self._json({"id": REPO, "sha": COMMIT, "private": False})
        if path.startswith(api + "tree/"):
            revision, _, inner = path[len(api + "tree/") :].partition("/")
            if revision != COMMIT:
                return self._error(404, "RevisionNotFound")
            recursive = parse_qs(url.query).get("recursive") == ["True"]
            return self._tree(inner, recursive)
        resolve = f"/datasets/{REPO}/resolve/{COMMIT}/"
        if path.startswith(resolve):
            return self._file(self.root / path[len(resolve) :])
        return self._error(404, "RepoNotFound")

    def _tree(self, inner: str, recursive: bool) -> None:
        base = self.root / inner if inner else self.root
        if not base.is_dir():
            return self._error(404, "EntryNotFound")
        entries = sorted(base.rglob("*") if recursive else base.iterdir())
        out = []
        for entry in entries:
            rel = entry.relative_to(self.root).as_posix()
            oid = hashlib.sha1(rel.encode()).hexdigest()  # noqa: S324  (an id, not security)
            if entry.is_dir():
                out.append({"type": "directory", "path": rel, "oid": oid})
            else:
                out.append({"type": "file", "path": rel, "oid": oid, "size": entry.stat().st_size})
        return self._json(out)

    def _file(self, path: Path) -> None:
        if not path.is_file():
            return self._error(404, "EntryNotFound")
        data = path.read_bytes()
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        status = 200
        if match:
            start = int(match.group(1))
            end = int(match.group(2)) + 1 if match.group(2) else len(data)
            data, status = data[start:end], 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return None

    def _json(self, value: Any) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
