"""Attention on the JAX backend (payload/backends/jax/attention.py), on this machine's CPU.

It shows: splash attention (the TPU kernel, run in Pallas' interpret mode) gives the
reference's outputs and gradients, causal and bidirectional, with grouped-query attention
and padding that differs per example, in float32 and bfloat16; under shard_map on a mesh
of 8 virtual devices it equals the unsharded call; a tiny Llama and a tiny BERT built with
it give the reference's logits and gradients; cuDNN flash attention (jax.nn's "cudnn") the
same where a GPU is present; the reference's scores kept in float32 are closer to a float32
computation than scores rounded to bf16 (the path before); the runtime's choice
(`train.attention`) and its one-line refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from payload import model as model_lib
from payload.backends.jax import attention
from payload.errors import SpecError
from payload.spec import parse_job

DRIVER = Path(__file__).with_name("jax_attention_driver.py")
EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
B, T, N, K, H = 2, 128, 4, 2, 16  # grouped-query: 2 query heads per key/value head
# Max |difference| over the tokens, as a share of the largest |reference| value.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _inputs(dtype: str) -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H)).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, K, H)).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, K, H)).astype(dtype)
    # Padding that differs per example: 100 tokens then padding; a full row.
    mask = (jnp.arange(T)[None, :] < jnp.array([100, T])[:, None]).astype(jnp.int32)
    weight = jax.random.normal(keys[3], (B, T, N, H)) * mask[:, :, None, None]
    return q, k, v, mask, weight


def _value_and_grads(fn: Any, q: Any, k: Any, v: Any, weight: Any) -> tuple[Any, ...]:
    def loss(q: Any, k: Any, v: Any) -> Any:
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weight), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out, *grads)


def _relative_gaps(got: tuple[Any, ...], want: tuple[Any, ...], mask: Any) -> list[float]:
    """Output (at the tokens), dq, dk, dv: max |got - want| / max |want|."""
    rows = mask[:, :, None, None] > 0
    gaps = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if i == 0:
            a32, b32 = a32 * rows, b32 * rows
        gaps.append(float(np.max(np.abs(a32 - b32)) / np.max(np.abs(b32))))
    return gaps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_splash_matches_the_reference(causal: bool, dtype: str) -> None:
    q, k, v, mask, weight = _inputs(dtype)
    got = _value_and_grads(
        lambda q, k, v: attention.splash(q, k, v, causal=causal, mask=mask, interpret=True),
        q, k, v, weight,
    )  # fmt: skip
    want = _value_and_grads(
        lambda q, k, v: attention.reference(q, k, v, causal=causal, mask=mask), q, k, v, weight
    )
    gaps = _relative_gaps(got, want, mask)
    print(f"splash vs reference, {dtype}, causal={causal}: out, dq, dk, dv {gaps}")
    assert got[0].dtype == q.dtype and got[0].shape == q.shape
    assert max(gaps) <= TOLERANCE[dtype], gaps


def test_the_reference_is_jax_s_own_attention() -> None:
    """Our einsums = jax.nn.dot_product_attention's XLA path (which repeats nothing either)
    with the same boolean mask, in float32: the reference is the textbook formula."""
    q, k, v, mask, _ = _inputs("float32")
    for causal in (True, False):
        ours = attention.reference(q, k, v, causal=causal, mask=mask)
        keys = mask.astype(bool)[:, None, None, :]
        theirs = jax.nn.dot_product_attention(
            q, k, v, mask=keys, is_causal=causal, implementation="xla"
        )
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-6)


def _rounded_scores_reference(q: Any, k: Any, v: Any) -> Any:
    """The attention before this change (models.py at ed0c256): QK^T in the inputs' dtype
    (bf16), then a float32 softmax."""
    q5 = jnp.reshape(q, (B, T, K, N // K, H))
    scores = jnp.einsum("bskgd,btkd->bkgst", q5, k) * (H**-0.5)
    visible = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.reshape(jnp.einsum("bkgst,btkd->bskgd", probs, v), (B, T, N, H))


def test_float32_scores_are_closer_to_float32_than_bf16_scores() -> None:
    """bf16 inputs with scores of a trained model's size (|QK^T / sqrt(H)| up to ~30): the
    reference (scores accumulated and kept in float32) against the previous path (scores
    rounded to bf16 before the float32 softmax), both against float32 throughout."""
    keys = jax.random.split(jax.random.key(7), 3)
    q = (4.0 * jax.random.normal(keys[0], (B, T, N, H))).astype(jnp.bfloat16)
    k = (2.0 * jax.random.normal(keys[1], (B, T, K, H))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, K, H)).astype(jnp.bfloat16)
    exact = attention.reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), causal=True
    )

    def error(out: Any) -> float:
        return float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact)))

    new = error(attention.reference(q, k, v, causal=True))
    old = error(_rounded_scores_reference(q, k, v))
    print(f"max |error| vs float32: scores in float32 {new:.4f}, scores in bf16 {old:.4f}")
    assert new < old / 2, (new, old)


@pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU"
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cudnn_matches_the_reference(causal: bool) -> None:
    q, k, v, mask, weight = _inputs("bfloat16")
    got = _value_and_grads(
        lambda q, k, v: attention.cudnn(q, k, v, causal=causal, mask=mask), q, k, v, weight
    )
    want = _value_and_grads(
        lambda q, k, v: attention.reference(q, k, v, causal=causal, mask=mask), q, k, v, weight
    )
    gaps = _relative_gaps(got, want, mask)
    print(f"cuDNN vs reference, bf16, causal={causal}: out, dq, dk, dv {gaps}")
    assert max(gaps) <= TOLERANCE["bfloat16"], gaps


def _driver(mode: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(DRIVER), mode],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    return report


def test_splash_under_shard_map_equals_the_unsharded_call() -> None:
    """8 rows over a (data 2 x fsdp 4) mesh of 8 virtual CPU devices, each device its rows."""
    report = _driver("sharded", EIGHT)
    for causal in (True, False):
        assert report[f"shard_map_{causal}"], report
        assert report[f"out_gap_{causal}"] <= 1e-6, report
        assert report[f"grad_gap_{causal}"] <= 1e-5, report


def test_models_with_splash_give_the_reference_logits_and_gradients() -> None:
    """A tiny Llama (4 query heads over 2 key/value heads) and a tiny BERT, float32, rows
    of 128, 100, 77 and 128 tokens: logits at the tokens within 1e-5 of their scale, every
    weight's gradient within 1e-5 of the largest gradient entry."""
    report = _driver("models")
    for family in ("llama", "bert"):
        assert report[f"{family}_kernel_used"], report
        assert report[f"{family}_logit_gap"] <= 1e-5 * report[f"{family}_logit_scale"], report
        assert report[f"{family}_grad_gap"] <= 1e-5, report


