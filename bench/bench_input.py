"""Input pipeline throughput: shards -> batches with dynamic MLM masking (sequences/s).

Writes a temporary shard set (random tokens, uint16, seq 128) with the payload's own record
writer and manifest, then times, on the same shards, the TF backend's tf.data pipeline
(`payload.backends.tf.input.make_dataset`: interleave, shuffle, batch, parse_batch, mask, prefetch)
and the JAX backend's Grain pipeline (`payload.backends.jax.input.make_batches`: window reads,
CRC checks, numpy masking on Grain's threads), alternating rounds of each so that a busy
machine slows both alike; and, for contrast, the common reader of tf.train.Example records
(`parse_single_example` per record, then batch, without masking). Then what a 1B Llama
(seq 2048) step needs per second on one v5e chip at the plan's MFU (payload/plan/estimate.py)
against the Grain pipeline's rate on causal-LM shards of that length. Bounded in time: each
measurement stops after --seconds.

    .venv/bin/python bench/bench_input.py [--records 200000] [--batch 256] [--seconds 10]
        [--cores N]   # pin the process to N cores: the per-host-core rate (pod slices)
        [--rounds R]  # alternating tf.data / Grain rounds per host batch (default 2)
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
from payload.core import records
from payload.schema import manifest as manifest_lib
from payload.spec import parse_job

SEQ = 128
VOCAB = 32000
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
TARGET = 200_000
REFERENCE_RECORDS = 30_000
LLAMA_SEQ = 2048
LLAMA_HOST_BATCH = 16  # rows per host batch of the CLM measurement


def write_shards(
    root: Path, total: int, shards: int, *, objective: str = "mlm", seq: int = SEQ
) -> tuple[object, object]:
    clm = objective == "clm"
    doc = {
        "name": "bench",
        "output": str(root),
        "corpus": {"paths": ["unused.txt"]},
        "tokenizer": {"kind": "bpe" if clm else "wordpiece", "vocab_size": VOCAB},
        "data": {"objective": objective, "seq_length": seq},
        "model": {"family": "llama", "size": "1b"} if clm else {"family": "bert"},
        "train": {"steps": 1},
    }
    job = parse_job(doc, source=str(root / "job.yaml"))
    data_dir = Path(job.paths.data)
    data_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    token_dtype = records.token_dtype_for(VOCAB)
    entries = []
    for index, count in enumerate(np.array_split(np.arange(total), shards)):
        rows = rng.integers(5, VOCAB, size=(len(count), seq))
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
        objective=objective,
        seq_length=seq,
        vocab_size=VOCAB,
        token_dtype=token_dtype,
        tokenizer_sha256="0" * 64,
        special_ids={"pad": 0, "unk": 1, "bos": 2, "eos": 3} if clm else SPECIAL,
        shards=tuple(entries),
        total_records=total,
        total_tokens=total * seq,
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
    rate = n * batch / (time.perf_counter() - start)
    if hasattr(iterator, "close"):
        iterator.close()
    return rate


def llama_1b_need() -> tuple[float, float]:
    """(tokens/s, FLOPs per token) one v5e chip trains a Llama 1B at seq 2048 at the plan's
    MFU (payload/plan/estimate.py: DEFAULT_MFU, MaxText's FLOPs per token, Google's peak)."""
    from payload.plan import estimate

    shape = estimate.model_shape("llama", "1b", {}, 32768)
    per_token = estimate.flops_per_token(shape, LLAMA_SEQ)
    chip = estimate.accelerator("v5litepod-1")
    return chip.peak_flops * estimate.DEFAULT_MFU / per_token, per_token


def compare(job: object, manifest: object, batches: list[int], args: object, cores: int) -> dict:
    """tf.data vs Grain on the same shards, alternating rounds; the tf.data rates by batch."""
    from payload.backends.jax import input as grain_input
    from payload.backends.tf import input as data_lib

    results, grain_results = {}, {}
    for batch in batches:
        tf_rates, grain_rates = [], []
        for _ in range(args.rounds):
            ds = data_lib.make_dataset(job, manifest, batch_size=batch, seed=0)
            tf_rates.append(measure(ds, batch, args.seconds))
            grain = grain_input.make_batches(job, manifest, batch_size=batch, seed=0)
            grain_rates.append(measure(grain, batch, args.seconds))
        results[batch], grain_results[batch] = max(tf_rates), max(grain_rates)
        for name, rates in (
            (
                "tf.data pipeline (TF backend: interleave, shuffle, batch, parse_batch, "
                f"mask with {job.data.max_predictions} slots)",
                tf_rates,
            ),
            (
                "Grain pipeline (JAX backend: window reads + CRCs, numpy mask, "
                f"{grain_input.BATCH_THREADS} threads)",
                grain_rates,
            ),
        ):
            best = max(rates)
            print(
                f"{name}, host batch {batch}: {best:,.0f} sequences/s "
                f"({best * SEQ / 1e6:.1f}M tokens/s, {best / cores:,.0f} per core; rounds: "
                f"{', '.join(f'{r:,.0f}' for r in rates)})"
            )
        print(
            f"  Grain / tf.data at host batch {batch}: {grain_results[batch] / results[batch]:.2f}x"
        )
    return results


def llama_case(root: Path, args: object) -> None:
    """The JAX backend's Llama case: causal-LM shards at seq 2048, against what one v5e
    chip consumes at the plan's MFU."""
    from payload.backends.jax import input as grain_input

    need, per_token = llama_1b_need()
    clm_records = max(2000, args.records // 64)
    clm_job, clm_manifest = write_shards(
        root, clm_records, args.shards, objective="clm", seq=LLAMA_SEQ
    )
    clm = grain_input.make_batches(clm_job, clm_manifest, batch_size=LLAMA_HOST_BATCH, seed=0)
    clm_rate = measure(clm, LLAMA_HOST_BATCH, args.seconds, warmup_batches=5) * LLAMA_SEQ
    print(
        f"Llama 1B, seq {LLAMA_SEQ}, one v5e chip at {need * per_token / 197e12:.0%} MFU "
        f"({per_token / 1e9:.2f} GFLOPs/token): needs {need:,.0f} tokens/s; the Grain "
        f"pipeline (causal LM, host batch {LLAMA_HOST_BATCH}) gives {clm_rate:,.0f} "
        f"tokens/s = {clm_rate / need:.0f}x one chip's need, {clm_rate / need / 8:.1f}x "
        "a v5litepod-8 host's (8 chips)"
    )


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
    parser.add_argument("--rounds", type=int, default=2)
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

    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        t0 = time.perf_counter()
        job, manifest = write_shards(Path(tmp), args.records, args.shards)
        print(
            f"wrote {args.records} records x {SEQ} tokens in {args.shards} shards "
            f"({time.perf_counter() - t0:.1f}s); {cores} of {os.cpu_count()} cores"
        )
        batches = [int(b) for b in args.batch.split(",")]
        results = compare(job, manifest, batches, args, cores)
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
        llama_case(Path(tmp) / "clm", args)
        load = os.getloadavg()[0]
        print(f"load average during the run: {load:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
