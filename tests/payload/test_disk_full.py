"""A full disk is one line, exit 2, the same line in status.json, nothing half-written.

Two kinds of test:

* on a real small file system: a tmpfs mounted for the test (`mount -t tmpfs -o size=256k`),
  where the kernel itself answers ENOSPC. Mounting needs root with CAP_SYS_ADMIN (CI and
  this project's containers have it); elsewhere these tests skip and say why;
* everywhere: the free space injected (``storage.free_bytes``) for the checks before a stage,
  and ``OSError(ENOSPC)`` raised at the shard writer's write boundary for the mid-stage case.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml
from train_helpers import assert_user_error, job_document, run_cli, write_corpus

from payload import cli, pipeline
from payload.core import records, storage
from payload.core.errors import DiskFullError
from payload.core.status import StatusWriter
from payload.data import corpus, tokenizer
from payload.data.encode import local as encode_local
from payload.data.encode import rules as encode_rules
from payload.data.encode import stage
from payload.spec import JobSpec, load_job

SMALL_FS = "256k"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 kB tmpfs, unmounted afterwards; skips where mounting is not allowed."""
    mount = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): needs CAP_SYS_ADMIN")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=60)


def make_job(tmp_path: Path, output: Path, lines: int) -> JobSpec:
    corpus = write_corpus(tmp_path / f"corpus-{lines}.txt", lines=lines)
    document = {**job_document(tmp_path, corpus), "name": "disk", "output": str(output)}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(document, allow_unicode=True))
    job = load_job(str(tmp_path / "job.yaml"))
    tokenizer.train_tokenizer(job, StatusWriter(job.paths.status, job.name))
    return job


def last_error(job: JobSpec) -> str:
    return str(json.loads(Path(job.paths.status).read_text())["last_error"]["error"])


def leftovers(data_dir: str) -> list[str]:
    """Every file and directory under data/, hidden ones (staging) included."""
    root = Path(data_dir)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_estimate_is_close_to_the_encoded_size(tmp_path: Path) -> None:
    job = make_job(tmp_path, tmp_path / "out", lines=20_000)  # ~0.8 MB
    sources = corpus.resolve_sources(job.corpus)
    total = Path(sources[0][0]).stat().st_size
    estimate = encode_local.estimate_output_bytes(job, encode_rules.prepare(job), sources, total)
    manifest = stage.encode(job, StatusWriter(job.paths.status, job.name))
    real = sum(s.bytes for s in (*manifest.shards, *manifest.eval_shards))
    assert manifest.token_dtype == records.token_dtype_for(300)  # uint16
    assert abs(estimate - real) / real < 0.10, (estimate, real)
    row = job.data.seq_length * 2 + encode_local.RECORD_FRAMING
    assert real == (manifest.total_records + manifest.eval_records) * row
    one_token = np.zeros((1, 1), dtype=np.uint16)
    assert len(records.frame_records(one_token, "uint16")) - 2 == encode_local.RECORD_FRAMING


# --------------------------------------------------------------------------- a real small disk


def test_encode_refuses_before_it_starts_when_the_disk_is_too_small(
    tmp_path: Path, small_fs: Path
) -> None:
    job = make_job(tmp_path, small_fs / "out", lines=25_000)  # ~1 MB corpus, ~0.45 MB shards
    result = run_cli("encode", "--job", str(tmp_path / "job.yaml"))
    line = assert_user_error(
        result,
        rf"^error: {job.paths.data}: not enough free space for the shards of 1\.0 MB of corpus: "
        r"needs about \d+\.\d kB, \d+\.\d kB free; free some space or choose an output on a "
        "larger disk$",
    )
    assert last_error(job) == line.removeprefix("error: ")
    assert leftovers(job.paths.data) == []
    assert not list(small_fs.glob("out/.lease.json"))  # released


