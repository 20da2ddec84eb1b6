"""Encode workers die with their parent (issue 14, item 8).

The real `encode.encode()` runs in a child process with two spawned workers; that process
stops itself (blocks forever) at the moment it consumes the first tokenized group, so the
workers are provably running, and says so on stdout. The test lists the process's children
(the workers and multiprocessing's resource tracker) from /proc, kills the process with
SIGKILL, and waits, bounded, until none of those children is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from train_helpers import job_document, write_corpus, write_job

from payload.core import lease
from payload.core.status import StatusWriter
from payload.data import tokenizer
from payload.data.encode import stage
from payload.schema import manifest as mf

WORKERS = 2
DEADLINE_S = 120.0  # generous: only a leak takes this long

BLOCKED_ENCODE = textwrap.dedent(
    """
    import sys, threading
    from payload.data import corpus
    from payload.data.encode import stage, local as encode_local
    from payload.spec import load_job
    from payload.core.status import StatusWriter

    corpus.GROUP_BYTES = 2048  # many groups from a small corpus: every worker gets work

    def stop_here(self, group):
        print("consuming", flush=True)
        threading.Event().wait()  # until SIGKILL

    encode_local._Assembler.add = stop_here
    job = load_job(sys.argv[1])
    stage.encode(job, StatusWriter(job.paths.status, job.name))
    """
)


def children_of(pid: int) -> dict[int, str]:
    """Live children of ``pid``: their pid and start time (to tell a reused pid apart)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[1]) == pid:
            out[int(entry.name)] = fields[19]
    return out


def alive(pid: int, start: str) -> bool:
    """Running (not a zombie waiting for init to reap it) and the same process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return fields[0] != "Z" and fields[19] == start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_encode_leaves_no_worker_behind(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    document = job_document(tmp_path, corpus)
    document["data"]["workers"] = WORKERS
    job = write_job(tmp_path, document)
    tokenizer.train_tokenizer(job, StatusWriter(job.paths.status, job.name))

    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_ENCODE, str(tmp_path / "job.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: dict[int, str] = {}
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the workers have tokenized a group
        assert line == "consuming\n", proc.communicate(timeout=DEADLINE_S)
        children = children_of(proc.pid)
        workers = {
            pid: start
            for pid, start in children.items()
            if "multiprocessing" in Path(f"/proc/{pid}/cmdline").read_text()
        }
        assert len(workers) >= WORKERS, children  # the workers, and the resource tracker
        assert all(start == lease.process_start(pid) for pid, start in children.items())
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:  # bounded: ends as soon as every child is gone
            left = {pid for pid, start in children.items() if alive(pid, start)}
            if not left:
                break
            time.sleep(0.05)
        assert not left, f"still running after the parent's SIGKILL: {sorted(left)}"
        # The killed run left its staging directory and no manifest; the next run starts
        # clean and finishes (what `rerun to continue` means for encode).
        assert list(Path(job.paths.data).glob(".staging-*"))
        assert not stage.is_complete(job)
        manifest = stage.encode(job, StatusWriter(job.paths.status, job.name))
        mf.verify_shards(job.paths.data, manifest)
        assert not list(Path(job.paths.data).glob(".staging-*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=DEADLINE_S)
        for pid, start in children.items():  # a failed run leaks nothing either
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("parent", "survives"), [("os.getppid()", True), ("1", False)])
def test_a_worker_whose_parent_is_already_gone_exits(parent: str, survives: bool) -> None:
    """The race before prctl: a worker re-parented before its initializer ran ends itself
    (here: told a parent that is not its own, as after a re-parenting)."""
    code = (
        "import os\nfrom payload.data.encode import local\n"
        f"local._die_with_parent({parent})\nprint('ran')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert (result.returncode, result.stdout) == ((0, "ran\n") if survives else (1, ""))
