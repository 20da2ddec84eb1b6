"""JAX backend: what several optimizer steps per compiled call buy (payload/backends/jax).

    .venv/bin/python bench/bench_jax_steps.py [--size mini] [--steps 64] [--rounds 3]

A BERT MLM of the given preset (vocab 2,000, sequence 128, global batch 32, 20 masked
positions) trains on synthetic batches with `steps.make_train_chunk`, K steps per call for K in
1, 4 and 8, after a warm-up call that compiles. Rounds are interleaved (K=1, 4, 8, K=1, ...)
so that the machine's load hits every K alike; the table shows each K's best and median
steps/s and the ratio to K=1 in the same round. On CPU the step's compute dominates and the
gain is the host dispatch saved; on a TPU, where a step takes milliseconds, that share is
larger (not measured here). Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.model import configs  # noqa: E402

VOCAB, SEQ, BATCH, POSITIONS = 2000, 128, 32, 20


def make_batches(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, VOCAB, size=(count, BATCH, SEQ)).astype("int32")
    positions = np.sort(
        np.stack([rng.choice(SEQ, POSITIONS, replace=False) for _ in range(count * BATCH)]),
        -1,
    ).reshape(count, BATCH, POSITIONS)
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "masked_lm_positions": positions.astype("int32"),
        "masked_lm_ids": np.take_along_axis(ids, positions, -1).astype("int32"),
        "masked_lm_weights": np.ones(positions.shape, "float32"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="mini", choices=("tiny", "mini", "small"))
    parser.add_argument("--steps", type=int, default=64, help="steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    special = {"pad": 0, "cls": 2, "sep": 3, "mask": 4}
    config = configs.build_config("bert", args.size, {}, vocab_size=VOCAB, special_ids=special)
    seed_keras(0)
    model = models.create_model("bert", config, SEQ)
    optimizer = keras.optimizers.AdamW(learning_rate=1e-4)
    optimizer.build(model.trainable_variables)
    chunk = steps.make_train_chunk(model, optimizer, "mlm")
    data = make_batches(args.steps, seed=1)
    ks = (1, 4, 8)
    state = steps.TrainState.of(model, optimizer)
    for k in ks:  # compile each shape once, outside the timings
        state, metrics = chunk(state, {n: v[:k] for n, v in data.items()})
        jax.block_until_ready(metrics["loss"])
    rates: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(args.rounds):
        for k in ks:
            started = time.perf_counter()
            for i in range(0, args.steps, k):
                state, metrics = chunk(state, {n: v[i : i + k] for n, v in data.items()})
            jax.block_until_ready(metrics["loss"])
            rates[k].append(args.steps / (time.perf_counter() - started))
    print(
        f"BERT {args.size}, batch {BATCH} x {SEQ}, {args.steps} steps x {args.rounds} rounds, "
        f"devices {[d.platform for d in jax.devices()]}"
    )
    print(f"{'K':>3}  {'best steps/s':>12}  {'median':>8}  {'median / K=1 (same round)':>26}")
    for k in ks:
        ratio = statistics.median(a / b for a, b in zip(rates[k], rates[1], strict=True))
        print(
            f"{k:>3}  {max(rates[k]):>12.2f}  {statistics.median(rates[k]):>8.2f}  {ratio:>26.3f}"
        )


if __name__ == "__main__":
    main()
