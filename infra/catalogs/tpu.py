"""The zone catalog: which accelerator types a zone offers, which TPU VM base images a TPU
generation boots, and the Python each image ships. The data lives in catalogs/tpu.yaml (with its
sources); infra/config/accelerators.py turns it into config errors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import yaml

CATALOG_PATH = Path(__file__).with_name("tpu.yaml")
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
    """A multi-host accelerator type: one TPU node of `hosts` TPU VMs, listed only with
    evidence that Google runs JAX on exactly this type (`source`)."""

    hosts: int
    chips_per_host: int
    source: str = ""  # the Google doc or CI job (catalogs/tpu.yaml)
    # The base image that evidence boots, where it names one the generation allows: a stack
    # of this slice boots it (tests/infra/test_infra_config.py); "" = the generation's first.
    image: str = ""

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: one TPU device per chip on the listed generations
        (catalogs/tpu.yaml's sources; the payload checks the real count when it starts)."""
        return self.hosts * self.chips_per_host


@dataclass(frozen=True)
class TfEvidence:
    """One public source for a tensorflow-tpu/libtpu pair: where it ran on a real TPU
    (`ran_on`: generations), or only says so (`ran_on` empty: a statement, no run)."""

    tensorflow_tpu: str
    libtpu: str
    source: str  # repository, file; commit and date
    ran_on: tuple[str, ...]  # generations it ran on, as the source shows
    installable_from_pypi: bool  # the pair resolves from PyPI alone


@dataclass(frozen=True)
class TfTpuPin:
    """The TF backend's TPU environment (requirements/tpu-vm.txt pins the same versions)
    and the evidence for it and for the pairs it was chosen over."""

    tensorflow_tpu: str
    libtpu: str
    tf_keras: str
    evidence: tuple[TfEvidence, ...]

    def is_pin(self, evidence: TfEvidence) -> bool:
        return (evidence.tensorflow_tpu, evidence.libtpu) == (self.tensorflow_tpu, self.libtpu)

    @property
    def ran_on(self) -> tuple[str, ...]:
        """Generations where exactly the pinned pair ran on a real TPU (public CI)."""
        found = {g for e in self.evidence if self.is_pin(e) for g in e.ran_on}
        return tuple(sorted(found))


@dataclass(frozen=True)
class Catalog:
    images: Mapping[str, Image]
    generations: Mapping[str, Generation]
    accelerators: Mapping[str, str]  # accelerator type -> generation name
    zones: Mapping[str, tuple[str, ...]]  # zone -> accelerator types offered there
    # multi-host accelerator types
    slices: Mapping[str, Slice] = field(default_factory=lambda: MappingProxyType({}))
    tensorflow_tpu: TfTpuPin | None = None

    def slice_of(self, accelerator_type: str) -> Slice | None:
        """The slice shape of a multi-host type, None for a single-host type."""
        return self.slices.get(accelerator_type)

    def unlisted_slice(self, accelerator_type: str) -> bool:
        """A TPU type of a listed generation (its name's prefix, e.g. v5p-16 -> v5p) larger than
        every single-host type of it, and not a listed slice: a multi-host slice without
        evidence (catalogs/tpu.yaml `slices:`)."""
        match = re.fullmatch(r"(v[0-9]+[a-z]*)-([0-9]+)", accelerator_type)
        if not match or accelerator_type in self.accelerators:
            return False
        prefix, size = match.group(1), int(match.group(2))
        single = [
            int(name.rsplit("-", 1)[1])
            for name in self.accelerators
            if name.rsplit("-", 1)[0] == prefix and name not in self.slices
        ]
        return bool(single) and size > max(single)

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
    slices = _slices(path, raw.get("slices") or {}, accelerators, generations)
    tensorflow_tpu = _tf_tpu_pin(path, raw.get("tensorflow_tpu"), generations)
    return Catalog(
        tensorflow_tpu=tensorflow_tpu,
        slices=MappingProxyType(slices),
        images=MappingProxyType(images),
        generations=MappingProxyType(generations),
        accelerators=MappingProxyType(accelerators),
        zones=MappingProxyType(zones),
    )


def _slices(
    path: Path, raw: Mapping, accelerators: Mapping[str, str], generations: Mapping
) -> dict[str, Slice]:
    """catalog.yaml `slices:`: each a known accelerator type of >= 2 hosts, with its source."""
    slices = {
        name: Slice(
            hosts=int(entry["hosts"]),
            chips_per_host=int(entry["chips_per_host"]),
            source=" ".join(str(entry.get("source") or "").split()),
            image=str(entry.get("image") or ""),
        )
        for name, entry in raw.items()
    }
    for name, shape in slices.items():
        if name not in accelerators:
            raise ValueError(f"{path}: slice {name} is not an accelerator type")
        if shape.hosts < 2 or shape.chips_per_host < 1:
            raise ValueError(f"{path}: slice {name} needs hosts >= 2 and chips_per_host >= 1")
        if not shape.source:
            raise ValueError(
                f"{path}: slice {name} has no source (a Google doc or CI job that runs JAX on it)"
            )
        if shape.image and shape.image not in generations[accelerators[name]].images:
            raise ValueError(
                f"{path}: slice {name}: image {shape.image} is not an image of its generation"
            )
    return slices


def _tf_tpu_pin(path: Path, raw: Mapping | None, generations: Mapping) -> TfTpuPin | None:
    if raw is None:
        return None
    pin = raw["pin"]
    evidence = tuple(
        TfEvidence(
            tensorflow_tpu=str(entry["tensorflow-tpu"]),
            libtpu=str(entry["libtpu"]),
            source=str(entry["source"]),
            ran_on=tuple(entry["ran_on"]),
            installable_from_pypi=bool(entry["installable_from_pypi"]),
        )
        for entry in raw["evidence"]
    )
    tf_tpu = TfTpuPin(
        tensorflow_tpu=str(pin["tensorflow-tpu"]),
        libtpu=str(pin["libtpu"]),
        tf_keras=str(pin["tf_keras"]),
        evidence=evidence,
    )
    for entry in evidence:
        unknown = [g for g in entry.ran_on if g not in generations]
        if unknown:
            raise ValueError(f"{path}: tensorflow_tpu evidence lists unknown {unknown}")
    if not tf_tpu.ran_on:
        raise ValueError(
            f"{path}: tensorflow_tpu pins tensorflow-tpu {tf_tpu.tensorflow_tpu} + libtpu "
            f"{tf_tpu.libtpu}, a pair no listed source ran on a TPU"
        )
    if not all(e.installable_from_pypi for e in evidence if tf_tpu.is_pin(e)):
        raise ValueError(f"{path}: the pinned tensorflow_tpu pair must install from PyPI")
    minor = ".".join(tf_tpu.tensorflow_tpu.split(".")[:2])
    if not tf_tpu.tf_keras.startswith(minor + "."):
        raise ValueError(
            f"{path}: tf_keras {tf_tpu.tf_keras} does not match tensorflow-tpu "
            f"{tf_tpu.tensorflow_tpu} (tf_keras follows the TensorFlow minor)"
        )
    return tf_tpu
