"""The JAX backend's chunked loss (steps.chunked_loss_terms: the logits a chunk of positions
at a time, its own backward pass) gives the whole-batch reference's loss sum, weight sum,
correct count and gradients: Llama (tied and untied LM head), GPT-2 and BERT's MLM head (its
bias, the masked positions) in float32, and Llama under mixed_bfloat16 (where the chunked
logits are accumulated in float32 and the reference's are rounded to bf16 first), in a fresh
process (Keras 3 picks its backend at import). In this process, on the function alone: in
bf16 its loss and gradients are the unchunked float32 loss's within bf16 rounding, and its
backward pass runs every matmul in one dtype (bf16 x bf16, float32 accumulation) and adds the
kernel's gradient in float32."""

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

from payload.backends.jax import steps
from payload.model import configs

DRIVER = Path(__file__).parent / "drivers" / "jax_loss_driver.py"


def test_chunk_length_rule() -> None:
    # 125m preset at batch 8 per device, sequence 2,048, vocabulary 49,152: 128 positions
    # (1,024 tokens, 192 MiB of float32 logits) per chunk.
    assert configs.loss_chunk_length(8, 2048, 49152) == 128
    # Llama 3.2's 128,256 at batch 4: 128 positions (512 tokens, 250 MiB).
    assert configs.loss_chunk_length(4, 2048, 128256) == 128
    # The largest divisor under the budget, never less than one position.
    assert configs.loss_chunk_length(2, 20, 10, budget=2 * 7 * 10 * 4) == 5
    assert configs.loss_chunk_length(1000, 16, 10**6, budget=1) == 1
    # A small batch fits in one chunk.
    assert configs.loss_chunk_length(1, 128, 2048) == 128
    # The budget follows the device's memory: 1/64 of it, 256 MiB to 2 GiB.
    assert configs.loss_chunk_budget(None) == 256 * 2**20
    assert configs.loss_chunk_budget(16 * 10**9) == 256 * 2**20  # v5e
    assert configs.loss_chunk_budget(80 * 2**30) == 80 * 2**30 // 64  # H100: 1.25 GiB
    assert configs.loss_chunk_budget(141 * 10**9) == 2 * 2**30  # H200
    # Llama 3.2 1B's vocabulary, 4 rows of 2,048 on an 80 GB GPU: 4 chunks of 512, not 16.
    budget = configs.loss_chunk_budget(80 * 2**30)
    assert configs.loss_chunk_length(4, 2048, 128256, budget) == 512


def test_chunked_loss_matches_the_whole_batch_logits() -> None:
    result = subprocess.run(
        [sys.executable, str(DRIVER)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["family"], r["policy"]) for r in runs] == [
        ("llama", "float32"),
        ("llama", "float32"),
        ("gpt2", "float32"),
        ("bert", "float32"),
        ("llama", "mixed_bfloat16"),
    ]
    assert [r["tied"] for r in runs[:2]] == [True, False]
    for run in runs:
        assert run["chunks"] == 4, run
        ref, chunked = run["values"]["reference"], run["values"]["chunked"]
        fp32 = run["policy"] == "float32"
        tolerance = 1e-5 if fp32 else 2e-2  # bf16 logits in the reference
        assert abs(chunked[0] - ref[0]) <= tolerance * abs(ref[0]), run
        assert chunked[1] == ref[1] > 0, run  # the weight sum, exactly
        # The argmax: equal in float32; bf16 rounding may flip a near tie.
        assert abs(chunked[2] - ref[2]) <= (0 if fp32 else 2), run
        assert run["grad_gap"] <= (1e-5 if fp32 else 5e-2), run


B, S, H, V = 4, 64, 32, 96


def _loss_inputs() -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    features = jax.random.normal(keys[0], (B, S, H))
    kernel = 0.2 * jax.random.normal(keys[1], (H, V))
    bias = 0.1 * jax.random.normal(keys[2], (V,))
    labels = jax.random.randint(keys[3], (B, S), 0, V)
    weights = (jnp.arange(S)[None] < jnp.array([S, 50, 10, S])[:, None]).astype(jnp.float32)
    return features, kernel, bias, labels, weights


