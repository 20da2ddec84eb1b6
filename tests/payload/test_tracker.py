"""`train.tracker: wandb` across a preemption, and `train.profile`'s trace.

The W&B test is a preemption as a VM sees one: the real CLI (JAX backend) trains with
WANDB_MODE=offline, is paused after a log line (drivers/pause_driver.py: no sleep a fast
machine outruns), and its whole process group is SIGKILLed, with the wandb service it
started in a session of its own (wandb 0.29 service_process.py) — a VM's death ends both.
The rerun resumes from the last checkpoint under the run id kept beside the checkpoints.
What the offline runs hold is read from wandb's own transaction logs (run-<id>.wandb, read
with wandb's DataStore and its Record proto)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import wandb
from train_helpers import (
    PausedCli,
    assert_user_error,
    job_document,
    prepare_data,
    run_cli,
    write_corpus,
    write_job,
)
from wandb.proto import wandb_internal_pb2
from wandb.sdk.internal import datastore

from payload import pipeline
from payload.core.errors import SpecError
from payload.spec import load_job, parse_job
from payload.training import tracker

LOG_POINT = "after:payload.training.shared:Meter.log:{}"
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
HANG_GUARD_S = 120  # a killed service's end: far above any real duration


def _doc(tmp_path: Path, **train: object) -> dict[str, object]:
    return job_document(tmp_path, tmp_path / "corpus.txt", "clm", **train)


def test_tracker_and_profile_keys_are_checked(tmp_path: Path) -> None:
    doc = _doc(tmp_path, steps=20)
    job = parse_job(doc, source=str(tmp_path / "job.yaml"))
    assert job.train.tracker == "tensorboard" and job.train.profile is None
    doc["train"] = {**doc["train"], "tracker": "wandb", "profile": {"start_step": 5, "steps": 3}}  # type: ignore[dict-item]
    job = parse_job(doc, source=str(tmp_path / "job.yaml"))
    assert job.train.tracker == "wandb"
    assert job.train.profile is not None and job.train.profile.end_step == 8
    allowed = r"is not allowed \(allowed: tensorboard, wandb\)$"
    cases = [
        ({"tracker": "mlflow"}, rf"^train\.tracker: 'mlflow' {allowed}"),
        ({"profile": {"start_step": 18, "steps": 5}}, r"^train\.profile: steps 19-23 end past"),
        ({"profile": {"start_step": 1}}, r"^train\.profile\.steps is required$"),
        ({"profile": {"start_step": 1, "steps": 2, "x": 3}}, r"^train\.profile\.x: unknown key"),
        ({"profile": {"start_step": 1, "steps": 0}}, r"^train\.profile\.steps: 0 is out of range"),
        ({"profile": 5}, r"^train\.profile: expected a mapping"),
        ({"profile": {"start_step": 1, "steps": 2}, "backend": "tf"}, r"^train\.profile: .*TF"),
    ]
    for bad, message in cases:
        broken = {**doc, "train": {**_doc(tmp_path, steps=20)["train"], **bad}}  # type: ignore[dict-item]
        with pytest.raises(SpecError, match=message):
            parse_job(broken, source=str(tmp_path / "job.yaml"))


def test_train_force_starts_a_new_wandb_run(tmp_path: Path) -> None:
    job = write_job(tmp_path, _doc(tmp_path, steps=4, warmup_steps=1, tracker="wandb"))
    kept = tracker.keep_run_id(job, tracker.new_run_id())
    assert tracker.kept_run_id(job) == kept
    assert tracker.keep_run_id(job, "another1") == kept  # the first start's id stays
    pipeline.clear(job, "train")  # `tpu-payload train --force`
    assert tracker.kept_run_id(job) is None


def _offline_runs(wandb_dir: Path) -> list[tuple[str, list[int], set[str]]]:
    """Each offline run under `wandb_dir`, oldest first: (its run id, the `_step` of each
    history row in the order written, the keys logged). The id is the log's name's
    (run-<id>.wandb), and its run record's where the record reached the file."""
    runs = []
    for run_dir in sorted(wandb_dir.glob("wandb/offline-run-*")):
        (log,) = run_dir.glob("run-*.wandb")
        store = datastore.DataStore()
        store.open_for_scan(str(log))
        run_id = log.name.removeprefix("run-").removesuffix(".wandb")
        steps, keys = [], set()
        while True:
            try:
                data = store.scan_data()
            except AssertionError:  # a killed writer's torn last block: what came before
                break
            if data is None:
                break
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id, (record.run.run_id, log)
            elif record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                steps.append(int(json.loads(items["_step"])))
                keys.update(k for k in items if not k.startswith("_"))
        runs.append((run_id, steps, keys))
    return runs


