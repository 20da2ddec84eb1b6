"""The GPU catalog: which machine types carry which GPUs, which N1 shapes a GPU can be
attached to, which zones offer which GPU, and the image that drives them. The data lives in
catalogs/gpu.yaml (with its sources); `validate()` is the one place that decides whether a
machine type x GPU x count x zone x provisioning combination exists, and says why not in one
line that names what is allowed. The boot image and its NVIDIA kernel modules come from the
catalog too: each GPU names its image, and an image a GPU cannot use is refused."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

GPU_CATALOG_PATH = Path(__file__).with_name("gpu.yaml")
PROVISIONING = ("on-demand", "spot")
# NVIDIA's kernel-module flavours; an image whose flavour is not known drives only GPUs that
# run both (catalogs/gpu.yaml "Boot images").
KERNEL_MODULES = ("open", "proprietary")
UNKNOWN_MODULES = "unknown"
# Compute Engine's N1 shapes (general-purpose machine family, N1 table): vCPU counts and GB of
# memory per vCPU of each N1 series.
N1_VCPUS = (1, 2, 4, 8, 16, 32, 64, 96)
N1_MEMORY_PER_VCPU = {"standard": 3.75, "highmem": 6.5, "highcpu": 0.9}
# n1-highmem and n1-highcpu start at 2 vCPUs (the N1 table has no n1-highmem-1/-highcpu-1).
N1_MIN_VCPUS = {"standard": 1, "highmem": 2, "highcpu": 2}
# The boot disk of a GPU VM unless its family says otherwise (catalogs/gpu.yaml boot_disk).
DEFAULT_BOOT_DISK = "pd-balanced"
# Compute Engine's vNIC types a family may require (networkInterfaces[].nicType; pulumi-gcp
# 10.2 Instance network_interfaces nic_type); "" leaves Compute Engine's default.
NIC_TYPES = ("GVNIC", "VIRTIO_NET")
_N1_RE = re.compile(r"^n1-(standard|highmem|highcpu)-(\d+)$")


class GpuChoiceError(ValueError):
    """A machine type x GPU x count x zone x provisioning combination that does not exist.
    `field` names the argument of validate() the message is about."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Gpu:
    type: str  # Compute Engine accelerator type, nvidia-tesla-t4
    name: str  # T4
    compute_capability: str
    precision: str  # Keras mixed-precision policy: mixed_bfloat16 | mixed_float16 | float32
    quota: str  # regional quota metric, NVIDIA_T4_GPUS (spot: PREEMPTIBLE_ + it)
    kernel_modules: tuple[str, ...] = KERNEL_MODULES  # the NVIDIA flavours that drive it
    image: str = ""  # the key of the image it boots (GpuCatalog.images)

    def can_boot(self, image: GpuImage) -> bool:
        if image.kernel_modules == UNKNOWN_MODULES:
            return set(KERNEL_MODULES) <= set(self.kernel_modules)
        return image.kernel_modules in self.kernel_modules


@dataclass(frozen=True)
class GpuImage:
    """A boot image of GPU VMs and how its NVIDIA driver gets there: preinstalled (no
    packages) or installed once by the startup script from NVIDIA's apt repository."""

    name: str  # ubuntu-2204-nvidia-open
    project: str
    family: str
    python: str  # its python3 ("3.10"): the wheelhouse is built for it
    dlvm: bool  # a Deep Learning VM image (G2 cannot boot those)
    kernel_modules: str  # open | proprietary | unknown
    driver_repo: str = ""  # the apt repository's keyring package (.deb URL)
    driver_packages: tuple[str, ...] = ()  # () : the driver comes with the image

    @property
    def uri(self) -> str:
        return f"projects/{self.project}/global/images/family/{self.family}"


@dataclass(frozen=True)
class Family:
    name: str  # a2
    spot_only: bool
    types: Mapping[str, tuple[str, int]]  # machine type -> (gpu type, count)
    # Machine types of the family that have no on-demand capacity although the family has.
    spot_only_types: tuple[str, ...] = ()
    boot_disk: str = DEFAULT_BOOT_DISK  # the only boot disk type some families take
    dlvm_boot: bool = True  # False: the family cannot boot Deep Learning VM images (G2)
    nic_type: str = ""  # the vNIC the family needs (NIC_TYPES); "": Compute Engine's default

    def spot_only_for(self, machine_type: str) -> bool:
        return self.spot_only or machine_type in self.spot_only_types