def test_documents_attend_to_themselves_only() -> None:
    """Document ids (data.document_mask): one row packs a 50-token document and a 78-token
    one; the second's outputs = the reference over it alone, and splash gives the reference's
    outputs and gradients with the same ids."""
    q, k, v, _, weight = _inputs("float32")
    ids = jnp.where(jnp.arange(T) < 50, 1, 2)[None, :].repeat(B, 0).astype(jnp.int32)
    packed = attention.reference(q, k, v, causal=True, mask=ids)
    alone = attention.reference(q[:, 50:], k[:, 50:], v[:, 50:], causal=True)
    np.testing.assert_allclose(np.asarray(packed[:, 50:]), np.asarray(alone), atol=1e-6)
    crossing = attention.reference(q, k, v, causal=True)  # what the mask changes
    assert float(jnp.max(jnp.abs(crossing[:, 50:] - packed[:, 50:]))) > 1e-2
    got = _value_and_grads(
        lambda q, k, v: attention.splash(q, k, v, causal=True, mask=ids, interpret=True),
        q, k, v, weight,
    )  # fmt: skip
    want = _value_and_grads(
        lambda q, k, v: attention.reference(q, k, v, causal=True, mask=ids), q, k, v, weight
    )
    gaps = _relative_gaps(got, want, jnp.ones((B, T), jnp.int32))
    print(f"splash vs reference, documents: out, dq, dk, dv {gaps}")
    assert max(gaps) <= TOLERANCE["float32"], gaps


def test_a_packed_llama_document_is_computed_as_if_alone() -> None:
    report = _driver("documents")
    assert report["gap_masked"] <= 1e-5 * report["scale"], report
    assert report["gap_unmasked"] > 1e-2 * report["scale"], report  # the mask matters


# ---------------------------------------------------------------- the runtime's choice


def _config(family: str, **overrides: Any) -> Any:
    return model_lib.build_config(family, "tiny", overrides, vocab_size=300, special_ids={})


