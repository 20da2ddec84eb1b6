"""The JAX backend's one-line refusals and stops, through the real CLI: a TPU VM whose JAX
finds no TPU, a loss that becomes NaN, checkpoints of the other backend or of the earlier
npz format, a checkpoint of other variables, a worker index without the JAX backend; an
unfinished checkpoint write ignored; and bfloat16 when asked on the CPU. The backend choice
(`train.backend: auto`, TPU_PAYLOAD_BACKEND) and the slice settings are checked as pure
functions."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import (
    assert_user_error,
    copy_prepared,
    job_document,
    prepare_data,
    run_cli,
    write_corpus,
    write_job,
)

from payload.backends.jax import distributed
from payload.core.errors import TRANSIENT_EXIT, DataError, UserError
from payload.spec import JobSpec
from payload.training import shared


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, dict]:
    root = tmp_path_factory.mktemp("jax-safety")
    corpus = write_corpus(root / "corpus.txt", lines=300)
    doc = job_document(root, corpus, "mlm", steps=10, checkpoint_every=5, backend="jax")
    job = write_job(root, doc)
    prepare_data(job)
    return job, doc


@pytest.fixture(scope="module")
def five_steps(prepared, tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    """A JAX run of 5 steps that stopped after its step-5 checkpoint (export removed)."""
    root = tmp_path_factory.mktemp("five-steps")
    job = _job(prepared, root, steps=5)
    result = run_cli("train", "--job", str(root / "job.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.rmtree(job.paths.export)
    return job


def _steps_on_disk(checkpoint_dir: str) -> list[str]:
    """Orbax's finished step directories (an unfinished write is <step>.orbax-checkpoint-tmp)."""
    return sorted(p.name for p in Path(checkpoint_dir).glob("*") if p.name.isdigit())


def _read_checkpoint(checkpoint_dir: str, step: int) -> dict:
    """The raw items of an Orbax checkpoint of the JAX backend ({"state", "layout"})."""
    items = ("state", "layout")  # payload/backends/jax/checkpoint.py STATE, LAYOUT
    with ocp.CheckpointManager(checkpoint_dir, item_names=items) as manager:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(), layout=ocp.args.JsonRestore()
            ),
        )
    return {"state": restored["state"], "layout": restored["layout"]}


def _job(prepared: tuple[JobSpec, dict], root: Path, **train: object) -> JobSpec:
    source, doc = prepared
    doc = json.loads(json.dumps(doc))
    doc["train"].update(train)
    return copy_prepared(source, root, doc)


def test_a_tpu_vm_whose_jax_finds_no_tpu_is_one_line(prepared, tmp_path: Path) -> None:
    job = _job(prepared, tmp_path)
    result = run_cli(
        "train",
        "--job",
        str(tmp_path / "job.yaml"),
        env={
            "TPU_PRETRAIN_ACCELERATOR_TYPE": "v6e-8",
            "TPU_PRETRAIN_RUNTIME_VERSION": "v2-alpha-tpuv6e",
            "JAX_PLATFORMS": "tpu",  # the JAX trainer unit's setting
        },
    )
    line = assert_user_error(
        result,
        r"^error: TPU not found: runtime v2-alpha-tpuv6e on accelerator v6e-8: no TPU chip on "
        r"this VM's PCI bus and JAX ",
    )
    assert "could not initialise it" in line and "not training on the host CPU" in line
    status = json.loads(Path(job.paths.status).read_text())
    assert status["state"] == "failed" and "TPU not found" in status["last_error"]["error"]
    assert not _steps_on_disk(job.paths.checkpoints)


ERROR_DRIVER = Path(__file__).parent / "drivers" / "error_driver.py"


