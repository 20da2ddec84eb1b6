"""What the VM's trainer unit says this host is (a TPU VM or a GPU VM), free of any
framework: the CLI declares it from the unit's environment before training, and either
backend then trains on that accelerator or fails with one line, never on the host CPU."""

from __future__ import annotations

from dataclasses import dataclass

from payload.core.errors import TransientError, UserError


class TpuNotFoundError(UserError):
    """This is a TPU VM, but the backend finds no TPU: training on its CPU would be useless."""


class TpuUnavailableError(TransientError):
    """This TPU VM's chips are attached, but the backend could not initialise them (held by
    another process, a slice whose other hosts are not up, a driver that is not ready): a
    restart may fix it."""


class GpuNotFoundError(UserError):
    """This is a GPU VM, but the backend finds no GPU: training on its CPU would be useless."""


@dataclass(frozen=True)
class TpuHost:
    """What the TPU VM's trainer unit says this host is (catalog names)."""

    accelerator_type: str  # e.g. v5litepod-8
    runtime_version: str  # the base image, e.g. v2-alpha-tpuv5-lite


@dataclass(frozen=True)
class GpuHost:
    """What the GPU VM's trainer unit says this host is (infra/catalogs/gpu.yaml)."""

    gpu: str  # e.g. T4
    count: int
    policy: str  # the GPU's mixed-precision policy: mixed_bfloat16 | mixed_float16
    image: str = "unknown"  # the boot image family


_expected_tpu: TpuHost | None = None
_expected_gpu: GpuHost | None = None


def expect_tpu(host: TpuHost | None) -> None:
    """Declare that this host is a TPU VM (the CLI calls it from the unit's environment)."""
    global _expected_tpu  # noqa: PLW0603  (set once by the CLI, the edge that reads env)
    _expected_tpu = host


def expect_gpu(host: GpuHost | None) -> None:
    """Declare that this host is a GPU VM (the CLI calls it from the unit's environment)."""
    global _expected_gpu  # noqa: PLW0603  (set once by the CLI, the edge that reads env)
    _expected_gpu = host


def expected_tpu() -> TpuHost | None:
    return _expected_tpu


def expected_gpu() -> GpuHost | None:
    return _expected_gpu


def tpu_not_found(host: TpuHost, reason: str) -> TpuNotFoundError:
    return TpuNotFoundError(
        f"TPU not found: runtime {host.runtime_version} on accelerator {host.accelerator_type}: "
        f"{reason}; not training on the host CPU (check the VM's accelerator and runtime "
        "against infra/catalogs/tpu.yaml, and `journalctl -t tpu-pretrain` on the VM)"
    )


def tpu_unavailable(host: TpuHost, chips: int, reason: str) -> TpuUnavailableError:
    return TpuUnavailableError(
        f"TPU unavailable: runtime {host.runtime_version} on accelerator {host.accelerator_type}: "
        f"{chips} TPU chips are on this VM's PCI bus but {reason}; a restart may fix it (another "
        "process holding the TPU, a slice whose other hosts are not up yet); the trainer unit "
        "restarts it (check `journalctl -t tpu-pretrain` on the VM if it does not)"
    )
