"""The accelerator a stack asks for, checked against the catalogs: a TPU VM's zone, type,
slice and base image (infra/catalogs/tpu.yaml), a GPU VM's machine type x GPU x count x zone x
capacity x image (infra/catalogs/gpu.yaml), and which kind of accelerator a stack is."""

from __future__ import annotations

import re
from collections.abc import Mapping

from infra.catalogs.gpu import GpuCatalog, GpuChoiceError
from infra.catalogs.tpu import MIN_PYTHON, Catalog, Generation, Image
from infra.config.keys import (
    ACCELERATORS,
    GPU_KEYS,
    SCHEDULING,
    TPU_KEYS,
    boolean,
    integer,
    qualified,
    region_of,
    string,
    unset,
)
from infra.config.types import GpuConfig, TpuConfig
from infra.errors import ConfigError

TPU_NODE_CUTOFF = "2025-04-15"


def tpu_config(values: Mapping[str, object], catalog: Catalog, prefix: str) -> TpuConfig:
    architecture = string(values, "tpuArchitecture").lower()
    if architecture in ("node", "tpu-node", "tpu_node"):
        raise ConfigError(
            f"{qualified('tpuArchitecture')}: {architecture!r} asks for a TPU Node, which Google "
            "no "
            f"longer provisions (new TPU Nodes are refused since {TPU_NODE_CUTOFF}); "
            f"set {qualified('tpuArchitecture')} to 'vm' (TPU VM, gcp.tpu.V2Vm)"
        )
    if architecture != "vm":
        raise ConfigError(
            f"{qualified('tpuArchitecture')}: {architecture!r} is not allowed; use 'vm'"
        )

    zone = string(values, "tpuZone")
    region = region_of("tpuZone", zone)
    if zone not in catalog.zones:
        raise ConfigError(
            f"{qualified('tpuZone')}: unknown zone {zone!r}; infra/catalogs/tpu.yaml lists: "
            + ", ".join(sorted(catalog.zones))
        )
    accelerator_type = string(values, "acceleratorType")
    if catalog.unlisted_slice(accelerator_type):
        raise ConfigError(
            f"{qualified('acceleratorType')}: {accelerator_type!r} is a multi-host slice that no "
            "Google "
            "doc or CI job shows running JAX on Cloud TPU VMs; supported slices: "
            + ", ".join(catalog.slices)
            + " (infra/catalogs/tpu.yaml, docs/pod-slices.md)"
        )
    offered = catalog.zones[zone]
    if accelerator_type not in offered:
        raise ConfigError(
            f"{qualified('acceleratorType')}: {accelerator_type!r} is not offered in {zone}; "
            f"offered there: {', '.join(offered)}"
        )
    generation = catalog.generation_of(accelerator_type)
    runtime = _runtime(values, catalog, generation, accelerator_type)
    scheduling = string(values, "scheduling")
    if scheduling not in SCHEDULING:
        raise ConfigError(
            f"{qualified('scheduling')}: {scheduling!r} is not allowed; use one of: "
            + ", ".join(SCHEDULING)
        )
    auto_recover = _auto_recover(values, scheduling, "tpuAutoRecover")
    release_when_done = boolean(values, "tpuReleaseWhenDone")
    if release_when_done and not auto_recover:
        raise ConfigError(
            f"{qualified('tpuReleaseWhenDone')}: true needs {qualified('tpuAutoRecover')}: true "
            "(the "
            "controller's watchdog releases the TPU VM); turn both on or leave it false"
        )
    shape = catalog.slice_of(accelerator_type)
    return TpuConfig(
        hosts=shape.hosts if shape else 1,
        chips_per_host=shape.chips_per_host if shape else 0,
        name=f"{prefix}-tpu",
        zone=zone,
        region=region,
        accelerator_type=accelerator_type,
        generation=generation.name,
        runtime_version=runtime.name,
        python_version=runtime.python,
        preemptible=scheduling == "preemptible",
        spot=scheduling == "spot",
        external_ip=boolean(values, "tpuExternalIp"),
        shielded_boot=generation.shielded_boot,
        auto_recover=auto_recover,
        release_when_done=release_when_done,
    )