def test_a_tpu_attached_but_not_initialised_is_restarted_not_stopped(prepared, tmp_path) -> None:
    """The same VM, but JAX's own count of the TPU chips on the PCI bus finds four (the
    driver answers for the hardware this machine lacks): libtpu failing to open chips that
    are there (held by another process, a slice's other hosts not up) is a transient
    failure, exit 75, which the trainer unit restarts; not `TPU not found`, exit 2, which
    stops it for good."""
    job = _job(prepared, tmp_path)
    chips = "tpu-chips@jax._src.hardware_utils:num_available_tpu_chips_and_device_id:1"
    train = ("train", "--job", str(tmp_path / "job.yaml"))
    result = subprocess.run(
        [sys.executable, str(ERROR_DRIVER), chips, "-", *train],
        capture_output=True, text=True, timeout=300, check=False,
        env={
            **os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
            "TPU_PRETRAIN_ACCELERATOR_TYPE": "v6e-8",
            "TPU_PRETRAIN_RUNTIME_VERSION": "v2-alpha-tpuv6e",
            "JAX_PLATFORMS": "tpu",
        },
    )  # fmt: skip
    assert result.returncode == TRANSIENT_EXIT, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "error: TPU unavailable: runtime v2-alpha-tpuv6e on accelerator v6e-8: 4 TPU chips are "
        f"on this VM's PCI bus but JAX {jax.__version__} could not initialise them ("
    ), lines[0]
    status = json.loads(Path(job.paths.status).read_text())
    assert "TPU unavailable" in status["last_error"]["error"], status


def test_a_nan_loss_stops_with_one_line_and_keeps_the_checkpoint(
    prepared, five_steps, tmp_path
) -> None:
    # Poison the step-5 checkpoint's weights, then ask for 5 more steps.
    job = _job(prepared, tmp_path / "more", steps=10)
    shutil.copytree(five_steps.paths.checkpoints, job.paths.checkpoints)
    items = _read_checkpoint(job.paths.checkpoints, 5)
    state = items["state"]
    state["trainable"][0] = np.full_like(np.asarray(state["trainable"][0]), np.nan)
    shutil.rmtree(Path(job.paths.checkpoints, "5"))
    with ocp.CheckpointManager(job.paths.checkpoints, item_names=("state", "layout")) as m:
        m.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), layout=ocp.args.JsonSave(items["layout"])
            ),
        )
    result = run_cli("train", "--job", str(tmp_path / "more" / "job.yaml"))
    assert_user_error(result, r"^error: loss became nan between steps 5 and 10 ")
    assert _steps_on_disk(job.paths.checkpoints) == ["5"]
    assert not shared.is_complete(job)


def test_checkpoints_of_the_other_backend_are_refused(prepared, five_steps, tmp_path) -> None:
    job = _job(prepared, tmp_path, steps=10, backend="tf")
    shutil.copytree(five_steps.paths.checkpoints, job.paths.checkpoints)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert_user_error(result, r"belong to a different run \(backend: 'jax' -> 'tf'\)")


def test_checkpoints_of_the_earlier_npz_format_are_refused(prepared, tmp_path) -> None:
    job = _job(prepared, tmp_path, steps=10)
    Path(job.paths.checkpoints).mkdir(parents=True)
    Path(job.paths.checkpoints, "ckpt-5.npz").write_bytes(b"an npz of an earlier release")
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert_user_error(
        result,
        r"^error: .*/checkpoints holds checkpoints of the earlier JAX format \(ckpt-5\.npz\), "
        r"which this release cannot resume \(it writes Orbax checkpoints\): use a new output "
        r"directory, or --force to start over$",
    )
    assert sorted(p.name for p in Path(job.paths.checkpoints).iterdir()) == ["ckpt-5.npz"]


def test_a_checkpoint_of_other_variables_is_one_line(prepared, five_steps, tmp_path) -> None:
    job = _job(prepared, tmp_path, steps=10)
    shutil.copytree(five_steps.paths.checkpoints, job.paths.checkpoints)
    metadata = Path(job.paths.checkpoints, "5", "layout", "metadata")
    layout = json.loads(metadata.read_text())
    path, shape = layout["trainable"][0]
    layout["trainable"][0] = [path, [*shape[:-1], shape[-1] + 1]]
    metadata.write_text(json.dumps(layout))
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert_user_error(
        result,
        rf"/checkpoints/5 holds other variables than this run's model and optimizer "
        rf"\(trainable: {re.escape(path)} \[.*\] saved, {re.escape(path)} \[.*\] now\): use a "
        r"new output directory, or --force to start over$",
    )