@pytest.mark.parametrize(
    "case",  # setting, platform, family, config overrides (or "documents": data.document_mask),
    # seq_length, compute dtype, expected
    [
        ("auto", "gpu", "llama", {}, 2048, "bfloat16", "cudnn"),
        ("auto", "tpu", "llama", {}, 2048, "bfloat16", "splash"),
        ("auto", "cpu", "llama", {}, 2048, "float32", "reference"),
        ("auto", "gpu", "llama", {}, 2048, "float32", "reference"),  # cuDNN: bf16/fp16 only
        ("auto", "tpu", "llama", {}, 200, "bfloat16", "reference"),  # not a multiple of 128
        ("auto", "tpu", "bert", {}, 512, "bfloat16", "reference"),  # attention dropout 0.1
        ("auto", "tpu", "bert", {"attention_probs_dropout_prob": 0.0}, 512, "bfloat16", "splash"),
        ("fused", "gpu", "gpt2", {"attn_pdrop": 0.0}, 1024, "bfloat16", "cudnn"),
        ("reference", "tpu", "llama", {}, 2048, "bfloat16", "reference"),
        ("auto", "gpu", "llama", "documents", 2048, "bfloat16", "reference"),
        ("auto", "tpu", "llama", "documents", 2048, "bfloat16", "splash"),
    ],
)
def test_choose(case: tuple[str, str, str, Any, int, str, str]) -> None:
    setting, platform, family, overrides, seq, dtype, expected = case
    documents = overrides == "documents"  # data.document_mask: true
    chosen = attention.choose(
        setting,
        platform=platform,
        family=family,
        config=_config(family, **({} if documents else overrides)),
        seq_length=seq,
        compute_dtype=dtype,
        document_mask=documents,
    )
    assert chosen.implementation == expected, chosen
    if setting == "auto" and expected == "reference":
        assert chosen.reason.startswith("auto: "), chosen


@pytest.mark.parametrize(
    ("platform", "family", "dtype", "message"),
    [
        ("cpu", "llama", "float32", "train.attention: fused: cpu has no fused attention kernel"),
        ("gpu", "llama", "float32", "cuDNN flash attention takes bfloat16/float16 only"),
        ("tpu", "electra", "bfloat16", "attention dropout 0.1 needs the attention probabilities"),
    ],
)
def test_fused_without_a_kernel_is_one_line(
    platform: str, family: str, dtype: str, message: str
) -> None:
    with pytest.raises(SpecError) as caught:
        attention.choose(
            "fused",
            platform=platform,
            family=family,
            config=_config(family),
            seq_length=512,
            compute_dtype=dtype,
        )
    text = str(caught.value)
    assert message in text and "\n" not in text, text
    assert text.endswith("use train.attention: auto or reference"), text


def _job(family: str, data: dict | None = None, **train: object) -> dict:
    return {
        "name": "attention",
        "output": "/tmp/unused-attention-out",
        "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": 600},
        "data": {"objective": "clm", "seq_length": 128, **(data or {})},
        "model": {"family": family},
        "train": {"steps": 2, "global_batch_size": 8, **train},
    }


def test_spec_takes_train_attention() -> None:
    assert parse_job(_job("llama"), source="/tmp/job.yaml").train.attention == "auto"
    job = parse_job(_job("llama", attention="reference"), source="/tmp/job.yaml")
    assert job.train.attention == "reference"
    assert not job.data.document_mask
    job = parse_job(_job("llama", {"document_mask": True}), source="/tmp/job.yaml")
    assert job.data.document_mask


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"attention": "flash"},
         "train.attention: 'flash' is not allowed (allowed: auto, fused, reference)"),
        ({"attention": "fused", "backend": "tf"},
         "train.attention: fused is a JAX backend setting, not one of train.backend: tf; "
         "use train.backend: jax, or train.attention: auto"),
        ({"backend": "tf", "data": {"document_mask": True}},
         "data.document_mask: true is a JAX backend setting, not one of train.backend: tf; "
         "use train.backend: jax, or data.document_mask: false"),
        ({"data": {"document_mask": "yes"}}, "data.document_mask: expected true or false"),
        ({"data": {"objective": "mlm", "document_mask": True}},
         "data.document_mask: masks packed documents from each other in data.objective: clm"),
    ],
)  # fmt: skip
def test_spec_refuses_in_one_line(train: dict, message: str) -> None:
    data = train.pop("data", None)
    family = "bert" if data and data.get("objective") == "mlm" else "gpt2"
    with pytest.raises(SpecError) as caught:
        parse_job(_job(family, data, **train), source="/tmp/job.yaml")
    assert message in str(caught.value) and "\n" not in str(caught.value), caught.value
