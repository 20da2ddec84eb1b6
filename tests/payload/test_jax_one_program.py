"""A slice of 3 or 4 JAX processes on 127.0.0.1 (one CPU device each, `jax.distributed`), each
the real `tpu-payload train` as a slice worker runs it (multihost.py's workers), proves it runs
one program and classes its failures alike on every host (backends/jax/agreement.py,
distributed.py):

- four hosts, one on another job (`train.steps`), one on another payload (a copy of the
  source with one line added, as a startup script re-run on one host rolls it out), one
  whose listing does not show the newest checkpoint yet: every host stops before the model
  build with exit 2 and the same one line naming each field, the hosts and their values;
- three hosts on gs:// (the storage emulator), one of which finds Cloud Storage unreachable
  while it loads the manifest: every host exits 75 (a transient failure the unit
  restarts), not 2, with the same line;
- three hosts, two of which abort at once with different classes (a full disk, a bug): every
  host ends with the class of the abort the coordination service recorded first;
- three hosts whose local outputs are not one directory (standing for each VM's own disk):
  refused in one line, exit 2 on every host.

Every slice here stops in its start-up, before the model is built: no test waits for a
compile. Nothing depends on the machine's speed: failures are injected at fixed calls
(drivers/error_driver.py) and every wait is bounded by a guard only a hung process reaches;
how long each slice took to end is printed (`-s`), never asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, _free_port
from multihost import (
    HANG_GUARD_S,
    Worker,
    child_env,
    copy_job,
    error_lines,
    exits_seen,
    injected_at,
    prepared,  # noqa: F401  (a fixture)
)
from train_helpers import tensorflow_env

from payload import __version__ as payload_version
from payload.backends.jax import agreement
from payload.core import storage
from payload.core.errors import TRANSIENT_EXIT
from payload.training import shared


def _ended(workers: list[Worker], label: str) -> list[tuple[int, str]]:
    """Every worker's (exit status, stderr), once all ended; prints how long they took from
    the first start."""
    started = min(w.started for w in workers)
    try:
        exits = exits_seen([w.proc for w in workers])
    finally:
        for w in workers:
            w.kill()
    print(
        f"{label}: every process ended {max(t for _, t in exits) - started:.1f} s after the "
        "first started"
    )
    return [(code, w.stderr) for (code, _), w in zip(exits, workers, strict=True)]


def _one_line_each(results: list[tuple[int, str]], code: int) -> str:
    """Every process exited `code` with exactly one `error:` line, the same on all."""
    lines = []
    for exit_code, err in results:
        assert exit_code == code, err[-3000:]
        assert len(error_lines(err)) == 1, err[-3000:]
        lines += error_lines(err)
    assert len(set(lines)) == 1, lines
    return lines[0]


def _steps(directory: str) -> list[int]:
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    """A one-process run of the prepared job to its committed checkpoint of step 8."""
    root = tmp_path_factory.mktemp("trained")
    job = copy_job(prepared, root, steps=8)
    result = subprocess.run(
        [sys.executable, "-m", "payload", "train", "--job", str(root / "job.yaml")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=False, env=child_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert _steps(job.paths.checkpoints) == [8]
    return job


@pytest.mark.slow
def test_hosts_on_another_job_payload_or_checkpoint_stop_every_host(
    prepared,  # noqa: F811
    trained,
    tmp_path,
) -> None:
    """Process 1 is given another job (train.steps 9, the same output: agree_on_stop alone
    would take the smaller stop), process 2 runs another payload, process 3 does not see
    the newest checkpoint (it would train from scratch while the others resume): all four
    stop with exit 2 and one line that names each field, the hosts and their values."""
    job = copy_job(prepared, tmp_path, steps=8)
    shutil.copytree(trained.paths.checkpoints, job.paths.checkpoints, dirs_exist_ok=True)
    other = json.loads(json.dumps(prepared[1]))
    other["train"]["steps"], other["output"] = 9, job.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "job.yaml").write_text(yaml.safe_dump(other))
    rolled_out = tmp_path / "rolled-out"
    shutil.copytree(
        REPO / "payload", rolled_out / "payload", ignore=shutil.ignore_patterns("__pycache__")
    )
    with (rolled_out / "payload" / "__init__.py").open("a") as init:
        init.write("# a payload rolled out on one host only\n")

    port, logs, job_file = _free_port(), tmp_path / "logs", tmp_path / "job.yaml"
    lagging = ("lagging@payload.backends.jax.checkpoint:finished_steps:1", "-")
    workers = [
        Worker(job_file, logs, port, 0, processes=4),
        Worker(tmp_path / "other" / "job.yaml", logs, port, 1, processes=4),
        # `python -m` puts its working directory first on sys.path: the copy's own.
        Worker(job_file, logs, port, 2, processes=4, cwd=rolled_out, PYTHONPATH=str(rolled_out)),
        Worker(job_file, logs, port, 3, processes=4, inject=lagging),
    ]
    results = _ended(workers, "four hosts, three differing")
    line = _one_line_each(results, 2)
    assert line.startswith("error: the hosts of this slice do not run one program: "), line
    # Each field's values in the order of the first process that has them.
    version = re.escape(payload_version)
    payload = re.search(rf"payload differs \(processes 0, 1, 3: {version} source ([0-9a-f]{{12}}); "
                        rf"process 2: {version} source ([0-9a-f]{{12}})\)", line)  # fmt: skip
    assert payload and payload.group(1) != payload.group(2), line
    assert re.search(r"job differs \(processes 0, 2, 3: sha256 [0-9a-f]{12}; process 1: sha256 "
                     r"[0-9a-f]{12}\)", line), line  # fmt: skip
    assert "restored step differs (processes 0, 1, 2: 8; process 3: none)" in line, line
    assert "manifest differs" not in line and "libraries differs" not in line, line
    for _, err in results:
        assert "Traceback" not in err, err[-3000:]
        assert "resumed from" not in err and "train: programs" not in err, err[-3000:]
    assert _steps(job.paths.checkpoints) == [8]
    assert not shared.is_complete(job)


@pytest.mark.slow
@pytest.mark.emulator
def test_a_transient_storage_failure_restarts_every_host(prepared, gcs_root, tmp_path) -> None:  # noqa: F811
    """The output on gs:// (the emulator: status.json, the lease, the compilation cache and
    the data); process 1 finds Cloud Storage unreachable as it loads the manifest, and its
    retries (2 s here) run out: every host exits 75, which the trainer unit restarts (exit 2
    would stop every unit for good), with the same line naming process 1."""
    source, doc = prepared
    doc = json.loads(json.dumps(doc))
    doc["output"] = gcs_root
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    storage.upload_tree(source.paths.tokenizer, f"{gcs_root}/tokenizer")
    storage.upload_tree(source.paths.data, f"{gcs_root}/data")
    env = {
        **tensorflow_env("block"),  # TF's gs:// cannot be pointed at an emulator (etils)
        "TENSORSTORE_GCS_HTTP_URL": os.environ["STORAGE_EMULATOR_HOST"],
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "TPU_PAYLOAD_GCS_RETRY_S": "2",
    }
    port, logs = _free_port(), tmp_path / "logs"
    down = ("unreachable@payload.schema.manifest:load_manifest:1", "-")
    workers = [
        Worker(job_file, logs, port, w, processes=3, inject=down if w == 1 else None, **env)
        for w in range(3)
    ]
    results = _ended(workers, "Cloud Storage unreachable from process 1")
    line = _one_line_each(results, TRANSIENT_EXIT)
    assert re.fullmatch(
        rf"error: process 1 of the slice: gs://{gcs_root.split('/')[2]}: cannot reach Cloud "
        r"Storage at http://127\.0\.0\.1:\d+ \(after retrying for 2s\): .+",
        line,
    ), line
    injected_at(results[1][1], "unreachable")
    for _, err in results:
        assert "Traceback" not in err, err[-3000:]
    status = json.loads(storage.read_text(f"{gcs_root}/status.json"))
    assert status["state"] == "failed", status
    assert "cannot reach Cloud Storage" in status["last_error"]["error"], status


@pytest.mark.slow
def test_two_hosts_that_abort_at_once_with_different_classes_end_alike(prepared, tmp_path) -> None:  # noqa: F811
    """Processes 1 and 2 abort at the same call, right after the data checks' agreement
    released all three: process 1 finds its disk full (a user error: exit 2), process 2
    has a bug (exit 1). Each used to leave with its own class (and a full disk was published
    as a bug, then relabelled on its own host): the units then disagreed on restarting.
    Now the first abort the coordination service recorded decides, on every host."""
    job = copy_job(prepared, tmp_path, global_batch_size=12)  # 3 devices
    full = f"{job.paths.export}/model.safetensors"
    port, logs, job_file = _free_port(), tmp_path / "logs", tmp_path / "job.yaml"
    point = "payload.backends.jax.train:_build:1"
    inject = {1: (f"enospc@{point}", full), 2: (f"bug@{point}", "injected: a bug on process 2")}
    workers = [Worker(job_file, logs, port, w, processes=3, inject=inject.get(w)) for w in range(3)]
    results = _ended(workers, "a full disk and a bug at once")
    code = results[0][0]
    line = _one_line_each(results, code)
    disk_full = (
        rf"error: process 1 of the slice: {re.escape(job.paths.export)}: no space left on "
        r"device \(.* free\); nothing half-written is marked complete"
    )
    bug = (
        "error: process 2 of the slice failed: RuntimeError: injected: a bug on process 2 (not "
        "a user error: its traceback is in process 2's log)"
    )
    assert (code == 2 and re.match(disk_full, line)) or (code == 1 and line == bug), line
    loser = results[2 if code == 2 else 1][1]
    print(f"decided: {'the full disk (exit 2)' if code == 2 else 'the bug (exit 1)'}")
    if "not what the slice leaves with" in loser:  # it aborted itself, then lost the race
        assert "Traceback" in loser if code == 2 else "Traceback" not in loser, loser[-3000:]
    assert "Traceback" not in results[0][1], results[0][1][-3000:]


@pytest.mark.slow
def test_a_local_output_the_hosts_do_not_share_is_refused(prepared, tmp_path) -> None:  # noqa: F811
    """Process 0 writes to one local directory, processes 1 and 2 to another (on a slice:
    each VM's own disk at the same path): each host would checkpoint alone and resume from
    its own steps. Refused before anything is read: exit 2, one line, on every host."""
    copy_job(prepared, tmp_path / "a")
    copy_job(prepared, tmp_path / "b")
    port, logs = _free_port(), tmp_path / "logs"
    workers = [
        Worker(tmp_path / ("a" if w == 0 else "b") / "job.yaml", logs, port, w, processes=3)
        for w in range(3)
    ]
    line = _one_line_each(_ended(workers, "three hosts, two disks"), 2)
    assert line == (
        f"error: output: {tmp_path / 'a' / 'out'} is a local path that processes 1, 2 of this "
        "slice do not share with process 0 (a file process 0 wrote there is not there); every "
        "host of a slice must read and write one output: use gs://<bucket>/... (or a file "
        "system every host mounts)"
    ), line
    assert not list((tmp_path / "a" / "out").glob(".slice-probe-*"))  # the chief removed it


def test_the_mismatch_line_names_each_field_the_hosts_and_their_values() -> None:
    """The line every host prints (agreement.mismatch): the fields in the digest's order,
    each value's processes by their first index, hashes shortened; nothing when all agree."""
    source = "0.1.0 source " + "a" * 64
    digest = {"payload": source, "job": "b" * 64, "restored step": "8", "programs": "train 1"}
    assert agreement.mismatch([digest, dict(digest), dict(digest)]) is None
    assert agreement.mismatch([digest]) is None
    other_job = {**digest, "job": "c" * 64}
    fresh = {**digest, "restored step": "none", "programs": "train 2"}
    line = agreement.mismatch([digest, fresh, other_job, digest])
    assert line == (
        "the hosts of this slice do not run one program: job differs (processes 0, 1, 3: "
        f"sha256 {'b' * 12}; process 2: sha256 {'c' * 12}), restored step differs (processes "
        "0, 2, 3: 8; process 1: none), programs differs (processes 0, 2, 3: train 1; process "
        "1: train 2); every host must run the same payload and job on the same data and "
        "checkpoints (re-run the startup script on every host: `pulumi stack output "
        "rerunStartupCommands`)"
    ), line
    older = {**digest, "payload": "0.1.0 source " + "d" * 64}
    assert "payload differs (process 0: 0.1.0 source dddddddddddd; process 1: 0.1.0 source " \
        "aaaaaaaaaaaa)" in str(agreement.mismatch([older, digest]))  # fmt: skip
