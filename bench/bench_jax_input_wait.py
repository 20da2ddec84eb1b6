"""The JAX backend's input time per step against its step time, on the CPU, in the real loop.

Trains the example job (`examples/tiny.yaml`: BERT tiny, MLM, batch 32 x 128, the bundled
corpus; `train.backend: jax`, --steps steps, one checkpoint at the end, no evaluation) with
`payload.backends.jax.train.train` in this process, timing what the loop's thread spends
between dispatching a chunk and dispatching the next on the input: pulling the host batches
from the Grain pipelines (`Pipelines.next_host_batch`: the wait for batches that Grain's
threads prefetch) and handing them to the devices (`Pipelines.to_devices`). Reported per
step, beside the trainer's steps/s (its Meter: compilation excluded); the first chunk's
batches (read before anything is prefetched) are counted apart.

    .venv/bin/python bench/bench_jax_input_wait.py [--steps 96]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=96)
    args = parser.parse_args()

    from payload.backends.jax import train as trainer
    from payload.backends.jax.batches import Pipelines
    from payload.core.status import StatusWriter
    from payload.data import tokenizer
    from payload.data.encode import stage
    from payload.spec import load_job

    pulls: list[float] = []
    transfers: list[float] = []
    pull, to_devices = Pipelines.next_host_batch, Pipelines.to_devices

    def timed_pull(iterators: list) -> dict:
        start = time.perf_counter()
        try:
            return pull(iterators)
        finally:
            pulls.append(time.perf_counter() - start)

    def timed_transfer(self: Pipelines, arrays: dict, *, chunk: bool) -> dict:
        start = time.perf_counter()
        try:
            return to_devices(self, arrays, chunk=chunk)
        finally:
            if chunk:
                transfers.append(time.perf_counter() - start)

    Pipelines.next_host_batch = staticmethod(timed_pull)  # type: ignore[method-assign]
    Pipelines.to_devices = timed_transfer  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory(prefix="bench-input-wait-") as tmp:
        document = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
        document["output"] = str(Path(tmp) / "out")
        document["corpus"]["paths"] = [str(REPO / "examples" / "corpus" / "*.txt")]
        document["train"].update(
            steps=args.steps, checkpoint_every=args.steps, log_every=8, backend="jax"
        )
        document["data"]["eval_fraction"] = 0.0  # no held-out set: only training's batches
        spec = Path(tmp) / "job.yaml"
        spec.write_text(yaml.safe_dump(document))
        job = load_job(str(spec))
        status = StatusWriter(job.paths.status, job.name)
        tokenizer.train_tokenizer(job, status)
        stage.encode(job, status)
        stats = trainer.train(job, status)

    first, rest = pulls[:8], pulls[8:]
    step_s = 1.0 / stats["steps_per_second"]
    mean_pull = sum(rest) / max(1, len(rest))
    mean_transfer = sum(transfers[1:]) / max(1, len(transfers) - 1) / 8
    print(
        f"JAX backend, BERT tiny, batch 32 x 128, {args.steps} steps on {os.cpu_count()} "
        f"cores: step {step_s * 1e3:.1f} ms ({stats['steps_per_second']:.2f} steps/s); "
        f"input per step: pulling a prefetched batch {mean_pull * 1e3:.2f} ms "
        f"(max {max(rest) * 1e3:.1f} ms), handing it to the devices {mean_transfer * 1e3:.2f} ms "
        f"= {(mean_pull + mean_transfer) / step_s:.2%} of a step; the first chunk's 8 batches "
        f"(nothing prefetched yet) {sum(first) * 1e3:.0f} ms"
    )
    print(f"load average: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