def test_disk_full_during_encode_is_one_line_and_leaves_nothing(
    tmp_path: Path,
    small_fs: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = make_job(tmp_path, small_fs / "out", lines=25_000)
    # The estimate is wrong (too low) here: the check before the stage passes, the disk fills.
    monkeypatch.setattr(encode_local, "estimate_output_bytes", lambda *args: 100_000)
    capsys.readouterr()
    assert cli.main(["encode", "--job", str(tmp_path / "job.yaml")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert re.fullmatch(
        rf"error: {re.escape(job.paths.data)}: no space left on device \((\d+\.\d) kB free, "
        r"the stage needs about 100\.0 kB\); nothing half-written is marked complete: free "
        r"some space or choose an output on a larger disk, then rerun",
        errors[0],
    ), errors[0]
    # The free space is counted after the staged shards were removed: most of the disk.
    assert float(errors[0].split("(")[1].split(" kB")[0]) > 200
    assert last_error(job) == errors[0].removeprefix("error: ")
    assert leftovers(job.paths.data) == []  # the staged shards are gone, no manifest


def test_disk_full_in_a_tensorflow_checkpoint_is_one_line(
    tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorFlow's own file system reports ENOSPC as RESOURCE_EXHAUSTED with the errno text;
    the pipeline turns it into the same line (the stage's checkpoint directory)."""
    import tensorflow as tf

    job = make_job(tmp_path, small_fs / "out", lines=200)

    class Trainer:
        @staticmethod
        def train(job: JobSpec, status: StatusWriter, target: object = None) -> dict[str, Any]:
            weights = tf.Variable(tf.zeros([256 * 1024]))  # 1 MB: more than the disk holds
            tf.train.Checkpoint(w=weights).save(str(Path(job.paths.checkpoints, "ckpt")))
            raise AssertionError("the save should have failed")

    monkeypatch.setattr(pipeline, "_train_module", lambda job: Trainer)
    status = StatusWriter(job.paths.status, job.name)
    with pytest.raises(DiskFullError) as caught:
        pipeline.run_stage(job, "train", status)
    assert str(caught.value).startswith(f"{job.paths.checkpoints}: no space left on device ("), (
        caught.value
    )
    assert isinstance(caught.value.__cause__, tf.errors.ResourceExhaustedError)


# --------------------------------------------------------------------------- injected


def test_encode_space_check_with_injected_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, tmp_path / "out", lines=2000)
    asked: list[str] = []

    def free(path: str) -> int:
        asked.append(path)
        return 1000

    monkeypatch.setattr(storage, "free_bytes", free)
    with pytest.raises(DiskFullError, match=r"needs about \d+\.\d kB, 1\.0 kB free"):
        pipeline.run_stage(job, "encode", StatusWriter(job.paths.status, job.name))
    assert asked == [job.paths.data]
    assert leftovers(job.paths.data) == []


def test_encode_space_check_for_gcs_output_looks_at_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gs:// output: the shards are staged in this machine's temp directory first."""
    job = make_job(tmp_path, tmp_path / "out", lines=2000)
    on_gcs = SimpleNamespace(
        paths=SimpleNamespace(data="gs://bucket/runs/x/data"), data=job.data, corpus=job.corpus
    )
    asked: list[str] = []
    monkeypatch.setattr(storage, "free_bytes", lambda path: asked.append(path) or 10)
    sources = corpus.resolve_sources(job.corpus)
    total = Path(sources[0][0]).stat().st_size
    with pytest.raises(DiskFullError, match=r": not enough free space .*\(or point TMPDIR"):
        encode_local._check_space(on_gcs, encode_rules.prepare(job), sources, total)  # type: ignore[arg-type]
    assert asked == [tempfile.gettempdir()]


def test_disk_full_mid_encode_with_an_injected_enospc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, tmp_path / "out", lines=4000)
    write = encode_local._ShardSet.add

    def add_then_fill(self: encode_local._ShardSet, rows: Any) -> None:
        write(self, rows)  # a real, partial shard in the staging directory
        assert self._path is not None and self._path.exists()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(encode_local._ShardSet, "add", add_then_fill)
    status = StatusWriter(job.paths.status, job.name)
    with pytest.raises(DiskFullError) as caught:
        pipeline.run_stage(job, "encode", status)
    message = str(caught.value)
    assert message.startswith(f"{job.paths.data}: no space left on device (")
    assert " free, the stage needs about " in message
    assert leftovers(job.paths.data) == []
    assert not stage.is_complete(job)


def test_an_error_that_is_not_a_full_disk_keeps_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, tmp_path / "out", lines=2000)

    def broken(self: encode_local._ShardSet, rows: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(encode_local._ShardSet, "add", broken)
    with pytest.raises(OSError) as caught:
        pipeline.run_stage(job, "encode", StatusWriter(job.paths.status, job.name))
    assert not isinstance(caught.value, DiskFullError) and caught.value.errno == errno.EIO


def test_checkpoint_size_and_space_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf
    import tf_keras

    from payload.backends.tf import checkpoint

    model = tf_keras.Sequential([tf_keras.layers.Dense(300, input_shape=(200,))])
    optimizer = tf_keras.optimizers.AdamW(1e-3)
    optimizer.build(model.trainable_variables)
    variables = [*model.variables, *optimizer.variables]
    one = checkpoint.checkpoint_bytes(variables)
    assert one == (200 * 300 + 300) * 4 * 3 + 8  # weights, two Adam slots, the step counter
    saved = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "c" / "x"))
    real = sum(p.stat().st_size for p in Path(saved).parent.glob("x-1*"))
    assert 0.95 < real / one < 1.10, (real, one)

    monkeypatch.setattr(storage, "free_bytes", lambda path: 2 * one)
    checkpoint.require_space(str(tmp_path / "c"), variables, keep=3, kept=2)  # 2 more fit
    with pytest.raises(
        DiskFullError,
        match=rf"not enough free space for 4 more checkpoints of {storage.human_bytes(one)} "
        r"\(train.keep_checkpoints=3\): .*lower train.keep_checkpoints",
    ):
        checkpoint.require_space(str(tmp_path / "c"), variables, keep=3, kept=0)
    monkeypatch.setattr(storage, "free_bytes", lambda path: None)  # gs://: no check
    checkpoint.require_space("gs://b/c", variables, keep=3, kept=0)
