"""Run by test_jax_steps.py in a fresh process (Keras 3 picks its backend at import): the
JAX backend's compiled training steps on a tiny BERT and a tiny GPT-2 with synthetic data.
Prints one JSON line of measurements per family."""

import json
import sys

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.model import configs  # noqa: E402

VOCAB, SEQ, BATCH, POSITIONS = 64, 16, 8, 3


def batches(objective: str, count: int, seed: int) -> dict[str, np.ndarray]:
    """`count` batches stacked on a leading axis; sequences repeat a short cycle, so that
    the model can learn them."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, 7, size=(count, BATCH, 1))
    ids = (10 + (starts + np.arange(SEQ)) % 7).astype("int32")
    out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if objective == "mlm":
        positions = np.sort(rng.choice(np.arange(1, SEQ), size=(count, BATCH, POSITIONS)), -1)
        labels = np.take_along_axis(ids, positions, axis=-1)
        masked = ids.copy()
        np.put_along_axis(masked, positions, 4, axis=-1)  # [MASK]
        out.update(
            input_ids=masked,
            masked_lm_positions=positions.astype("int32"),
            masked_lm_ids=labels.astype("int32"),
            masked_lm_weights=np.ones(labels.shape, "float32"),
        )
    else:
        out.update(
            labels=np.concatenate([ids[..., 1:], ids[..., :1]], -1).astype("int32"),
            label_weights=np.concatenate(
                [np.ones(ids[..., 1:].shape, "float32"), np.zeros(ids[..., :1].shape, "float32")],
                -1,
            ),
        )
    return out


def build(family: str):
    special = {"pad": 0, "cls": 2, "sep": 3} if family == "bert" else {"pad": 1, "bos": 0, "eos": 2}
    config = configs.build_config(family, "tiny", {}, vocab_size=VOCAB, special_ids=special)
    seed_keras(5)
    model = models.create_model(family, config, SEQ)
    optimizer = keras.optimizers.AdamW(learning_rate=3e-3, weight_decay=0.01)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def take(data: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in data.items()}


for family in sys.argv[1:]:
    objective = "clm" if family == "gpt2" else "mlm"
    model, optimizer = build(family)
    chunk = steps.make_train_chunk(model, optimizer, objective)
    data = batches(objective, 48, seed=1)
    start = steps.TrainState.of(model, optimizer)

    # 4 steps in one call == 4 calls of one step, from the same state.
    four, metrics4 = chunk(start, take(data, 0, 4))
    state = start
    singles = []
    for i in range(4):
        state, m = chunk(state, take(data, i, i + 1))
        singles.append(float(m["loss"][0]))
    weight_gap = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(four.trainable, state.trainable, strict=True)
    )
    loss_gap = float(np.abs(np.asarray(metrics4["loss"]) - np.asarray(singles)).max())
    # A chunk cut short: n = 2 of 4 batch slots (the rest zeros) == a 2-step call.
    padded = {k: np.concatenate([v[:2], np.zeros_like(v[2:4])]) for k, v in data.items()}
    two_of_four, metrics_n = chunk(start, padded, np.int32(2))
    two, metrics2 = chunk(start, take(data, 0, 2))
    partial_gap = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(two_of_four.trainable, two.trainable, strict=True)
    )
    unused = np.asarray(metrics_n["loss"])[2:].tolist()
    partial_loss_gap = float(
        np.abs(np.asarray(metrics_n["loss"])[:2] - np.asarray(metrics2["loss"])).max()
    )

    # The loss is the weighted mean cross entropy at the predicted positions (numpy check).
    one = {k: v[0] for k, v in take(data, 0, 1).items()}
    inputs, labels, weights = steps.model_inputs(objective, one)
    logits = np.asarray(model(inputs, training=False), dtype="float64")
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    numpy_loss = float(
        -(np.take_along_axis(logp, labels[..., None], -1)[..., 0] * weights).sum() / weights.sum()
    )
    loss_sum, weight_sum, _ = steps.loss_terms(logits.astype("float32"), labels, weights)
    terms_gap = abs(float(loss_sum / weight_sum) - numpy_loss)

    # Training: 44 more steps, 4 per call; the loss falls.
    losses = list(np.asarray(metrics4["loss"]))
    state = four
    for i in range(4, 48, 4):
        state, m = chunk(state, take(data, i, i + 4))
        losses += list(np.asarray(m["loss"]))
    state.write_back(model, optimizer)
    written = float(
        np.abs(
            np.asarray(model.trainable_variables[0].value) - np.asarray(state.trainable[0])
        ).max()
    )
    print(
        json.dumps(
            {
                "family": family,
                "backend": keras.backend.backend(),
                "devices": [d.platform for d in jax.devices()],
                "weight_gap": weight_gap,
                "loss_gap": loss_gap,
                "partial_gap": partial_gap,
                "partial_loss_gap": partial_loss_gap,
                "unused": unused,
                "terms_gap": terms_gap,
                "first_loss": float(np.mean(losses[:4])),
                "last_loss": float(np.mean(losses[-4:])),
                "steps": len(losses),
                "iterations": int(np.asarray(optimizer.iterations.value)),
                "written_gap": written,
            }
        )
    )