@dataclass(frozen=True)
class GpuChoice:
    """A validated GPU VM: what to create and what the trainer should expect."""

    machine_type: str
    gpu: Gpu
    count: int
    attached: bool  # N1: GPUs go in guest_accelerators; otherwise they come with the type
    zone: str
    region: str
    spot: bool
    image: GpuImage
    boot_disk: str = DEFAULT_BOOT_DISK
    nic_type: str = ""  # the family's vNIC (catalogs/gpu.yaml families `nic`)

    @property
    def summary(self) -> str:
        return f"{self.count} × {self.gpu.name} on {self.machine_type}"

    @property
    def quota_metrics(self) -> tuple[str, str]:
        """The quotas this VM needs (both start at 0 on a new project): the project-wide
        GPU count and the region's quota for this GPU and provisioning model."""
        regional = f"PREEMPTIBLE_{self.gpu.quota}" if self.spot else self.gpu.quota
        return ("GPUS_ALL_REGIONS", regional)


@dataclass(frozen=True)
class GpuCatalog:
    checked: str
    shielded_boot: bool
    gpus: Mapping[str, Gpu]
    images: Mapping[str, GpuImage]
    retired: Mapping[str, str]
    n1: Mapping[str, Mapping[int, tuple[int, int]]]  # gpu -> count -> (max vCPUs, max GB)
    families: Mapping[str, Family]
    no_gpu_regions: tuple[str, ...]
    zones: Mapping[str, tuple[str, ...]]
    # machine type -> its zones, where they are fewer than its GPU's
    machine_zones: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # gpu -> count -> (zones, (max vCPUs, max GB)): lower N1 ceilings in those zones
    n1_zone_limits: Mapping[str, Mapping[int, tuple[tuple[str, ...], tuple[int, int]]]] = field(
        default_factory=dict
    )

    def family_of(self, machine_type: str) -> Family | None:
        return self.families.get(machine_type.split("-", 1)[0])

    def validate(
        self,
        machine_type: str,
        gpu: str | None,
        count: int | None,
        zone: str,
        provisioning: str,
        *,
        image: str | None = None,
    ) -> GpuChoice:
        """The one check of a GPU VM's shape; GpuChoiceError names what is allowed."""
        if provisioning not in PROVISIONING:
            raise GpuChoiceError(
                "provisioning",
                f"{provisioning!r} is not a GPU provisioning model: use "
                + " or ".join(PROVISIONING),
            )
        if gpu is not None and gpu in self.retired:
            raise GpuChoiceError("gpu", f"{self.retired[gpu]}; use one of: {self._gpu_list()}")
        if gpu is not None and gpu not in self.gpus:
            raise GpuChoiceError("gpu", f"{gpu!r} is not a GPU type; known: {self._gpu_list()}")
        family = self.family_of(machine_type)
        if family is not None:
            chosen, attached, count = self._optimized(family, machine_type, gpu, count)
        elif _N1_RE.match(machine_type):
            chosen, count = self._n1(machine_type, gpu, count, zone), count or 0
            attached = True
        else:
            raise GpuChoiceError(
                "machine_type",
                f"{machine_type!r} has no GPUs: use an N1 type (n1-standard-8, ...) with "
                f"{', '.join(self.gpus[g].name for g in self.n1)} or a type of the "
                f"{', '.join(f.upper() for f in self.families)} families",
            )
        region = self._zone(zone, chosen)
        offered = self.machine_zones.get(machine_type)
        if offered is not None and zone not in offered:
            raise GpuChoiceError(
                "zone",
                f"{zone} offers {chosen.name} but not the machine type {machine_type}; zones "
                f"with {machine_type}: {', '.join(offered)}",
            )
        if family is not None and family.spot_only_for(machine_type) and provisioning != "spot":
            what = family.name.upper() if family.spot_only else machine_type
            raise GpuChoiceError(
                "provisioning",
                f"{what} has no on-demand capacity; use spot (flex-start is not supported "
                "here yet)",
            )
        boot = self._image(family, machine_type, chosen, image)
        return GpuChoice(
            machine_type=machine_type,
            gpu=chosen,
            count=count,
            attached=attached,
            zone=zone,
            region=region,
            spot=provisioning == "spot",
            image=boot,
            boot_disk=family.boot_disk if family is not None else DEFAULT_BOOT_DISK,
            nic_type=family.nic_type if family is not None else "",
        )

    def usable_images(self, family: Family | None, gpu: Gpu) -> list[str]:
        """The images this machine type x GPU can boot, its own first."""
        usable = [
            name
            for name, image in self.images.items()
            if gpu.can_boot(image) and not (image.dlvm and family and not family.dlvm_boot)
        ]
        return sorted(usable, key=lambda name: name != gpu.image)

    def _image(
        self, family: Family | None, machine_type: str, gpu: Gpu, name: str | None
    ) -> GpuImage:
        """The boot image: the GPU's own, or the one asked if this machine type x GPU can
        boot it (its kernel modules drive the GPU; no Deep Learning VM image on G2)."""
        if name is None:
            return self.images[gpu.image]
        usable = ", ".join(self.usable_images(family, gpu))
        if name not in self.images:
            raise GpuChoiceError(
                "image",
                f"{name!r} is not a GPU image of infra/catalogs/gpu.yaml; {gpu.name} on "
                f"{machine_type} boots: {usable}",
            )
        image = self.images[name]
        if image.dlvm and family is not None and not family.dlvm_boot:
            raise GpuChoiceError(
                "image",
                f"{family.name.upper()} cannot boot Deep Learning VM images ({name}); use {usable}",
            )
        if not gpu.can_boot(image):
            runs = " or ".join(gpu.kernel_modules)
            has = (
                "kernel modules of an unknown flavour"
                if image.kernel_modules == UNKNOWN_MODULES
                else f"the {image.kernel_modules} kernel modules"
            )
            raise GpuChoiceError(
                "image",
                f"{name} has {has} and {gpu.name} runs only the {runs} NVIDIA kernel "
                f"modules; use {usable}",
            )
        return image

    def _gpu_list(self) -> str:
        return ", ".join(f"{gpu.name} ({gpu.type})" for gpu in self.gpus.values())

    def _optimized(
        self, family: Family, machine_type: str, gpu: str | None, count: int | None
    ) -> tuple[Gpu, bool, int]:
        if machine_type not in family.types:
            raise GpuChoiceError(
                "machine_type",
                f"{machine_type!r} is not a {family.name.upper()} machine type; use one of: "
                + ", ".join(family.types),
            )
        carried, carried_count = family.types[machine_type]
        carried_gpu = self.gpus[carried]
        if (gpu is not None and gpu != carried) or (count is not None and count != carried_count):
            asked = f"{count or carried_count} × {self.gpus[gpu].name if gpu else carried_gpu.name}"
            raise GpuChoiceError(
                "machine_type",
                f"{machine_type} comes with {carried_count} × {carried_gpu.name} and takes no "
                f"other GPUs ({asked} asked); leave the GPU type and count unset or pick "
                "another machine type",
            )
        return carried_gpu, False, carried_count

    def _n1(self, machine_type: str, gpu: str | None, count: int | None, zone: str) -> Gpu:
        attachable = ", ".join(f"{self.gpus[g].name} ({g})" for g in self.n1)
        if gpu is None or count is None:
            raise GpuChoiceError("gpu", f"{machine_type} needs a GPU type and count: {attachable}")
        if gpu not in self.n1:
            raise GpuChoiceError(
                "gpu",
                f"{self.gpus[gpu].name} cannot be attached to {machine_type}; N1 takes "
                f"{attachable}; {self.gpus[gpu].name} comes with its own machine types",
            )
        limits = self.n1[gpu]
        name = self.gpus[gpu].name
        if count not in limits:
            raise GpuChoiceError(
                "count", f"{count} × {name} is not a valid count: {_or_list(sorted(limits))}"
            )
        series, vcpus_text = _N1_RE.match(machine_type).groups()  # type: ignore[union-attr]
        vcpus = int(vcpus_text)
        sizes = [n for n in N1_VCPUS if n >= N1_MIN_VCPUS[series]]
        if vcpus not in sizes:
            raise GpuChoiceError(
                "machine_type",
                f"{machine_type!r} is not an N1 machine type: n1-{series}-N with N in "
                + _or_list(sizes),
            )
        max_vcpus, max_memory = limits[count]
        where = ""
        zones, lower = self.n1_zone_limits.get(gpu, {}).get(count, ((), (0, 0)))
        if zone in zones:
            (max_vcpus, max_memory), where = lower, f" in {zone}"
        if vcpus > max_vcpus:
            raise GpuChoiceError(
                "machine_type",
                f"{machine_type} has more vCPUs than {count} × {name} allows{where} ({max_vcpus})",
            )
        memory = vcpus * N1_MEMORY_PER_VCPU[series]
        if memory > max_memory:
            raise GpuChoiceError(
                "machine_type",
                f"{machine_type} has more memory ({memory:g} GB) than {count} × {name} allows"
                f"{where} ({max_memory} GB)",
            )
        return self.gpus[gpu]

    def _zone(self, zone: str, gpu: Gpu) -> str:
        match = re.fullmatch(r"([a-z]+-[a-z]+\d+)-[a-z]", zone)
        if not match:
            raise GpuChoiceError("zone", f"{zone!r} is not a zone name like us-central1-a")
        region = match.group(1)
        if region in self.no_gpu_regions:
            raise GpuChoiceError("zone", f"{region} has no GPUs")
        if zone not in self.zones:
            raise GpuChoiceError(
                "zone",
                f"zone {zone!r} is not in infra/catalogs/gpu.yaml; listed: "
                + ", ".join(sorted(self.zones)),
            )
        if gpu.type not in self.zones[zone]:
            where = sorted(z for z, offered in self.zones.items() if gpu.type in offered)
            raise GpuChoiceError(
                "zone",
                f"{zone} does not offer {gpu.name}; zones with {gpu.name}: {', '.join(where)}",
            )
        return region


