"""A JAX CLI run's start to first step, for two source trees (before/after a change).

Prepares one small job (tokenizer + shards, BERT tiny MLM, `train.backend: jax`), then runs
`python -m payload train` from each tree in turn (`--rounds` times, alternating, each on a
fresh copy of the prepared output) and reports, per tree, the seconds from process start
to the first `step N/M` log line (log_every 1: the first chunk's end, compiling included),
to the end of the process, and whether TensorFlow was imported (the child's sitecustomize
watch: tests/payload/no_tensorflow). Both trees share one JAX compilation cache, filled by
a first untimed run of each, so the timed runs load their programs instead of compiling.

    .venv/bin/python bench/bench_jax_startup.py --before /work/main:/work/main/.venv \\
        --after .:.venv [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "payload"))
sys.path.insert(0, str(ROOT))

STEP_LINE = "step 1/"
IMPORTED = "no_tensorflow: tensorflow was imported"


def prepare(root: Path) -> Path:
    from train_helpers import job_document, prepare_data, write_corpus, write_job

    corpus = write_corpus(root / "corpus.txt", lines=400)
    doc = job_document(root, corpus, "mlm", steps=4, backend="jax", log_every=1)
    doc["train"].update(checkpoint_every=4, warmup_steps=1)
    job = write_job(root, doc)
    prepare_data(job)
    return root


def run_once(tree: Path, venv: Path, prepared: Path, work: Path, cache: Path) -> dict:
    """One timed `train` run on a fresh copy of the prepared job."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(prepared, work)
    job = work / "job.yaml"
    job.write_text(job.read_text().replace(str(prepared), str(work)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "payload" / "no_tensorflow"), str(tree)]
        ),
        "TPU_PAYLOAD_TEST_TENSORFLOW": "watch",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "payload", "train", "--job", str(job)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(tree),
    )
    first_step = None
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if first_step is None and line.startswith(STEP_LINE):
            first_step = time.perf_counter() - start
    code = proc.wait(timeout=900)
    total = time.perf_counter() - start
    if code != 0 or first_step is None:
        raise SystemExit(f"{tree}: train failed ({code}):\n{''.join(lines)[-3000:]}")
    return {
        "first_step": first_step,
        "total": total,
        "tensorflow": any(IMPORTED in line for line in lines),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="TREE:VENV of the baseline")
    parser.add_argument("--after", required=True, help="TREE:VENV of the change")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {}
    for name in ("before", "after"):
        tree, _, venv = getattr(args, name).partition(":")
        trees[name] = (Path(tree).resolve(), Path(venv).absolute())
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        base = Path(tmp)
        (base / "prepared").mkdir()
        prepared = prepare(base / "prepared")
        cache = base / "jax-cache"
        for name, (tree, venv) in trees.items():  # fill the compilation cache, untimed
            run_once(tree, venv, prepared, base / f"warm-{name}", cache)
        results: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, (tree, venv) in trees.items():
                results[name].append(run_once(tree, venv, prepared, base / name, cache))
        for name, runs in results.items():
            firsts = sorted(r["first_step"] for r in runs)
            totals = sorted(r["total"] for r in runs)
            print(
                f"{name} ({trees[name][0]}): start to first step median "
                f"{firsts[len(firsts) // 2]:.1f} s (runs {', '.join(f'{x:.1f}' for x in firsts)}); "
                f"whole process median {totals[len(totals) // 2]:.1f} s; TensorFlow imported: "
                f"{sorted({r['tensorflow'] for r in runs})}"
            )
        gain = [
            b["first_step"] - a["first_step"]
            for b, a in zip(results["before"], results["after"], strict=True)
        ]
        print(
            f"after - before, start to first step, per round: "
            f"{', '.join(f'{-g:+.1f} s' for g in gain)}"
        )
        print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
