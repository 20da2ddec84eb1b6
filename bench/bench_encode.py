"""Encode benchmark: our encoder vs raw `tokenizers` batch encoding, bytes/token, peak RSS.

    .venv/bin/python bench/bench_encode.py            # 50 MB corpus, RSS at 50 vs 200 MB
    .venv/bin/python bench/bench_encode.py --quick    # 5 MB vs 20 MB, about a minute
    .venv/bin/python bench/bench_encode.py --mb 50 --rss-mb 0   # skip the RSS comparison

Everything runs in one invocation on the same generated corpus (examples/generate_corpus.py,
seeded): a WordPiece tokenizer (vocab 32,000) is trained on the first few MB, then

* raw: `tokenizers.Tokenizer.encode_batch` (Rust, all cores) over every document, timed
  around the encode calls only; also `encode_batch_fast` (no offsets: what the encoder uses);
* ours: `payload.data.encode.stage.encode` in a fresh child process (spawned workers, packing,
framing,
  sha256, shard files, manifest), timed around the call; throughput is counted in the same
  corpus tokens as raw;
* peak RSS of the encode child (VmHWM) and of its workers (/proc sampled every 50 ms) for
  the base corpus and for a corpus ``--rss-mb`` large.

Figures are printed, not asserted. Each child has a timeout, so the run is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
CHILD_TIMEOUT_S = 1800
SEQ_LENGTH = 128
VOCAB = 32_000

CHILD = r"""
import json, os, sys, threading, time
from pathlib import Path
from payload import spec
from payload.data.encode import stage
from payload.core.status import StatusWriter

def rss_kb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0

def children(pid):
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]

peak = {"total": 0, "worker": 0}
done = threading.Event()

def sample():
    me = os.getpid()
    while not done.is_set():
        workers = [rss_kb(c) for c in children(me)]
        peak["worker"] = max([peak["worker"], *workers])
        peak["total"] = max(peak["total"], rss_kb(me) + sum(workers))
        time.sleep(0.05)

job = spec.load_job(sys.argv[1])
status = StatusWriter(job.paths.status, job.name, min_interval_s=30)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
manifest = stage.encode(job, status)
seconds = time.perf_counter() - start
done.set()
thread.join()
# VmHWM, not getrusage: ru_maxrss survives execve and would include the parent's memory.
hwm = next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines()
           if l.startswith("VmHWM:"))
