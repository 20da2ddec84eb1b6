"""Local paths and gs:// URIs behind one small API.

Local writes go to a temporary file in the destination directory and are renamed into
place, so a reader never sees half a file; ``if_absent`` writes are create-only (hard
link of the finished temp file). gs:// goes through google-cloud-storage, which honours
``STORAGE_EMULATOR_HOST`` (tests run against a real fake-gcs-server); create-only writes
use ``if_generation_match=0``. Transient errors (429, 5xx, connection resets) and the
403s of freshly granted IAM roles are retried with exponential backoff for a bounded time
(``RETRY_DEADLINE_S``, or ``TPU_PAYLOAD_GCS_RETRY_S`` read by the CLI).

What the user must fix becomes a one-line :class:`StorageError` naming the bucket and what to
do: no credentials, credentials refused, 403 after the retries, a bucket that does not exist;
a local output below a regular file or in a directory that cannot be written
(:func:`check_output`, run before any stage). Cloud Storage still failing when the retries
ran out (an endpoint that cannot be reached, 5xx, 429) is a one-line
:class:`StorageUnavailableError`: not the user's to fix, so a unit restarts it.

TensorFlow (checkpoints, TensorBoard, reading shards) does not use this module: it takes
the path strings directly and reads gs:// natively.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import hashlib
import ipaddress
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from payload.core.errors import DiskFullError, StorageError, StorageUnavailableError, UserError

GCS_SCHEME = "gs://"
RETRY_DEADLINE_S = 120.0
# Cloud Storage bucket names (https://cloud.google.com/storage/docs/buckets#naming): only
# a-z 0-9 - _ . ; start and end alphanumeric; 3-63 characters, or up to 222 with dots and
# each dot-separated part at most 63; no IPv4 address; no "goog" prefix; no "google" or
# close misspellings such as "g00gle" (we check those two; others are Google's call).
_BUCKET_CHARS = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")
_GOOGLE_LIKE = re.compile(r"g[o0][o0]gle")
# What the stack grants (infra/components/bucket.py, infra/executables.py) and how to mend a
# missing grant within the policy pack's rules, which refuse objectAdmin to a stack account.
SA_ROLE_HINT = (
    "the stack's accounts hold roles/storage.objectViewer and roles/storage.objectUser on its "
    "bucket, the latter with an IAM condition that leaves jobs/, startup/ and payload/ to "
    "`pulumi up` and a job's checkpoints/, export/ and compilation-cache/ to the TPU/GPU VM: "
    "run `pulumi up` to restore a missing grant; your own account needs "
    "roles/storage.objectUser on the bucket (roles/storage.objectViewer to read only), not "
    "objectAdmin (docs/bad-input.md)"
)
LOGIN_HINT = (
    "run `gcloud auth application-default login` (on a laptop) or give the VM its service "
    "account, or set GOOGLE_APPLICATION_CREDENTIALS to a key file"
)
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


def bucket_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid Cloud Storage bucket name, or None."""
    try:
        ipaddress.IPv4Address(name)
        is_ip = True
    except ValueError:
        is_ip = False
    checks = (
        (
            3 <= len(name) <= (222 if "." in name else 63),
            f"must be 3-63 characters (up to 222 with dots), not {len(name)}",
        ),
        (
            bool(_BUCKET_CHARS.match(name)),
            "may hold only a-z, 0-9, '-', '_' and '.', and must start and end with a-z or 0-9",
        ),
        (
            all(len(part) <= 63 for part in name.split(".")),
            "each dot-separated part may hold at most 63 characters",
        ),
        (".." not in name, "may not contain '..'"),
        (not is_ip, "may not be an IP address"),
        (not name.startswith("goog"), "may not start with 'goog'"),
        (not _GOOGLE_LIKE.search(name), "may not contain 'google' or a look-alike"),
    )
    return next((problem for ok, problem in checks if not ok), None)


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


