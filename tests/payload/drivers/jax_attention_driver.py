"""Run by test_jax_attention.py in a fresh process. Prints one JSON line of measurements.

argv[1] (one mode, or several separated by commas, run in this process one after another):
- `sharded` (with 8 virtual CPU devices): splash attention (Pallas interpret mode) and our
  cuDNN path (its arguments run by jax.nn.dot_product_attention's XLA implementation: no
  cuDNN here) under shard_map over a (data 2 x fsdp 4) mesh against the same call without
  a mesh, outputs and gradients, causal and bidirectional;
- `models` (Keras 3 on JAX): a tiny Llama (grouped-query attention) and a tiny BERT built
  twice with the same weights, once with splash attention in interpret mode and once with
  the reference, on rows with different padding: logits at the tokens and the gradients of
  every weight;
- `documents` (Keras 3 on JAX): data.document_mask on a tiny Llama.
"""

import json
import sys

import numpy as np

MODE = sys.argv[1]
B, T, N, K, H = 8, 128, 4, 2, 16
LENGTHS = [128, 100, 77, 128, 5, 64, 128, 120]


def token_mask(batch: int, length: int) -> np.ndarray:
    return (np.arange(length)[None, :] < np.array(LENGTHS[:batch])[:, None]).astype("int32")


def sharded() -> dict:
    import jax
    import jax.numpy as jnp

    from payload.backends.jax import attention

    assert len(jax.devices()) == 8, jax.devices()
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k = jax.random.normal(keys[1], (B, T, K, H))
    v = jax.random.normal(keys[2], (B, T, K, H))
    mask = jnp.asarray(token_mask(B, T))
    weight = jax.random.normal(keys[3], (B, T, N, H)) * mask[:, :, None, None]
    attention.CUDNN_IMPLEMENTATION = "xla"  # the cuDNN path's arguments, XLA's attention
    kernels = {
        "splash": lambda causal, mesh: (
            lambda q, k, v: attention.splash(
                q, k, v, causal=causal, mask=mask, mesh=mesh, interpret=True
            )
        ),
        "cudnn": lambda causal, mesh: (
            lambda q, k, v: attention.cudnn(q, k, v, causal=causal, mask=mask, mesh=mesh)
        ),
    }
    report: dict = {}
    for name, kernel in kernels.items():
        for causal in (True, False):

            def loss(q, k, v, on_mesh, *, causal=causal, kernel=kernel):
                out = kernel(causal, mesh if on_mesh else None)(q, k, v)
                return jnp.sum(out * weight), out

            results = {}
            for on_mesh in (True, False):
                grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
                fn = jax.jit(grad, static_argnums=3)
                (_, out), grads = fn(q, k, v, on_mesh)
                results[on_mesh] = (out, grads)
                if on_mesh:
                    jaxpr = str(jax.make_jaxpr(fn, static_argnums=3)(q, k, v, True))
                    report[f"{name}_shard_map_{causal}"] = "shard_map" in jaxpr
            (out_a, grads_a), (out_b, grads_b) = results[True], results[False]
            gap = float(jnp.max(jnp.abs((out_a - out_b) * mask[:, :, None, None])))
            grad_gap = max(
                float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads_a, grads_b, strict=True)
            )
            report[f"{name}_out_gap_{causal}"] = gap
            report[f"{name}_grad_gap_{causal}"] = grad_gap
    return report


