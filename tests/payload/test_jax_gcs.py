"""The JAX backend on gs:// without TensorFlow, against the storage emulator
(drivers/jax_gcs_driver.py in a child process where TensorFlow is unimportable, as on a JAX VM):
JAX's compilation cache and Orbax checkpoints go through etils.epath, which without
TensorFlow reaches gs:// through gcsfs (fsspec); Orbax's arrays through tensorstore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import tensorflow_env

DRIVER = Path(__file__).parent / "drivers" / "jax_gcs_driver.py"


@pytest.mark.emulator
def test_compilation_cache_and_checkpoints_on_gs_without_tensorflow(gcs_root: str) -> None:
    emulator = os.environ["STORAGE_EMULATOR_HOST"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    result = subprocess.run(
        [sys.executable, str(DRIVER), gcs_root],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={
            **env,
            **tensorflow_env("block"),
            # tensorstore's own settings for a GCS emulator (tensorstore 0.1.86 docs, gcs
            # driver): the endpoint, and a token it sends instead of asking for credentials.
            "TENSORSTORE_GCS_HTTP_URL": emulator,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["cache_dir"] == f"{gcs_root}/compilation-cache"
    assert report["after_compile"]["compiled"] >= 1 and report["after_compile"]["loaded"] == 0
    assert report["after_reload"]["loaded"] >= 1, report  # read back from gs://
    assert report["same_result"] and report["cached_files"] >= 1, report
    # keep=2 of steps 1..3, written and listed through gcsfs, the newest restored bitwise.
    assert report["steps"] == [2, 3] and report["listed"] == ["2", "3"], report
    assert report["bitwise"], report
    assert not report["tensorflow_imported"]
