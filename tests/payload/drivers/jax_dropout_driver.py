"""Run by test_jax_dropout.py in a fresh process (Keras 3 picks its backend at import): the
JAX models' dropout (payload/backends/jax/models/blocks.py) on ones, printed as one JSON line."""

import json

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax.models import blocks  # noqa: E402

SHAPE = (64, 128, 129)  # an odd last axis: its last draw uses one half of a word
SEED = np.array([0, 7], np.uint32)
OTHER = np.array([0, 8], np.uint32)


def measured(rate: float) -> dict[str, float | bool]:
    ones = jnp.ones(SHAPE, jnp.float32)
    out = np.asarray(blocks.dropout(ones, rate, SEED))
    again = np.asarray(blocks.dropout(ones, rate, SEED))
    other = np.asarray(blocks.dropout(ones, rate, OTHER))
    dropped = out == 0
    half = (SHAPE[-1] + 1) // 2  # element j and j + half come from one 32-bit word
    pair = dropped[..., : SHAPE[-1] - half] & dropped[..., half:]
    return {
        "dropped": float(dropped.mean()),
        "mean": float(out.mean()),
        "values": sorted({float(v) for v in np.unique(out)}),
        "same_seed_same_mask": bool((out == again).all()),
        "both_dropped_other_seed": float((dropped & (other == 0)).mean()),
        "both_dropped_one_word": float(pair.mean()),
    }


def layer_checks() -> dict[str, bool]:
    layer = blocks.Dropout(0.25, seed=3)
    x = jnp.ones((4, 256), jnp.float32)
    first = np.asarray(layer(x, training=True))
    second = np.asarray(layer(x, training=True))
    bf16 = blocks.dropout(x.astype(jnp.bfloat16), 0.25, SEED)
    return {
        "inference_identity": bool((np.asarray(layer(x, training=False)) == 1).all()),
        "rate_0_identity": bool((np.asarray(blocks.Dropout(0.0)(x, training=True)) == 1).all()),
        "rate_1_zeros": bool((np.asarray(blocks.Dropout(1.0)(x, training=True)) == 0).all()),
        "seed_advances": bool((first != second).any()),
        "keeps_dtype": str(bf16.dtype) == "bfloat16",
    }


print(json.dumps({"rates": {str(r): measured(r) for r in (0.1, 0.5)}, "layer": layer_checks()}))