def models() -> dict:
    from payload.backends import jax as jax_backend

    jax_backend.use_jax()
    import jax
    import jax.numpy as jnp

    from payload.backends.jax import attention, models
    from payload.backends.jax.program import seed_keras
    from payload.model import configs

    splash = attention.Attention("splash", "test", interpret=True)
    report: dict = {}
    batch = 4
    for family in ("llama", "bert"):
        special = {"bos": 0, "pad": 1, "eos": 2} if family == "llama" else {}
        overrides: dict = {}  # the presets have no attention dropout
        config = configs.build_config(
            family, "tiny", overrides, vocab_size=300, special_ids=special
        )
        built = {}
        for name, impl in (("reference", attention.REFERENCE), ("splash", splash)):
            seed_keras(3)
            built[name] = models.create_model(family, config, T, attention=impl)
        ref, fused = built["reference"], built["splash"]
        for a, b in zip(ref.trainable_variables, fused.trainable_variables, strict=True):
            b.assign(a.value)  # the same weights whatever the initialisers drew
        rng = np.random.default_rng(4)
        mask = token_mask(batch, T)
        ids = np.where(mask > 0, rng.integers(3, 300, size=(batch, T)), 1).astype("int32")
        inputs = {"input_ids": ids, "attention_mask": mask}
        cotangent = rng.normal(size=(batch, T, 300)).astype("float32") * mask[:, :, None]

        def loss(trainable, model, inputs=inputs, cotangent=cotangent):
            frozen = [v.value for v in model.non_trainable_variables]
            logits, _ = model.stateless_call(trainable, frozen, inputs, training=False)
            return jnp.sum(logits * cotangent), logits

        out = {}
        for name, model in built.items():
            trainable = [v.value for v in model.trainable_variables]
            fn = jax.jit(jax.value_and_grad(lambda t, m=model: loss(t, m), has_aux=True))
            (_, logits), grads = fn(trainable)
            out[name] = (np.asarray(logits), [np.asarray(g) for g in grads])
        (logits_r, grads_r), (logits_s, grads_s) = out["reference"], out["splash"]
        tokens = mask[:, :, None] > 0
        report[f"{family}_logit_gap"] = float(np.max(np.abs(logits_r - logits_s) * tokens))
        report[f"{family}_logit_scale"] = float(np.max(np.abs(logits_r) * tokens))
        # Against the largest gradient entry of the model: some gradients are 0 in exact
        # arithmetic (a key bias shifts every score of a query alike; softmax ignores it),
        # and their rounding noise relative to themselves would mean nothing.
        scale = max(float(np.max(np.abs(a))) for a in grads_r)
        report[f"{family}_grad_gap"] = (
            max(float(np.max(np.abs(a - b))) for a, b in zip(grads_r, grads_s, strict=True)) / scale
        )
        weights = [v.value for v in fused.trainable_variables]
        jaxpr = str(jax.make_jaxpr(lambda t, m=fused: loss(t, m)[0])(weights))
        report[f"{family}_kernel_used"] = "pallas_call" in jaxpr
    return report


def documents() -> dict:
    """A tiny Llama with data.document_mask: the logits of a document packed after another
    = its logits alone (RoPE: relative positions only); without the mask they differ."""
    from payload.backends import jax as jax_backend

    jax_backend.use_jax()
    from payload.backends.jax import models
    from payload.backends.jax.program import seed_keras
    from payload.model import configs

    special = {"bos": 0, "pad": 1, "eos": 2}
    config = configs.build_config("llama", "tiny", {}, vocab_size=300, special_ids=special)
    rng = np.random.default_rng(5)
    first = [0, *rng.integers(3, 300, size=12).tolist(), 2]
    second = [0, *rng.integers(3, 300, size=16).tolist(), 2]
    length = 32
    packed = np.array([first + second], dtype="int32")
    alone = np.array([second + [1] * (length - len(second))], dtype="int32")
    report: dict = {}
    for masked in (True, False):
        seed_keras(3)
        model = models.create_model("llama", config, length, document_mask=masked)
        a = np.asarray(model({"input_ids": packed, "attention_mask": np.ones_like(packed)}))
        b = np.asarray(model({"input_ids": alone, "attention_mask": (alone != 1).astype("int32")}))
        gap = float(np.max(np.abs(a[0, len(first) :] - b[0, : len(second)])))
        report[f"gap_{'masked' if masked else 'unmasked'}"] = gap
        report["scale"] = float(np.max(np.abs(b[0, : len(second)])))
    return report


RUNS = {"sharded": sharded, "models": models, "documents": documents}
# A comma-separated list of modes runs in this one process, their reports merged.
print(json.dumps({key: value for mode in MODE.split(",") for key, value in RUNS[mode]().items()}))
