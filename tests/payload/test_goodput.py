"""Goodput across restarts, the ETA against the grant, and the trainer's own events.

The ledger's arithmetic on a clock the test moves (payload/training/goodput.py); the ETA and
`tpu-payload plan`'s printout (payload/plan/eta.py); `eta-past-grant` written once to a real
HTTP server that records the Logging API's entries:write, for a run in the storage emulator
(payload/training/report.py); and real local runs through the CLI: one killed by SIGKILL after
a checkpoint and resumed (two starts, lost progress, categories that add up to the wall time,
a continuous history, `finished` once), one that hangs (`hung`), one stopped by a user error
(`stopped`, and not when the VM's trainer unit is there to say it)."""

from __future__ import annotations

import json
import shutil
import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from train_helpers import (
    PausedCli,
    job_document,
    prepare_data,
    run_cli,
    write_corpus,
    write_job,
)

from payload.backends.jax import progress
from payload.cli import main as cli_main
from payload.core import hosts, storage
from payload.core.status import MAX_POINTS, StatusWriter
from payload.plan import estimate, eta
from payload.training import goodput, report

LOG_POINT = "after:payload.training.shared:Meter.log:{}"


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _events(status: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in status.get("events", []) if e["event"] == name]


def _adds_up(summary: dict[str, Any], within: float = 0.05) -> float:
    total = sum(summary["categories"].values())
    assert summary["wall_s"] > 0
    assert abs(total - summary["wall_s"]) <= within * summary["wall_s"], summary
    return total


# ---------------------------------------------------------------------------- the ledger


def test_a_start_splits_its_time_and_a_restart_counts_the_lost_steps(tmp_path: Path) -> None:
    clock = Clock()
    root = str(tmp_path / "run")
    first = goodput.Ledger(root, chief=True, clock=clock, process_started=clock.now - 30)
    with first.during("restore"):
        clock.now += 2
    first.restored(None)
    first.enter("compile")
    clock.now += 10
    first.chunk_done(1)  # the first chunk: the compile ends
    assert first.phase == "productive"
    clock.now += 9
    first.steps_done(10)
    with first.during("checkpoint"):
        clock.now += 3
    clock.now += 5  # steps 11-15, never checkpointed
    first.steps_done(15)
    first.write()
    seconds = first.record["seconds"]
    assert (seconds["boot"], seconds["restore"], seconds["compile"]) == (30, 2, 10)
    assert (seconds["productive"], seconds["checkpoint"]) == (14, 3)

    clock.now += 100  # killed at the last write; 100 s until the next start
    second = goodput.Ledger(root, chief=True, clock=clock, process_started=clock.now - 20)
    assert [r["last_step"] for r in second.previous] == [15]
    second.restored(10)
    second.enter("compile")
    clock.now += 4
    second.chunk_done(11)
    clock.now += 9
    second.steps_done(20)
    second.end("finished")
    summary = second.summary()
    categories = summary["categories"]
    # 5 steps lost at the first start's 14 s / 14 steps (its first chunk is the compile).
    assert categories["lost"] == pytest.approx(5.0)
    assert categories["productive"] == pytest.approx(14 + 9 - 5.0)
    assert categories["down"] == pytest.approx(100 - 20)  # the second process booted 20 s
    assert summary["wall_s"] == pytest.approx(30 + 29 + 80 + 20 + 13)
    assert sum(categories.values()) == pytest.approx(summary["wall_s"])
    assert [s["end"] for s in summary["starts"]] == ["killed", "finished"]
    assert [s["restored_step"] for s in summary["starts"]] == [None, 10]
    assert summary["goodput"] == pytest.approx(18 / summary["wall_s"], abs=1e-4)


