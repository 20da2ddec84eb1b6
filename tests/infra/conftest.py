"""Fixtures of the infra tests that run rendered scripts in the script sandbox
(script_sandbox.py, gpu_stubs.py), available to every test module in tests/infra."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import storage_emulator
from gpu_stubs import install_gpu_stubs
from harness import run_offline
from script_sandbox import Sandbox, job_with_backend, new_sandbox
from smoke_world import World


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    """A fresh script sandbox under the test's tmp_path."""
    return new_sandbox(tmp_path)


@pytest.fixture
def world(tmp_path, sandbox, monkeypatch):
    """`world(stack="v6e-euw4", **scenario)`: the offline world of one `make smoke` run
    (smoke_world.py): test_smoke.py, test_untrusted.py."""
    return lambda stack="v6e-euw4", **scenario: World(
        tmp_path, sandbox, monkeypatch, stack, **scenario
    )


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory):
    # v6e-euw4 with its job pinned to the TensorFlow backend: the TF TPU VM's script (v6e's
    # own default, train.backend auto, is the JAX environment: test_tpu_jax_env.py).
    job = job_with_backend(tmp_path_factory.mktemp("jobs"), "tf")
    return run_offline("v6e-euw4", {"tpu-pretrain:job": job})


@pytest.fixture(scope="module")
def gpu_run():
    """A spot GPU stack (t4-usc1: the GPU watchdog on) for test_gpu_watch.py and
    test_first_boot.py; test_gpu_scripts.py has its own (l4x2-use1, the driver at boot)."""
    return run_offline("t4-usc1")


@pytest.fixture
def box(sandbox: Sandbox) -> Sandbox:
    """The sandbox with the GPU VM's stubs (gpu_stubs.py): test_gpu_scripts.py,
    test_gpu_jax_env.py."""
    install_gpu_stubs(sandbox)
    return sandbox


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory) -> Iterator[str]:
    """fake-gcs-server on 127.0.0.1 for the stack twin (stack_twin.py); its URL."""
    emulator = storage_emulator.start(tmp_path_factory.mktemp("fake-gcs"))
    try:
        yield emulator.url
    finally:
        emulator.stop()
