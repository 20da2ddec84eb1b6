"""The two training backends on the same job: steps/s and held-out loss, TF vs JAX.

    .venv/bin/python bench/bench_backends.py [--steps 200] [--rounds 3] [--size tiny]

The bundled corpus (examples/corpus) is tokenized and encoded once; then `tpu-payload train`
(the real CLI, each run in its own process and output directory with a copy of the same
tokenizer and shards) trains the same BERT MLM (batch 32 x 128, the example job's schedule)
with `train.backend: tf` and `train.backend: jax` in turn, and the JAX backend once more without
its CPU oneDNN matmuls (TPU_PAYLOAD_CPU_ONEDNN=0, payload/backends/jax/program.py
CPU_TRAIN_OPTIONS): TF, JAX, JAX without oneDNN, TF, ... so that the machine's load hits all
alike. Reported per run: the trainer's mean steps/s (compilation
excluded: the first chunk is not counted, payload/training/shared.py Meter) and the held-out loss
after the same steps, and the machine's 1-minute load average when it ended (on a shared
machine the two backends' ratio in one round moves with the load: they use the cores
differently; docs/performance.md); then each side's median and the JAX/TF ratios of each
round. Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def job(output: Path, steps: int, size: str, backend: str) -> dict:
    document = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    document["output"] = str(output)
    document["corpus"]["paths"] = [str(REPO / "examples" / "corpus" / "*.txt")]
    document["model"]["size"] = size
    document["train"].update(
        steps=steps,
        warmup_steps=steps // 10,
        checkpoint_every=steps,
        log_every=50,
        eval_every=0,  # held out only at the end
        backend=backend,
    )
    return document


# The sides of each round: (name, train.backend, extra environment).
SIDES = (
    ("tf", "tf", {}),
    ("jax", "jax", {}),
    ("jax, no oneDNN", "jax", {"TPU_PAYLOAD_CPU_ONEDNN": "0"}),
)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "payload", *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
    )
    if result.returncode != 0:
        sys.exit(f"tpu-payload {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def summary_value(stdout: str, key: str) -> float:
    match = re.search(rf"\b{key}=([0-9.eE+-]+)", stdout)
    if not match:
        sys.exit(f"no {key} in the train summary:\n{stdout[-2000:]}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="tiny", choices=("tiny", "mini", "small"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        root = Path(tmp)
        data_job = root / "data.yaml"
        data_job.write_text(yaml.safe_dump(job(root / "data", args.steps, args.size, "tf")))
        cli("tokenizer", "--job", str(data_job))
        cli("encode", "--job", str(data_job))
        results: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in SIDES}
        for round_index in range(args.rounds):
            for side, (name, backend, env) in enumerate(SIDES):
                out = root / f"{backend}-{side}-{round_index}"
                for part in ("tokenizer", "data"):
                    shutil.copytree(root / "data" / part, out / part)
                spec = root / f"{backend}-{side}-{round_index}.yaml"
                spec.write_text(yaml.safe_dump(job(out, args.steps, args.size, backend)))
                stdout = cli("train", "--job", str(spec), env=env).stdout
                rate = summary_value(stdout, "steps_per_second")
                loss = summary_value(stdout, "eval_loss")
                results[name].append((rate, loss))
                print(
                    f"round {round_index + 1} {name:>14}: {rate:.3f} steps/s, "
                    f"held-out loss {loss:.4f} after {args.steps} steps, "
                    f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
                    flush=True,
                )
                shutil.rmtree(out)
    print(f"\nBERT {args.size}, batch 32 x 128, {args.steps} steps, {args.rounds} rounds")
    print("          side  median steps/s  best   held-out loss (median)")
    for name, runs in results.items():
        rates = [r for r, _ in runs]
        losses = [loss for _, loss in runs]
        print(
            f"{name:>14}  {statistics.median(rates):14.3f}  {max(rates):5.3f}  "
            f"{statistics.median(losses):.4f}"
        )
    for name in ("jax", "jax, no oneDNN"):
        ratios = [j[0] / t[0] for t, j in zip(results["tf"], results[name], strict=True)]
        print(f"{name} / tf steps/s per round: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
