"""Local paths and gs:// URIs behind one small API.

Local writes go to a temporary file in the destination directory and are renamed into
place, so a reader never sees half a file; ``if_absent`` writes are create-only (hard
link of the finished temp file). gs:// goes through google-cloud-storage, which honours
``STORAGE_EMULATOR_HOST`` (tests run against a real fake-gcs-server); create-only writes
use ``if_generation_match=0``. Transient errors (429, 5xx, connection resets) and the
403s of freshly granted IAM roles are retried with exponential backoff for a bounded time.

TensorFlow (checkpoints, TensorBoard, reading shards) does not use this module: it takes
the path strings directly and reads gs:// natively.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

GCS_SCHEME = "gs://"
RETRY_DEADLINE_S = 120.0
_CHUNK = 8 << 20


class AlreadyExists(Exception):  # noqa: N818  (name fixed by the payload contract)
    """A create-only write found the destination already present."""


def is_gcs(path: str) -> bool:
    return path.startswith(GCS_SCHEME)


def join(base: str, *parts: str) -> str:
    if is_gcs(base):
        out = base.rstrip("/")
        for part in parts:
            out = out + "/" + part.strip("/")
        return out
    return str(Path(base, *parts))


def dirname(path: str) -> str:
    if is_gcs(path):
        bucket, name = split_gcs(path)
        parent = name.rstrip("/").rpartition("/")[0]
        return f"{GCS_SCHEME}{bucket}/{parent}" if parent else f"{GCS_SCHEME}{bucket}"
    return str(Path(path).parent)


def basename(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] if is_gcs(path) else Path(path).name


def split_gcs(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``."""
    if not is_gcs(uri):
        raise ValueError(f"not a gs:// URI: {uri}")
    bucket, _, name = uri[len(GCS_SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"gs:// URI without a bucket: {uri}")
    return bucket, name


# --------------------------------------------------------------------------- gs:// client


def _retryable(exc: BaseException) -> bool:
    from google.api_core import exceptions as gexc  # noqa: PLC0415
    from google.auth import exceptions as auth_exc  # noqa: PLC0415

    transient = (
        gexc.TooManyRequests,
        gexc.InternalServerError,
        gexc.BadGateway,
        gexc.ServiceUnavailable,
        gexc.GatewayTimeout,
        # IAM grants on a fresh bucket/service account take a while to propagate.
        gexc.Forbidden,
        ConnectionError,
        auth_exc.TransportError,
    )
    if isinstance(exc, transient):
        return True
    try:
        import requests  # noqa: PLC0415

        return isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout)
    except ImportError:  # pragma: no cover - requests comes with google-cloud-storage
        return False


@functools.cache
def _retry() -> Any:
    from google.api_core.retry import Retry  # noqa: PLC0415

    return Retry(
        predicate=_retryable, initial=0.5, maximum=16.0, multiplier=2.0, timeout=RETRY_DEADLINE_S
    )


@functools.cache
def _client() -> Any:
    from google.cloud import storage as gcs  # noqa: PLC0415

    # Application default credentials in production; with STORAGE_EMULATOR_HOST set the
    # library itself switches to the emulator with anonymous credentials.
    return gcs.Client()


def reset_client() -> None:
    """Forget the cached client (tests switch emulators between sessions)."""
    _client.cache_clear()


def _blob(uri: str) -> Any:
    bucket, name = split_gcs(uri)
    return _client().bucket(bucket).blob(name)


def _not_found() -> type[Exception]:
    from google.api_core import exceptions as gexc  # noqa: PLC0415

    return gexc.NotFound


def _precondition_failed() -> type[Exception]:
    from google.api_core import exceptions as gexc  # noqa: PLC0415

    return gexc.PreconditionFailed


# --------------------------------------------------------------------------- queries


def exists(path: str) -> bool:
    if is_gcs(path):
        return bool(_blob(path).exists(retry=_retry()))
    return Path(path).exists()


def size(path: str) -> int:
    if is_gcs(path):
        blob = _blob(path)
        try:
            blob.reload(retry=_retry())
        except _not_found() as exc:
            raise FileNotFoundError(path) from exc
        return int(blob.size)
    return Path(path).stat().st_size


def listdir(path: str) -> list[str]:
    """Sorted names directly under ``path`` (files and sub-directories)."""
    if is_gcs(path):
        bucket, name = split_gcs(path)
        prefix = name.rstrip("/") + "/" if name.strip("/") else ""
        iterator = _client().list_blobs(bucket, prefix=prefix, delimiter="/", retry=_retry())
        names = {blob.name[len(prefix) :] for blob in iterator}
        names |= {p[len(prefix) :].rstrip("/") for p in iterator.prefixes}
        return sorted(n for n in names if n)
    return sorted(p.name for p in Path(path).iterdir())


def walk_files(path: str) -> list[str]:
    """Every file under ``path`` (recursive), sorted; hidden names are skipped."""
    if is_gcs(path):
        bucket, name = split_gcs(path)
        prefix = name.rstrip("/") + "/" if name.strip("/") else ""
        blobs = _client().list_blobs(bucket, prefix=prefix, retry=_retry())
        return sorted(
            f"{GCS_SCHEME}{bucket}/{b.name}"
            for b in blobs
            if not b.name.endswith("/")
            and not any(p.startswith(".") for p in b.name[len(prefix) :].split("/"))
        )
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(str(Path(root, f)) for f in files if not f.startswith("."))
    return sorted(out)