def set_retry_deadline(seconds: float) -> None:
    """How long transient errors and fresh-IAM 403s are retried (CLI: TPU_PAYLOAD_GCS_RETRY_S)."""
    global RETRY_DEADLINE_S  # noqa: PLW0603  (one process-wide setting, read at the edge)
    RETRY_DEADLINE_S = float(seconds)
    _retry.cache_clear()


@functools.cache
def _retry() -> Any:
    from google.api_core.retry import Retry  # noqa: PLC0415

    return Retry(
        predicate=_retryable,
        initial=min(0.5, RETRY_DEADLINE_S / 4),
        maximum=16.0,
        multiplier=2.0,
        timeout=RETRY_DEADLINE_S,
    )


@contextlib.contextmanager
def _access(uri: str) -> Iterator[None]:
    """Turn what the user must fix about a gs:// bucket into one StorageError line."""
    from google.api_core import exceptions as gexc  # noqa: PLC0415
    from google.auth import exceptions as auth_exc  # noqa: PLC0415

    bucket = split_gcs(uri)[0]
    where = f"{GCS_SCHEME}{bucket}"
    try:
        yield
    except (gexc.RetryError, auth_exc.DefaultCredentialsError, auth_exc.RefreshError) as exc:
        cause = exc.cause if isinstance(exc, gexc.RetryError) and exc.cause else exc
        raise _access_error(where, cause, retried=cause is not exc) from None
    except (gexc.Forbidden, gexc.Unauthorized) as exc:
        raise _access_error(where, exc, retried=True) from None
    except Exception as exc:
        if _retryable(exc):  # transient, but still failing when the retries ran out
            raise _access_error(where, exc, retried=True) from None
        raise


def _access_error(where: str, exc: BaseException, *, retried: bool) -> Exception:
    """What the user must fix (credentials, a permission still refused after the retries, a
    missing bucket) is a StorageError (exit 2, not restarted); Cloud Storage itself failing
    when the retries ran out (unreachable, 5xx, 429, a timeout) is a StorageUnavailableError,
    which a restart may fix (errors.TRANSIENT_EXIT)."""
    from google.api_core import exceptions as gexc  # noqa: PLC0415
    from google.auth import exceptions as auth_exc  # noqa: PLC0415

    message = _access_message(where, exc, retried=retried)
    user = (auth_exc.DefaultCredentialsError, auth_exc.RefreshError, gexc.Forbidden)
    if isinstance(exc, (*user, gexc.Unauthorized, gexc.NotFound)):
        return StorageError(message)
    return StorageUnavailableError(message)


def _access_message(where: str, exc: BaseException, *, retried: bool) -> str:
    from google.api_core import exceptions as gexc  # noqa: PLC0415
    from google.auth import exceptions as auth_exc  # noqa: PLC0415

    detail = " ".join(str(getattr(exc, "message", "") or exc).split())[:200]
    after = f" (after retrying for {RETRY_DEADLINE_S:.0f}s)" if retried else ""
    if isinstance(exc, auth_exc.DefaultCredentialsError):
        return f"{where}: no Google credentials found ({detail}): {LOGIN_HINT}"
    if isinstance(exc, auth_exc.RefreshError | gexc.Unauthorized):
        return (
            f"{where}: the Google credentials were refused ({detail}): {LOGIN_HINT}; "
            "`gcloud auth application-default print-access-token` shows whether they work"
        )
    if isinstance(exc, gexc.Forbidden):
        return f"{where}: permission denied{after} ({detail}): {SA_ROLE_HINT}"
    if isinstance(exc, gexc.NotFound):
        return _missing_bucket(where)
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
    return f"{where}: cannot reach Cloud Storage at {endpoint}{after}: {detail}"


def _bucket_missing(uri: str) -> bool:
    """True when the bucket of ``uri`` does not exist (a listing 404s only then)."""
    bucket = split_gcs(uri)[0]
    with _access(uri):
        try:
            for _ in _client().list_blobs(bucket, max_results=1, retry=_retry()):
                break
        except _not_found():
            return True
    return False


