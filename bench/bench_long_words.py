"""Long-word benchmark: tokenizer + encode time on the bundled corpus alone vs with
whitespace-free lines added (a base64 blob, and corpus text with its whitespace removed,
like a minified file or glued URL lists), for each tokenizer kind.

    .venv/bin/python bench/bench_long_words.py                  # 300 KB + 150 KB lines
    .venv/bin/python bench/bench_long_words.py --line-kb 100 --kinds bpe
    .venv/bin/python bench/bench_long_words.py --max-word-length 65536   # (almost) no limit

Each run is the real CLI (`tpu-payload tokenizer`, then `encode`) in a child process with a
timeout; peak RSS is the children's ru_maxrss. It prints the time ratio (with lines / alone;
wall and CPU seconds, the latter steadier on a shared host) next to the size ratio; figures
are printed, not asserted.
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "corpus"
CHILD_TIMEOUT_S = 900
FAMILY = {"wordpiece": "bert", "bpe": "roberta", "unigram": "roberta"}


def odd_lines(kb: int) -> str:
    rng = random.Random(0)
    blob = base64.b64encode(rng.randbytes(kb * 1024 * 3 // 4)).decode()
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS.glob("*.txt")))
    glued = re.sub(r"\s+", "", text)
    glued = (glued * (kb * 1024 // max(len(glued.encode()), 1) + 1))[: kb * 1024 // 2]
    return f"{blob}\n\n{glued}\n"


def run_stages(work: Path, kind: str, extra: str | None, max_word_length: int) -> dict:
    corpus_dir = work / "corpus"
    corpus_dir.mkdir(parents=True)
    for path in CORPUS.glob("*.txt"):
        (corpus_dir / path.name).write_bytes(path.read_bytes())
    if extra is not None:
        (corpus_dir / "zz-odd.txt").write_text(extra, encoding="utf-8")
    size = sum(p.stat().st_size for p in corpus_dir.iterdir())
    job = {
        "name": "bench",
        "output": str(work / "out"),
        "corpus": {"paths": [str(corpus_dir)]},
        "tokenizer": {"kind": kind, "vocab_size": 8000, "max_word_length": max_word_length},
        "data": {"objective": "mlm", "seq_length": 128, "workers": 2},
        "model": {"family": FAMILY[kind]},
        "train": {"steps": 1},
    }
    job_path = work / "job.yaml"
    job_path.write_text(yaml.safe_dump(job))
    times = {}
    cpu_before = _children_cpu()
    for stage in ("tokenizer", "encode"):
        started = time.perf_counter()
        try:
            result = subprocess.run(
                [sys.executable, "-m", "payload", stage, "--job", str(job_path)],
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"size": size, "error": f"{stage} timed out after {CHILD_TIMEOUT_S}s"}
        times[stage] = time.perf_counter() - started
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["?"])[-1]
            return {"size": size, "error": f"{stage} exit {result.returncode}: {tail}"}
    return {"size": size, **times, "cpu": _children_cpu() - cpu_before}


def _children_cpu() -> float:
    """CPU seconds of finished children (and theirs): steadier than wall time on a busy host."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--line-kb", type=int, default=300, help="size of the base64 line")
    parser.add_argument("--kinds", default="wordpiece,bpe,unigram")
    parser.add_argument("--max-word-length", type=int, default=100)
    args = parser.parse_args()
    extra = odd_lines(args.line_kb)
    print(
        f"max_word_length={args.max_word_length}; added: a {args.line_kb} KB base64 line and "
        f"a {args.line_kb // 2} KB line of corpus text without whitespace"
    )
    print(
        f"{'kind':10} {'corpus':>8} {'MB':>6} {'tokenizer s':>12} {'encode s':>9} "
        f"{'total s':>8} {'CPU s':>7}"
    )
    for kind in args.kinds.split(","):
        rows = {}
        for label, text in (("alone", None), ("+lines", extra)):
            with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
                row = run_stages(Path(tmp), kind, text, args.max_word_length)
            rows[label] = row
            if "error" in row:
                print(f"{kind:10} {label:>8} {row['size'] / 1e6:6.2f}  {row['error']}")
                continue
            total = row["tokenizer"] + row["encode"]
            row["total"] = total
            print(
                f"{kind:10} {label:>8} {row['size'] / 1e6:6.2f} {row['tokenizer']:12.2f} "
                f"{row['encode']:9.2f} {total:8.2f} {row['cpu']:7.2f}"
            )
        alone, lines = rows["alone"], rows["+lines"]
        if "total" in alone and "total" in lines:
            print(
                f"{kind:10} time ratio {lines['total'] / alone['total']:.2f} (CPU "
                f"{lines['cpu'] / alone['cpu']:.2f}) vs size ratio "
                f"{lines['size'] / alone['size']:.2f}"
            )
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS of any child: {peak:.0f} MB (cpu count {os.cpu_count()})")


if __name__ == "__main__":
    main()
