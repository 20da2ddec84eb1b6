"""JAX backend: the decoder's blocks unrolled (today) vs under one `lax.scan` (issue 33,
item 3: "measure, then keep what helps"), by compile time and compiled memory.

    .venv/bin/python bench/bench_scan_blocks.py [--sizes 1b,3b] [--seq 2048] [--batch 1]

What is compiled, for each preset's Llama block (payload/backends/jax/models.LlamaBlock,
the trainer's layer, under Keras `mixed_bfloat16`) and its layer count: the loss
sum(h_L^2) of the stack of L blocks and its gradients with respect to every block's
weights, i.e. the blocks' share of a training step (the rest of a step, the embedding,
the head and the optimizer, is the same either way):
- unrolled: L blocks one after another, each with its own weights (the trainer's model:
  a Python loop over `model.blocks`); XLA compiles L copies of the block.
- scan: the L blocks' weights stacked [L, ...] and one block body run by
  `jax.lax.scan` over them (MaxText's `scan_layers: true`, src/maxtext/configs/base.yml at
  e591f30); XLA compiles the block once.
Each under train.remat none and block (jax.checkpoint with nothing_saveable per block,
as the trainer applies it). Nothing is run: the weights and activations are abstract
(jax.ShapeDtypeStruct), so the 3b preset compiles on a laptop. Figures: wall seconds of
`lower` + `compile` (XLA's CPU compiler here; a GPU or TPU compiler takes longer in
absolute terms, but the unrolled program grows with L on every backend) and the compiled
program's temporary bytes (XLA's memory analysis). Printed, not asserted.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402

from payload import model as model_lib  # noqa: E402
from payload.backends.jax import models  # noqa: E402

GIB = 2**30


def block_and_shapes(size: str, seq: int, batch: int) -> tuple[Any, int, list[Any], Any]:
    """One built LlamaBlock of the preset, its layer count, its weights' abstract values and
    the abstract input [batch, seq, H] in the compute dtype."""
    config = model_lib.build_config(
        "llama", size, {}, vocab_size=32000, special_ids={"bos": 0, "pad": 1, "eos": 2}
    )
    block = models.LlamaBlock(config, name="layers_0")
    width = int(config.hidden_size)
    head, theta = width // int(config.num_attention_heads), models.rope_theta(config)
    # A call on 8 tokens builds the block's weights.
    block(
        jnp.zeros((1, 8, width), jnp.bfloat16),
        None,
        *models.rotary_tables(8, head, theta, "bfloat16"),
    )
    weights = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in block.trainable_variables]
    x = jax.ShapeDtypeStruct((batch, seq, width), jnp.bfloat16)
    block.rope = models.rotary_tables(seq, head, theta, "bfloat16")
    return block, int(config.num_hidden_layers), weights, x


def loss_fn(block: Any, mode: str, remat: str) -> Any:
    cos, sin = block.rope

    def one(weights: list[Any], h: Any) -> Any:
        out, _ = block.stateless_call(weights, [], h, None, cos, sin)
        return out

    if remat == "block":
        one = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable)

    def unrolled(per_layer: list[list[Any]], x: Any) -> Any:
        h = x
        for weights in per_layer:
            h = one(weights, h)
        return jnp.sum(jnp.square(h.astype(jnp.float32)))

    def scanned(stacked: list[Any], x: Any) -> Any:
        h, _ = jax.lax.scan(lambda h, w: (one(w, h), None), x, stacked)
        return jnp.sum(jnp.square(h.astype(jnp.float32)))

    return jax.value_and_grad(unrolled if mode == "unrolled" else scanned)


def measure(size: str, seq: int, batch: int, mode: str, remat: str) -> dict[str, float]:
    keras.backend.clear_session()  # (which also resets the dtype policy)
    keras.config.set_dtype_policy("mixed_bfloat16")
    block, layers, weights, x = block_and_shapes(size, seq, batch)
    if mode == "unrolled":
        params: Any = [list(weights) for _ in range(layers)]
    else:
        params = [jax.ShapeDtypeStruct((layers, *w.shape), w.dtype) for w in weights]
    fn = jax.jit(loss_fn(block, mode, remat))
    start = time.perf_counter()
    compiled = fn.lower(params, x).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    return {"layers": layers, "seconds": seconds, "temp": analysis.temp_size_in_bytes / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1b,3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="rows per device")
    args = parser.parse_args()
    print(f"{jax.devices()[0].platform}: seq {args.seq}, {args.batch} row(s), mixed_bfloat16")
    print(
        f"{'preset':<7}{'L':>4}{'remat':>7}{'unrolled s':>12}{'scan s':>9}{'ratio':>7}"
        f"{'temp GiB unrolled':>19}{'scan':>7}"
    )
    for size in args.sizes.split(","):
        for remat in ("none", "block"):
            rows = {m: measure(size, args.seq, args.batch, m, remat) for m in ("unrolled", "scan")}
            u, s = rows["unrolled"], rows["scan"]
            print(
                f"{size:<7}{u['layers']:>4}{remat:>7}{u['seconds']:>12.1f}{s['seconds']:>9.1f}"
                f"{u['seconds'] / s['seconds']:>7.1f}{u['temp']:>19.2f}{s['temp']:>7.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
