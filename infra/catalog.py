"""The zone catalog: which accelerator types a zone offers, which TPU VM base images a TPU
generation boots, and the Python each image ships. The data lives in catalog.yaml (with its
sources); infra/config.py turns it into config errors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import yaml

CATALOG_PATH = Path(__file__).with_name("catalog.yaml")
# The payload's floor (pyproject.toml requires-python); older images are refused.
MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class Image:
    name: str
    python: str  # the image's python3, "3.10"
    tf_ci: bool  # Google's TF-on-TPU CI runs TensorFlow on this image

    @property
    def python_ok(self) -> bool:
        return python_tuple(self.python) >= MIN_PYTHON


@dataclass(frozen=True)
class Generation:
    name: str
    images: tuple[str, ...]  # the first is the recommended one
    shielded_boot: bool


@dataclass(frozen=True)
class Slice:
    """A multi-host accelerator type: one TPU node of `hosts` TPU VMs."""

    hosts: int
    chips_per_host: int

    @property
    def replicas(self) -> int:
        """TensorFlow's replicas: one TPU device per chip on the listed generations
        (catalog.yaml's sources; the payload checks the real count when it connects)."""
        return self.hosts * self.chips_per_host


@dataclass(frozen=True)
class Catalog:
    images: Mapping[str, Image]
    generations: Mapping[str, Generation]
    accelerators: Mapping[str, str]  # accelerator type -> generation name
    zones: Mapping[str, tuple[str, ...]]  # zone -> accelerator types offered there
    # multi-host accelerator types
    slices: Mapping[str, Slice] = field(default_factory=lambda: MappingProxyType({}))

    def slice_of(self, accelerator_type: str) -> Slice | None:
        """The slice shape of a multi-host type, None for a single-host type."""
        return self.slices.get(accelerator_type)

    def generation_of(self, accelerator_type: str) -> Generation:
        return self.generations[self.accelerators[accelerator_type]]

    def usable_images(self, generation: Generation) -> tuple[str, ...]:
        """The generation's images whose Python the payload can run on."""
        return tuple(name for name in generation.images if self.images[name].python_ok)


def python_tuple(version: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"python version {version!r} is not MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2))


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    images = {
        name: Image(name=name, python=str(entry["python"]), tf_ci=bool(entry["tf_ci"]))
        for name, entry in raw["images"].items()
    }
    for image in images.values():
        python_tuple(image.python)
    generations = {
        name: Generation(
            name=name,
            images=tuple(entry["images"]),
            shielded_boot=bool(entry["shielded_boot"]),
        )
        for name, entry in raw["generations"].items()
    }
    for generation in generations.values():
        unknown = [image for image in generation.images if image not in images]
        if unknown:
            raise ValueError(f"{path}: generation {generation.name} lists unknown {unknown}")
        if not generation.images or not images[generation.images[0]].python_ok:
            raise ValueError(f"{path}: generation {generation.name} needs a usable first image")
    accelerators = dict(raw["accelerators"])
    zones = {zone: tuple(types) for zone, types in raw["zones"].items()}
    for zone, types in zones.items():
        for accelerator_type in types:
            if accelerator_type not in accelerators:
                raise ValueError(f"{path}: zone {zone} lists unknown type {accelerator_type}")
    for accelerator_type, generation in accelerators.items():
        if generation not in generations:
            raise ValueError(f"{path}: {accelerator_type} has unknown generation {generation}")
    slices = {
        name: Slice(hosts=int(entry["hosts"]), chips_per_host=int(entry["chips_per_host"]))
        for name, entry in (raw.get("slices") or {}).items()
    }
    for name, shape in slices.items():
        if name not in accelerators:
            raise ValueError(f"{path}: slice {name} is not an accelerator type")
        if shape.hosts < 2 or shape.chips_per_host < 1:
            raise ValueError(f"{path}: slice {name} needs hosts >= 2 and chips_per_host >= 1")
    return Catalog(
        slices=MappingProxyType(slices),
        images=MappingProxyType(images),
        generations=MappingProxyType(generations),
        accelerators=MappingProxyType(accelerators),
        zones=MappingProxyType(zones),
    )
