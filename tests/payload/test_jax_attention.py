"""Attention on the JAX backend (payload/backends/jax/attention.py), on this machine's CPU.

It shows: splash attention (the TPU kernel, run in Pallas' interpret mode) gives the
reference's outputs and gradients, causal and bidirectional, with grouped-query attention
and padding that differs per example, in float32 and bfloat16; under shard_map on a mesh
of 8 virtual devices it equals the unsharded call; a tiny Llama and a tiny BERT built with
it give the reference's logits and gradients; cuDNN flash attention (jax.nn's "cudnn") the
same where a GPU is present, and on this CPU every argument our cuDNN path gives
jax.nn.dot_product_attention (plain causal for padded causal rows, lengths for bidirectional
ones, a same-document mask) run through JAX's XLA implementation instead; splash's blocks
divide any multiple of 128; the reference's scores kept in float32 are closer to a float32
computation than scores rounded to bf16 (the path before); the runtime's choice
(`train.attention`, payload/model/kernels.py's table: every family's preset reaches a kernel on
Ampere+ GPUs and TPUs, docs/models.md's table regenerated), the precision `auto` picks per
chip, and the one-line refusals.
"""

from __future__ import annotations

import functools
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
from train_helpers import cpu_devices

from payload.backends.jax import attention, runtime
from payload.core.errors import SpecError
from payload.model import configs, kernels
from payload.plan import attention_table, estimate
from payload.spec import parse_job

DRIVER = Path(__file__).parent / "drivers" / "jax_attention_driver.py"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
H100 = kernels.Chip("gpu", "nvidia", (9, 0), "H100")
A100 = kernels.Chip("gpu", "nvidia", (8, 0), "A100")
T4 = kernels.Chip("gpu", "nvidia", (7, 5), "T4")
MI300 = kernels.Chip("gpu", "amd", None, "MI300X")
TPU = kernels.Chip("tpu", name="TPU v5 lite")
CHIPS = {"gpu": H100, "a100": A100, "t4": T4, "rocm": MI300, "tpu": TPU, "cpu": kernels.CPU}
EIGHT = cpu_devices(8)
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


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_splash_matches_the_reference_in_bf16(causal: bool) -> None:
    """bf16 q/k/v, padding per example: outputs and dq/dk/dv within bf16 rounding. In float32
    (1e-5) splash = the reference through whole models (causal GQA Llama, bidirectional BERT,
    every weight's gradient: test_models_with_splash_...) and on q/k/v directly with document
    ids (test_documents_attend_to_themselves_only)."""
    dtype = "bfloat16"
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