@contextlib.contextmanager
def _listing(uri: str) -> Iterator[None]:
    """A listing 404s only when the bucket does not exist."""
    try:
        yield
    except _not_found():
        raise StorageError(_missing_bucket(uri)) from None


def _missing_bucket(uri: str) -> str:
    return f"{GCS_SCHEME}{split_gcs(uri)[0]}: the bucket does not exist: check its name and project"


def _missing(uri: str) -> Exception:
    """FileNotFoundError for a missing object, StorageError for a missing bucket."""
    return StorageError(_missing_bucket(uri)) if _bucket_missing(uri) else FileNotFoundError(uri)


@functools.cache
def _client() -> Any:
    from google.cloud import storage as gcs  # noqa: PLC0415

    # Application default credentials in production; with STORAGE_EMULATOR_HOST set the
    # library itself switches to the emulator with anonymous credentials. Credentials are
    # looked up here, so callers create the client inside _access(). project=None, not
    # omitted: object and bucket-scoped calls need no project, and without it credentials
    # with no project attached (a laptop's `gcloud auth application-default login` without
    # a quota project) fail with "Project was not passed" (google/cloud/storage/client.py).
    return gcs.Client(project=None)


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
        with _access(path):
            return bool(_blob(path).exists(retry=_retry()))
    return Path(path).exists()


def size(path: str) -> int:
    if is_gcs(path):
        with _access(path):
            blob = _blob(path)
            try:
                blob.reload(retry=_retry())
            except _not_found():
                raise _missing(path) from None
            return int(blob.size)
    return Path(path).stat().st_size


def listdir(path: str) -> list[str]:
    """Sorted names directly under ``path`` (files and sub-directories)."""
    if is_gcs(path):
        bucket, name = split_gcs(path)
        prefix = name.rstrip("/") + "/" if name.strip("/") else ""
        with _access(path), _listing(path):
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
        with _access(path), _listing(path):
            blobs = _client().list_blobs(bucket, prefix=prefix, retry=_retry())
            return sorted(
                f"{GCS_SCHEME}{bucket}/{b.name}"
                for b in blobs
                if not b.name.endswith("/")
                and not any(p.startswith(".") for p in b.name[len(prefix) :].split("/"))
            )
    out: list[str] = []
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
        with _access(pattern), _listing(pattern):
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
        with _access(path), _listing(path):
            blobs = _client().list_blobs(bucket, prefix=prefix, max_results=1, retry=_retry())
            return any(True for _ in blobs)
    return Path(path).is_dir()


# --------------------------------------------------------------------------- reads


def read_bytes(path: str) -> bytes:
    if is_gcs(path):
        with _access(path):
            try:
                return bytes(_blob(path).download_as_bytes(retry=_retry()))
            except _not_found():
                raise _missing(path) from None
    return Path(path).read_bytes()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def open_read(path: str) -> IO[bytes]:
    """A binary file object streaming ``path`` (gs:// is read in chunks, not all at once)."""
    if is_gcs(path):
        with _access(path):
            blob = _blob(path)
            if not blob.exists(retry=_retry()):
                raise _missing(path)
            return blob.open("rb", chunk_size=_CHUNK, retry=_retry())
    return Path(path).open("rb")


def read_range(path: str, start: int, length: int) -> bytes:
    """``length`` bytes of ``path`` from byte ``start`` (one ranged GET on gs://, one
    ``pread`` locally): how the JAX backend's input streams shards of any size. Fewer bytes
    than asked means the file is shorter; the caller decides whether that is an error."""
    if length <= 0:
        return b""
    if is_gcs(path):
        with _access(path):
            try:
                return bytes(
                    _blob(path).download_as_bytes(
                        start=start, end=start + length - 1, retry=_retry(), checksum=None
                    )
                )
            except _not_found():
                raise _missing(path) from None
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, start)
    finally:
        os.close(fd)


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
        with _access(src):
            try:
                _blob(src).download_to_filename(tmp, retry=_retry())
            except _not_found():
                Path(tmp).unlink(missing_ok=True)
                raise _missing(src) from None
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
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
    with _access(uri):
        try:
            getattr(blob, method)(source, retry=_retry(), **precondition)
        except _precondition_failed() as exc:
            raise AlreadyExists(uri) from exc
        except _not_found():  # uploads 404 only when the bucket is missing
            raise _missing(uri) from None