def test_an_unfinished_checkpoint_write_is_not_resumed_from(prepared, five_steps, tmp_path):
    """A write cut off by a kill leaves <step>.orbax-checkpoint-tmp (Orbax renames it into
    place only when every process has finished): the rerun resumes from the last finished
    step, and Orbax removes the unfinished one."""
    job = _job(prepared, tmp_path, steps=10)
    shutil.copytree(five_steps.paths.checkpoints, job.paths.checkpoints)
    partial = Path(job.paths.checkpoints, "8.orbax-checkpoint-tmp")
    shutil.copytree(Path(job.paths.checkpoints, "5"), partial)
    shutil.rmtree(partial / "state")
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {job.paths.checkpoints}/5 at step 5" in result.stderr
    assert _steps_on_disk(job.paths.checkpoints) == ["10", "5"]
    assert not partial.exists()


def test_bf16_when_asked_on_cpu(prepared, tmp_path: Path) -> None:
    job = _job(prepared, tmp_path, steps=10, precision="bf16")
    result = run_cli("run", "--job", str(tmp_path / "job.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads(Path(job.paths.status).read_text())
    assert status["runtime"]["policy"] == "mixed_bfloat16", status["runtime"]
    summary = next(x for x in result.stdout.splitlines() if x.startswith("train: complete ("))
    first, last = (
        float(re.search(rf"\b{key}=([0-9.]+)", summary).group(1)) for key in ("first_loss", "loss")
    )
    assert np.isfinite(last) and last < first, summary
    state = _read_checkpoint(job.paths.checkpoints, 10)["state"]
    dtypes = {str(np.asarray(x).dtype) for x in jax.tree.leaves(state)}
    assert "bfloat16" not in dtypes and "float32" in dtypes, dtypes


def test_a_worker_index_needs_the_jax_backend(prepared, tmp_path: Path) -> None:
    _job(prepared, tmp_path, backend="tf")
    result = run_cli("run", "--job", str(tmp_path / "job.yaml"), env={"TPU_PRETRAIN_WORKER": "1"})
    assert_user_error(result, r"^error: TPU_PRETRAIN_WORKER=1: only the JAX backend runs on every")


def test_backend_choice(prepared) -> None:
    job, _ = prepared  # train.backend: jax
    assert shared.resolve_backend(job, {"TPU_PAYLOAD_BACKEND": "tf"}) == "jax"
    auto = dataclasses.replace(job, train=dataclasses.replace(job.train, backend="auto"))
    assert shared.resolve_backend(auto, {}) == "tf"
    assert shared.resolve_backend(auto, {"TPU_PAYLOAD_BACKEND": "jax"}) == "jax"
    with pytest.raises(UserError, match=r"TPU_PAYLOAD_BACKEND: 'torch' is not a training"):
        shared.resolve_backend(auto, {"TPU_PAYLOAD_BACKEND": "torch"})
    assert shared.worker_index(job, {}) == 0
    assert shared.worker_index(job, {"TPU_PRETRAIN_WORKER": "3"}) == 3
    with pytest.raises(UserError, match="must be a worker index"):
        shared.worker_index(job, {"TPU_PRETRAIN_WORKER": "-1"})


def test_distributed_settings() -> None:
    assert distributed.parse("auto") is None
    assert distributed.parse("10.0.0.2:8476,4,3") == ("10.0.0.2:8476", 4, 3)
    for bad in ("", "127.0.0.1,2,0", "127.0.0.1:1234,2", "127.0.0.1:1234,2,2"):
        with pytest.raises(UserError, match="TPU_PAYLOAD_JAX_DISTRIBUTED"):
            distributed.parse(bad)
    assert distributed.initialize_from_env({}) is False


def test_waiting_for_worker_0s_data_is_bounded(prepared, tmp_path: Path) -> None:
    source, doc = prepared
    job = write_job(tmp_path, {**doc, "output": str(tmp_path / "out")})  # no data yet
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds
        if len(sleeps) == 3:  # worker 0 finishes encoding while this one waits
            shutil.copytree(source.paths.data, job.paths.data)

    shared.wait_for_data(job, timeout_s=100, poll_s=10, sleep=sleep, clock=lambda: now[0])
    assert sleeps == [10, 10, 10]
    empty = write_job(tmp_path / "never", {**doc, "output": str(tmp_path / "never" / "out")})
    with pytest.raises(DataError, match=r"no encoded data in .* after 30 s: worker 0 encodes"):
        shared.wait_for_data(empty, timeout_s=30, poll_s=10, sleep=sleep, clock=lambda: now[0])