def test_the_watchdogs_capacity_wait_comes_out_of_the_time_between_starts(tmp_path) -> None:
    run = {"seconds": dict.fromkeys(goodput.PHASES, 0.0), "end": "preempted", "last_step": 0}
    records = [
        {**run, "started_at": "a", "started_s": 0.0, "ended_s": 100.0},
        {**run, "started_at": "b", "started_s": 400.0, "ended_s": 500.0, "end": "running"},
    ]
    records[0]["seconds"] = {**run["seconds"], "other": 100.0}
    records[1]["seconds"] = {**run["seconds"], "other": 100.0}
    within = goodput.summarise(records, capacity_wait=250.0)
    assert (within["categories"]["capacity_wait"], within["categories"]["down"]) == (250, 50)
    assert within["wall_s"] == 500
    before = goodput.summarise(records, capacity_wait=400.0)  # 100 s before the first start
    assert (before["wall_s"], before["categories"]["down"]) == (600, 0)
    assert sum(before["categories"].values()) == pytest.approx(600)

    # The second start on a new VM that booted 60 s before its process: boot and install.
    records[1]["host_booted_s"] = 340.0
    vm = goodput.summarise(records, capacity_wait=0.0)
    assert (vm["categories"]["boot"], vm["categories"]["down"], vm["wall_s"]) == (60, 240, 500)

    (tmp_path / "bootstrap").mkdir()
    (tmp_path / "bootstrap" / "tpu-watch.json").write_text('{"capacity_wait_s": 42}')
    assert goodput.capacity_wait_s(str(tmp_path)) == 42.0
    with pytest.raises(ValueError, match="phase must be one of"):
        goodput.Ledger(str(tmp_path), chief=False).enter("lunch")


def test_the_process_start_is_the_kernels() -> None:
    started = goodput.process_start_time()
    now = datetime.now(timezone.utc).timestamp()
    assert started is not None and 0 < now - started < 24 * 3600


def test_history_is_bounded_and_cut_back_to_the_restored_step(tmp_path: Path) -> None:
    status = StatusWriter(str(tmp_path / "status.json"), "job")
    for step in range(1, 3 * MAX_POINTS):
        status.add_point("train", step, 1.0 / step)
    points = status.document["history"]["train"]
    assert len(points) <= MAX_POINTS and points[0][0] == 1 and points[-1][0] == 3 * MAX_POINTS - 1
    assert [p[0] for p in points] == sorted({p[0] for p in points})
    status.trim_history(700)
    status.flush()
    again = StatusWriter(str(tmp_path / "status.json"), "job")  # a restart keeps it
    assert again.document["history"]["train"][-1][0] <= 700


# ---------------------------------------------------------------------------- the ETA


def test_the_eta_and_the_grant() -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    during = eta.estimate(step=250, steps=1000, tokens_per_step=1000, tokens_per_s=100.0, now=now,
                          grant_ends="2026-12-31")  # fmt: skip
    assert (during.tokens_done, during.tokens_total, during.remaining_s) == (250_000, 10**6, 7500)
    assert (during.eta, during.grant_ends) == ("2026-12-01T14:05:00Z", "2027-01-01T00:00:00Z")
    assert not during.past_grant and during.warning is None
    late = eta.estimate(step=0, steps=1000, tokens_per_step=1000, tokens_per_s=0.1, now=now,
                        grant_ends="2026-12-02")  # fmt: skip
    assert late.past_grant and late.warning and "after the grant's end" in late.warning
    unknown = eta.estimate(step=1, steps=10, tokens_per_step=1, tokens_per_s=None, now=now)
    assert (unknown.eta, unknown.remaining_s, unknown.past_grant) == (None, None, False)
    done = eta.estimate(step=10, steps=10, tokens_per_step=1, tokens_per_s=None, now=now)
    assert (done.remaining_s, done.eta) == (0.0, "2026-12-01T12:00:00Z")


