"""`train.tracker: wandb` across a kill and a resume, and `train.profile`'s trace (JAX backend,
the real CLI on CPU).

W&B runs offline (WANDB_MODE=offline, WANDB_DIR in the test's folder: nothing leaves the
machine); each start of the run writes its own offline folder, read back with wandb's own
reader of its transaction log (wandb 0.29.0 ``wandb/sdk/internal/datastore.py`` DataStore,
records of ``wandb_internal_pb2.Record``), not by parsing the bytes here."""

from __future__ import annotations

import copy
import gzip
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from train_helpers import (
    PausedCli,
    job_document,
    prepare_data,
    run_cli,
    write_corpus,
    write_job,
)

from payload import spec
from payload.core.errors import SpecError
from payload.core.tensorboard import Scalars
from payload.training import tracker

LOG_POINT = "after:payload.training.shared:Meter.log:{}"
BASE: dict[str, Any] = {
    "name": "unit",
    "output": "runs/unit",
    "corpus": {"paths": ["corpus/*.txt"]},
    "tokenizer": {"kind": "wordpiece", "vocab_size": 2000},
    "data": {"objective": "mlm", "seq_length": 64},
    "model": {"family": "bert", "size": "tiny"},
    "train": {"steps": 20},
}


def _load(tmp_path: Path, **train: Any) -> spec.JobSpec:
    doc = copy.deepcopy(BASE)
    doc["train"].update(train)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return spec.load_job(str(path))


def test_tracker_and_profile_keys(tmp_path: Path) -> None:
    job = _load(tmp_path)
    assert job.train.tracker == "tensorboard" and job.train.profile is None
    assert job.paths.profile == str(tmp_path / "runs/unit/profile")
    job = _load(tmp_path, tracker="wandb", wandb_project="p", profile={"start_step": 3})
    assert (job.train.tracker, job.train.wandb_project) == ("wandb", "p")
    assert job.train.profile == spec.ProfileSpec(start_step=3, steps=5)
    cases = [
        ({"tracker": "mlflow"}, r"^train\.tracker: 'mlflow' is not allowed \(allowed: tensorb"),
        ({"wandb_project": "p"}, r"^train\.wandb_project: applies with train\.tracker: wandb"),
        ({"profile": {"start_step": 18}}, r"^train\.profile\.steps: the window ends at step 22"),
        ({"profile": {"start_step": 0}}, r"^train\.profile\.start_step: 0 is too small"),
        ({"profile": {"start": 2}}, r"^train\.profile\.start_step is required"),
        ({"profile": {"start_step": 2, "step": 1}}, r"^train\.profile\.step: unknown key"),
        ({"profile": {"start_step": 2}, "backend": "tf"}, r"^train\.profile: a JAX profiler"),
    ]
    for train, message in cases:
        with pytest.raises(SpecError, match=message):
            _load(tmp_path, **train)


def test_wandb_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _load(tmp_path, tracker="wandb")
    monkeypatch.setattr(tracker.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SpecError, match=r"^train\.tracker: wandb needs the wandb package"):
        tracker.require(job)
    tracker.require(_load(tmp_path))  # tensorboard needs nothing more