@pytest.mark.parametrize(
    ("causal", "documents"),
    [(True, False), (False, False), (True, True)],
    ids=["causal-padding", "bidirectional-padding", "causal-documents"],
)
def test_cudnn_arguments_through_xla_give_the_reference(
    causal: bool, documents: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention.cudnn with jax.nn.dot_product_attention's XLA implementation in place of
    cuDNN's (the one thing swapped): padded causal rows run plain causal (no mask at all),
    bidirectional ones pass their lengths, document numbers a same-document mask; outputs
    at the tokens and dq/dk/dv equal the reference's in float32."""
    monkeypatch.setattr(attention, "CUDNN_IMPLEMENTATION", "xla")
    q, k, v, mask, weight = _inputs("float32")
    if documents:  # two documents in every row, then the first row's padding
        mask = jnp.where(jnp.arange(T) < 50, 1, 2)[None, :] * mask
    extra = attention.cudnn_arguments(mask, causal=causal, documents=documents)
    assert sorted(extra) == (
        ["mask"] if documents else [] if causal else ["key_value_seq_lengths", "query_seq_lengths"]
    )
    got = _value_and_grads(
        lambda q, k, v: attention.cudnn(q, k, v, causal=causal, mask=mask, documents=documents),
        q, k, v, weight,
    )  # fmt: skip
    want = _value_and_grads(
        lambda q, k, v: attention.reference(q, k, v, causal=causal, mask=mask), q, k, v, weight
    )
    gaps = _relative_gaps(got, want, mask)
    print(f"cuDNN arguments via XLA vs reference, {causal=}, {documents=}: {gaps}")
    assert max(gaps) <= TOLERANCE["float32"], gaps


def test_splash_blocks_divide_the_sequence() -> None:
    """The block is the largest multiple of 128 up to 512 dividing S, and the kernel builds
    at S = 640, 768, 1,280; min(512, S), the block before, does not divide them (the kernel's
    mask processing raised there, splash_attention_mask_info.py "should divide"); a block
    that does not divide S is refused in one line naming both."""
    blocks = {s: kernels.splash_block(s) for s in (128, 384, 512, 640, 768, 1280, 2048, 200)}
    assert blocks == {128: 128, 384: 384, 512: 512, 640: 128, 768: 384, 1280: 256,
                      2048: 512, 200: None}  # fmt: skip
    for length in (640, 768, 1280):
        assert attention._splash_kernel(True, length, 2, True) is not None  # builds
        with pytest.raises(ValueError, match=f"got {length} tokens and block 512"):
            attention._splash_kernel(True, length, 2, True, min(512, length))


@functools.cache
def _models_report() -> dict[str, Any]:
    """The driver's `models` and `documents` runs in one process (Keras and JAX imported
    once for both tests)."""
    return _driver("models,documents")


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


def test_kernels_under_shard_map_equal_the_unsharded_call() -> None:
    """8 rows over a (data 2 x fsdp 4) mesh of 8 virtual CPU devices, each device its rows:
    splash, and the cuDNN path (q/k/v/mask held to their rows by shard_map before the call;
    jax's cuDNN attention refuses sequence or head-dim sharding) run through XLA."""
    report = _driver("sharded", EIGHT)
    for kernel in ("splash", "cudnn"):
        for causal in (True, False):
            assert report[f"{kernel}_shard_map_{causal}"], report
            assert report[f"{kernel}_out_gap_{causal}"] <= 1e-6, report
            assert report[f"{kernel}_grad_gap_{causal}"] <= 1e-5, report


def test_models_with_splash_give_the_reference_logits_and_gradients() -> None:
    """A tiny Llama (4 query heads over 2 key/value heads) and a tiny BERT, float32, rows
    of 128, 100, 77 and 128 tokens: logits at the tokens within 1e-5 of their scale, every
    weight's gradient within 1e-5 of the largest gradient entry."""
    report = _models_report()
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
    report = _models_report()
    assert report["gap_masked"] <= 1e-5 * report["scale"], report
    assert report["gap_unmasked"] > 1e-2 * report["scale"], report  # the mask matters


# ---------------------------------------------------------------- the runtime's choice


def _config(family: str, **overrides: Any) -> Any:
    return configs.build_config(family, "tiny", overrides, vocab_size=300, special_ids={})


@pytest.mark.parametrize(
    "case",  # setting, chip, family, config overrides (or "documents": data.document_mask),
    # seq_length, compute dtype, expected
    [
        ("auto", "gpu", "llama", {}, 2048, "bfloat16", "cudnn"),
        ("auto", "tpu", "llama", {}, 2048, "bfloat16", "splash"),
        ("auto", "cpu", "llama", {}, 2048, "float32", "reference"),
        ("auto", "gpu", "llama", {}, 2048, "float32", "reference"),  # cuDNN: bf16/fp16 only
        ("auto", "t4", "llama", {}, 2048, "bfloat16", "reference"),  # compute capability 7.5
        ("auto", "rocm", "llama", {}, 2048, "bfloat16", "reference"),  # not cuDNN's
        ("auto", "tpu", "llama", {}, 200, "bfloat16", "reference"),  # not a multiple of 128
        ("auto", "tpu", "llama", {}, 640, "bfloat16", "splash"),  # blocks of 128
        ("auto", "tpu", "bert", {}, 512, "bfloat16", "splash"),  # the presets: dropout 0
        ("auto", "gpu", "electra", {}, 512, "bfloat16", "cudnn"),
        ("auto", "tpu", "bert", {"attention_probs_dropout_prob": 0.1}, 512, "bfloat16",
         "reference"),
        ("auto", "gpu", "gpt2", {"attn_pdrop": 0.1}, 1024, "bfloat16", "reference"),
        ("fused", "gpu", "gpt2", {}, 1024, "bfloat16", "cudnn"),
        ("reference", "tpu", "llama", {}, 2048, "bfloat16", "reference"),
        ("auto", "gpu", "llama", "documents", 2048, "bfloat16", "cudnn"),
        ("auto", "gpu", "llama", "documents", 2047, "bfloat16", "reference"),  # bias: even S
        ("auto", "tpu", "llama", "documents", 2048, "bfloat16", "splash"),
        ("auto", "gpu", "llama", {"hidden_size": 1024, "num_attention_heads": 4,
                                  "num_key_value_heads": 2}, 2048, "bfloat16", "cudnn"),  # 256
        ("auto", "a100", "llama", {"hidden_size": 1024, "num_attention_heads": 4,
                                   "num_key_value_heads": 2}, 2048, "bfloat16", "reference"),
    ],
)  # fmt: skip
def test_choose(case: tuple[str, str, str, Any, int, str, str]) -> None:
    setting, chip, family, overrides, seq, dtype, expected = case
    documents = overrides == "documents"  # data.document_mask: true
    chosen = attention.choose(
        setting,
        chip=CHIPS[chip],
        family=family,
        config=_config(family, **({} if documents else overrides)),
        seq_length=seq,
        compute_dtype=dtype,
        document_mask=documents,
    )
    assert chosen.implementation == expected, chosen
    if expected == "splash":
        assert chosen.block == kernels.splash_block(seq) and chosen.describe()["block"], chosen
    if setting == "auto" and expected == "reference":
        assert chosen.reason.startswith("auto: "), chosen
        # On an accelerator, one warning line (the trainer logs it; status.json has it).
        warned = chosen.describe().get("warning", "")
        assert (chip != "cpu") == bool(warned) and "\n" not in warned, chosen
        assert chosen.reason[len("auto: ") :] in warned or chip == "cpu"


@pytest.mark.parametrize(
    ("chip", "family", "overrides", "dtype", "message"),
    [
        ("cpu", "llama", {}, "float32", "fused: cpu has no fused attention kernel"),
        ("gpu", "llama", {}, "float32", "cuDNN flash attention takes bfloat16/float16 only"),
        ("t4", "llama", {}, "bfloat16", "needs an NVIDIA GPU of compute capability 8.0 or newer"),
        ("rocm", "llama", {}, "bfloat16", "is an AMD (ROCm) GPU"),
        ("tpu", "electra", {"attention_probs_dropout_prob": 0.1}, "bfloat16",
         "attention dropout 0.1 needs the attention probabilities"),
    ],
)  # fmt: skip
def test_fused_without_a_kernel_is_one_line(
    chip: str, family: str, overrides: dict, dtype: str, message: str
) -> None:
    with pytest.raises(SpecError) as caught:
        attention.choose(
            "fused",
            chip=CHIPS[chip],
            family=family,
            config=_config(family, **overrides),
            seq_length=512,
            compute_dtype=dtype,
        )
    text = str(caught.value)
    assert message in text and "\n" not in text, text
    assert text.endswith("use train.attention: auto or reference"), text


def test_every_family_reaches_a_kernel_at_its_presets() -> None:
    """docs/models.md's attention table is payload/plan/attention_table.py's (regenerated here),
    every cell the plan's table gives is what the trainer's attention.choose picks on the
    transformers config it builds, and on every GPU of compute capability 8.0+ and every TPU
    each family's every preset gets a kernel."""
    text = DOCS.read_text(encoding="utf-8")
    begin, end = "<!-- attention-table:begin -->\n", "<!-- attention-table:end -->"
    assert text[text.index(begin) + len(begin) : text.index(end)] == attention_table.markdown()
    compared = 0
    for row in attention_table.rows():
        config = configs.build_config(row.family, row.size, {}, vocab_size=32000, special_ids={})
        for cell in row.cells:
            chip = estimate.accelerator(cell.accelerator).chip
            chosen = attention.choose(
                "auto", chip=chip, family=row.family, config=config,
                seq_length=row.seq_length, compute_dtype=kernels.compute_dtype("auto", chip),
                document_mask=row.documents,
            )  # fmt: skip
            assert chosen.implementation == cell.choice.implementation, (row, cell, chosen)
            if chip.platform == "tpu" or (chip.capability or (0, 0)) >= (8, 0):
                assert chosen.implementation != "reference", (row, cell)
            compared += 1
    assert compared >= 5 * 3 * len(attention_table.ACCELERATORS)


def test_precision_auto_is_bf16_where_the_chip_computes_it() -> None:
    """`train.precision: auto` on the JAX backend: mixed bfloat16 on TPUs and NVIDIA GPUs of
    compute capability 8.0+ (also on a GPU machine the project does not manage), float32 on
    older or AMD GPUs and the CPU; bf16 and fp32 as asked."""
    policy = {name: runtime.policy_for("auto", chip) for name, chip in CHIPS.items()}
    assert policy == {"gpu": "mixed_bfloat16", "a100": "mixed_bfloat16", "tpu": "mixed_bfloat16",
                      "t4": "float32", "rocm": "float32", "cpu": "float32"}  # fmt: skip
    assert runtime.policy_for("bf16", kernels.CPU) == "mixed_bfloat16"
    assert runtime.policy_for("fp32", H100) == "float32"
    # A device's attributes as JAX reports them (platform, client.platform_version, ...).
    cuda = kernels.device_chip("gpu", "PJRT C API\ncuda 12080", "NVIDIA H200", "9.0")
    assert (cuda.vendor, cuda.capability) == ("nvidia", (9, 0))
    rocm = kernels.device_chip("gpu", "PJRT C API\nrocm 60342", "AMD Instinct MI300X", "gfx942")
    assert (rocm.vendor, rocm.capability) == ("amd", None)
    assert kernels.device_chip("tpu", "", "TPU v5 lite", None) == kernels.Chip(
        "tpu", name="TPU v5 lite"
    )
    assert runtime.chip_of(jax.devices()[0]) == kernels.Chip("cpu", name="cpu")


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
