"""The run's events: one table (payload/core/events.py), the docs' copy of it, and its two
writers (the payload's emit, the scripts' emit_event) producing the same entry.

emit writes to a real HTTP server on 127.0.0.1 (the Logging API's entries:write shape:
conftest.py's `logging_api`); the shell writer runs with a gcloud on PATH that records its
arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from payload.core import events

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "infra" / "render" / "templates" / "common.sh"


def _doc_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`[a-z-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_docs_table_is_the_events_table():
    rows = _doc_rows()
    assert list(rows) == list(events.EVENTS)
    for name, (severity, sources, when, fields) in rows.items():
        event = events.EVENTS[name]
        assert severity == event.severity
        assert sources.split(", ") == list(event.sources)
        assert when == event.when
        assert fields == (", ".join(f"`{f}`" for f in event.fields) or "—")


def _shell(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    prelude = f"set -Eeuo pipefail\nROLE=test\nsource {COMMON}\n"
    return subprocess.run(
        ["bash", "-c", prelude + script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_the_scripts_severities_are_the_tables():
    names = " ".join(events.EVENTS)
    out = _shell(f'for e in {names}; do echo "$e $(event_severity "$e")"; done').stdout
    assert dict(line.split() for line in out.splitlines()) == {
        name: event.severity for name, event in events.EVENTS.items()
    }
    with pytest.raises(subprocess.CalledProcessError):
        _shell("event_severity no-such-event")


def test_an_entry_names_what_is_wrong():
    base = {"bucket": "b", "job": "j", "host": "h", "message": "m"}
    with pytest.raises(events.EventError, match="unknown event 'nope'; events: preempted"):
        events.entry("nope", source="trainer", **base)
    with pytest.raises(events.EventError, match="comes from watchdog, not 'trainer'"):
        events.entry("preempted", source="trainer", **base)
    with pytest.raises(events.EventError, match="has no field 'loss'; its fields: phase, step"):
        events.entry("hung", source="trainer", loss=1.0, **base)
    assert events.bucket_of("gs://bkt/runs/j") == "bkt"
    assert events.bucket_of("/tmp/runs/j") is None


def test_emit_writes_one_entry_to_the_logging_api(logging_api, capsys):
    endpoint, api = logging_api
    env = {"TPU_PRETRAIN_LOGGING_ENDPOINT": endpoint, "TPU_PRETRAIN_PROJECT": "proj"}
    payload = events.emit(
        "hung",
        run_root="gs://stack-bucket/runs/tiny",
        job="tiny",
        message="no progress in train\nfor 300 s",
        environ=env,
        phase="train",
        step=40,
    )
    [(path, body)] = api.received
    assert path == "/v2/entries:write"
    assert body["logName"] == "projects/proj/logs/tpu-pretrain-events"
    assert body["resource"]["type"] == "global"
    [entry] = body["entries"]
    assert entry["severity"] == "ERROR"
    assert entry["jsonPayload"] == payload
    assert payload["bucket"] == "stack-bucket"
    assert payload["message"] == "no progress in train for 300 s"
    assert (payload["schema"], payload["phase"], payload["step"]) == (events.SCHEMA, "train", 40)
    assert "tpu-pretrain event: {" in capsys.readouterr().err


def test_a_failed_write_never_stops_the_run(logging_api, capsys):
    endpoint, api = logging_api
    api.status = 403
    env = {"TPU_PRETRAIN_LOGGING_ENDPOINT": endpoint, "TPU_PRETRAIN_PROJECT": "proj"}
    events.emit("finished", run_root="gs://b/runs/j", job="j", message="done", environ=env)
    assert len(api.received) == 1
    assert "not written to Cloud Logging (RuntimeError: HTTP 403" in capsys.readouterr().err


def test_a_local_run_sends_nothing(logging_api):
    endpoint, api = logging_api
    env = {"TPU_PRETRAIN_LOGGING_ENDPOINT": endpoint, "TPU_PRETRAIN_PROJECT": "proj"}
    events.emit("finished", run_root="/tmp/runs/j", job="j", message="done", environ=env)
    events.emit(
        "finished",
        run_root="gs://b/runs/j",
        job="j",
        message="done",
        environ={**env, "TPU_PRETRAIN_EVENTS": "off"},
    )
    assert api.received == []


def test_the_shell_writer_writes_the_same_entry(tmp_path):
    calls = tmp_path / "calls"
    stub = tmp_path / "bin" / "gcloud"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {calls}\n')
    stub.chmod(0o755)
    script = 'emit_event preempted watchdog "TPU node-1 was \\"PREEMPTED\\"" state=PREEMPTED'
    env = {
        "PATH": f"{stub.parent}:{os.environ['PATH']}",
        "RUN_ROOT": "gs://stack-bucket/runs/tiny",
        "JOB_NAME": "tiny",
        "PROJECT": "proj",
    }
    _shell(script, env)
    args = calls.read_text().splitlines()
    assert args[:2] == ["logging", "write"]
    assert args[2] == events.LOG_ID
    assert args[4:] == ["--payload-type=json", "--severity=WARNING", "--project", "proj"]
    shell = json.loads(args[3])
    python = events.entry(
        "preempted",
        bucket="stack-bucket",
        job="tiny",
        source="watchdog",
        host=shell["host"],
        message='TPU node-1 was "PREEMPTED"',
        at=shell["at"],
        state="PREEMPTED",
    )
    assert shell == python
