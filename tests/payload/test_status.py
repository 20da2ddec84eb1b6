"""status.json: stages, progress, last error, throttling; locally and in the emulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from payload.core import storage
from payload.core.status import StatusWriter


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.emulator)])
def status_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run" / "status.json")
    return request.getfixturevalue("gcs_root") + "/status.json"


def _read(path: str) -> dict:
    return json.loads(storage.read_text(path))


def test_stage_progress_and_failure(status_path: str) -> None:
    status = StatusWriter(status_path, "job-a", min_interval_s=3600)
    status.update(stage="encode", progress=0.0, message="starting")
    doc = _read(status_path)
    assert (doc["job"], doc["stage"], doc["state"], doc["progress"]) == (
        "job-a",
        "encode",
        "running",
        0.0,
    )

    status.update(stage="encode", progress=0.5, records=10)  # throttled: same stage and state
    assert _read(status_path)["progress"] == 0.0
    status.flush()
    doc = _read(status_path)
    assert doc["progress"] == 0.5
    assert doc["metrics"] == {"records": 10}

    status.update(stage="encode", state="complete")
    status.fail(stage="train", error="DataError: shard x is missing")
    doc = _read(status_path)
    assert doc["state"] == "failed"
    assert doc["last_error"]["error"] == "DataError: shard x is missing"
    assert doc["stages"]["encode"]["state"] == "complete"
    assert doc["stages"]["encode"]["progress"] == 1.0
    assert doc["stages"]["train"]["state"] == "failed"

    # A new writer for the same job keeps the per-stage history.
    again = StatusWriter(status_path, "job-a")
    again.update(stage="train", message="retry")
    doc = _read(status_path)
    assert doc["stages"]["encode"]["state"] == "complete"
    assert doc["stages"]["train"]["state"] == "running"


def test_rejects_unknown_state(tmp_path: Path) -> None:
    status = StatusWriter(str(tmp_path / "s.json"), "j")
    with pytest.raises(ValueError, match="state"):
        status.update(stage="x", state="done")


def test_a_hang_is_its_own_state_naming_the_phase(status_path: str) -> None:
    """The progress watchdog's end (payload/backends/jax/progress.py): state `hung`, the
    phase in last_error, the stage ended; the restart's `running` replaces it."""
    status = StatusWriter(status_path, "job-h", min_interval_s=3600)
    status.update(stage="train", progress=0.25, step=4)
    status.hung(stage="train", phase="checkpoint", error="error: process 1 of the slice hung")
    doc = _read(status_path)
    assert (doc["stage"], doc["state"]) == ("train", "hung")
    assert doc["last_error"]["phase"] == "checkpoint"
    assert doc["last_error"]["error"] == "error: process 1 of the slice hung"
    assert doc["stages"]["train"]["state"] == "hung" and "finished_at" in doc["stages"]["train"]
    again = StatusWriter(status_path, "job-h")
    again.update(stage="train", message="starting")
    doc = _read(status_path)
    assert doc["state"] == "running" and doc["last_error"]["phase"] == "checkpoint"
