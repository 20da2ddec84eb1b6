"""Shards whose records say which record they are, for the input pipelines' tests
(test_data_pipeline.py: tf.data; test_jax_input.py: Grain)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from payload.core import records
from payload.schema import manifest as manifest_lib
from payload.spec import parse_job

SEQ = 16
VOCAB = 500
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def write_data(tmp_path: Path, objective: str, shard_sizes: tuple[int, ...], **train: object):
    doc = {
        "name": "pipe",
        "output": str(tmp_path / "out"),
        "corpus": {"paths": ["unused.txt"]},
        "tokenizer": {"kind": "wordpiece" if objective == "mlm" else "bpe", "vocab_size": VOCAB},
        "data": {"objective": objective, "seq_length": SEQ},
        "model": {"family": "bert" if objective == "mlm" else "gpt2"},
        "train": {"steps": 10, "shuffle_buffer": 64, **train},
    }
    job = parse_job(doc, source=str(tmp_path / "job.yaml"))
    data_dir = Path(job.paths.data)
    data_dir.mkdir(parents=True)
    # Record r of the data set: [cls, r (as two base-400 digits + 5), counting tokens..., sep].
    shards, first = [], 0
    for index, count in enumerate(shard_sizes):
        rows = np.zeros((count, SEQ), np.int64)
        for i in range(count):
            r = first + i
            rows[i] = [
                SPECIAL["cls"],
                5 + r // 400,
                5 + r % 400,
                *range(10, 10 + SEQ - 4),
                SPECIAL["sep"],
            ]
        name = f"shard-{index:05d}-of-{len(shard_sizes):05d}.tfrecord"
        path = data_dir / name
        with path.open("wb") as f:
            records.TFRecordWriter(f).write_framed(records.frame_records(rows, "uint16"), count)
        shards.append(
            manifest_lib.Shard(
                name, count, path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
            )
        )
        first += count
    manifest = manifest_lib.Manifest(
        format_version=manifest_lib.FORMAT_VERSION,
        objective=objective,
        seq_length=SEQ,
        vocab_size=VOCAB,
        token_dtype=records.token_dtype_for(VOCAB),
        tokenizer_sha256="0" * 64,
        special_ids=SPECIAL if objective == "mlm" else {"pad": 0, "bos": 2, "eos": 3, "unk": 1},
        shards=tuple(shards),
        total_records=first,
        total_tokens=first * SEQ,
    )
    manifest_lib.write_manifest(job.paths.data, manifest)
    return job, manifest_lib.load_manifest(job.paths.data)


def record_ids(input_ids: np.ndarray) -> list[int]:
    return [int((row[1] - 5) * 400 + row[2] - 5) for row in input_ids]