print(json.dumps({
    "seconds": seconds,
    "records": manifest.total_records,
    "tokens": manifest.total_tokens,
    "bytes": sum(s.bytes for s in manifest.shards),
    "shards": len(manifest.shards),
    "documents": manifest.corpus["documents"],
    "rss_main_mb": hwm / 1024,
    "rss_worker_mb": peak["worker"] / 1024,
    "rss_total_mb": peak["total"] / 1024,
}))
"""


def write_job(root: Path, corpus: Path, name: str, workers: int) -> Path:
    import yaml

    doc = {
        "name": name,
        "output": str(root / name),
        "corpus": {"paths": [str(corpus)]},
        "tokenizer": {"kind": "wordpiece", "vocab_size": VOCAB},
        "data": {
            "objective": "mlm",
            "seq_length": SEQ_LENGTH,
            "records_per_shard": 20_000,
            "workers": workers,
        },
        "model": {"family": "bert", "size": "tiny"},
        "train": {"steps": 1},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_child(job_path: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(job_path)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"encode child failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def raw_tokenizer_throughput(
    tokenizer_json: Path, corpus: Path, method: str = "encode_batch"
) -> tuple[float, int]:
    """Corpus tokens/s of Rust batch encoding alone (documents prepared beforehand)."""
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    text = corpus.read_text(encoding="utf-8")
    docs = [d.strip() for d in re.split(r"\n[ \t\r\f\v]*\n", text) if d.strip()]
    del text
    tokens = 0
    seconds = 0.0
    batch = 4096
    for i in range(0, len(docs), batch):
        start = time.perf_counter()
        encodings = getattr(tok, method)(docs[i : i + batch], add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(e.ids) for e in encodings)
    return tokens / seconds, tokens


def main() -> None:  # noqa: PLR0915
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="base corpus size (MB)")
    parser.add_argument(
        "--rss-mb", type=float, default=200.0, help="larger corpus for RSS; 0 skips"
    )
    parser.add_argument("--quick", action="store_true", help="5 MB and 20 MB")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: temp)")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.rss_mb = 5.0, 20.0

    from generate_corpus import write_corpus

    from payload import spec
    from payload.core import records
    from payload.core.status import StatusWriter
    from payload.data import tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-encode-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        corpus = root / f"corpus-{args.mb:g}mb.txt"
        sample = root / "sample.txt"
        print(f"generating {args.mb:g} MB corpus ...", flush=True)
        write_corpus(corpus, int(args.mb * 1e6), seed=1, rich=True)
        write_corpus(sample, int(min(args.mb, 5.0) * 1e6), seed=7, rich=True)

        print(f"training a wordpiece tokenizer (vocab {VOCAB}) on 5 MB ...", flush=True)
        tok_job = spec.load_job(str(write_job(root, sample, "tok", args.workers)))
        tokenizer.train_tokenizer(tok_job, StatusWriter(tok_job.paths.status, "tok"))

        def job_for(name: str, path: Path) -> Path:
            job_path = write_job(root, path, name, args.workers)
            job = spec.load_job(str(job_path))
            import shutil

            shutil.copytree(tok_job.paths.tokenizer, job.paths.tokenizer)
            return job_path

        print("raw tokenizers encode_batch ...", flush=True)
        tok_file = Path(tok_job.paths.tokenizer, "tokenizer.json")
        raw_tps, corpus_tokens = raw_tokenizer_throughput(tok_file, corpus)
        fast_tps, _ = raw_tokenizer_throughput(tok_file, corpus, "encode_batch_fast")

        print(f"payload encode ({args.workers} workers) ...", flush=True)
        ours = run_child(job_for("base", corpus))
        ours_tps = corpus_tokens / ours["seconds"]

        vocab = len(tokenizer.load_tokenizer(tok_job.paths.tokenizer))
        itemsize = 2 if records.token_dtype_for(vocab) == "uint16" else 4
        print()
        print(f"corpus: {args.mb:g} MB, {ours['documents']} documents, {corpus_tokens} tokens")
        print(f"raw tokenizers encode_batch : {raw_tps / 1e3:8.0f}k tokens/s")
        print(f"raw encode_batch_fast       : {fast_tps / 1e3:8.0f}k tokens/s (no offsets)")
        print(
            f"payload encode              : {ours_tps / 1e3:8.0f}k tokens/s "
            f"({ours['seconds']:.1f} s, {ours_tps / raw_tps:.2f}x encode_batch, "
            f"{ours_tps / fast_tps:.2f}x encode_batch_fast)"
        )
        print(
            f"output                      : {ours['bytes'] / ours['tokens']:.3f} bytes/token at "
            f"length {SEQ_LENGTH}, vocab {vocab} ({records.token_dtype_for(vocab)}: "
            f"{itemsize:.3f} ids + {16 / SEQ_LENGTH:.3f} TFRecord framing; target <= 2.2)"
        )
        print(
            f"peak RSS ({args.mb:g} MB)       : main {ours['rss_main_mb']:.0f} MB, "
            f"largest worker {ours['rss_worker_mb']:.0f} MB, "
            f"all processes {ours['rss_total_mb']:.0f} MB"
        )
        if args.rss_mb:
            big = root / f"corpus-{args.rss_mb:g}mb.txt"
            print(f"generating {args.rss_mb:g} MB corpus for the RSS comparison ...", flush=True)
            write_corpus(big, int(args.rss_mb * 1e6), seed=2, rich=True)
            large = run_child(job_for("large", big))
            print(
                f"peak RSS ({args.rss_mb:g} MB)      : main {large['rss_main_mb']:.0f} MB, "
                f"largest worker {large['rss_worker_mb']:.0f} MB, "
                f"all processes {large['rss_total_mb']:.0f} MB "
                f"({large['tokens'] / large['seconds'] / 1e3:.0f}k packed tokens/s)"
            )


if __name__ == "__main__":
    main()
