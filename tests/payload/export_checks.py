"""What the export tests compare (test_export.py, test_jax_train.py, test_jax_llama.py,
test_electra.py): the logits tolerance, the tokens an exported tokenizer puts first and last,
the word cycle a tiny CLM learns, and the logits of the JAX backend's newest checkpoint
(drivers/jax_checkpoint_logits.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LOGITS_DRIVER = Path(__file__).parent / "drivers" / "jax_checkpoint_logits.py"
TOLERANCE = 1e-4

CYCLE = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]
PROMPT_WORDS = 3


def expected_tokens(job, text: str) -> dict[str, str | None]:
    """First and last token of `tok(text)` with the exported tokenizer."""
    if job.model.family == "bert":
        return {"first": "[CLS]", "last": "[SEP]"}
    if job.model.family == "roberta":
        return {"first": "<s>", "last": "</s>"}
    return {"first": "<s>", "last": None}  # gpt2: BOS only, the last token is text


def checkpoint_logits(job_file: Path, ids: Path, mask: Path, out: Path) -> int:
    result = subprocess.run(
        [sys.executable, str(LOGITS_DRIVER), str(job_file), str(ids), str(mask), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.strip().splitlines()[-1])
