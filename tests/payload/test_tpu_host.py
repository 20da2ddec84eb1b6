"""The TPU VM rules of payload/backends/tf/strategy.py that a CPU machine can check for real: a host
declared a TPU VM (by the trainer unit) without a TPU fails with one line, and jit_compile
follows whether this TensorFlow build can XLA-compile on the host (the full tensorflow-tpu
run is tests/infra/test_tpu_parity.py)."""

from __future__ import annotations

import pytest

from payload.backends.tf import strategy as strategy_lib
from payload.core.errors import UserError


@pytest.mark.parametrize(
    ("accelerator", "host_xla", "jit"),
    [("cpu", True, True), ("cpu", False, False), ("gpu", False, True), ("tpu", True, False)],
)
def test_jit_follows_host_xla(accelerator: str, host_xla: bool, jit: bool) -> None:
    assert strategy_lib.decide(accelerator, "auto", host_xla=host_xla).jit_compile is jit


def test_this_tensorflow_can_xla_compile_on_the_host() -> None:
    # The CPU build of the lock (tensorflow) has the XLA CPU backend; tensorflow-tpu does
    # not (asserted in the parity test, where the strategy turns jit off).
    assert strategy_lib.host_xla_available()


def test_a_declared_tpu_vm_without_a_tpu_refuses_to_train_on_the_cpu() -> None:
    assert not strategy_lib.tpu_present()
    strategy_lib.expect_tpu(strategy_lib.TpuHost("v5litepod-8", "v2-alpha-tpuv5-lite"))
    try:
        with pytest.raises(strategy_lib.TpuNotFoundError) as caught:
            strategy_lib.setup("auto")
    finally:
        strategy_lib.expect_tpu(None)
    assert isinstance(caught.value, UserError)  # the CLI: one line, exit 2, status.json
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "TPU not found: runtime v2-alpha-tpuv5-lite on accelerator v5litepod-8: "
    )
    assert "not training on the host CPU" in message
    # Without the declaration the same machine is a CPU host.
    assert strategy_lib.detect() == "cpu"
