"""Fixtures of the infra tests that run rendered scripts in the script sandbox
(script_sandbox.py), available to every test module in tests/infra."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_offline
from script_sandbox import Sandbox, job_with_backend, new_sandbox


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    """A fresh script sandbox under the test's tmp_path."""
    return new_sandbox(tmp_path)


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory):
    # v6e-euw4 with its job pinned to the TensorFlow backend: the TF TPU VM's script (v6e's
    # own default, train.backend auto, is the JAX environment: test_tpu_jax_env.py).
    job = job_with_backend(tmp_path_factory.mktemp("jobs"), "tf")
    return run_offline("v6e-euw4", {"tpu-pretrain:job": job})
