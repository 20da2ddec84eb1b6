"""The JAX models' dropout (payload/backends/jax/models/blocks.py: two 16-bit draws per
random word): the rate and the expectation Keras' Dropout has, within sampling noise of a
million draws; the same seed gives the same mask, another seed an independent one, and the
two halves of one word are independent draws; inference, rates 0 and 1 and the dtype as in
Keras. Run in a fresh process: Keras 3 picks its backend at import."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).parent / "drivers" / "jax_dropout_driver.py"
ELEMENTS = 64 * 128 * 129  # the driver's SHAPE


def test_jax_dropout_rate_expectation_and_independence() -> None:
    result = subprocess.run(
        [sys.executable, str(DRIVER)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for key, got in out["rates"].items():
        rate = float(key)
        keep = (65536 - round(rate * 65536)) / 65536  # the 16-bit threshold's keep probability
        # 5 standard deviations of a mean of ELEMENTS draws (a fixed seed: not flaky).
        assert abs(got["dropped"] - rate) < 5 * math.sqrt(rate * (1 - rate) / ELEMENTS), got
        assert abs(got["mean"] - 1.0) < 5 * math.sqrt((1 / keep - 1) / ELEMENTS), got
        assert len(got["values"]) == 2 and got["values"][0] == 0.0, got
        assert abs(got["values"][1] - 1 / keep) < 1e-6, got  # float32's 1 / keep
        assert got["same_seed_same_mask"], got
        band = 5 * math.sqrt(rate**2 * (1 - rate**2) / ELEMENTS)
        assert abs(got["both_dropped_other_seed"] - rate**2) < band, got
        assert abs(got["both_dropped_one_word"] - rate**2) < 2 * band, got
    assert out["layer"] == {
        "inference_identity": True,
        "rate_0_identity": True,
        "rate_1_zeros": True,
        "seed_advances": True,
        "keeps_dtype": True,
    }
