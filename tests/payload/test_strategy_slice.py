"""The TF backend on one host only: TPU_NAME naming a slice is refused through the real CLI.

Multi-host slices run the JAX backend (docs/pod-slices.md); the TF backend's former
single-client slice path (a TF TPU worker on every host, TPU_NAME on worker 0) is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tensorflow as tf
import yaml
from train_helpers import job_document, write_corpus

from payload.backends.tf import strategy

ENDPOINTS = "grpc://10.130.0.2:8470,grpc://10.130.0.3:8470"


def test_global_batch_must_split_over_replicas() -> None:
    runtime = strategy.Runtime(strategy.decide("cpu", "fp32"), tf.distribute.get_strategy())
    assert (runtime.num_hosts, runtime.num_replicas, runtime.is_chief) == (1, 1, True)
    strategy.check_global_batch(7, runtime)  # anything splits over one replica


def _cli(job: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payload", "train", "--job", str(job)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
    )


def test_cli_refuses_a_slice_on_the_tf_backend(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=20)
    job = tmp_path / "job.yaml"
    document = job_document(tmp_path, corpus)
    document.setdefault("train", {})["backend"] = "tf"
    job.write_text(yaml.safe_dump(document))
    for name in ("bert-v4-32", ENDPOINTS):
        result = _cli(job, TPU_NAME=name, TPU_LOAD_LIBRARY="0")
        assert result.returncode == 2, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "trains on one host only" in last, last
        assert "train.backend: jax" in last
    assert not (tmp_path / "out" / "checkpoints").exists()
