"""The JAX backend's training loop, before and after a change: steps/s of the same job.

    .venv/bin/python bench/bench_jax_loop.py --baseline REV [--steps 200] [--rounds 3]
        [--size tiny] [--log-every 10]

REV's `payload/` (git archive, into a temporary directory) and this checkout's run the same
`tpu-payload train` (the real CLI, each run in its own process and output directory with a
copy of the same tokenizer and shards: BERT MLM, batch 32 x 128, the example job's schedule,
`train.backend: jax`, the spec's default `log_every: 10`, one checkpoint at the end, the
held-out evaluation only at the end), alternately — baseline, current, baseline, current,
... — so that the machine's load hits both alike. Reported per run: the trainer's mean
steps/s (compilation excluded: the first chunk is not counted, payload/training/shared.py Meter)
and the held-out loss; then each side's median and the current/baseline ratio per round.
Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from bench_backends import summary_value  # the train summary's figures, read alike

REPO = Path(__file__).resolve().parents[1]


def job(output: Path, steps: int, size: str, log_every: int) -> dict:
    document = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    document["output"] = str(output)
    document["corpus"]["paths"] = [str(REPO / "examples" / "corpus" / "*.txt")]
    document["model"]["size"] = size
    document["train"].update(
        steps=steps,
        warmup_steps=steps // 10,
        checkpoint_every=steps,
        log_every=log_every,
        eval_every=0,  # held out only at the end
        backend="jax",
    )
    return document


def cli(source: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`tpu-payload ARGS` with the `payload` package of `source` first on the path."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(source)}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-m", "payload", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=source,
    )
    if result.returncode != 0:
        sys.exit(f"tpu-payload {' '.join(args)} ({source}) failed:\n{result.stderr[-3000:]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="tiny", choices=("tiny", "mini", "small"))
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-jax-loop-") as tmp:
        root = Path(tmp)
        baseline = root / "baseline"
        baseline.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.baseline, "payload"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
        sides = {"baseline": baseline, "current": REPO}
        data_job = root / "data.yaml"
        data_job.write_text(yaml.safe_dump(job(root / "data", args.steps, args.size, 10)))
        cli(REPO, "tokenizer", "--job", str(data_job))
        cli(REPO, "encode", "--job", str(data_job))
        results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        for round_index in range(args.rounds):
            for side, source in sides.items():
                out = root / f"{side}-{round_index}"
                for part in ("tokenizer", "data"):
                    shutil.copytree(root / "data" / part, out / part)
                spec = root / f"{side}-{round_index}.yaml"
                spec.write_text(yaml.safe_dump(job(out, args.steps, args.size, args.log_every)))
                stdout = cli(source, "train", "--job", str(spec)).stdout
                rate = summary_value(stdout, "steps_per_second")
                loss = summary_value(stdout, "eval_loss")
                results[side].append((rate, loss))
                print(
                    f"round {round_index + 1} {side:>8}: {rate:.3f} steps/s, "
                    f"held-out loss {loss:.4f} after {args.steps} steps",
                    flush=True,
                )
                shutil.rmtree(out)
    print(
        f"\nJAX backend, BERT {args.size}, batch 32 x 128, {args.steps} steps, "
        f"log_every {args.log_every}, {args.rounds} rounds; baseline {args.baseline}"
    )
    print("    side  median steps/s  best   held-out loss (median)")
    for side, runs in results.items():
        rates = [r for r, _ in runs]
        losses = [loss for _, loss in runs]
        print(
            f"{side:>8}  {statistics.median(rates):14.3f}  {max(rates):5.3f}  "
            f"{statistics.median(losses):.4f}"
        )
    ratios = [c[0] / b[0] for b, c in zip(results["baseline"], results["current"], strict=True)]
    print(f"current / baseline steps/s per round: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
