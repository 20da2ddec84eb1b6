"""The accelerators the plan knows (payload/plan/accelerators.yaml: Google's and NVIDIA's
pages): an accelerator type's chips, memory per chip, peak FLOP/s, compute dtype and, for an
NVIDIA GPU, its compute capability (what payload/model/kernels.py's table reads). The plan
(payload/plan/estimate.py) and `tpu-payload compile` (backends/jax/aot.py) read them through
`accelerator(name)`; a TPU type's slice as libtpu's topology API names it (what `compile`
asks the TPU compiler for) through `topology_of`.

Framework-free (standard library and PyYAML): the plan runs in the Pulumi program's
environment (tests/infra/test_jobfit.py checks its import closure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from payload.core.errors import UserError
from payload.model import kernels


class AcceleratorError(UserError):
    """An accelerator type the plan has no figures for."""


@dataclass(frozen=True)
class Accelerator:
    name: str  # as given: v5litepod-8, v4-32, nvidia-l4x2
    kind: str  # tpu | gpu
    generation: str  # v5e, nvidia-l4, ...
    chips: int
    memory_bytes: int  # per chip
    peak_flops: float  # per chip, dense, in the precision it trains in
    activation_bytes: int  # 2 (bf16/fp16) or 4 (fp32)
    source: str
    compute_capability: str = ""  # NVIDIA GPUs (accelerators.yaml)

    @property
    def chip(self) -> kernels.Chip:  # what payload/model/kernels.py's table reads of it
        if self.kind != "gpu":
            return kernels.Chip(self.kind, name=self.generation)
        return kernels.Chip("gpu", "nvidia", kernels.parse_capability(self.compute_capability),
                            self.generation)  # fmt: skip


@cache
def catalog() -> dict[str, Any]:
    text = resources.files("payload.plan").joinpath("accelerators.yaml").read_text(encoding="utf-8")
    import yaml  # noqa: PLC0415

    data: dict[str, Any] = yaml.safe_load(text)
    return data


def known_accelerators() -> list[str]:
    """Examples of every accelerator the plan knows (for the refusal of an unknown one)."""
    tpu = [
        f"{g['prefix']}-<{'cores' if g['cores_per_chip'] > 1 else 'chips'}>"
        for g in catalog()["tpu"].values()
    ]
    return tpu + [f"{name}[x<count>]" for name in catalog()["gpu"]]


def accelerator(name: str) -> Accelerator:
    """The accelerator an accelerator type names, or AcceleratorError (one line)."""
    for generation, row in catalog()["tpu"].items():
        match = re.fullmatch(re.escape(row["prefix"]) + r"-(\d+)", name)
        if match:
            cores, per_chip = int(match.group(1)), int(row["cores_per_chip"])
            if cores < per_chip or cores % per_chip:
                raise AcceleratorError(
                    f"--accelerator {name!r}: {row['prefix']} counts TensorCores, "
                    f"{per_chip} per chip; use a multiple of {per_chip}"
                )
            return Accelerator(
                name=name,
                kind="tpu",
                generation=generation,
                chips=cores // per_chip,
                memory_bytes=int(row["memory_bytes"]),
                peak_flops=float(row["peak_flops"]),
                activation_bytes=2,
                source=str(row["source"]),
            )
    match = re.fullmatch(r"(.+?)(?:x(\d+))?", name)
    row = catalog()["gpu"].get(match.group(1)) if match else None
    if match and row is not None and (match.group(2) is None or int(match.group(2)) >= 1):
        return Accelerator(
            name=name,
            kind="gpu",
            generation=match.group(1),
            chips=int(match.group(2) or 1),
            memory_bytes=int(row["memory_bytes"]),
            peak_flops=float(row["peak_flops"]),
            activation_bytes=int(row["activation_bytes"]),
            source=str(row["source"]),
            compute_capability=str(row.get("compute_capability", "")),
        )
    raise AcceleratorError(
        f"--accelerator {name!r}: unknown accelerator type; known: "
        + ", ".join(known_accelerators())
    )


@dataclass(frozen=True)
class Topology:
    """A TPU type's slice as libtpu's topology API names it."""

    name: str  # e.g. v5e:4x4
    chip_config: str  # default | megacore
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]
    hosts: int

    def describe(self) -> str:
        return f"{self.name}, {self.hosts} host(s)"


def topology_of(acc: Accelerator) -> Topology:
    """The topology of a TPU accelerator type (payload/plan/accelerators.yaml `topology`)."""
    if acc.kind == "gpu":
        raise AcceleratorError(
            f"--accelerator {acc.name}: the GPU compiler (XLA:GPU, cuDNN autotuning) needs a GPU "
            "in this machine; compile it where one is, or use `tpu-payload plan` here"
        )
    table = catalog()["tpu"][acc.generation].get("topology")
    if not table:
        raise AcceleratorError(
            f"--accelerator {acc.name}: no topology for {acc.generation} (compile knows "
            + ", ".join(g for g, row in catalog()["tpu"].items() if row.get("topology"))
            + ")"
        )
    shapes = {int(k): str(v) for k, v in table["shapes"].items()}
    if acc.chips not in shapes:
        sizes = ", ".join(f"{acc.name.split('-')[0]}-{_type_count(acc, n)}" for n in shapes)
        raise AcceleratorError(
            f"--accelerator {acc.name}: no topology of {acc.chips} chips; {sizes}"
        )
    shape = tuple(int(d) for d in shapes[acc.chips].split("x"))
    host_chips = int(table["host_chips"])
    if acc.chips <= host_chips:
        bounds = (*shape, 1, 1)[:3]
        hosts = 1
    else:
        bounds, hosts = (2, 2, 1), acc.chips // 4
    wrap = table.get("wrap", {}).get(acc.chips, [False, False, False])
    return Topology(
        name=f"{table['name']}:{shapes[acc.chips]}",
        chip_config=str(table["chip_config"]),
        chips_per_host_bounds=(int(bounds[0]), int(bounds[1]), int(bounds[2])),
        wrap=(bool(wrap[0]), bool(wrap[1]), bool(wrap[2])),
        hosts=hosts,
    )


def _type_count(acc: Accelerator, chips: int) -> int:
    return chips * int(catalog()["tpu"][acc.generation]["cores_per_chip"])