def glob(pattern: str) -> list[str]:
    """Sorted matches of a glob pattern (``*``, ``?``, ``[..]``; ``**`` for gs:// too)."""
    if is_gcs(pattern):
        bucket, name = split_gcs(pattern)
        literal = name
        for i, ch in enumerate(name):
            if ch in "*?[":
                literal = name[:i]
                break
        blobs = _client().list_blobs(bucket, prefix=literal, retry=_retry())
        return sorted(
            f"{GCS_SCHEME}{bucket}/{b.name}" for b in blobs if fnmatch.fnmatchcase(b.name, name)
        )
    import glob as _glob  # noqa: PLC0415

    matches = _glob.glob(pattern, recursive=True)  # noqa: PTH207  (absolute patterns)
    return sorted(p for p in matches if Path(p).is_file())


def is_dir(path: str) -> bool:
    if is_gcs(path):
        bucket, name = split_gcs(path)
        prefix = name.rstrip("/") + "/" if name.strip("/") else ""
        blobs = _client().list_blobs(bucket, prefix=prefix, max_results=1, retry=_retry())
        return any(True for _ in blobs)
    return Path(path).is_dir()


# --------------------------------------------------------------------------- reads


def read_bytes(path: str) -> bytes:
    if is_gcs(path):
        try:
            return bytes(_blob(path).download_as_bytes(retry=_retry()))
        except _not_found() as exc:
            raise FileNotFoundError(path) from exc
    return Path(path).read_bytes()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def open_read(path: str) -> IO[bytes]:
    """A binary file object streaming ``path`` (gs:// is read in chunks, not all at once)."""
    if is_gcs(path):
        blob = _blob(path)
        if not blob.exists(retry=_retry()):
            raise FileNotFoundError(path)
        return blob.open("rb", chunk_size=_CHUNK, retry=_retry())
    return Path(path).open("rb")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open_read(path) as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(src: str, local_path: str) -> None:
    Path(local_path).parent.mkdir(parents=True, exist_ok=True)
    if is_gcs(src):
        tmp = f"{local_path}.part"
        try:
            _blob(src).download_to_filename(tmp, retry=_retry())
        except _not_found() as exc:
            Path(tmp).unlink(missing_ok=True)
            raise FileNotFoundError(src) from exc
        Path(tmp).replace(local_path)
    else:
        shutil.copyfile(src, local_path)


def download_tree(src_dir: str, local_dir: str) -> list[str]:
    """Copy every file under ``src_dir`` into ``local_dir``; returns the local paths."""
    out = []
    prefix_len = len(src_dir.rstrip("/")) + 1
    for src in walk_files(src_dir):
        dest = str(Path(local_dir, src[prefix_len:]))
        download_file(src, dest)
        out.append(dest)
    return out


# --------------------------------------------------------------------------- writes


def _upload(blob: Any, method: str, source: Any, uri: str, *, if_absent: bool) -> None:
    """One blob upload; ``if_absent`` makes it create-only (generation 0 precondition)."""
    precondition = {"if_generation_match": 0} if if_absent else {}
    try:
        getattr(blob, method)(source, retry=_retry(), **precondition)
    except _precondition_failed() as exc:
        raise AlreadyExists(uri) from exc


def write_bytes(path: str, data: bytes, *, if_absent: bool = False) -> None:
    """Write atomically; with ``if_absent`` raise :class:`AlreadyExists` instead of replacing."""
    if is_gcs(path):
        _upload(_blob(path), "upload_from_string", data, path, if_absent=if_absent)
        return
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        _commit_local(tmp, dest, if_absent=if_absent)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def _file_mode() -> int:
    """Mode for new files: 0o666 minus the umask (mkstemp alone would give 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _commit_local(tmp: str, dest: Path, *, if_absent: bool) -> None:
    Path(tmp).chmod(_file_mode())
    if if_absent:
        try:
            os.link(tmp, dest)  # atomic create-only: fails if dest exists
        except FileExistsError as exc:
            raise AlreadyExists(str(dest)) from exc
    else:
        Path(tmp).replace(dest)


def write_text(path: str, text: str, *, if_absent: bool = False) -> None:
    write_bytes(path, text.encode("utf-8"), if_absent=if_absent)


def upload_file(local_path: str, dest: str, *, if_absent: bool = False) -> None:
    """Copy a finished local file to ``dest`` (gs:// or local, atomically)."""
    if is_gcs(dest):
        blob = _blob(dest)
        blob.chunk_size = _CHUNK * 4
        _upload(blob, "upload_from_filename", local_path, dest, if_absent=if_absent)
        return
    target = Path(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(local_path, tmp)
        _commit_local(tmp, target, if_absent=if_absent)
    finally:
        Path(tmp).unlink(missing_ok=True)


def upload_tree(local_dir: str, dest_dir: str) -> list[str]:
    """Upload every file under ``local_dir``; returns the destination paths."""
    out = []
    for local in walk_files(local_dir):
        rel = Path(local).relative_to(local_dir).as_posix()
        dest = join(dest_dir, rel)
        upload_file(local, dest)
        out.append(dest)
    return out


def remove(path: str) -> None:
    """Delete one file if present."""
    if is_gcs(path):
        try:
            _blob(path).delete(retry=_retry())
        except _not_found():
            pass
        return
    Path(path).unlink(missing_ok=True)


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it (missing is fine)."""
    if is_gcs(path):
        bucket, name = split_gcs(path)
        prefix = name.rstrip("/") + "/" if name.strip("/") else ""
        for blob in _client().list_blobs(bucket, prefix=prefix, retry=_retry()):
            try:
                blob.delete(retry=_retry())
            except _not_found():
                pass
        return
    shutil.rmtree(path, ignore_errors=True)


def makedirs(path: str) -> None:
    """Create a local directory (no-op for gs://, which has no directories)."""
    if not is_gcs(path):
        Path(path).mkdir(parents=True, exist_ok=True)
