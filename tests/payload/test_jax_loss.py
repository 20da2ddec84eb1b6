"""The JAX backend's chunked loss (steps.chunked_loss_terms: the logits a chunk of positions
at a time under jax.checkpoint) gives the whole-batch reference's loss sum, weight sum,
correct count and gradients: Llama (tied and untied LM head), GPT-2 and BERT's MLM head (its
bias, the masked positions) in float32, and Llama under mixed_bfloat16 (where the chunked
logits are accumulated in float32 and the reference's are rounded to bf16 first). Run in a
fresh process: Keras 3 picks its backend at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from payload import model as model_lib

DRIVER = Path(__file__).with_name("jax_loss_driver.py")


def test_chunk_length_rule() -> None:
    # 125m preset at batch 8 per device, sequence 2,048, vocabulary 49,152: 128 positions
    # (1,024 tokens, 192 MiB of float32 logits) per chunk.
    assert model_lib.loss_chunk_length(8, 2048, 49152) == 128
    # Llama 3.2's 128,256 at batch 4: 128 positions (512 tokens, 250 MiB).
    assert model_lib.loss_chunk_length(4, 2048, 128256) == 128
    # The largest divisor under the budget, never less than one position.
    assert model_lib.loss_chunk_length(2, 20, 10, budget=2 * 7 * 10 * 4) == 5
    assert model_lib.loss_chunk_length(1000, 16, 10**6, budget=1) == 1
    # A small batch fits in one chunk.
    assert model_lib.loss_chunk_length(1, 128, 2048) == 128


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