def write_bytes(path: str, data: bytes, *, if_absent: bool = False) -> None:
    """Write atomically; with ``if_absent`` raise :class:`AlreadyExists` instead of replacing."""
    if is_gcs(path):
        with _access(path):
            blob = _blob(path)
        _upload(blob, "upload_from_string", data, path, if_absent=if_absent)
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


class Conflict(Exception):  # noqa: N818
    """A conditional write or delete found another generation than the one it was given."""


def read_versioned(path: str) -> tuple[bytes, int] | None:
    """``(content, generation)`` of one object, or None when it does not exist.

    gs://: the object's generation (content and generation read as one pair: the download is
    conditional on the generation of the metadata read). Local: a number derived from the
    content (the file is only ever replaced whole, by :func:`write_versioned`), read under the
    directory's lock file.
    """
    if is_gcs(path):
        with _access(path):
            for _ in range(5):
                bucket, name = split_gcs(path)
                blob = _client().bucket(bucket).get_blob(name, retry=_retry())
                if blob is None:
                    return None
                try:
                    data = blob.download_as_bytes(
                        if_generation_match=blob.generation, retry=_retry()
                    )
                except (_not_found(), _precondition_failed()):
                    continue  # replaced or deleted between the two calls: look again
                return bytes(data), int(blob.generation)
        raise Conflict(f"{path} changed on every one of 5 reads")
    with _local_lock(path):
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        return data, _content_generation(data)


def write_versioned(path: str, data: bytes, *, generation: int) -> int:
    """Write only if the object is at ``generation`` (0: only if it does not exist).

    Returns the new generation; :class:`Conflict` when the object is at another generation
    (or exists, for 0). gs://: ``if_generation_match`` (the server decides). Local: the
    check and the atomic rename happen under an exclusive ``flock`` on a lock file next to
    ``path``, which every versioned call takes.
    """
    if is_gcs(path):
        with _access(path):
            blob = _blob(path)
            try:
                blob.upload_from_string(data, if_generation_match=generation, retry=_retry())
            except _precondition_failed() as exc:
                raise Conflict(path) from exc
            except _not_found():
                raise _missing(path) from None
            return int(blob.generation)
    with _local_lock(path):
        current = _local_generation(path)
        if current != generation:
            raise Conflict(path)
        write_bytes(path, data)
        return _content_generation(data)


def remove_versioned(path: str, *, generation: int) -> None:
    """Delete only if the object is at ``generation``; :class:`Conflict` otherwise."""
    if is_gcs(path):
        with _access(path):
            try:
                _blob(path).delete(if_generation_match=generation, retry=_retry())
            except (_precondition_failed(), _not_found()) as exc:
                raise Conflict(path) from exc
        return
    with _local_lock(path):
        if _local_generation(path) != generation:
            raise Conflict(path)
        Path(path).unlink()


def _content_generation(data: bytes) -> int:
    # Never 0 (0 means "absent"), as a GCS generation never is.
    return int.from_bytes(hashlib.sha256(data).digest()[:7], "big") | 1


def _local_generation(path: str) -> int:
    try:
        return _content_generation(Path(path).read_bytes())
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def _local_lock(path: str) -> Iterator[None]:
    """An exclusive flock on ``.<name>.lock`` beside ``path``, for one short read-check-write."""
    import fcntl  # noqa: PLC0415  (POSIX only, like the rest of the payload)

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def write_text(path: str, text: str, *, if_absent: bool = False) -> None:
    write_bytes(path, text.encode("utf-8"), if_absent=if_absent)


