"""Multi-host training on CPU: a loopback multi-worker cluster stands in for a TPU slice.

Two TF server processes on 127.0.0.1 (`MultiWorkerMirroredStrategy` with TF_CONFIG) play
the hosts of a slice: each runs the real `train.train()`, and its input pipeline comes from
`distribute_datasets_from_function` (one pipeline per worker, as TPUStrategy makes one per
host). The test proves what a slice relies on:

- each worker's pipeline reads a disjoint set of shards, and together they read them all;
- the losses equal a single-host run on the same data. "The same data" by construction:
  4 shards x 4 sequences and a global batch of 16, so every step of either run is the whole
  data set (full batch), however it is split between hosts. Dropout is off, and the
  objective is CLM (MLM masks are seeded per input pipeline, by design);
- a whole-cluster preemption (every process gone, new ones started) resumes from the
  chief's checkpoint and ends at the single-host run's loss;
- only the chief writes (TensorBoard event file names carry the writer's pid).

Bounded: every worker ends itself after WORKER_DEADLINE_S (a hang guard: no working run comes
near it), collectives time out after as long, and the test kills any process group left.
Ports are picked free, and a launch that lost a port to another process between picking and
binding is retried.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from train_helpers import job_document, write_corpus

from payload import manifest as mf
from payload import records, storage, tokenizer
from payload.spec import JobSpec, load_job
from payload.status import StatusWriter

HOSTS = 2
SHARDS, RECORDS_PER_SHARD = 4, 4
GLOBAL_BATCH = SHARDS * RECORDS_PER_SHARD  # full batch: every step sees all the data
STEPS, PREEMPTED_AT = 4, 2
# A guard against a hung cluster, never reached by a working one: one launch took 90 s on a
# loaded 2-core machine (load average 7); slower machines must not fail the test.
WORKER_DEADLINE_S = 900
LAUNCH_ATTEMPTS = 3

WORKER = textwrap.dedent(
    """
    import dataclasses, json, os, sys, threading

    # Self-stopping: whatever happens to the test or to a peer, this process ends.
    threading.Timer(float(sys.argv[3]), lambda: os._exit(124)).start()

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # the workers share 2 cores
    from payload import manifest as mf
    from payload import strategy, train
    from payload.spec import load_job
    from payload.status import StatusWriter

    # A collective waits for the slowest worker (TensorFlow import, tracing, the chief's
    # checkpoint): bounded only by the same guard.
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=float(sys.argv[3]))
    cluster = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    # XLA compilation would cost each process seconds and proves nothing about hosts.
    plan = dataclasses.replace(strategy.decide("cpu", "fp32"), jit_compile=False)
    runtime = strategy.Runtime(plan, cluster)
    job = load_job(sys.argv[1])
    report = {
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "pid": os.getpid(),
        "chief": runtime.is_chief,
        "hosts": runtime.num_hosts,
        "replicas": runtime.num_replicas,
    }
    if sys.argv[2] == "inspect":
        try:
            strategy.check_global_batch(3, runtime)
        except Exception as exc:  # SpecError: the one line a user would see
            report["batch_error"] = str(exc)
        # Exactly the dataset function that training uses. One batch is one epoch of this
        # worker's pipeline here; two batches are two epochs (the shard order reshuffled).
        manifest = mf.load_manifest(job.paths.data)
        fn = train.input_fn(job, manifest, 0)
        batches = iter(cluster.distribute_datasets_from_function(fn))
        report["markers_per_epoch"] = [
            sorted(
                int(token)
                for ids in cluster.experimental_local_results(next(batches)["input_ids"])
                for token in ids.numpy()[:, -1]
            )
            for _ in range(2)
        ]
    stats = train.train(job, StatusWriter(job.paths.status, job.name), runtime=runtime)
    report["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)  # the timer thread would keep the process alive
    """
)


def _free_loopback_ports(count: int) -> list[int]:
    """Distinct free ports: all held open at once, so none is handed out twice."""
    held = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def _launch(worker: Path, job_file: Path, mode: str, logs: Path) -> list[tuple[int, str, str]]:
    """HOSTS workers on fresh ports; (exit code, stdout, stderr) of each, in task order.

    Output goes to files (a chatty worker cannot block on a full pipe). When one worker
    fails, the others are stopped at once instead of waiting for it until their deadline.
    """
    ports = _free_loopback_ports(HOSTS)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for index in range(HOSTS):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            with (logs / f"{index}.out").open("w") as out, (logs / f"{index}.err").open("w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(worker), str(job_file), mode, str(WORKER_DEADLINE_S)],
                        stdout=out,
                        stderr=err,
                        env={
                            **os.environ,
                            "TF_CONFIG": json.dumps(tf_config),
                            "TF_CPP_MIN_LOG_LEVEL": "2",
                        },
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + WORKER_DEADLINE_S + 30
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            if all(code is not None for code in codes) or any(code for code in codes):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return [
        (proc.returncode, (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text())
        for i, proc in enumerate(procs)
    ]


def _run_cluster(worker: Path, job_file: Path, mode: str) -> list[dict[str, Any]]:
    """HOSTS workers on loopback, to the end; their reports in task order."""
    for attempt in range(LAUNCH_ATTEMPTS):
        results = _launch(worker, job_file, mode, job_file.parent / f"logs-{mode}-{attempt}")
        codes = [code for code, _, _ in results]
        stderr = "\n".join(err for _, _, err in results).lower()
        # A port taken by another process between picking and binding: pick again.
        lost_port = "address already in use" in stderr or "failed to add port" in stderr
        if codes == [0] * HOSTS or not lost_port:
            break
    assert codes == [0] * HOSTS, f"worker exit codes {codes}:\n" + "\n".join(
        err[-3000:] for _, _, err in results
    )
    reports = [
        json.loads(next(ln for ln in out.splitlines() if ln.startswith("REPORT "))[7:])
        for _, out, _ in results
    ]
    return sorted(reports, key=lambda r: r["task"])


def _write_job(path: Path, document: dict[str, Any]) -> JobSpec:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    return load_job(str(path))


def _write_marked_shards(job: JobSpec) -> dict[int, int]:
    """SHARDS x RECORDS_PER_SHARD sequences, each ending in its own marker token.

    Written with the payload's record writer and manifest, for the real tokenizer, so
    every check of the trainer applies (tokenizer hash, vocabulary, sizes, sha256).
    Returns marker token -> shard index.
    """
    tokenizer_json = tokenizer.tokenizer_json(job.paths.tokenizer)
    tok = tokenizer.load_tokenizer(job.paths.tokenizer)
    special = {role: tok.convert_tokens_to_ids(t) for role, t in job.special_roles.items()}
    vocab_size = len(tok)
    ordinary = [i for i in range(vocab_size) if i not in set(special.values())]
    markers, fillers = ordinary[-GLOBAL_BATCH:], ordinary[:-GLOBAL_BATCH]
    token_dtype = records.token_dtype_for(vocab_size)
    rng = np.random.default_rng(0)
    storage.makedirs(job.paths.data)
    shards, marker_shard = [], {}
    for s in range(SHARDS):
        rows = rng.choice(fillers, size=(RECORDS_PER_SHARD, job.data.seq_length))
        rows[:, -1] = markers[s * RECORDS_PER_SHARD : (s + 1) * RECORDS_PER_SHARD]
        marker_shard.update({int(m): s for m in rows[:, -1]})
        name = f"shard-{s:05d}-of-{SHARDS:05d}.tfrecord"
        path = Path(job.paths.data) / name
        with path.open("wb") as f, records.TFRecordWriter(f) as writer:
            for row in rows:
                writer.write(records.encode_record(row, token_dtype))
        data = path.read_bytes()
        shards.append(
            mf.Shard(name, RECORDS_PER_SHARD, len(data), hashlib.sha256(data).hexdigest())
        )
    manifest = mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        objective="clm",
        seq_length=job.data.seq_length,
        vocab_size=vocab_size,
        token_dtype=token_dtype,
        tokenizer_sha256=hashlib.sha256(tokenizer_json).hexdigest(),
        special_ids=special,
        shards=tuple(shards),
        total_records=GLOBAL_BATCH,
        total_tokens=GLOBAL_BATCH * job.data.seq_length,
    )
    storage.write_text(mf.manifest_path(job.paths.data), manifest.to_json())
    return marker_shard


def test_two_hosts_read_disjoint_shards_and_match_one_host(tmp_path: Path) -> None:
    import tensorflow as tf

    from payload import strategy, train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=200)
    document = job_document(
        tmp_path,
        corpus,
        "clm",
        steps=STEPS,
        global_batch_size=GLOBAL_BATCH,
        warmup_steps=1,
        decay="constant",  # the rate at step k must not depend on train.steps (resume below)
        checkpoint_every=PREEMPTED_AT,
        log_every=1,
        shuffle_buffer=GLOBAL_BATCH,
    )
    document["model"]["config"] = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    single = _write_job(
        tmp_path / "single" / "job.yaml", {**document, "output": str(tmp_path / "single" / "out")}
    )
    tokenizer.train_tokenizer(single, StatusWriter(single.paths.status, single.name))
    marker_shard = _write_marked_shards(single)

    multi_out = str(tmp_path / "multi" / "out")
    multi = _write_job(tmp_path / "multi" / "job.yaml", {**document, "output": multi_out})
    preempted_doc = {**document, "output": multi_out}
    preempted_doc["train"] = {**document["train"], "steps": PREEMPTED_AT}
    _write_job(tmp_path / "multi" / "job-preempted.yaml", preempted_doc)
    shutil.copytree(single.paths.tokenizer, multi.paths.tokenizer)
    shutil.copytree(single.paths.data, multi.paths.data)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)

    # One host: one input pipeline, one replica, the whole batch.
    plan = dataclasses.replace(strategy.decide("cpu", "fp32"), jit_compile=False)
    runtime = strategy.Runtime(plan, tf.distribute.get_strategy())
    one = train.train(single, StatusWriter(single.paths.status, single.name), runtime=runtime)

    # Two hosts, until the "preemption" after step 2: every process ends.
    first = _run_cluster(worker, tmp_path / "multi" / "job-preempted.yaml", "inspect")
    assert [(r["chief"], r["hosts"], r["replicas"]) for r in first] == [(True, 2, 2), (False, 2, 2)]
    shards_read = []
    for report in first:
        per_epoch = report["markers_per_epoch"]
        assert per_epoch[0] == per_epoch[1], "an epoch must read the same shards every time"
        shards_read.append({marker_shard[m] for m in per_epoch[0]})
        # Whole shards: every sequence of each shard this pipeline reads.
        assert len(per_epoch[0]) == len(shards_read[-1]) * RECORDS_PER_SHARD
    assert shards_read[0].isdisjoint(shards_read[1]), shards_read
    assert shards_read[0] | shards_read[1] == set(range(SHARDS)), shards_read
    assert first[0]["batch_error"] == (
        "train.global_batch_size: 3 must be a multiple of the 2 replicas of this cpu "
        "(2 hosts x 1 replicas); e.g. 2 or 4"
    )
    assert first[0]["stats"]["first_loss"] == _same(one["first_loss"])

    # A new cluster (the recreated slice) resumes from the chief's checkpoint.
    second = _run_cluster(worker, tmp_path / "multi" / "job.yaml", "train")
    for report in second:
        assert report["stats"]["resumed_from"] == PREEMPTED_AT
        assert report["stats"]["step"] == STEPS
        assert report["stats"]["loss"] == _same(one["loss"])
    assert one["loss"] < one["first_loss"]  # it learned: the comparison is not of constants

    # Written once, by the chief: checkpoints of both runs, one export, its event files only.
    ckpt = tf.train.get_checkpoint_state(multi.paths.checkpoints)
    assert ckpt is not None and ckpt.model_checkpoint_path.endswith(f"ckpt-{STEPS}")
    assert "export" in second[0]["stats"] and "export" not in second[1]["stats"]
    assert train.is_complete(multi)
    events = [p.name for p in Path(multi.paths.logs).rglob("events.out.tfevents.*")]
    writers = {name.split(".")[-3] for name in events}
    assert writers == {str(first[0]["pid"]), str(second[0]["pid"])}, events


def _same(value: float) -> Any:
    """Equal up to float summation order (the hosts' sums are added in another order)."""
    return pytest.approx(value, rel=1e-4, abs=1e-5)