def _or_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _load_images(raw: Mapping[str, Any], path: Path) -> dict[str, GpuImage]:
    images = {
        name: GpuImage(
            name=name,
            project=str(entry["project"]),
            family=str(entry["family"]),
            python=str(entry["python"]),
            dlvm=bool(entry["dlvm"]),
            kernel_modules=str(entry["kernel_modules"]),
            driver_repo=str(entry.get("driver_repo") or ""),
            driver_packages=tuple(str(p) for p in entry.get("driver_packages") or ()),
        )
        for name, entry in raw["images"].items()
    }
    for image in images.values():
        if image.kernel_modules not in (*KERNEL_MODULES, UNKNOWN_MODULES):
            raise ValueError(f"{path}: image {image.name}: kernel_modules {image.kernel_modules}")
        if bool(image.driver_packages) != bool(image.driver_repo):
            raise ValueError(f"{path}: image {image.name}: driver_packages need a driver_repo")
    return images


def _nic(path: Path, family: str, entry: Mapping[str, Any]) -> str:
    """A family's `nic`: one of NIC_TYPES, with the source that requires it."""
    nic = str(entry.get("nic") or "")
    if nic and nic not in NIC_TYPES:
        raise ValueError(f"{path}: {family}: nic {nic!r} is not one of {', '.join(NIC_TYPES)}")
    if nic and not " ".join(str(entry.get("nic_source") or "").split()):
        raise ValueError(f"{path}: {family}: nic {nic} has no nic_source")
    return nic


