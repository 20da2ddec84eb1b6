"""The JAX backend's compiled training steps (payload/backends/jax/steps.py), on CPU: K steps
in one compiled call give what K one-step calls give (and n < K steps of a K-slot call what
an n-step call gives), the loss is the TF backend's loss
(weighted mean cross entropy at the predicted positions), and a tiny BERT and GPT-2 learn a
cyclic synthetic corpus. Run in a fresh process: Keras 3 picks its backend at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).parent / "drivers" / "jax_steps_driver.py"


def test_jax_training_steps_bert_and_gpt2() -> None:
    result = subprocess.run(
        [sys.executable, str(DRIVER), "bert", "gpt2"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["family"] for r in runs] == ["bert", "gpt2"]
    for run in runs:
        assert run["backend"] == "jax" and run["devices"] == ["cpu"], run
        # One scan of 4 steps == 4 one-step calls (same RNG for dropout, same updates).
        assert run["weight_gap"] <= 1e-5 and run["loss_gap"] <= 1e-5, run
        assert run["terms_gap"] <= 1e-5, run
        # n steps of a K-slot chunk (n traced: one compiled program) == an n-step chunk.
        assert run["partial_gap"] <= 1e-5 and run["partial_loss_gap"] <= 1e-5, run
        assert run["unused"] == [0.0, 0.0], run
        assert run["steps"] == 48 and run["iterations"] == 48, run
        assert run["last_loss"] < 0.7 * run["first_loss"], run  # bert: 3.34 -> 2.02 here
        assert run["written_gap"] == 0.0, run