def _runtime(
    values: Mapping[str, object], catalog: Catalog, generation: Generation, accelerator_type: str
) -> Image:
    """The base image: one the generation boots, with a Python the payload runs on."""
    runtime = string(values, "runtimeVersion")
    usable = catalog.usable_images(generation)
    allowed = ", ".join(usable)
    recommended = usable[0]
    if re.fullmatch(r"\d+\.\d+(\.\d+)?", runtime):
        raise ConfigError(
            f"{qualified('runtimeVersion')}: {runtime!r} is a TPU Node TensorFlow version; new TPU "
            f"Nodes are refused since {TPU_NODE_CUTOFF}; use a TPU VM base image for TPU "
            f"{generation.name}: {allowed}"
        )
    if runtime.startswith("tpu-vm-tf-"):
        raise ConfigError(
            f"{qualified('runtimeVersion')}: {runtime!r} is a TensorFlow image; TensorFlow comes "
            "from "
            f"pip (tensorflow-tpu in the payload's venv), so boot the base image for TPU "
            f"{generation.name}: {allowed} (recommended: {recommended})"
        )
    if runtime not in generation.images:
        raise ConfigError(
            f"{qualified('runtimeVersion')}: {runtime!r} is not a base image for TPU "
            f"{generation.name} ({accelerator_type}); use one of: {allowed}"
        )
    shape = catalog.slice_of(accelerator_type)
    if shape is not None and shape.image and runtime != shape.image:
        # A slice boots the image its evidence boots (catalogs/tpu.yaml slices `image:`), as a
        # single host boots one of its generation's images: another image of the generation
        # has no evidence of JAX running on that multi-host type.
        raise ConfigError(
            f"{qualified('runtimeVersion')}: {runtime!r} is not the image the {accelerator_type} "
            "slice's "
            f"evidence boots; use {shape.image} (infra/catalogs/tpu.yaml slices, "
            "docs/pod-slices.md)"
        )
    image = catalog.images[runtime]
    if not image.python_ok:
        floor = ".".join(map(str, MIN_PYTHON))
        raise ConfigError(
            f"{qualified('runtimeVersion')}: {runtime!r} ships Python {image.python}; the payload "
            f"needs Python >= {floor}; use one of: {allowed}"
        )
    return image


def _auto_recover(values: Mapping[str, object], scheduling: str, key: str) -> bool:
    """tpuAutoRecover / gpuAutoRecover: unset means on for spot and preemptible capacity."""
    raw = values.get(key)
    if raw is None or raw == "":
        return scheduling != "on-demand"
    return boolean(values, key)


def gpu_config(values: Mapping[str, object], catalog: GpuCatalog, prefix: str) -> GpuConfig:
    """A GPU VM: the catalog decides whether machine type x GPU x count x zone x capacity
    exists (infra/catalogs/gpu.py validate); its message names the key it is about."""
    zone = string(values, "gpuZone")
    machine_type = string(values, "gpuMachineType")
    gpu_type = string(values, "gpuType") or None
    count = None if unset(values, "gpuCount") else integer(values, "gpuCount", 1, 16)
    image = string(values, "gpuImage") or None
    scheduling = string(values, "scheduling")
    if scheduling not in SCHEDULING:
        raise ConfigError(
            f"{qualified('scheduling')}: {scheduling!r} is not allowed; use one of: "
            + ", ".join(SCHEDULING)
        )
    try:
        choice = catalog.validate(machine_type, gpu_type, count, zone, scheduling, image=image)
    except GpuChoiceError as error:
        raise ConfigError(f"{qualified(GPU_FIELD_KEYS[error.field])}: {error}") from None
    return GpuConfig(
        name=f"{prefix}-gpu",
        zone=zone,
        region=choice.region,
        machine_type=machine_type,
        gpu_type=choice.gpu.type,
        gpu_name=choice.gpu.name,
        count=choice.count,
        attached=choice.attached,
        spot=choice.spot,
        image=choice.image.uri,
        image_name=choice.image.name,
        kernel_modules=choice.image.kernel_modules,
        driver_repo=choice.image.driver_repo,
        driver_packages=choice.image.driver_packages,
        boot_disk=choice.boot_disk,
        nic_type=choice.nic_type,
        python_version=choice.image.python,
        shielded_boot=catalog.shielded_boot,
        precision=choice.gpu.precision,
        quota_metrics=choice.quota_metrics,
        auto_recover=_auto_recover(values, scheduling, "gpuAutoRecover"),
    )


# validate()'s arguments -> the setting that holds each
GPU_FIELD_KEYS = {
    "machine_type": "gpuMachineType",
    "gpu": "gpuType",
    "count": "gpuCount",
    "zone": "gpuZone",
    "provisioning": "scheduling",
    "image": "gpuImage",
}


def accelerator_kind(values: Mapping[str, object]) -> str:
    kind = string(values, "accelerator").lower()
    if kind not in ACCELERATORS:
        raise ConfigError(
            f"{qualified('accelerator')}: {kind!r} is not allowed; use one of: "
            + ", ".join(ACCELERATORS)
        )
    # The Pulumi CLI gives every stack every project default (infra/config/project.py):
    # a GPU stack sees tpuArchitecture "vm", so a foreign key at its default is unset.
    foreign = TPU_KEYS if kind == "gpu" else GPU_KEYS
    for name in foreign:
        if not unset(values, name):
            raise ConfigError(
                f"{qualified(name)}: a {'TPU' if kind == 'gpu' else 'GPU'} setting in a "
                f"{kind.upper()} "
                f"stack ({qualified('accelerator')}: {kind}); remove it"
            )
    return kind
