"""Run by test_jax_llama.py in a fresh process (Keras 3 picks its backend at import): a tiny
Llama's loss and gradients with train.remat none vs every other policy, and one optimizer
step of a batch of B vs the same step with train.grad_accum_steps 2 (2 micro-batches of
B/2). Prints one JSON line of measurements."""

import json

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import evaluate, models, steps  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.model import configs  # noqa: E402

VOCAB, SEQ, BATCH = 96, 16, 8


def batch() -> dict[str, np.ndarray]:
    """One clm batch whose rows hold different numbers of predicted tokens (label weights
    0 past a per-row length), so that a mean of micro-batch means would differ from the
    batch's mean."""
    rng = np.random.default_rng(2)
    ids = rng.integers(3, VOCAB, size=(BATCH, SEQ)).astype("int32")
    lengths = np.array([16, 3, 16, 5, 2, 16, 4, 16])[:, None]
    weights = (np.arange(SEQ)[None, :] < lengths - 1).astype("float32")
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "labels": np.concatenate([ids[:, 1:], ids[:, :1]], 1),
        "label_weights": weights,
    }


def build(remat: str):
    config = configs.build_config(
        "llama", "tiny", {}, vocab_size=VOCAB, special_ids={"bos": 0, "pad": 1, "eos": 2}
    )
    seed_keras(5)
    return models.create_model("llama", config, SEQ, remat=remat)


def loss_and_grads(model, data):
    inputs, labels, weights = steps.model_inputs("clm", data)

    def loss(trainable):
        logits, _ = model.stateless_call(trainable, [], inputs, training=True)
        total, count, _ = steps.loss_terms(logits, labels, weights)
        return total / count

    trainable = [v.value for v in model.trainable_variables]
    fn = jax.value_and_grad(loss)
    return fn(trainable), str(jax.make_jaxpr(fn)(trainable))


data = batch()
(plain_loss, plain_grads), plain_jaxpr = loss_and_grads(build("none"), data)
# train.remat policies keeping the most, some and nothing of a layer (sharding.REMAT_SAVES;
# `block` is `full`'s other name): the same loss and gradients as none.
remat_loss_gap, remat_gap, remat_checkpointed = 0.0, 0.0, True
for policy in ("minimal", "save_qkv_proj", "block"):
    (remat_loss, remat_grads), remat_jaxpr = loss_and_grads(build(policy), data)
    remat_loss_gap = max(remat_loss_gap, abs(float(plain_loss) - float(remat_loss)))
    remat_gap = max(
        remat_gap,
        *(float(jnp.abs(a - b).max()) for a, b in zip(plain_grads, remat_grads, strict=True)),
    )
    remat_checkpointed &= "checkpoint" in remat_jaxpr or "remat" in remat_jaxpr

# One SGD step (the update is -lr x the gradient itself: any scale error shows) and one
# AdamW step, each as one batch of 8 and as 2 accumulated micro-batches of 4.
report = {
    "remat_loss_gap": remat_loss_gap,
    "remat_grad_gap": remat_gap,
    "grad_scale": max(float(jnp.abs(g).max()) for g in plain_grads),
    "checkpoint_in_plain": "checkpoint" in plain_jaxpr or "remat" in plain_jaxpr,
    "checkpoint_in_remat": remat_checkpointed,
}
stacked = {k: v[None] for k, v in data.items()}
for name, make in (
    ("sgd", lambda: keras.optimizers.SGD(learning_rate=0.5)),
    ("adamw", lambda: keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.01)),
):
    results = {}
    for accum in (1, 2):
        model = build("none")
        optimizer = make()
        optimizer.build(model.trainable_variables)
        chunk = steps.make_train_chunk(model, optimizer, "clm", accum_steps=accum)
        state, metrics = chunk(steps.TrainState.of(model, optimizer), stacked)
        results[accum] = (state, metrics)
    (big, big_m), (acc, acc_m) = results[1], results[2]
    report[f"{name}_weight_gap"] = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(big.trainable, acc.trainable, strict=True)
    )
    report[f"{name}_loss_gap"] = abs(float(big_m["loss"][0]) - float(acc_m["loss"][0]))
    report[f"{name}_norm_gap"] = abs(float(big_m["grad_norm"][0]) - float(acc_m["grad_norm"][0]))
    report[f"{name}_moved"] = max(
        float(np.abs(np.asarray(a) - np.asarray(b.value)).max())
        for a, b in zip(big.trainable, build("none").trainable_variables, strict=True)
    )

# The gradient a mean of the two micro-batch MEANS would give (rows i, i+2, ...: the split
# steps.py makes), to show the batch is uneven enough to tell the two apart.
model = build("none")
parts = [loss_and_grads(model, {k: v[part::2] for k, v in data.items()})[0][1] for part in range(2)]
report["mean_of_means_grad_gap"] = max(
    float(jnp.abs((a + b) / 2 - c).max()) for a, b, c in zip(*parts, plain_grads, strict=True)
)

# The held-out sums of the batch in one pass and in 4 micro-batches (evaluate.make_eval_sums,
# a lax.scan of B / 4 rows at a time): the same sums.
model = build("none")
trainable = [v.value for v in model.trainable_variables]
whole = evaluate.make_eval_sums(model, "clm", 1)
micro = evaluate.make_eval_sums(model, "clm", 4)
zero = jnp.zeros([3], jnp.float32)
sums_whole = np.asarray(whole(trainable, [], data, np.int32(0), zero))
sums_micro = np.asarray(micro(trainable, [], data, np.int32(0), zero))
report["eval_sums"] = sums_whole.tolist()
report["eval_micro_gap"] = float(np.abs(sums_whole - sums_micro).max())
micro_jaxpr = str(jax.make_jaxpr(micro)(trainable, [], data, np.int32(0), zero))
micro_rows = f"{BATCH // 4},{SEQ}]"
report["eval_micro_scans"] = "scan" in micro_jaxpr and micro_rows in micro_jaxpr.replace(" ", "")
print(json.dumps(report))