def _check_gpus(gpus: Mapping[str, Gpu], images: Mapping[str, GpuImage], path: Path) -> None:
    for gpu in gpus.values():
        if gpu.precision not in ("mixed_bfloat16", "mixed_float16", "float32"):
            raise ValueError(f"{path}: {gpu.type}: unknown precision {gpu.precision}")
        if not gpu.kernel_modules or not set(gpu.kernel_modules) <= set(KERNEL_MODULES):
            raise ValueError(f"{path}: {gpu.type}: kernel_modules {gpu.kernel_modules}")
        if gpu.image not in images or not gpu.can_boot(images[gpu.image]):
            raise ValueError(f"{path}: {gpu.type}: image {gpu.image!r} cannot drive it")


def load_gpu_catalog(path: Path = GPU_CATALOG_PATH) -> GpuCatalog:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    gpus = {
        key: Gpu(
            type=key,
            name=str(entry["name"]),
            compute_capability=str(entry["compute_capability"]),
            precision=str(entry["precision"]),
            quota=str(entry["quota"]),
            kernel_modules=tuple(str(m) for m in entry["kernel_modules"]),
            image=str(entry["image"]),
        )
        for key, entry in raw["gpus"].items()
    }
    images = _load_images(raw, path)
    _check_gpus(gpus, images, path)
    n1 = {
        gpu: MappingProxyType(
            {int(count): (int(limit[0]), int(limit[1])) for count, limit in counts.items()}
        )
        for gpu, counts in raw["n1"].items()
    }
    families = {
        name: Family(
            name=name,
            spot_only=bool(entry["spot_only"]),
            types=MappingProxyType(
                {mt: (str(pair[0]), int(pair[1])) for mt, pair in entry["types"].items()}
            ),
            spot_only_types=tuple(entry.get("spot_only_types") or ()),
            boot_disk=str(entry.get("boot_disk") or DEFAULT_BOOT_DISK),
            dlvm_boot=bool(entry.get("dlvm_boot", True)),
            nic_type=_nic(path, name, entry),
        )
        for name, entry in raw["families"].items()
    }
    for family in families.values():
        unknown_types = sorted(set(family.spot_only_types) - set(family.types))
        if unknown_types:
            raise ValueError(f"{path}: {family.name}: spot_only_types {unknown_types} unknown")
    zones = {zone: tuple(offered) for zone, offered in raw["zones"].items()}
    named = set(n1) | {gpu for f in families.values() for gpu, _ in f.types.values()}
    named |= {gpu for offered in zones.values() for gpu in offered}
    unknown = sorted(named - set(gpus))
    if unknown:
        raise ValueError(f"{path}: unknown GPU types {unknown}")
    for family in families.values():
        on_dlvm = sorted(g for g, _ in family.types.values() if images[gpus[g].image].dlvm)
        if on_dlvm and not family.dlvm_boot:  # the family's own GPUs must boot elsewhere
            raise ValueError(f"{path}: {family.name}: {on_dlvm} boot a Deep Learning VM image")
    carried = {mt: gpu for f in families.values() for mt, (gpu, _) in f.types.items()}
    machine_zones = {mt: tuple(listed) for mt, listed in (raw.get("machine_zones") or {}).items()}
    for mt, listed in machine_zones.items():
        if mt not in carried:
            raise ValueError(f"{path}: machine_zones: {mt} is not a machine type of a family")
        extra = sorted(z for z in listed if carried[mt] not in zones.get(z, ()))
        if extra:  # a type is never offered where its GPU is not
            raise ValueError(f"{path}: machine_zones: {mt}: {extra} do not offer {carried[mt]}")
    n1_zone_limits = {
        gpu: MappingProxyType(
            {
                int(count): (tuple(rule["zones"]), (int(rule["limit"][0]), int(rule["limit"][1])))
                for count, rule in counts.items()
            }
        )
        for gpu, counts in (raw.get("n1_zone_limits") or {}).items()
    }
    for gpu, counts in n1_zone_limits.items():
        if gpu not in n1 or not set(counts) <= set(n1[gpu]):
            raise ValueError(f"{path}: n1_zone_limits: {gpu} {sorted(counts)} not in n1")
    return GpuCatalog(
        checked=str(raw["checked"]),
        shielded_boot=bool(raw["shielded_boot"]),
        gpus=MappingProxyType(gpus),
        images=MappingProxyType(images),
        retired=MappingProxyType(dict(raw.get("retired") or {})),
        n1=MappingProxyType(n1),
        families=MappingProxyType(families),
        no_gpu_regions=tuple(raw["no_gpu_regions"]),
        zones=MappingProxyType(zones),
        machine_zones=MappingProxyType(machine_zones),
        n1_zone_limits=MappingProxyType(n1_zone_limits),
    )