def upload_file(local_path: str, dest: str, *, if_absent: bool = False) -> None:
    """Copy a finished local file to ``dest`` (gs:// or local, atomically)."""
    if is_gcs(dest):
        with _access(dest):
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
        with _access(path):
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
        with _access(path), _listing(path):
            for blob in _client().list_blobs(bucket, prefix=prefix, retry=_retry()):
                with contextlib.suppress(_not_found()):
                    blob.delete(retry=_retry())
        return
    shutil.rmtree(path, ignore_errors=True)


def check_output(path: str, key: str = "output") -> None:
    """StorageError unless the job's outputs can be written under ``path``.

    Run before any stage, so a wrong path costs one line instead of a stage's work. Local:
    no regular file on the way, and the directory can be created and written. gs://: the
    bucket exists and a probe object can be created and deleted under ``path``.
    """
    if is_gcs(path):
        probe = join(path, f".write-probe-{os.getpid()}")
        write_bytes(probe, b"")
        remove(probe)
        return
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        if existing == target:
            raise StorageError(f"{key}: {path} is a file; {key} must be a directory")
        raise StorageError(
            f"{key}: {path} is below {existing}, which is a file; {key} must be a directory path"
        )
    try:
        target.mkdir(parents=True, exist_ok=True)
        fd, probe_path = tempfile.mkstemp(prefix=".write-probe-", dir=target)
        os.close(fd)
        Path(probe_path).unlink()
    except OSError as exc:
        raise StorageError(
            f"{key}: cannot write to {path} ({exc.strerror or exc}); choose a directory you "
            "can write to"
        ) from None


def makedirs(path: str) -> None:
    """Create a local directory (no-op for gs://, which has no directories)."""
    if not is_gcs(path):
        Path(path).mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- disk space

_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# TensorFlow's file systems report errno text (tsl/platform/errors.cc IOError: strerror).
_DISK_FULL_TEXT = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer can still use on the file system of ``path`` (its
    nearest existing parent); None for gs:// (no such limit)."""
    if is_gcs(path):
        return None
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    stat = os.statvfs(existing)
    return int(stat.f_bavail * stat.f_frsize)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, from Python or in a TensorFlow error's text, here or in its causes."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL_ERRNOS:
            return True
        if type(seen).__module__.startswith("tensorflow") and any(
            text in str(seen) for text in _DISK_FULL_TEXT
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def as_disk_full(exc: BaseException, where: str) -> DiskFullError | None:
    """`exc` as the DiskFullError the user must fix when it is a full disk (`disk_full` under
    the directory of the file it names, else `where`); None for anything else (a UserError
    already). One rule for every stage and every host of a slice."""
    if not isinstance(exc, Exception) or isinstance(exc, UserError) or not is_disk_full(exc):
        return None
    filename = getattr(exc, "filename", None)
    return disk_full(exc, str(Path(filename).parent) if filename else where)


def disk_full(exc: BaseException, path: str, *, need: int | None = None) -> DiskFullError:
    """The one line for a write that found the disk full under ``path`` (after the stage
    removed what it had half-written, so the free space shown is what is really free)."""
    free = free_bytes(path)
    what = next((text for text in _DISK_FULL_TEXT if text in str(exc)), _DISK_FULL_TEXT[0])
    needs = f", the stage needs about {human_bytes(need)}" if need else ""
    left = f"{human_bytes(free)} free" if free is not None else "free space unknown"
    return DiskFullError(
        f"{path}: {what.lower()} ({left}{needs}); nothing half-written is marked complete: "
        "free some space or choose an output on a larger disk, then rerun"
    )


def require_space(path: str, need: int, what: str, hint: str = "") -> None:
    """DiskFullError before a stage starts when ``path``'s file system has less than ``need``
    bytes free (local paths only)."""
    free = free_bytes(path)
    if free is None or free >= need:
        return
    raise DiskFullError(
        f"{path}: not enough free space for {what}: needs about {human_bytes(need)}, "
        f"{human_bytes(free)} free; free some space{hint} or choose an output on a larger disk"
    )
