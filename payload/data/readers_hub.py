"""Corpus files on the Hugging Face Hub: ``hf://datasets/<owner>/<name>@<commit>/<path or glob>``.

Read through ``huggingface_hub``'s fsspec file system (``HfFileSystem``): listing with the
Hub's tree API, reading by HTTP range requests, so a Parquet file is read one row group at a
time here too. The revision is a full commit id, checked by the spec (payload/spec.py
``HF_COMMIT_RE``): a branch or tag can move, and a corpus that changes under a run is not
the corpus its manifest names. ``huggingface_hub.HfApi().dataset_info(repo,
revision="main").sha`` gives a branch's current commit.

The endpoint is ``HF_ENDPOINT`` when set (huggingface_hub's own setting, read here at call
time rather than at its import so that a test can point it at a loopback server), and the
token is huggingface_hub's usual one (``HF_TOKEN`` or the saved login) for gated datasets.
"""

from __future__ import annotations

import os
from typing import IO, Any

from payload.core.errors import CorpusError
from payload.schema.job import HF_DATASET_RE, HF_SCHEME

_GLOB_CHARS = "*?["


def is_hub(path: str) -> bool:
    return path.startswith(HF_SCHEME)


def revision_of(path: str) -> str | None:
    """The commit an ``hf://`` path is pinned to (None for any other path)."""
    match = HF_DATASET_RE.match(path)
    return match.group("revision") if match else None


def _filesystem() -> Any:
    from huggingface_hub import HfFileSystem  # noqa: PLC0415  (only hf:// corpora need it)

    endpoint = os.environ.get("HF_ENDPOINT") or None
    return HfFileSystem(
        endpoint=endpoint.rstrip("/") if endpoint else None, skip_instance_cache=True
    )


def _fs_path(path: str) -> str:
    return path[len(HF_SCHEME) :]


def _is_hidden(path: str, root: str) -> bool:
    return any(part.startswith(".") for part in path[len(root) :].split("/") if part)


def resolve(path: str, key: str) -> list[str]:
    """The files an ``hf://`` path names (a file, a directory, or a glob), sorted."""
    fs = _filesystem()
    target = _fs_path(path)
    try:
        if any(ch in target for ch in _GLOB_CHARS):
            found = [p for p in fs.glob(target) if fs.isfile(p)]
            if not found:
                raise CorpusError(f"{key}: pattern {path} matched no files")
        elif fs.isfile(target):
            found = [target]
        elif fs.isdir(target):
            root = target.rstrip("/") + "/"
            found = [p for p in fs.find(target) if not _is_hidden(p, root)]
            if not found:
                raise CorpusError(f"{key}: directory {path} contains no files")
        else:
            raise CorpusError(f"{key}: no such file or directory on the Hub: {path}")
    except CorpusError:
        raise
    except (OSError, ValueError) as exc:  # unknown repo or revision, network, HTTP errors
        text = " ".join(str(exc).split())[:300]
        raise CorpusError(f"{key}: cannot list {path} on the Hub: {text}") from None
    return [HF_SCHEME + p for p in sorted(found)]


def open_read(path: str) -> IO[bytes]:
    """A seekable binary file object reading ``path`` by range requests."""
    file: IO[bytes] = _filesystem().open(_fs_path(path), "rb")
    return file


def size(path: str) -> int:
    return int(_filesystem().size(_fs_path(path)))
