"""The JAX backend's Orbax checkpoints (payload/backends/jax/checkpoint.py) on 8 virtual CPU
devices, in a fresh process (drivers/jax_checkpoint_driver.py): a state sharded over 8 devices is
restored bitwise onto 4 devices (replicated) and onto a 2 x 4 mesh sharded another way; only
the newest `keep` checkpoints stay; another layout is one line (a Llama's of earlier
releases, one variable per decoder layer, its own line); the space check before
training estimates what a checkpoint takes on disk. Through the real CLI
(test_jax_safety.py): the npz format refused, an unfinished write ignored, a layout
mismatch in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from train_helpers import cpu_devices

DRIVER = Path(__file__).parent / "drivers" / "jax_checkpoint_driver.py"


def test_a_sharded_state_restores_bitwise_onto_other_meshes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={
            **os.environ,
            **cpu_devices(8),
            "TF_CPP_MIN_LOG_LEVEL": "3",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # keep=2 of steps 1..4: the two newest, nothing unfinished left behind.
    assert report["on_disk"] == ["3", "4"], report
    assert report["steps"] == [3, 4], report
    assert report["restored"] == {
        "replicated_on_4": {"bitwise_equal": True, "shardings_as_asked": True, "devices": [4]},
        "fsdp_columns_on_2x4": {
            "bitwise_equal": True,
            "shardings_as_asked": True,
            "devices": [8],
        },
    }, report
    assert report["refused"] == (
        f"{tmp_path / 'checkpoints' / '4'} holds other variables than this run's model and "
        "optimizer (trainable: dense/kernel [256, 64] saved, dense/kernel [256, 32] now): use "
        "a new output directory, or --force to start over"
    ), report
    assert report["refused_llama"] == (
        f"{tmp_path / 'checkpoints-llama' / '1'} holds a Llama with one variable per decoder "
        "layer (llama/layers_<i>/..., earlier releases), which this release cannot resume (it "
        "stacks the layers' weights [L, ...] and scans over them): use a new output "
        "directory, or --force to start over"
    ), report
    # Layout.nbytes (what require_space counts) vs what Orbax wrote: its arrays are zstd
    # compressed (orbax tensorstore_utils), which random float32 barely shrinks; + metadata.
    assert 0.85 <= report["written_over_estimate"] < 1.25, report
    assert re.search(
        r"not enough free space for 3 more checkpoints of .* \(train.keep_checkpoints=2\): "
        r"needs about .*; free some space, lower train.keep_checkpoints or choose an output",
        report["disk_full"],
    ), report
