"""The zone catalog: which accelerator types a zone offers and which TensorFlow runtime
versions a TPU generation accepts. The data lives in catalog.yaml (with its sources)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

CATALOG_PATH = Path(__file__).with_name("catalog.yaml")


@dataclass(frozen=True)
class Generation:
    name: str
    runtimes: tuple[str, ...]
    shielded_boot: bool


@dataclass(frozen=True)
class Catalog:
    generations: Mapping[str, Generation]
    accelerators: Mapping[str, str]  # accelerator type -> generation name
    zones: Mapping[str, tuple[str, ...]]  # zone -> accelerator types offered there

    def generation_of(self, accelerator_type: str) -> Generation:
        return self.generations[self.accelerators[accelerator_type]]


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    generations = {
        name: Generation(
            name=name,
            runtimes=tuple(entry["runtimes"]),
            shielded_boot=bool(entry["shielded_boot"]),
        )
        for name, entry in raw["generations"].items()
    }
    accelerators = dict(raw["accelerators"])
    zones = {zone: tuple(types) for zone, types in raw["zones"].items()}
    for zone, types in zones.items():
        for accelerator_type in types:
            if accelerator_type not in accelerators:
                raise ValueError(f"{path}: zone {zone} lists unknown type {accelerator_type}")
    for accelerator_type, generation in accelerators.items():
        if generation not in generations:
            raise ValueError(f"{path}: {accelerator_type} has unknown generation {generation}")
    return Catalog(
        generations=MappingProxyType(generations),
        accelerators=MappingProxyType(accelerators),
        zones=MappingProxyType(zones),
    )
