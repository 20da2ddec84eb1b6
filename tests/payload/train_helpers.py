"""Shared by the training tests: a learnable corpus, job specs, and the real data stages.

The data for a training test is made by the real stages (`tokenizer.train_tokenizer`,
`encode.encode`), once per objective per session, and copied into each test's own output
root so a test can tamper with it.
"""

from __future__ import annotations

import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from payload.core.status import StatusWriter
from payload.data import tokenizer
from payload.data.encode import stage
from payload.spec import JobSpec, load_job

SUBJECTS = {
    "the cat": "eats fish",
    "a dog": "chases the ball",
    "my teacher": "reads a book",
    "the farmer": "grows rice",
    "고양이가": "생선을 먹는다",
    "선생님이": "책을 읽는다",
}
PLACES = ["in the garden", "at home", "near the river", "every morning", "집에서", "아침마다"]


def write_corpus(path: Path, lines: int = 1500, seed: int = 0) -> Path:
    """Sentences where the subject determines the predicate: quickly learnable."""
    rng = random.Random(seed)
    subjects = list(SUBJECTS)
    with path.open("w", encoding="utf-8") as f:
        for i in range(lines):
            subject = rng.choice(subjects)
            f.write(f"{subject} {SUBJECTS[subject]} {rng.choice(PLACES)} .\n")
            if i % 7 == 6:
                f.write("\n")  # documents of a few sentences
    return path


def job_document(
    root: Path, corpus: Path, objective: str = "mlm", family: str | None = None, **train: Any
) -> dict[str, Any]:
    family = family or {"mlm": "bert", "rtd": "electra"}.get(objective, "gpt2")
    kind = "wordpiece" if family in ("bert", "electra") else "bpe"
    return {
        "name": f"train-{family}",
        "output": str(root / "out"),
        "corpus": {"paths": [str(corpus)]},
        "tokenizer": {"kind": kind, "vocab_size": 400 if kind == "wordpiece" else 600},
        "data": {"objective": objective, "seq_length": 32, "records_per_shard": 100},
        "model": {"family": family, "size": "tiny"},
        "train": {
            "steps": 30,
            "global_batch_size": 16,
            "learning_rate": 2e-3,
            "warmup_steps": 5,
            "checkpoint_every": 10,
            "log_every": 5,
            "shuffle_buffer": 200,
            **train,
        },
    }


def write_job(root: Path, document: dict[str, Any]) -> JobSpec:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    return load_job(str(path))


def prepare_data(job: JobSpec) -> None:
    """The real tokenizer and encode stages."""
    status = StatusWriter(job.paths.status, job.name)
    tokenizer.train_tokenizer(job, status)
    stage.encode(job, status)


def copy_prepared(source: JobSpec, root: Path, document: dict[str, Any]) -> JobSpec:
    """A new job under `root` whose tokenizer/ and data/ are copies of `source`'s."""
    document = {**document, "output": str(root / "out")}
    job = write_job(root, document)
    shutil.copytree(source.paths.tokenizer, job.paths.tokenizer)
    shutil.copytree(source.paths.data, job.paths.data)
    return job


def cpu_devices(count: int) -> dict[str, str]:
    """The environment for a child JAX process with `count` virtual CPU devices: XLA_FLAGS
    with --xla_force_host_platform_device_count beside the suite's own flags (conftest.py),
    so that those children compile as fast and round alike as every other process."""
    suite = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{suite} --xla_force_host_platform_device_count={count}".strip()}


NO_TENSORFLOW_DIR = Path(__file__).with_name("no_tensorflow")


def tensorflow_env(mode: str) -> dict[str, str]:
    """The environment of a child process in which TensorFlow is unimportable (`block`), or
    importable but reported at exit if imported (`watch`): no_tensorflow/sitecustomize.py."""
    path = os.pathsep.join(p for p in (str(NO_TENSORFLOW_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "TPU_PAYLOAD_TEST_TENSORFLOW": mode}


def run_cli(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real `tpu-payload` CLI in a child process (`env` adds to this environment)."""
    return subprocess.run(
        [sys.executable, "-m", "payload", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
    )


def assert_user_error(result: subprocess.CompletedProcess[str], pattern: str) -> str:
    """A user error: exit 2, no traceback, exactly one `error:` line matching `pattern`."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


PAUSE_DRIVER = Path(__file__).parent / "drivers" / "pause_driver.py"
HANG_GUARD_S = 600  # far above any real duration: only a hung process ever reaches it


class PausedCli:
    """The real CLI (`drivers/pause_driver.py`) in its own process group, paused once at `point`.

    The test waits for the pause (`wait_paused`), signals the group (a terminal's Ctrl-C
    reaches every process of the foreground group: encode workers too), opens the gate
    (`release`), and reads the outcome (`finish`). No step depends on timing: the signal
    lands while the process provably waits at the pause; the only time limit is a guard
    against a hung process. Output goes to files, so a chatty process never blocks on a pipe.
    """

    def __init__(self, logs: Path, point: str, *args: str, env: dict[str, str] | None = None):
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "stdout", logs / "stderr"
        self._ready_r, ready_w = os.pipe()
        gate_r, self._gate_w = os.pipe()
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(PAUSE_DRIVER), str(ready_w), str(gate_r), point, *args],
                stdout=out,
                stderr=err,
                pass_fds=(ready_w, gate_r),
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
                start_new_session=True,
            )
        os.close(ready_w)  # the child holds the only write end: EOF when it is gone
        os.close(gate_r)

    def __enter__(self) -> PausedCli:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for fd in (self._ready_r, self._gate_w):
            if fd >= 0:
                os.close(fd)
        self._ready_r = self._gate_w = -1
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_paused(self) -> str:
        """The driver's line once it waits at the pause (fails if it ended without pausing)."""
        deadline = time.monotonic() + HANG_GUARD_S
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            assert left > 0, f"no pause within {HANG_GUARD_S}s (hung?):\n{self.stderr[-3000:]}"
            if select.select([self._ready_r], [], [], left)[0]:
                block = os.read(self._ready_r, 4096)
                assert block, f"ended without pausing ({self.proc.wait()}):\n{self.stderr[-3000:]}"
                line += block
        return line.decode().strip()

    def wait_while_paused(self, done: Callable[[], bool], what: str) -> None:
        """Until `done()` holds while the process waits at the pause: what its other threads
        finish there, such as a JAX checkpoint (Orbax commits it in a background thread,
        which a loaded machine may leave unfinished ten steps later)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while not done():
            assert self.proc.poll() is None, f"ended before {what}:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} within {HANG_GUARD_S}s (hung?)"
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def release(self) -> None:
        os.close(self._gate_w)
        self._gate_w = -1

    def finish(self) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once the process ended."""
        if self._gate_w >= 0:
            self.release()
        code = self.proc.wait(timeout=HANG_GUARD_S)
        return code, self.stdout_path.read_text(), self.stderr