def _services_of(pid: int) -> list[int]:
    """The wandb-core processes started for process `pid` (`--pid <pid>` on their line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and argv[0].endswith(b"wandb-core")
            and b"--pid" in argv
            and argv[argv.index(b"--pid") + 1] == str(pid).encode()
        ):
            found.append(int(proc.name))
    return found


def _kill_and_wait(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + HANG_GUARD_S
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids):
        assert time.monotonic() < deadline, f"wandb-core {pids} outlived SIGKILL"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _checkpoints(root: Path) -> list[int]:
    return sorted(int(p.name) for p in root.glob("*") if p.name.isdigit())


@pytest.fixture
def parents_service() -> Iterator[str]:
    """A wandb service started by this (the parent) process: wandb puts its address in
    WANDB_SERVICE, which every child inherits, and a child that connected to it would leave
    its run id registered there when killed ("run ID ... is in use" for the next start)."""
    wandb.setup().ensure_service()
    try:
        yield os.environ[tracker.SERVICE_ENV]
    finally:
        wandb.teardown()
        os.environ.pop(tracker.SERVICE_ENV, None)


@pytest.mark.slow
@pytest.mark.parametrize("stale", ["killed-with-the-vm", "parents-service-outlives-the-kill"])
def test_wandb_offline_run_survives_a_kill_and_resumes(
    tmp_path: Path, stale: str, request: pytest.FixtureRequest
) -> None:
    if stale == "parents-service-outlives-the-kill":
        assert request.getfixturevalue("parents_service")
    write_corpus(tmp_path / "corpus.txt", lines=600)
    doc = _doc(tmp_path, steps=5000, checkpoint_every=10, log_every=5, eval_every=0,
               backend="jax", tracker="wandb")  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    job_file = str(tmp_path / "job.yaml")

    point = LOG_POINT.format(3)  # steps 5, 10 and 15 logged; step 10's checkpoint kept
    with PausedCli(tmp_path / "first", point, "train", "--job", job_file, env=OFFLINE) as first:
        assert first.wait_paused() == f"paused at {point}"
        first.wait_while_paused(  # the kill lands after checkpoint 10 is committed
            lambda: 10 in _checkpoints(Path(job.paths.checkpoints)), "commit of checkpoint 10"
        )
        services = _services_of(first.proc.pid)
        first.signal(signal.SIGKILL)  # the trainer's whole process group
        if stale == "killed-with-the-vm":
            assert services, "the trainer started no wandb service of its own"
            _kill_and_wait(services)  # and its service, in a session of its own
        code, _, _ = first.finish()
    assert code == -signal.SIGKILL
    kept = _checkpoints(Path(job.paths.checkpoints))[-1]
    assert kept == 10
    run_id = tracker.kept_run_id(job)
    assert run_id and re.fullmatch(r"[a-z0-9]+", run_id)

    doc["train"]["steps"] = 30  # type: ignore[index]
    write_job(tmp_path, doc)
    result = run_cli("train", "--job", job_file, env=OFFLINE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {kept}" in result.stderr
    assert "Traceback" not in result.stderr
    assert tracker.kept_run_id(load_job(job_file)) == run_id  # the same id, not a new one

    runs = _offline_runs(Path(job.paths.root) / "wandb")
    assert [r[0] for r in runs] == [run_id, run_id], runs  # one W&B run, two starts
    (_, before, _), (_, after, keys) = runs
    # What reached the first start's log before the kill, in order: wandb-core writes it
    # from its own process, in blocks, and a kill loses what it had not written yet (here,
    # on a 2-core machine, usually all of it: an online run has streamed it by then).
    assert before == [5, 10, 15][: len(before)], before
    # The resumed start continues from the checkpoint, in order, to the end.
    assert after == [15, 20, 25, 30], after
    assert {"train/loss", "train/learning_rate", "train/grad_norm"} <= keys
    assert "eval/loss" in keys  # the final evaluation's, at step 30
    # Logged again: only the steps between the checkpoint and the kill (an online run
    # resumed by W&B skips them: tracker.py, WandbRun.log).
    assert set(before) & set(after) <= {15}


@pytest.mark.parametrize("backend", ["tf", "jax"])
def test_both_backends_log_the_same_scalars(tmp_path: Path, backend: str) -> None:
    write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = _doc(tmp_path, steps=4, warmup_steps=1, checkpoint_every=4, log_every=2,
               eval_every=0, backend=backend, tracker="wandb")  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env=OFFLINE)
    assert result.returncode == 0, result.stderr[-3000:]
    ((run_id, steps, keys),) = _offline_runs(Path(job.paths.root) / "wandb")
    assert run_id == tracker.kept_run_id(job)
    assert steps == [2, 4]
    # The scalars TensorBoard got, under the same names: train/ from logs/, eval/ from logs/eval.
    logs = Path(job.paths.logs)
    tensorboard = {f"train/{t}" for t in _tags(logs)} | {f"eval/{t}" for t in _tags(logs / "eval")}
    assert keys == tensorboard
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss"} <= keys


def _tags(logdir: Path) -> set[str]:
    """The scalar tags of the event files directly in `logdir` (TF's reader)."""
    import tensorflow as tf

    return {
        value.tag
        for path in logdir.glob("events.out.tfevents.*")
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    }


def test_wandb_missing_is_a_one_line_error(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = _doc(tmp_path, steps=2, warmup_steps=1, checkpoint_every=2, log_every=1, backend="jax",
               tracker="wandb")  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    blocker = tmp_path / "no_wandb"
    blocker.mkdir()
    (blocker / "wandb.py").write_text("raise ImportError('no wandb here')\n")
    path = os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH")) if p)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env={"PYTHONPATH": path})
    assert_user_error(result, r"train\.tracker: wandb needs the wandb package: pip install")


def test_wandb_without_a_key_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = _doc(tmp_path, steps=2, warmup_steps=1, checkpoint_every=2, log_every=1, backend="jax",
               tracker="wandb")  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_SERVICE"):
        monkeypatch.delenv(name, raising=False)
    home = {"HOME": str(tmp_path / "home"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env=home)
    assert_user_error(
        result, r"^error: train\.tracker: wandb: No API key configured.*WANDB_API_KEY"
    )
    assert _checkpoints(Path(job.paths.checkpoints)) == []  # stopped before a step


def test_profile_window_writes_a_trace(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = _doc(tmp_path, steps=6, checkpoint_every=6, log_every=2, eval_every=0,
               backend="jax", profile={"start_step": 2, "steps": 3})  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    profile = Path(job.paths.root) / "profile"
    assert f"train: profile of steps 3-5 written to {profile}" in result.stderr
    (trace,) = profile.glob("plugins/profile/*/*.xplane.pb")
    assert trace.stat().st_size > 1000
    (perfetto,) = profile.glob("plugins/profile/*/perfetto_trace.json.gz")
    assert perfetto.stat().st_size > 100
    assert wandb.__version__ == "0.29.0"  # the extra's pin (pyproject.toml), as tested
