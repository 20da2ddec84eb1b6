"""Fixtures of the infra tests that run rendered scripts in the script sandbox
(script_sandbox.py, gpu_stubs.py), available to every test module in tests/infra."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from gpu_stubs import APT_INSTALLS, DPKG, KEYRING_CURL, NVIDIA_SMI, UNAME, VENV_PYTHON
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
    recorder = 'echo "$(basename "$0") $*" >>"$CALLS"\n'
    for name, body in (
        ("nvidia-smi", NVIDIA_SMI),
        ("nvidia-smi.real", NVIDIA_SMI),
        ("dpkg", DPKG),
        ("apt-mark", recorder),
        ("modprobe", recorder),
        ("uname", UNAME),
    ):
        stub = sandbox.bin / name
        stub.write_text("#!/bin/bash\nset -u\n" + body)
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    for name, extra in (("curl", KEYRING_CURL), ("apt-get", APT_INSTALLS)):
        stub = sandbox.bin / name
        head, body = stub.read_text().split("\n", 1)[0], stub.read_text().split("\n", 1)[1]
        if name == "curl":
            stub.write_text(f"{head}\n{extra}{body}")
        else:
            stub.write_text(f"{head}\n{body}{extra}")
    # `python3 -m venv` copies the recorder as every venv tool: make its python answer.
    recorder = sandbox.bin / "recorder"
    recorder.write_text(
        recorder.read_text().replace('echo "lib/python3.10/site-packages/libtpu/libtpu.so"', "true")
    )
    python = sandbox.bin / "venv-python"
    python.write_text("#!/bin/bash\nset -u\n" + VENV_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    stub = sandbox.bin / "python3"
    stub.write_text(
        stub.read_text().replace(
            'if [ -n "${STUB_VENV_PYTHON:-}" ]; then',
            'cp "$STUB_DIR/venv-python" "$3/bin/python"\n  if [ -n "${STUB_VENV_PYTHON:-}" ]; then',
        )
    )
    return sandbox
