"""Multi-host on the JAX backend, on this machine: two JAX processes on 127.0.0.1 (four
virtual CPU devices each), joined by `jax.distributed.initialize`
(TPU_PAYLOAD_JAX_DISTRIBUTED), each the real `tpu-payload run` as a slice worker runs it
(TPU_PRETRAIN_WORKER), with the state sharded over all eight devices (train.sharding: fsdp).

It shows: each process reads its own training shard files (disjoint, together all of them);
worker 1 takes no lease, waits for worker 0's data and writes nothing but its shards of each
Orbax checkpoint; two processes x four devices train to the same weights, train losses and
held-out loss as ONE process with eight devices that reads the same global batches (two
input pipelines, drivers/jax_pipelines_driver.py), within 1e-4; and a two-process run interrupted
after its checkpoint resumes from it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
from conftest import _free_port
from multihost import HANG_GUARD_S, child_env
from safetensors.numpy import load_file
from train_helpers import (
    copy_prepared,
    cpu_devices,
    job_document,
    prepare_data,
    write_corpus,
    write_job,
)

from payload.core import storage
from payload.schema import manifest as manifest_lib
from payload.training import export as export_lib

DRIVER = Path(__file__).parent / "drivers" / "jax_pipelines_driver.py"
TOLERANCE = 1e-4
# Both runs shard the state over all 8 devices (pure FSDP): 2 processes x 4 devices = 1 x 8.
MESH = '"mesh": {"sharding": "fsdp", "data": 1, "fsdp": 8}'


def _two_processes(job_file: Path, logs: Path) -> list[tuple[int, str, str]]:
    """`tpu-payload run` as workers 0 and 1 of a two-process slice; (code, stdout, stderr)."""
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for worker in (0, 1):
        out = (logs / f"{worker}.out").open("w")
        err = (logs / f"{worker}.err").open("w")
        env = child_env(
            TPU_PAYLOAD_JAX_DISTRIBUTED=f"127.0.0.1:{port},2,{worker}",
            TPU_PRETRAIN_WORKER=str(worker),
            **cpu_devices(4),
        )
        cmd = [sys.executable, "-m", "payload", "run", "--job", str(job_file)]
        procs.append((subprocess.Popen(cmd, stdout=out, stderr=err, env=env), out, err))
    results = []
    for worker, (proc, out, err) in enumerate(procs):
        code = proc.wait(timeout=HANG_GUARD_S)
        out.close()
        err.close()
        results.append(
            (code, (logs / f"{worker}.out").read_text(), (logs / f"{worker}.err").read_text())
        )
    return results


def _shards_read(stderr: str) -> list[str]:
    line = re.search(
        r"^train: process \d of 2 reads \d+ of \d+ training shards: (.*)$", stderr, re.M
    )
    assert line, stderr[-3000:]
    return line.group(1).split(", ")


def _train_scalars(job) -> dict[int, float]:
    out: dict[int, float] = {}
    for path in sorted(Path(job.paths.logs).glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "loss":
                    out[int(event.step)] = float(tf.make_ndarray(value.tensor))
    return out


def test_two_jax_processes_match_one_and_resume(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    doc = job_document(
        tmp_path, corpus, "mlm", steps=16, decay="constant", warmup_steps=0, backend="jax",
        sharding="fsdp",
    )  # fmt: skip
    doc["train"].update(checkpoint_every=8, log_every=4, eval_every=8, global_batch_size=16)
    doc["data"].update(records_per_shard=40, eval_fraction=0.1, eval_min_sequences=16)
    single = write_job(tmp_path / "single", {**doc, "output": str(tmp_path / "single" / "out")})
    prepare_data(single)
    manifest = manifest_lib.load_manifest(single.paths.data)
    assert len(manifest.shards) >= 4, manifest.shards  # files to split between the hosts

    # One process, eight devices, two input pipelines: the global batches of two hosts.
    result = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp_path / "single" / "job.yaml"), "2"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
        env=child_env(**cpu_devices(8)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"replicas": 8, "hosts": 1' in result.stderr
    assert MESH in result.stderr

    # Two processes, stopped after the step-8 checkpoint (a run of 8 steps)...
    half = json.loads(json.dumps(doc))
    half["train"]["steps"] = 8
    multi = copy_prepared(single, tmp_path / "multi", half)
    first = _two_processes(tmp_path / "multi" / "job.yaml", tmp_path / "logs-1")
    for code, _, err in first:
        assert code == 0, err[-3000:]
    (_, out0, err0), (_, out1, err1) = first
    assert '"replicas": 8, "hosts": 2' in err0 and MESH in err0
    mine, theirs = _shards_read(err0), _shards_read(err1)
    assert not set(mine) & set(theirs), (mine, theirs)
    assert sorted(mine + theirs) == sorted(
        storage.basename(p) for p in manifest_lib.shard_paths(single.paths.data, manifest)
    )
    assert "worker 1: training as one process of the slice" in out1
    assert "tokenizer: skipped: complete" in out0 and "tokenizer:" not in out1

    # ... then resumed to 16 steps: the same result as the single process's 16 steps.
    shutil.rmtree(multi.paths.export)
    multi = write_job(tmp_path / "multi", {**doc, "output": str(tmp_path / "multi" / "out")})
    second = _two_processes(tmp_path / "multi" / "job.yaml", tmp_path / "logs-2")
    for code, _, err in second:
        assert code == 0, err[-3000:]
    assert f"resumed from {multi.paths.checkpoints}/8 at step 8" in second[0][2]
    # Both processes wrote the checkpoints (Orbax): two step directories, nothing unfinished.
    assert sorted(p.name for p in Path(multi.paths.checkpoints).iterdir()) == [
        "16",
        "8",
        "run.json",
    ]

    a = load_file(str(Path(single.paths.export, export_lib.PT_WEIGHTS)))
    b = load_file(str(Path(multi.paths.export, export_lib.PT_WEIGHTS)))
    assert sorted(a) == sorted(b)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    print(f"two processes vs one: worst weight difference {worst:.2e}")
    assert worst <= TOLERANCE, worst
    single_loss, multi_loss = _train_scalars(single), _train_scalars(multi)
    assert sorted(single_loss) == sorted(multi_loss) == [4, 8, 12, 16]
    for step, loss in single_loss.items():
        assert abs(loss - multi_loss[step]) <= TOLERANCE, (step, loss, multi_loss[step])
    single_stats = json.loads(result.stdout.strip().splitlines()[-1])
    multi_status = json.loads(Path(multi.paths.status).read_text())
    evals = [single_stats["eval_loss"], multi_status["stages"]["train"]["metrics"]["eval_loss"]]
    assert abs(evals[0] - evals[1]) <= TOLERANCE, evals
