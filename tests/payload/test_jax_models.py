"""The Keras 3 / JAX backend's models (payload/backends/jax/models/) compute what
transformers' PyTorch classes compute: a model with random weights (every weight, biases and
LayerNorms included, set to random values), saved in the export layout, loads into
transformers 5 with the plain `from_pretrained` (no missing, unexpected or mismatched keys)
and gives the same logits within 1e-4, for BERT, RoBERTa and GPT-2, with padding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pt_runner import PT_SCRIPT, require_pt_python, run_pt

from payload.training import export as export_lib

DRIVER = Path(__file__).parent / "drivers" / "jax_export_driver.py"
TOLERANCE = 1e-4
VOCAB, SEQ = 300, 16


@pytest.mark.parametrize("family", ["bert", "roberta", "gpt2"])
def test_jax_backend_models_match_transformers5(family: str, tmp_path: Path) -> None:
    require_pt_python()
    rng = np.random.default_rng(3)
    ids = rng.integers(5, VOCAB, size=(3, SEQ)).astype("int32")
    mask = np.ones_like(ids)
    if family != "gpt2":  # right padding in one row (pad ids where the mask is 0)
        pad = 1 if family == "roberta" else 0
        ids[1, 10:], mask[1, 10:] = pad, 0
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    built = subprocess.run(
        [sys.executable, str(DRIVER), family, "tiny", str(VOCAB), str(SEQ), str(model_dir),
         str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy"), str(tmp_path / "jax.npy")],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.strip().splitlines()[-1] == "jax"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [export_lib.PYTORCH_CLASSES[family]]
    assert config["transformers_weights"] == export_lib.PT_WEIGHTS
    report = run_pt(
        PT_SCRIPT, str(model_dir), str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy"),
        str(tmp_path / "pt.npy"),
    )  # fmt: skip
    assert report["class"] == export_lib.PYTORCH_CLASSES[family]
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == [] and report["tokens"] is None
    jax_logits, pt_logits = np.load(tmp_path / "jax.npy"), np.load(tmp_path / "pt.npy")
    keep = mask.astype(bool)  # padded positions' outputs are not compared
    worst = float(np.abs(jax_logits[keep] - pt_logits[keep]).max())
    print(f"{family}: worst |jax - pt| = {worst:.2e}")
    assert worst <= TOLERANCE, worst
    assert float(np.abs(pt_logits[keep]).max()) > 1.0  # not a degenerate comparison
