"""TensorBoard scalars without TensorFlow (payload/core/tensorboard.py): TensorFlow's own reader
reads what the writer wrote locally, and on gs:// (the emulator) the event file is the same
bytes, uploaded whole at each flush."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from payload.core import records, storage
from payload.core.tensorboard import Scalars


def _write(logdir: str) -> Scalars:
    writer = Scalars(logdir, flush_seconds=3600)
    writer.write(1, {"loss": 2.5, "accuracy": 0.25})
    writer.flush()
    writer.write(2, {"loss": 1.5})
    writer.close()  # flushes step 2
    return writer


def _scalars(events: list) -> list[tuple[int, str, float]]:
    return [
        (int(e.step), v.tag, float(tf.make_ndarray(v.tensor)))
        for e in events
        for v in e.summary.value
    ]


def test_tensorflow_reads_the_scalars(tmp_path: Path) -> None:
    _write(str(tmp_path / "logs"))
    (path,) = (tmp_path / "logs").glob("events.out.tfevents.*.v2")
    events = list(tf.compat.v1.train.summary_iterator(str(path)))
    assert events[0].file_version == "brain.Event:2"
    assert _scalars(events) == [(1, "loss", 2.5), (1, "accuracy", 0.25), (2, "loss", 1.5)]
    plugin = events[1].summary.value[0].metadata.plugin_data.plugin_name
    assert plugin == "scalars"
    Scalars(str(tmp_path / "off"), enabled=False).write(1, {"loss": 1.0})  # no file, no dir
    assert not (tmp_path / "off").exists()


@pytest.mark.emulator
def test_the_event_file_on_gs_holds_every_flush(gcs_root: str) -> None:
    logdir = storage.join(gcs_root, "logs")
    path = _write(logdir)
    (name,) = storage.listdir(logdir)
    data = storage.read_bytes(storage.join(logdir, name))
    events = [tf.compat.v1.Event.FromString(r) for r in records.iter_records(io.BytesIO(data))]
    assert _scalars(events) == [(1, "loss", 2.5), (1, "accuracy", 0.25), (2, "loss", 1.5)]
    assert path.path is None  # closed


def test_the_locks_tensorboard_command_starts():
    """The controller's TensorBoard unit runs the lock's `tensorboard` command
    (infra/render/templates/controller.sh): it imports pkg_resources, which setuptools 82
    removed (requirements/payload.lock pins setuptools below it)."""
    command = Path(sys.executable).with_name("tensorboard")
    result = subprocess.run(
        [str(command), "--version"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lock = (Path(__file__).resolve().parents[2] / "requirements/payload.lock").read_text()
    assert f"tensorboard=={result.stdout.strip()}\n" in lock