def _offline_runs(wandb_dir: Path) -> list[tuple[str, list[int], dict[int, set[str]]]]:
    """(run id, steps in the order logged, names logged at each step) of each offline folder,
    oldest first, from wandb's own transaction-log reader."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    runs = []
    for folder in sorted(wandb_dir.glob("wandb/offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        store = datastore.DataStore()
        store.open_for_scan(str(log))
        run_id, steps, names = "", [], {}
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                step = int(json.loads(items["_step"]))
                steps.append(step)
                names[step] = {k for k in items if not k.startswith("_")}
        runs.append((run_id, steps, names))
    return runs


def test_a_restart_resumes_the_run_and_sends_no_step_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer both backends log through, in this process: two starts of one job."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_SILENT", "true")
    job = _load(tmp_path, tracker="wandb")
    logs = str(tmp_path / "logs")
    assert type(tracker.scalars(job, logs, chief=False)) is Scalars  # only the chief logs
    first = tracker.scalars(job, logs, chief=True, prefix="train")
    evaluation = tracker.scalars(job, logs, chief=True, prefix="eval")  # the same run
    for step in (1, 2, 3):
        first.write(step, {"loss": float(step)})
    evaluation.write(3, {"loss": 0.5})
    first.close()
    evaluation.close()
    state = json.loads(Path(tracker.state_path(job)).read_text())
    assert state["last_step"] == 3
    # A restart from checkpoint 1: steps 2 and 3 again, then 4.
    second = tracker.scalars(job, logs, chief=True, prefix="train")
    for step in (2, 3, 4):
        second.write(step, {"loss": 10.0 + step})
    second.close()
    runs = _offline_runs(tmp_path)
    assert [(run_id, steps) for run_id, steps, _ in runs] == [
        (state["run_id"], [1, 2, 3]), (state["run_id"], [4])
    ]  # fmt: skip
    assert runs[0][2][3] == {"train/loss", "eval/loss"}  # one row per step
    assert list(Path(logs).glob("events.out.tfevents.*"))  # TensorBoard as always


@pytest.mark.slow
def test_wandb_offline_run_survives_a_preemption_and_a_kill(tmp_path: Path) -> None:
    """Three starts of one run: stopped by SIGTERM (a preemption: the step is checkpointed),
    killed (the last checkpoint is older than the last step logged), resumed to the end."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    doc = job_document(
        tmp_path, corpus, "mlm", steps=5000, checkpoint_every=1000, log_every=5,
        backend="jax", tracker="wandb",
    )  # fmt: skip
    job = write_job(tmp_path, doc)
    prepare_data(job)
    job_file = str(tmp_path / "job.yaml")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    state = Path(job.paths.checkpoints, tracker.STATE_FILE)

    def stopped(name: str, signum: int, point: str) -> int:
        with PausedCli(tmp_path / name, point, "train", "--job", job_file, env=env) as run:
            assert run.wait_paused() == f"paused at {point}"
            run.signal(signum)
            code, _, _ = run.finish()
        return code

    # 1. SIGTERM while step 5's line is written: steps 5, 10, 15 logged, step 16 checkpointed
    # (8 steps per chunk on a CPU: test_resume.py), and the W&B run finished.
    assert stopped("first", signal.SIGTERM, LOG_POINT.format(1)) == 128 + signal.SIGTERM
    first = json.loads(state.read_text())
    assert first["last_step"] == 15, first
    # 2. Resumed from 16, killed after step 25's line: the checkpoint is still step 16's. W&B's
    # service (wandb-core, its own process) shuts down when its parent is gone without writing
    # what it was sent (its debug-core.log: "forced shutdown"): the offline log of this start
    # keeps nothing; online, what it had uploaded is kept.
    assert stopped("second", signal.SIGKILL, LOG_POINT.format(2)) == -signal.SIGKILL
    assert json.loads(state.read_text()) == {"run_id": first["run_id"], "last_step": 25}
    # 3. Resumed from 16 to the end: steps 17-25 are trained again but not sent again.
    doc["train"]["steps"] = 40
    write_job(tmp_path, doc)
    result = run_cli("train", "--job", job_file, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 16" in result.stderr, result.stderr[-3000:]
    assert f"W&B run {first['run_id']} resumed; steps up to 25 were logged" in result.stdout

    runs = _offline_runs(tmp_path)
    assert len(runs) == 3, runs
    (id1, steps1, _), (_, steps2, _), (id3, steps3, names) = runs
    assert id1 == id3 == first["run_id"]
    assert (steps1, steps2, steps3) == ([5, 10, 15], [], [30, 35, 40])
    assert {"train/loss", "train/learning_rate"} <= names[30]
    assert "eval/loss" in names[40], names[40]  # the final held-out evaluation
    assert json.loads(state.read_text()) == {"run_id": first["run_id"], "last_step": 40}


def _executions(trace: Path, program: str) -> int:
    """How many host calls of `program` (a jitted function's name) the trace shows: its
    events that are not nested in another of its events (a call is recorded at two levels)."""
    with gzip.open(trace) as handle:
        events = json.load(handle)["traceEvents"]
    calls = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and f"jit({program})" in e.get("name", "")
    )
    count, end = 0, float("-inf")
    for start, stop in calls:
        if start >= end:
            count, end = count + 1, stop
    return count


def test_profile_window_is_traced(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    doc = job_document(
        tmp_path, corpus, "mlm", steps=8, checkpoint_every=8, log_every=4, backend="jax",
        profile={"start_step": 3, "steps": 2},
    )  # fmt: skip
    job = write_job(tmp_path, doc)
    result = run_cli("run", "--job", str(tmp_path / "job.yaml"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"train: profile of steps 3-4 written to {job.paths.profile}/" in result.stderr
    (folder,) = Path(job.paths.profile, "plugins", "profile").iterdir()
    files = {p.name for p in folder.iterdir()}
    assert "perfetto_trace.json.gz" in files, files
    assert any(n.endswith(".xplane.pb") for n in files), files
    (trace,) = folder.glob("*.trace.json.gz")
    # One chunk, steps 3-4, cut at the window's edges: the chunks before (1-2) and after
    # (5-8) ran outside the trace.
    assert _executions(trace, "train_chunk") == 1, _executions(trace, "train_chunk")
