"""Run by test_jax_loss.py in a fresh process (Keras 3 picks its backend at import): the
chunked loss (steps.lm_loss_terms) against the reference (the whole batch's logits, then
steps.loss_terms) on tiny models, in float32 and under mixed_bfloat16: the three sums and
the gradients of the loss sum. Prints one JSON line per case."""

import json
import sys

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.model import configs  # noqa: E402

VOCAB, SEQ, ROWS, POSITIONS = 96, 16, 4, 4
SPECIAL = {
    "bert": {"pad": 0, "cls": 2, "sep": 3},
    "gpt2": {"pad": 1, "bos": 0, "eos": 2},
    "llama": {"pad": 1, "bos": 0, "eos": 2},
}


def batch(objective: str) -> tuple[dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    ids = rng.integers(4, VOCAB, size=(ROWS, SEQ)).astype("int32")
    mask = np.ones_like(ids)
    mask[1, SEQ - 5 :] = 0  # a padded row
    inputs = {"input_ids": ids, "attention_mask": mask}
    if objective == "mlm":
        positions = np.sort(rng.choice(np.arange(1, SEQ - 5), size=(ROWS, POSITIONS)), -1)
        inputs["masked_lm_positions"] = positions.astype("int32")
        labels = rng.integers(4, VOCAB, size=(ROWS, POSITIONS)).astype("int32")
        weights = np.ones(labels.shape, "float32")
        weights[2, -1] = 0.0  # an unused slot
        return inputs, labels, weights
    labels = np.concatenate([ids[:, 1:], ids[:, :1]], -1)
    weights = (mask * (np.arange(SEQ) < SEQ - 1)).astype("float32")
    weights[0, :3] = 0.5  # weights other than 0 and 1
    return inputs, labels, weights


def case(family: str, overrides: dict, policy: str) -> dict:
    keras.config.set_dtype_policy(policy)
    seed_keras(7)
    config = configs.build_config(
        family, "tiny", overrides, vocab_size=VOCAB, special_ids=SPECIAL[family]
    )
    model = models.create_model(family, config, SEQ)
    objective = "mlm" if family == "bert" else "clm"
    inputs, labels, weights = batch(objective)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    length = labels.shape[1]
    # A budget for chunks of a quarter of the positions: the scan runs 4 chunks.
    budget = ROWS * (length // 4) * VOCAB * 4
    chunks = length // configs.loss_chunk_length(ROWS, length, VOCAB, budget)

    def reference(trainable: list) -> jax.Array:
        logits, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
        return jnp.stack(steps.loss_terms(logits, labels, weights))

    def chunked(trainable: list) -> jax.Array:
        head, _ = model.stateless_call(
            trainable, non_trainable, inputs, training=False, head_inputs=True
        )
        return steps.chunked_loss_terms(*head, labels, weights, budget=budget)

    out = {"family": family, "policy": policy, "tied": config.tie_word_embeddings}
    out["chunks"] = chunks
    values = {}
    grads = {}
    for name, fn in (("reference", reference), ("chunked", chunked)):
        (_, terms), grad = jax.jit(
            jax.value_and_grad(lambda t, f=fn: (f(t)[0], f(t)), has_aux=True)
        )(trainable)
        values[name] = np.asarray(terms, "float64").tolist()
        grads[name] = [np.asarray(g, "float64") for g in grad]
    out["values"] = values
    # Relative to each weight's largest gradient entry, or 1e-4 of the largest of all where a
    # weight's gradient is zero but for rounding (GPT-2's key biases: softmax ignores them).
    floor = 1e-4 * max(float(np.abs(g).max()) for g in grads["reference"])
    out["grad_gap"] = max(
        float(np.abs(x - y).max() / max(float(np.abs(x).max()), floor))
        for x, y in zip(grads["reference"], grads["chunked"], strict=True)
    )
    return out


for family, overrides, policy in [
    ("llama", {}, "float32"),
    ("llama", {"tie_word_embeddings": False}, "float32"),
    ("gpt2", {}, "float32"),
    ("bert", {}, "float32"),
    ("llama", {}, "mixed_bfloat16"),
]:
    print(json.dumps(case(family, overrides, policy)), flush=True)
    keras.backend.clear_session()
assert len(sys.argv) == 1, sys.argv