def _unchunked(features: Any, kernel: Any, bias: Any, labels: Any, weights: Any) -> Any:
    """The whole batch's float32 logits, then steps.loss_terms."""
    logits = jnp.einsum("bsh,hv->bsv", features.astype(jnp.float32), kernel.astype(jnp.float32))
    return jnp.stack(steps.loss_terms(logits + bias, labels, weights))


def _dot_operand_dtypes(jaxpr: Any) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in a jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dot_operand_dtypes(inner)
    return found


def _scan_carries(jaxpr: Any) -> list[str]:
    """The carried values' types of every scan in a jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            # jax 0.12's scan has the flat trees of its inputs (constants, carry, xs) where
            # it had num_consts and num_carry (jax/_src/lax/control_flow/loops.py, ft_in).
            consts, carry, _ = eqn.params["ft_in"].elts
            carried = eqn.invars[len(consts) : len(consts) + len(carry)]
            found += [f"{v.aval.dtype}{list(v.aval.shape)}" for v in carried]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _scan_carries(inner)
    return found


def test_bf16_chunks_match_the_float32_loss_and_run_bf16_matmuls() -> None:
    """Features and kernel in bf16 (mixed_bfloat16's compute dtype), 4 chunks: the loss sum
    within 1e-3 and d features, d kernel, d bias within 1e-2 of the largest entry of the
    unchunked float32 loss's on the same (bf16-rounded) inputs; float32 inputs within 1e-5.
    The backward pass's matmuls take operands of one dtype (no float32 x bf16), and the
    kernel's gradient is carried across chunks in float32, never in bf16."""
    features, kernel, bias, labels, weights = _loss_inputs()
    budget = B * (S // 4) * V * 4  # 4 chunks

    def chunked(x: Any, k: Any, b: Any) -> Any:
        return steps.chunked_loss_terms(x, k, b, labels, weights, budget=budget)[0]

    def unchunked(x: Any, k: Any, b: Any) -> Any:
        return _unchunked(x, k, b, labels, weights)[0]

    for dtype, loss_tol, grad_tol in (("float32", 1e-6, 1e-5), ("bfloat16", 1e-3, 1e-2)):
        x, k = features.astype(dtype), kernel.astype(dtype)
        got = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2)))(x, k, bias)
        exact = (x.astype(jnp.float32), k.astype(jnp.float32), bias)
        want = jax.jit(jax.value_and_grad(unchunked, argnums=(0, 1, 2)))(*exact)
        loss_gap = abs(float(got[0]) - float(want[0])) / abs(float(want[0]))
        grad_gaps = [
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
            for a, b in zip(got[1], want[1], strict=True)
        ]
        print(f"{dtype}: loss {loss_gap:.2e}, d features / kernel / bias {grad_gaps}")
        assert [g.dtype for g in got[1]] == [x.dtype, k.dtype, bias.dtype]
        assert loss_gap <= loss_tol, loss_gap
        assert max(grad_gaps) <= grad_tol, grad_gaps

    x, k = features.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(chunked, argnums=(0, 1, 2)))(x, k, bias).jaxpr
    operands = _dot_operand_dtypes(jaxpr)
    assert operands and all(len(set(pair)) == 1 for pair in operands), operands
    assert ("bfloat16", "bfloat16") in operands, operands
    carries = _scan_carries(jaxpr)
    assert f"float32[{H}, {V}]" in carries and f"bfloat16[{H}, {V}]" not in carries, carries


def test_the_weights_gradient_is_the_loss_s() -> None:
    """d (loss sum, weight sum, correct) / d weights of the chunked loss = the unchunked
    loss's (its backward is written by hand; nothing in training differentiates the
    weights, but a wrong cotangent would be a silent trap)."""
    features, kernel, bias, labels, weights = _loss_inputs()
    mix = jnp.array([1.0, 0.3, 0.2])

    def chunked(w: Any) -> Any:
        terms = steps.chunked_loss_terms(features, kernel, bias, labels, w, budget=B * 16 * V * 4)
        return jnp.sum(terms * mix)

    def unchunked(w: Any) -> Any:
        return jnp.sum(_unchunked(features, kernel, bias, labels, w) * mix)

    got, want = jax.jit(jax.grad(chunked))(weights), jax.jit(jax.grad(unchunked))(weights)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