def test_the_plan_prints_the_same_estimate_and_the_grants_warning(tmp_path, capsys) -> None:
    doc = job_document(tmp_path, tmp_path / "corpus.txt", "clm", "gpt2", steps=2_000_000)
    doc["model"]["size"] = "base"  # hours, not a fraction of a second
    doc["grant_ends"] = "2020-01-31"
    write_job(tmp_path, doc)
    args = ["plan", "--job", str(tmp_path / "job.yaml"), "--accelerator", "v5litepod-8"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("ETA if it started now: "))
    assert "grant ends 2020-02-01T00:00:00Z" in printed
    assert "warning: at " in printed and "after the grant's end" in printed
    assert cli_main([*args, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["eta"]["past_grant"] and planned["eta"]["tokens_total"] == 2_000_000 * 16 * 32
    hours = planned["eta"]["remaining_s"] / 3600
    assert hours == pytest.approx(planned["hours"], rel=1e-3)
    assert f"({hours:,.1f} hours at" in line


def test_eta_past_grant_is_written_once_per_run(tmp_path, gcs_root, logging_api) -> None:
    endpoint, api = logging_api
    env = {"TPU_PRETRAIN_LOGGING_ENDPOINT": endpoint, "TPU_PRETRAIN_PROJECT": "proj"}
    doc = job_document(tmp_path, tmp_path / "corpus.txt", "clm", "gpt2", steps=100)
    doc.update(output=gcs_root, grant_ends="2020-01-31")
    job = write_job(tmp_path, doc)
    for start in range(2):  # a restart: the same run, no second event
        status = StatusWriter(job.paths.status, job.name)
        told = report.RunReport(job, status, chief=True, environ=env)
        for step in (10 + 20 * start, 20 + 20 * start):
            told.logged(step, 2.0, steps_per_s=0.5)
        status.flush()
    entries = [e for _, body in api.received for e in body["entries"]]
    assert [e["jsonPayload"]["event"] for e in entries] == ["eta-past-grant"]
    [entry] = entries
    assert (entry["severity"], entry["jsonPayload"]["bucket"]) == ("WARNING", "payload-tests")
    assert entry["jsonPayload"]["grant_ends"] == "2020-02-01T00:00:00Z"
    written = json.loads(storage.read_text(job.paths.status))
    assert len(_events(written, "eta-past-grant")) == 1 and written["eta"]["past_grant"]
    assert written["goodput"]["starts"] and written["history"]["train"][-1][0] == 40


def test_mfu_is_drawn_on_a_tpu_host_only(tmp_path) -> None:
    doc = job_document(tmp_path, tmp_path / "corpus.txt", "clm", "gpt2", steps=100)
    job = write_job(tmp_path, doc)
    acc = estimate.accelerator("v5litepod-8")
    per_token = estimate.plan_job(job, acc).flops_per_token
    hosts.expect_tpu(hosts.TpuHost("v5litepod-8", "v2-alpha-tpuv5-lite"))
    try:
        on_tpu = StatusWriter(str(tmp_path / "tpu.json"), job.name)
        report.RunReport(job, on_tpu, chief=False).logged(10, 2.0, steps_per_s=4.0)
    finally:
        hosts.expect_tpu(None)
    [[step, mfu]] = on_tpu.document["history"]["mfu"]
    assert step == 10
    assert mfu == pytest.approx(4.0 * 16 * 32 * per_token / (acc.chips * acc.peak_flops))
    elsewhere = StatusWriter(str(tmp_path / "cpu.json"), job.name)
    report.RunReport(job, elsewhere, chief=False).logged(10, 2.0, steps_per_s=4.0)
    assert "mfu" not in elsewhere.document["history"]
    assert elsewhere.document["history"]["tokens_per_s"] == [[10, 4.0 * 16 * 32]]


# ---------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("goodput")
    corpus = write_corpus(tmp / "corpus.txt", lines=600)
    doc = job_document(
        tmp, corpus, "clm", "gpt2", steps=5000, checkpoint_every=10, log_every=5, backend="jax"
    )
    doc["grant_ends"] = "2020-01-31"
    prepare_data(write_job(tmp, doc))
    return tmp, doc


# Three runs of the CLI, about 75 s. The JAX backend here; both backends' killed-and-resumed
# goodput is also checked by test_resume.py's SIGKILL test (the same ledger, report.py).
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax"])
def test_a_run_killed_after_a_checkpoint_and_resumed(prepared, tmp_path, backend) -> None:
    source, doc = prepared
    doc = {**doc, "output": str(tmp_path / "out"), "train": {**doc["train"], "backend": backend}}
    job = write_job(tmp_path, doc)
    for part in ("tokenizer", "data"):
        shutil.copytree(Path(source, "out", part), getattr(job.paths, part))
    tmp, job_file = tmp_path, str(tmp_path / "job.yaml")
    point = LOG_POINT.format(3)  # step 15 logged; the last checkpoint is step 10's
    with PausedCli(tmp / "first-run", point, "train", "--job", job_file) as first:
        assert first.wait_paused() == f"paused at {point}"
        first.wait_while_paused(  # the kill lands after checkpoint 10 is committed
            lambda: Path(job.paths.checkpoints, "10").is_dir(), "commit of checkpoint 10"
        )
        first.signal(signal.SIGKILL)
        code, _, first_log = first.finish()
    assert code == -signal.SIGKILL, first_log[-3000:]
    killed = json.loads(Path(job.paths.status).read_text())
    # status.json is written at most every 10 s and at each checkpoint: 15 may be in it.
    assert [p[0] for p in killed["history"]["train"]][:2] == [5, 10]
    ledger = json.loads(next(Path(job.paths.root, goodput.RECORDS).glob("*.json")).read_text())
    # Written at each log line; the chunk that logged step 15 may have trained beyond it.
    assert ledger["end"] == "running" and ledger["last_step"] >= 15
    trained = ledger["last_step"]

    write_job(tmp, {**doc, "train": {**doc["train"], "steps": 30}})
    for _ in range(2):  # the second run finds the stage complete and changes nothing
        result = run_cli("train", "--job", job_file)
        assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads(Path(job.paths.status).read_text())
    good = status["goodput"]
    assert [s["end"] for s in good["starts"]] == ["killed", "finished"], good
    assert [(s["restored_step"], s["last_step"]) for s in good["starts"]] == [
        (None, trained),
        (10, 30),
    ]
    assert good["categories"]["lost"] > 0 and good["categories"]["productive"] > 0
    assert good["categories"]["compile"] > 0 and good["categories"]["boot"] > 0
    total = _adds_up(good)
    print(f"goodput {good['goodput']}: {total:.1f} s of categories, {good['wall_s']} s wall")
    assert len(list(Path(job.paths.root, goodput.RECORDS).glob("*.json"))) == 2
    # The history: each series continuous, the killed start's steps after 10 replaced.
    assert [p[0] for p in status["history"]["train"]] == list(range(5, 31, 5))
    rates = [p[0] for p in status["history"]["tokens_per_s"]]
    assert rates == sorted(set(rates)) and rates[-1] == 30
    assert status["eta"]["tokens_done"] == status["eta"]["tokens_total"] == 30 * 16 * 32
    assert len(_events(status, "finished")) == 1
    assert len(_events(status, "eta-past-grant")) == 1  # once per run, not once per start
    assert _events(status, "finished")[0]["step"] == 30


def test_a_hung_run_writes_the_hung_event(prepared, tmp_path: Path) -> None:
    source, doc = prepared
    job = write_job(tmp_path, {**doc, "output": str(tmp_path / "out"), "grant_ends": None})
    for part in ("tokenizer", "data"):
        shutil.copytree(Path(source, "out", part), getattr(job.paths, part))
    env = {progress.HANG_ENV: "20", progress.STALL_ENV: "10"}
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env=env)
    assert result.returncode == progress.HUNG_EXIT, result.stderr[-3000:]
    status = json.loads(Path(job.paths.status).read_text())
    [hung] = _events(status, "hung")
    assert (hung["phase"], hung["step"], hung["source"]) == ("train", 10, "trainer")
    assert status["goodput"]["starts"][-1]["end"] == "hung"
    assert result.stderr.count('"event": "hung"') == 1


@pytest.mark.parametrize("under_the_unit", [False, True])
def test_a_user_error_stops_the_run_with_one_event(prepared, tmp_path, under_the_unit) -> None:
    source, doc = prepared
    job = write_job(tmp_path, {**doc, "output": str(tmp_path / "out")})
    for part in ("tokenizer", "data"):
        shutil.copytree(Path(source, "out", part), getattr(job.paths, part))
    write_job(tmp_path, {**doc, "output": str(tmp_path / "out"),
                         "data": {**doc["data"], "seq_length": 64}})  # fmt: skip
    env = {report.UNIT_ENV: str(tmp_path / "no-facts.json")} if under_the_unit else {}
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    status = json.loads(Path(job.paths.status).read_text())
    stopped = _events(status, "stopped")
    assert status["goodput"]["starts"][-1]["end"] == "stopped"
    if under_the_unit:  # the unit's ExecStopPost writes it (tpu.sh trainer_stopped)
        assert stopped == [] and '"event": "stopped"' not in result.stderr
    else:
        [event] = stopped
        assert event["reason"] == "user-error" and "seq_length 32" in event["message"]
