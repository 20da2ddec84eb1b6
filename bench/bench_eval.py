"""What held-out evaluation costs training: the tiny config with eval every 100 steps vs none.

Runs the real stages on the bundled corpus (examples/tiny.yaml: tiny BERT, seq 128, batch
32) twice from the same data: `train.eval_every: 100` and `0` (the final evaluation only).
Prints the training loop's steps/s (evaluation time excluded, as the trainer logs it), the
wall-clock steps/s of the whole train call (evaluation included), and the held-out figures.
Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import yaml

import payload  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from payload.backends.tf import train
from payload.core.status import StatusWriter
from payload.data import tokenizer
from payload.data.encode import stage
from payload.spec import load_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _job(root: Path, steps: int, eval_every: int):
    doc = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    doc["corpus"]["paths"] = [str(EXAMPLES / "corpus" / "*.txt")]
    doc["output"] = str(root / "out")
    doc["train"].update(steps=steps, eval_every=eval_every, checkpoint_every=steps, log_every=50)
    root.mkdir(parents=True, exist_ok=True)
    (root / "job.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    return load_job(str(root / "job.yaml"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        base = _job(Path(tmp, "data"), args.steps, 0)
        status = StatusWriter(base.paths.status, base.name)
        tokenizer.train_tokenizer(base, status)
        manifest = stage.encode(base, status)
        print(
            f"held-out split: {manifest.eval_records} sequences "
            f"(training: {manifest.total_records})"
        )
        results = {}
        for eval_every in (0, 100):
            job = _job(Path(tmp, f"eval-{eval_every}"), args.steps, eval_every)
            shutil.copytree(base.paths.tokenizer, job.paths.tokenizer)
            shutil.copytree(base.paths.data, job.paths.data)
            started = time.perf_counter()
            stats = train.train(job, StatusWriter(job.paths.status, job.name))
            wall = time.perf_counter() - started
            results[eval_every] = (stats, wall)
        print(f"\ntiny BERT, {args.steps} steps, batch 32, seq 128, CPU:")
        for eval_every, (stats, wall) in results.items():
            label = "eval every 100 steps" if eval_every else "no periodic eval (final only)"
            print(
                f"  {label:30s} training loop {stats['steps_per_second']:.2f} steps/s, "
                f"whole train call {args.steps / wall:.2f} steps/s ({wall:.1f} s incl. compile, "
                f"final eval, export); held-out loss {stats['eval_loss']:.4f}, "
                f"ppl {stats['eval_perplexity']:.2f}, acc {stats['eval_accuracy']:.4f}"
            )
        stats = results[100][0]
        per_eval = stats["eval_seconds"]  # the final evaluation: warm (the one at 100 compiled)
        per_step = 1.0 / stats["steps_per_second"]
        print(
            f"  one held-out evaluation ({stats['eval_sequences']} sequences, warm): "
            f"{per_eval:.2f} s = {per_eval / per_step:.1f} training steps; every 100 steps that "
            f"is {100 * per_eval / (100 * per_step + per_eval):.1f}% of the training time"
        )
        w0, w1 = results[0][1], results[100][1]
        extra = (args.steps - 1) // 100  # evaluations before the final one
        print(
            f"  cost of eval every 100: {100 * (w1 - w0) / w0:+.1f}% wall time "
            f"({w1 - w0:+.1f} s for {extra} extra evaluations)"
        )


if __name__ == "__main__":
    main()
