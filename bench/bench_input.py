"""Input pipeline throughput: shards -> batches with dynamic MLM masking (sequences/s).

Writes a temporary shard set (random tokens, uint16, seq 128) with the payload's own record
writer and manifest, then times `payload.data.make_dataset` (interleave, shuffle, batch,
parse_batch, mask, prefetch) and, for contrast, the common reader of tf.train.Example
records: `parse_single_example` per record, then batch, without masking. Bounded in time:
each measurement stops after --seconds.

    .venv/bin/python bench/bench_input.py [--records 200000] [--batch 256] [--seconds 10]
        [--cores N]   # pin the process to N cores: the per-host-core rate (pod slices)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import payload  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from payload import manifest as manifest_lib
from payload import records
from payload.spec import parse_job

SEQ = 128
VOCAB = 32000
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
TARGET = 200_000
REFERENCE_RECORDS = 30_000


def write_shards(root: Path, total: int, shards: int) -> tuple[object, object]:
    doc = {
        "name": "bench",
        "output": str(root),
        "corpus": {"paths": ["unused.txt"]},
        "tokenizer": {"kind": "wordpiece", "vocab_size": VOCAB},
        "data": {"objective": "mlm", "seq_length": SEQ},
        "model": {"family": "bert"},
        "train": {"steps": 1},
    }
    job = parse_job(doc, source=str(root / "job.yaml"))
    data_dir = Path(job.paths.data)
    data_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    token_dtype = records.token_dtype_for(VOCAB)
    entries = []
    for index, count in enumerate(np.array_split(np.arange(total), shards)):
        rows = rng.integers(5, VOCAB, size=(len(count), SEQ))
        rows[:, 0] = SPECIAL["cls"]
        rows[:, -1] = SPECIAL["sep"]
        name = f"shard-{index:05d}-of-{shards:05d}.tfrecord"
        path = data_dir / name
        with path.open("wb") as f:
            records.TFRecordWriter(f).write_framed(
                records.frame_records(rows, token_dtype), len(rows)
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        entries.append(manifest_lib.Shard(name, len(rows), path.stat().st_size, digest))
    manifest = manifest_lib.Manifest(
        format_version=manifest_lib.FORMAT_VERSION,
        objective="mlm",
        seq_length=SEQ,
        vocab_size=VOCAB,
        token_dtype=token_dtype,
        tokenizer_sha256="0" * 64,
        special_ids=SPECIAL,
        shards=tuple(entries),
        total_records=total,
        total_tokens=total * SEQ,
    )
    manifest_lib.write_manifest(job.paths.data, manifest)
    return job, manifest


def measure(ds: object, batch: int, seconds: float, warmup_batches: int = 20) -> float:
    iterator = iter(ds)
    for _ in range(warmup_batches):
        next(iterator)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(iterator)
        n += 1
    return n * batch / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument(
        "--batch",
        default="256,1024",
        help="host batch sizes to measure (the pipeline masks one host batch at a time)",
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--cores",
        type=int,
        default=0,
        help="pin this process to that many cores before TensorFlow starts (0: all); "
        "TF and tf.data size their thread pools from the affinity mask",
    )
    args = parser.parse_args()
    if args.cores:
        available = sorted(os.sched_getaffinity(0))
        if not 0 < args.cores <= len(available):
            parser.error(f"--cores must be 1..{len(available)}, got {args.cores}")
        os.sched_setaffinity(0, available[: args.cores])
    cores = len(os.sched_getaffinity(0))

    import tensorflow as tf

    from payload import data as data_lib

    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        t0 = time.perf_counter()
        job, manifest = write_shards(Path(tmp), args.records, args.shards)
        print(
            f"wrote {args.records} records x {SEQ} tokens in {args.shards} shards "
            f"({time.perf_counter() - t0:.1f}s); {cores} of {os.cpu_count()} cores"
        )
        batches = [int(b) for b in args.batch.split(",")]
        results = {}
        for batch in batches:
            ds = data_lib.make_dataset(job, manifest, batch_size=batch, seed=0)
            results[batch] = measure(ds, batch, args.seconds)
            print(
                f"payload pipeline, host batch {batch} (interleave, shuffle, batch, "
                f"parse_batch, mask with {job.data.max_predictions} slots): "
                f"{results[batch]:,.0f} sequences/s ({results[batch] * SEQ / 1e6:.1f}M tokens/s, "
                f"{results[batch] / cores:,.0f} per core)"
            )
        best_batch = max(results, key=results.__getitem__)
        ours = results[best_batch]

        # The common reference (HF's TPU example, google-research/bert): tf.train.Example
        # records with an int64_list feature, parse_single_example per record, then batch.
        reference_path = Path(tmp) / "reference.tfrecord"
        rng = np.random.default_rng(1)
        with tf.io.TFRecordWriter(str(reference_path)) as writer:
            for row in rng.integers(5, VOCAB, size=(REFERENCE_RECORDS, SEQ)):
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=row.tolist()))
                example = tf.train.Example(
                    features=tf.train.Features(feature={"input_ids": feature})
                )
                writer.write(example.SerializeToString())
        spec = {"input_ids": tf.io.FixedLenFeature([SEQ], tf.int64)}
        reference = (
            tf.data.TFRecordDataset(str(reference_path))
            .repeat()
            .shuffle(10000)
            .map(lambda r: tf.io.parse_single_example(r, spec), num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batches[0], drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
        )
        slow = measure(reference, batches[0], min(args.seconds, 5.0), warmup_batches=5)
        print(
            f"reference: tf.train.Example int64 records, parse_single_example then batch "
            f"{batches[0]}, no masking: {slow:,.0f} sequences/s"
        )
        if args.cores:
            print(f"per host core: {ours / cores:,.0f} sequences/s at host batch {best_batch}")
        else:
            verdict = "OK" if ours >= TARGET else "BELOW TARGET"
            print(
                f"target >= {TARGET:,} sequences/s with masking: {verdict} at host batch "
                f"{best_batch} ({ours / slow:.1f}x the reference)"
            )
        load = os.getloadavg()[0]
        print(f"load average during the run: {load:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
