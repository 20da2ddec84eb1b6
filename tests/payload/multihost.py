"""The multi-process JAX tests' helpers (test_jax_multihost.py, test_jax_hosts.py,
test_jax_slice.py): a child's environment, the hang guard, and `tpu-payload train` as one worker
of a slice of CPU processes joined by `jax.distributed`, with its exits and errors read back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from train_helpers import copy_prepared, job_document, prepare_data, write_corpus, write_job

from payload.spec import JobSpec

HANG_GUARD_S = 900  # far above a real run: only a hung process reaches it


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **extra}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, dict]:
    """A prepared JAX job for the slice tests (a fixture: test_jax_hosts.py and
    test_jax_slice.py import it); copy_job copies it with other train settings."""
    root = tmp_path_factory.mktemp("jax-hosts")
    corpus = write_corpus(root / "corpus.txt", lines=600)
    doc = job_document(root, corpus, "mlm", steps=8, checkpoint_every=1000, backend="jax")
    doc["data"].update(records_per_shard=40, eval_fraction=0.1, eval_min_sequences=16)
    job = write_job(root, doc)
    prepare_data(job)
    return job, doc


def copy_job(prepared: tuple[JobSpec, dict], root: Path, **train: object) -> JobSpec:
    source, doc = prepared
    doc = json.loads(json.dumps(doc))
    doc["train"].update(train)
    doc["output"] = str(root / "out")
    return copy_prepared(source, root, doc)


def worker_env(port: int, worker: int, processes: int = 2, **extra: str) -> dict[str, str]:
    return child_env(
        TPU_PAYLOAD_JAX_DISTRIBUTED=f"127.0.0.1:{port},{processes},{worker}",
        TPU_PRETRAIN_WORKER=str(worker),
        **extra,
    )


ERROR_DRIVER = Path(__file__).parent / "drivers" / "error_driver.py"


class Worker:
    """`tpu-payload train` as one worker of a slice of `processes`, output in files; with
    `inject`, run through error_driver.py with that injection (`[ACTION@]MODULE:ATTR:N[,...]`
    and its message)."""

    def __init__(
        self,
        job_file: Path,
        logs: Path,
        port: int,
        worker: int,
        *,
        inject: tuple[str, str] | None = None,
        processes: int = 2,
        cwd: Path | None = None,
        **extra: str,
    ):
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / f"{worker}.out", logs / f"{worker}.err"
        command = ["train", "--job", str(job_file)]
        driver = [str(ERROR_DRIVER), *inject] if inject else ["-m", "payload"]
        self.started = time.time()
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *driver, *command],
                stdout=out,
                stderr=err,
                env=worker_env(port, worker, processes, **extra),
                cwd=cwd,
                start_new_session=True,
            )

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def finish(self) -> tuple[int, str]:
        return self.proc.wait(timeout=HANG_GUARD_S), self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def exits_seen(procs: list[subprocess.Popen]) -> list[tuple[int, float]]:
    """(exit status, the time it was seen, time.time()) of each process, polled every 50 ms
    (to report how long a slice takes to end; never asserted on); a guard only a hung
    process reaches."""
    seen: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + HANG_GUARD_S
    while len(seen) < len(procs):
        left = sorted(set(range(len(procs))) - set(seen))
        assert time.monotonic() < deadline, f"processes {left} did not end (hung?)"
        for i, proc in enumerate(procs):
            if i not in seen and proc.poll() is not None:
                seen[i] = (int(proc.returncode), time.time())
        time.sleep(0.05)
    return [seen[i] for i in range(len(procs))]


def injected_at(stderr: str, action: str) -> float:
    """When error_driver.py injected `action` (its unix time)."""
    found = re.search(rf"^injected {re.escape(action)} at \S+ at ([0-9.]+)$", stderr, re.M)
    assert found, stderr[-3000:]
    return float(found.group(1))


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds; only a hung process reaches the guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_GUARD_S} s (hung?)"
        time.sleep(0.05)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# Worker 1 is told another chunk budget than worker 0 (which has none on the CPU): the
# chunks are agreed, one step each (runtime.CHUNK_SECONDS_ENV, training.FIRST_CHUNK_STEPS).
TINY_CHUNKS = {"TPU_PAYLOAD_CHUNK_SECONDS": "1e-9"}
