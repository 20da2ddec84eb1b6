"""Stack configuration: read once, validated into frozen dataclasses.

`read_stack_config()` is the only place that reads `pulumi.Config`; everything below it
takes a `StackConfig`. `parse_config()` is pure so the rules can be tested directly, and
every rule fails with one line that names the key, the value and what is allowed."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pulumi
from pulumi.runtime import config as runtime_config

from infra import jobfit, jobspec
from infra.catalog import MIN_PYTHON, Catalog, Generation, Image, load_catalog
from infra.dataflow_regions import dataflow_regions
from infra.errors import ConfigError
from infra.gpu_catalog import GpuCatalog, GpuChoiceError, load_gpu_catalog
from infra.project_config import cli_text

NAMESPACE = "tpu-pretrain"
REPO_ROOT = Path(__file__).resolve().parent.parent
IAP_RANGE = "35.235.240.0/20"
TPU_NODE_CUTOFF = "2025-04-15"


@dataclass(frozen=True)
class Key:
    name: str
    type: str  # the Pulumi.yaml config type: string | integer | boolean | array
    description: str
    default: object = None  # None: required in every stack
    # Required only in stacks of this accelerator kind ("tpu" | "gpu"); Pulumi.yaml gives
    # such a key default "" (Pulumi requires a value for every declared key without one).
    required_for: str = ""


# Pulumi.yaml declares exactly these keys (tests/infra checks that the two agree).
KEYS: tuple[Key, ...] = (
    Key("accelerator", "string", "What trains: 'tpu' (a TPU VM) or 'gpu' (a GPU VM).", "tpu"),
    Key(
        "tpuZone",
        "string",
        "Zone of the TPU VM, e.g. europe-west4-a (see infra/catalog.yaml).",
        "",
        "tpu",
    ),
    Key(
        "acceleratorType",
        "string",
        "TPU accelerator type offered in tpuZone, e.g. v3-8.",
        "",
        "tpu",
    ),
    Key(
        "runtimeVersion",
        "string",
        "TPU VM base image for the generation, e.g. v2-alpha-tpuv5 (see infra/catalog.yaml).",
        "",
        "tpu",
    ),
    Key("tpuArchitecture", "string", "TPU architecture: 'vm' (TPU Nodes are gone).", "vm"),
    Key(
        "scheduling",
        "string",
        "Capacity: on-demand, preemptible (TPU only) or spot.",
        "on-demand",
    ),
    Key("tpuExternalIp", "boolean", "Give the TPU VM an external IP (default: no).", False),
    # No fixed default: on for spot/preemptible scheduling, off for on-demand. Declared a
    # string: Pulumi refuses a boolean key whose default is not true or false, and "" is
    # "unset" here (infra/project_config.py).
    Key(
        "tpuAutoRecover",
        "string",
        "Recreate a preempted/terminated TPU VM from the controller (default: on for spot "
        "and preemptible, off for on-demand).",
        "",
    ),
    Key(
        "tpuReleaseWhenDone",
        "boolean",
        "With tpuAutoRecover: delete the TPU VM once the job's export is complete (default: "
        "keep it).",
        False,
    ),
    Key(
        "gpuZone",
        "string",
        "GPU stacks: zone of the GPU VM, e.g. us-central1-a (see infra/gpu_catalog.yaml).",
        "",
        "gpu",
    ),
    Key(
        "gpuMachineType",
        "string",
        "GPU stacks: machine type, e.g. n1-standard-8 (with gpuType) or g2-standard-8.",
        "",
        "gpu",
    ),
    Key(
        "gpuImage",
        "string",
        "GPU stacks: boot image, a key of infra/gpu_catalog.yaml images (default: the GPU's own).",
        "",
    ),
    Key(
        "gpuType",
        "string",
        "GPU stacks: GPU attached to an N1 type, e.g. nvidia-tesla-t4 (A2/A3/A4/G2 carry theirs).",
        "",
    ),
    # 0: unset (an accelerator-optimized type carries its GPUs); Pulumi refuses an integer
    # key whose default is not an integer.
    Key(
        "gpuCount",
        "integer",
        "GPU stacks: how many gpuType GPUs an N1 type gets (0: none set).",
        0,
    ),
    # No fixed default: on for spot, off for on-demand (which Compute Engine restarts itself).
    Key(
        "gpuAutoRecover",
        "string",
        "GPU stacks: start a preempted (stopped) spot GPU VM again from the controller "
        "(default: on for spot, off for on-demand).",
        "",
    ),
    Key(
        "bucketName",
        "string",
        "Bucket name, ending with -tpu-pretrain (default <project>-<stack>-tpu-pretrain).",
        "",
    ),
    Key("bucketLocation", "string", "Bucket location; must be the TPU region (default).", ""),
    Key("bucketSoftDeleteDays", "integer", "Days deleted objects stay restorable (7-90).", 7),
    Key(
        "destroyBucketWithStack",
        "boolean",
        "Delete the bucket and its contents on `pulumi destroy` (default: keep it).",
        False,
    ),
    Key("controllerMachineType", "string", "Machine type of the controller VM.", "e2-standard-4"),
    Key("tpuSubnetCidr", "string", "Subnet for the TPU VM and controller.", "10.10.0.0/20"),
    Key("hopSubnetCidr", "string", "Subnet of the VPN hop.", "10.20.0.0/24"),
    Key("vpnZone", "string", "Zone of the WireGuard hop, near you.", "asia-northeast3-a"),
    Key("vpnAllowedCidrs", "array", "Source CIDRs allowed to reach WireGuard (UDP)."),
    Key("vpnClientCidr", "string", "Addresses of VPN clients inside the tunnel.", "10.250.0.0/24"),
    Key("vpnPort", "integer", "WireGuard UDP port.", 51820),
    Key(
        "vpnClientPublicKey",
        "string",
        "Your own WireGuard public key; if unset a client key pair is generated.",
        "",
    ),
    Key("job", "string", "Job template (YAML) relative to the repository root."),
    Key(
        "dataflow",
        "boolean",
        "Give the stack Dataflow for encoding at scale: the Dataflow API, a worker service "
        "account and launch rights for the controller (default: off).",
        False,
    ),
    Key(
        "accountsFromBootstrap",
        "boolean",
        "GitOps: the bootstrap (infra/bootstrap) owns this stack's service accounts and the "
        "grants on them; the stack adopts them, keeps them on destroy and writes none of "
        "their IAM policies (default: the stack creates and deletes its own).",
        False,
    ),
)
KEYS_BY_NAME = {key.name: key for key in KEYS}
# Settings that belong to one kind of accelerator; a stack of the other kind refuses them.
TPU_KEYS = (
    "tpuZone",
    "acceleratorType",
    "runtimeVersion",
    "tpuArchitecture",
    "tpuExternalIp",
    "tpuAutoRecover",
    "tpuReleaseWhenDone",
)
GPU_KEYS = ("gpuZone", "gpuMachineType", "gpuType", "gpuCount", "gpuImage", "gpuAutoRecover")
ACCELERATORS = ("tpu", "gpu")
SCHEDULING = ("on-demand", "preemptible", "spot")
_ZONE_RE = re.compile(r"^([a-z]+-[a-z]+\d+)-[a-z]$")
_GCE_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Every stack bucket's name ends so: the deploy account's bucket and object powers are
# bound with a condition on it (infra/bootstrap/gitops_bootstrap.py STACK_BUCKET_SUFFIX),
# which keeps the Pulumi state bucket and every other bucket out of its reach.
STACK_BUCKET_SUFFIX = "-tpu-pretrain"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_MACHINE_RE = re.compile(r"^[a-z][a-z0-9]*-[a-z0-9-]+$")
# Every GCP name of a stack starts with "tp-<stack>". Service account ids are the tightest
# limit: 6-30 characters, [a-z][a-z0-9-]*[a-z0-9] (IAM serviceAccounts.create accountId);
# the stack's accounts are "<prefix>-<suffix>" for each suffix below (infra/program.py).
SERVICE_ACCOUNT_ID_MAX = 30
SERVICE_ACCOUNT_SUFFIXES = ("-workload", "-controller", "-vpn-hop", "-dataflow")
LONGEST_ACCOUNT_SUFFIX = max(SERVICE_ACCOUNT_SUFFIXES, key=len)
MAX_PREFIX = SERVICE_ACCOUNT_ID_MAX - len(LONGEST_ACCOUNT_SUFFIX)
MAX_STACK_NAME = MAX_PREFIX - len("tp-")


@dataclass(frozen=True)
class TpuConfig:
    """A TPU VM or a multi-host TPU slice (gcp.tpu.V2Vm)."""

    kind: ClassVar[str] = "tpu"
    name: str
    zone: str
    region: str
    accelerator_type: str
    generation: str
    runtime_version: str  # the TPU VM base image (catalog.yaml)
    python_version: str  # the image's python3, e.g. "3.10" (the wheelhouse targets it)
    preemptible: bool
    spot: bool
    external_ip: bool
    shielded_boot: bool
    auto_recover: bool  # the controller's watchdog recreates a preempted TPU VM
    release_when_done: bool = False  # ...and deletes it once the job's export is complete
    hosts: int = 1  # TPU VMs of the node: > 1 for a multi-host slice (catalog.yaml slices)
    chips_per_host: int = 0  # only set for a slice

    @property
    def label(self) -> str:
        return self.accelerator_type


@dataclass(frozen=True)
class GpuConfig:
    """A Compute Engine VM with NVIDIA GPUs (gcp.compute.Instance), validated against
    infra/gpu_catalog.yaml."""

    kind: ClassVar[str] = "gpu"
    name: str
    zone: str
    region: str
    machine_type: str
    gpu_type: str  # nvidia-tesla-t4
    gpu_name: str  # T4
    count: int
    attached: bool  # N1: guest_accelerators; A2/A3/A4/G2 carry their GPUs
    spot: bool
    image: str  # projects/<project>/global/images/family/<family> (gpu_catalog.yaml images)
    image_name: str  # its key in the catalog, ubuntu-2204-nvidia-open
    kernel_modules: (
        str  # the NVIDIA kernel-module flavour of the image: open | proprietary | unknown
    )
    driver_repo: str  # NVIDIA's apt keyring package the startup script installs ("" : none)
    driver_packages: tuple[str, ...]  # the driver packages it installs (() : preinstalled)
    boot_disk: str  # the boot disk type the machine type takes (gpu_catalog.yaml)
    nic_type: str  # the vNIC the machine family needs: GVNIC on A3/A4 ("" : the default)
    python_version: str  # the image's python3
    shielded_boot: bool  # secure boot (vTPM and integrity monitoring are always on)
    precision: str  # Keras mixed-precision policy for this GPU
    quota_metrics: tuple[str, ...]
    # The controller's watchdog starts the VM again when preemption stopped it (gpu-watch.sh).
    auto_recover: bool
    hosts: int = 1
    preemptible: bool = False  # GPU VMs use spot (provisioning_model SPOT), never legacy

    @property
    def label(self) -> str:
        return self.gpu_type


@dataclass(frozen=True)
class BucketConfig:
    name: str
    location: str
    soft_delete_seconds: int
    destroy_with_stack: bool


@dataclass(frozen=True)
class NetworkConfig:
    name: str
    tpu_subnet_cidr: str
    hop_subnet_cidr: str


@dataclass(frozen=True)
class VpnConfig:
    zone: str
    region: str
    allowed_cidrs: tuple[str, ...]
    client_cidr: str
    port: int
    client_public_key: str | None


@dataclass(frozen=True)
class StackConfig:
    project: str
    stack: str
    prefix: str  # prefix of every GCP resource name of this stack
    accelerator: TpuConfig | GpuConfig
    bucket: BucketConfig
    network: NetworkConfig
    vpn: VpnConfig
    controller_machine_type: str
    job_file: Path
    job_name: str
    # The training backend the accelerator VM's environment is built for ("tf" | "jax"):
    # the job's train.backend, or for auto the catalog's choice (resolve_backend).
    backend: str = "tf"
    # tpu-pretrain:dataflow: the stack provides Dataflow (infra/components/dataflow.py).
    dataflow: bool = False
    # tpu-pretrain:accountsFromBootstrap: the GitOps bootstrap created the stack's accounts and
    # every grant on their own allow policies (docs/gitops.md); the stack only adopts them.
    accounts_from_bootstrap: bool = False
    # The payload's plan of the job on the accelerator, in a line (infra/jobfit.py).
    job_plan: str = ""

    @property
    def labels(self) -> dict[str, str]:
        return {"app": "tpu-pretrain", "stack": self.stack, "job": self.job_name}

    @property
    def vm_labels(self) -> dict[str, str]:
        """The VMs' labels: no job (a VM runs whatever job the pointer names, and a TPU VM's
        labels are replaced, not updated: components/tpu.py IN_PLACE_FIELDS)."""
        return {k: v for k, v in self.labels.items() if k != "job"}

    @property
    def tpu(self) -> TpuConfig:
        if not isinstance(self.accelerator, TpuConfig):
            raise TypeError(f"stack {self.stack} trains on a GPU VM, not a TPU")
        return self.accelerator

    @property
    def gpu(self) -> GpuConfig:
        if not isinstance(self.accelerator, GpuConfig):
            raise TypeError(f"stack {self.stack} trains on a TPU, not a GPU VM")
        return self.accelerator


def _k(name: str) -> str:
    return f"{NAMESPACE}:{name}"


def _value(values: Mapping[str, object], name: str) -> object:
    key = KEYS_BY_NAME[name]
    raw = values.get(name)
    if raw is None or raw == "":
        if key.default is None or key.required_for:
            example = {"vpnAllowedCidrs": '["203.0.113.0/24"]'}.get(name, "")
            hint = f" (e.g. {example})" if example else ""
            raise ConfigError(f"{_k(name)} is required{hint}: {key.description}")
        return key.default
    return raw


def _unset(values: Mapping[str, object], name: str) -> bool:
    """Not set, or set to its Pulumi.yaml default ("" for the keys without a fixed one),
    compared as the CLI passes values (text)."""
    raw = values.get(name)
    default = KEYS_BY_NAME[name].default
    return raw is None or cli_text(raw) in ("", "" if default is None else cli_text(default))


def _string(values: Mapping[str, object], name: str) -> str:
    value = _value(values, name)
    if not isinstance(value, str):
        raise ConfigError(f"{_k(name)}: {value!r} must be a string")
    return value.strip()


def _boolean(values: Mapping[str, object], name: str) -> bool:
    value = _value(values, name)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{_k(name)}: {value!r} must be true or false")


def _integer(values: Mapping[str, object], name: str, low: int, high: int) -> int:
    value = _value(values, name)
    number: int | None = None
    # bool is an int to Python, not a count to a user.
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            number = int(value)
        except ValueError:
            number = None
    if number is None or not low <= number <= high:
        raise ConfigError(f"{_k(name)}: {value!r} must be an integer from {low} to {high}")
    return number


def _array(values: Mapping[str, object], name: str) -> list[object]:
    value = _value(values, name)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, list) or not value:
        raise ConfigError(f'{_k(name)}: must be a non-empty list, e.g. ["203.0.113.0/24"]')
    return value


def _cidr(name: str, value: object) -> ipaddress.IPv4Network:
    try:
        if not isinstance(value, str) or "/" not in value:
            raise ValueError(value)
        return ipaddress.IPv4Network(value, strict=True)
    except ValueError:
        raise ConfigError(
            f"{_k(name)}: {value!r} is not an IPv4 CIDR like 203.0.113.0/24"
        ) from None


def _region_of(name: str, zone: str) -> str:
    match = _ZONE_RE.match(zone)
    if not match:
        raise ConfigError(f"{_k(name)}: {zone!r} is not a zone name like europe-west4-a")
    return match.group(1)


def _tpu(values: Mapping[str, object], catalog: Catalog, prefix: str) -> TpuConfig:
    architecture = _string(values, "tpuArchitecture").lower()
    if architecture in ("node", "tpu-node", "tpu_node"):
        raise ConfigError(
            f"{_k('tpuArchitecture')}: {architecture!r} asks for a TPU Node, which Google no "
            f"longer provisions (new TPU Nodes are refused since {TPU_NODE_CUTOFF}); "
            f"set {_k('tpuArchitecture')} to 'vm' (TPU VM, gcp.tpu.V2Vm)"
        )
    if architecture != "vm":
        raise ConfigError(f"{_k('tpuArchitecture')}: {architecture!r} is not allowed; use 'vm'")

    zone = _string(values, "tpuZone")
    region = _region_of("tpuZone", zone)
    if zone not in catalog.zones:
        raise ConfigError(
            f"{_k('tpuZone')}: unknown zone {zone!r}; infra/catalog.yaml lists: "
            + ", ".join(sorted(catalog.zones))
        )
    accelerator_type = _string(values, "acceleratorType")
    if catalog.unlisted_slice(accelerator_type):
        raise ConfigError(
            f"{_k('acceleratorType')}: {accelerator_type!r} is a multi-host slice that no Google "
            "doc or CI job shows running JAX on Cloud TPU VMs; supported slices: "
            + ", ".join(catalog.slices)
            + " (infra/catalog.yaml, docs/pod-slices.md)"
        )
    offered = catalog.zones[zone]
    if accelerator_type not in offered:
        raise ConfigError(
            f"{_k('acceleratorType')}: {accelerator_type!r} is not offered in {zone}; "
            f"offered there: {', '.join(offered)}"
        )
    generation = catalog.generation_of(accelerator_type)
    runtime = _runtime(values, catalog, generation, accelerator_type)
    scheduling = _string(values, "scheduling")
    if scheduling not in SCHEDULING:
        raise ConfigError(
            f"{_k('scheduling')}: {scheduling!r} is not allowed; use one of: "
            + ", ".join(SCHEDULING)
        )
    auto_recover = _auto_recover(values, scheduling, "tpuAutoRecover")
    release_when_done = _boolean(values, "tpuReleaseWhenDone")
    if release_when_done and not auto_recover:
        raise ConfigError(
            f"{_k('tpuReleaseWhenDone')}: true needs {_k('tpuAutoRecover')}: true (the "
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
        external_ip=_boolean(values, "tpuExternalIp"),
        shielded_boot=generation.shielded_boot,
        auto_recover=auto_recover,
        release_when_done=release_when_done,
    )


def _runtime(
    values: Mapping[str, object], catalog: Catalog, generation: Generation, accelerator_type: str
) -> Image:
    """The base image: one the generation boots, with a Python the payload runs on."""
    runtime = _string(values, "runtimeVersion")
    usable = catalog.usable_images(generation)
    allowed = ", ".join(usable)
    recommended = usable[0]
    if re.fullmatch(r"\d+\.\d+(\.\d+)?", runtime):
        raise ConfigError(
            f"{_k('runtimeVersion')}: {runtime!r} is a TPU Node TensorFlow version; new TPU "
            f"Nodes are refused since {TPU_NODE_CUTOFF}; use a TPU VM base image for TPU "
            f"{generation.name}: {allowed}"
        )
    if runtime.startswith("tpu-vm-tf-"):
        raise ConfigError(
            f"{_k('runtimeVersion')}: {runtime!r} is a TensorFlow image; TensorFlow comes from "
            f"pip (tensorflow-tpu in the payload's venv), so boot the base image for TPU "
            f"{generation.name}: {allowed} (recommended: {recommended})"
        )
    if runtime not in generation.images:
        raise ConfigError(
            f"{_k('runtimeVersion')}: {runtime!r} is not a base image for TPU "
            f"{generation.name} ({accelerator_type}); use one of: {allowed}"
        )
    shape = catalog.slice_of(accelerator_type)
    if shape is not None and shape.image and runtime != shape.image:
        # A slice boots the image its evidence boots (catalog.yaml slices `image:`), as a
        # single host boots one of its generation's images: another image of the generation
        # has no evidence of JAX running on that multi-host type.
        raise ConfigError(
            f"{_k('runtimeVersion')}: {runtime!r} is not the image the {accelerator_type} slice's "
            f"evidence boots; use {shape.image} (infra/catalog.yaml slices, docs/pod-slices.md)"
        )
    image = catalog.images[runtime]
    if not image.python_ok:
        floor = ".".join(map(str, MIN_PYTHON))
        raise ConfigError(
            f"{_k('runtimeVersion')}: {runtime!r} ships Python {image.python}; the payload "
            f"needs Python >= {floor}; use one of: {allowed}"
        )
    return image


def _auto_recover(values: Mapping[str, object], scheduling: str, key: str) -> bool:
    """tpuAutoRecover / gpuAutoRecover: unset means on for spot and preemptible capacity."""
    raw = values.get(key)
    if raw is None or raw == "":
        return scheduling != "on-demand"
    return _boolean(values, key)


def _gpu(values: Mapping[str, object], catalog: GpuCatalog, prefix: str) -> GpuConfig:
    """A GPU VM: the catalog decides whether machine type x GPU x count x zone x capacity
    exists (infra/gpu_catalog.py validate); its message names the key it is about."""
    zone = _string(values, "gpuZone")
    machine_type = _string(values, "gpuMachineType")
    gpu_type = _string(values, "gpuType") or None
    count = None if _unset(values, "gpuCount") else _integer(values, "gpuCount", 1, 16)
    image = _string(values, "gpuImage") or None
    scheduling = _string(values, "scheduling")
    if scheduling not in SCHEDULING:
        raise ConfigError(
            f"{_k('scheduling')}: {scheduling!r} is not allowed; use one of: "
            + ", ".join(SCHEDULING)
        )
    try:
        choice = catalog.validate(machine_type, gpu_type, count, zone, scheduling, image=image)
    except GpuChoiceError as error:
        raise ConfigError(f"{_k(GPU_FIELD_KEYS[error.field])}: {error}") from None
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


def _accelerator_kind(values: Mapping[str, object]) -> str:
    kind = _string(values, "accelerator").lower()
    if kind not in ACCELERATORS:
        raise ConfigError(
            f"{_k('accelerator')}: {kind!r} is not allowed; use one of: " + ", ".join(ACCELERATORS)
        )
    # The Pulumi CLI gives every stack every project default (infra/project_config.py):
    # a GPU stack sees tpuArchitecture "vm", so a foreign key at its default is unset.
    foreign = TPU_KEYS if kind == "gpu" else GPU_KEYS
    for name in foreign:
        if not _unset(values, name):
            raise ConfigError(
                f"{_k(name)}: a {'TPU' if kind == 'gpu' else 'GPU'} setting in a {kind.upper()} "
                f"stack ({_k('accelerator')}: {kind}); remove it"
            )
    return kind


def _wireguard_key(name: str, value: str) -> str | None:
    if not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ConfigError(
            f"{_k(name)}: {value!r} is not a WireGuard public key (44 base64 characters, "
            "the output of `wg pubkey`)"
        )
    return value


def _bucket(
    values: Mapping[str, object], project: str, stack: str, region: str, what: str = "TPU"
) -> BucketConfig:
    bucket_name = _string(values, "bucketName") or f"{project}-{stack}{STACK_BUCKET_SUFFIX}"
    if not _BUCKET_RE.match(bucket_name) or "goog" in bucket_name:
        raise ConfigError(
            f"{_k('bucketName')}: {bucket_name!r} is not a valid bucket name "
            "(3-63 characters: lowercase letters, digits, '-', '_', '.')"
        )
    if not bucket_name.endswith(STACK_BUCKET_SUFFIX):
        raise ConfigError(
            f"{_k('bucketName')}: {bucket_name!r} must end with {STACK_BUCKET_SUFFIX!r}: the "
            "deploy account may change only buckets named so (docs/guard-rails.md)"
        )
    location = (_string(values, "bucketLocation") or region).lower()
    if location != region:
        raise ConfigError(
            f"{_k('bucketLocation')}: {location.upper()!r} is outside the {what} region "
            f"{region}; set it to {region} (or leave it unset)"
        )
    return BucketConfig(
        name=bucket_name,
        location=location.upper(),
        soft_delete_seconds=_integer(values, "bucketSoftDeleteDays", 7, 90) * 86400,
        destroy_with_stack=_boolean(values, "destroyBucketWithStack"),
    )


def _network(values: Mapping[str, object], prefix: str) -> NetworkConfig:
    tpu_subnet = _cidr("tpuSubnetCidr", _string(values, "tpuSubnetCidr"))
    hop_subnet = _cidr("hopSubnetCidr", _string(values, "hopSubnetCidr"))
    client_cidr = _cidr("vpnClientCidr", _string(values, "vpnClientCidr"))
    for left, right, a, b in (
        ("tpuSubnetCidr", "hopSubnetCidr", tpu_subnet, hop_subnet),
        ("tpuSubnetCidr", "vpnClientCidr", tpu_subnet, client_cidr),
        ("hopSubnetCidr", "vpnClientCidr", hop_subnet, client_cidr),
    ):
        if a.overlaps(b):
            raise ConfigError(f"{_k(right)}: {b} overlaps {_k(left)} {a}; use disjoint ranges")
    for key, net in (
        ("tpuSubnetCidr", tpu_subnet),
        ("hopSubnetCidr", hop_subnet),
        ("vpnClientCidr", client_cidr),
    ):
        if not net.is_private:
            raise ConfigError(f"{_k(key)}: {net} is not a private (RFC 1918) range")
    return NetworkConfig(
        name=f"{prefix}-vpc", tpu_subnet_cidr=str(tpu_subnet), hop_subnet_cidr=str(hop_subnet)
    )


def _vpn(values: Mapping[str, object], tpu_region: str, what: str = "TPU") -> VpnConfig:
    allowed_cidrs = tuple(
        str(_cidr(f"vpnAllowedCidrs[{i}]", item))
        for i, item in enumerate(_array(values, "vpnAllowedCidrs"))
    )
    vpn_zone = _string(values, "vpnZone")
    vpn_region = _region_of("vpnZone", vpn_zone)
    if vpn_region == tpu_region:
        raise ConfigError(
            f"{_k('vpnZone')}: {vpn_zone!r} is in the {what}'s own region {tpu_region}; the hop "
            "belongs in a region near you (default asia-northeast3-a)"
        )
    return VpnConfig(
        zone=vpn_zone,
        region=vpn_region,
        allowed_cidrs=allowed_cidrs,
        client_cidr=str(_cidr("vpnClientCidr", _string(values, "vpnClientCidr"))),
        port=_integer(values, "vpnPort", 1024, 65535),
        client_public_key=_wireguard_key(
            "vpnClientPublicKey", _string(values, "vpnClientPublicKey")
        ),
    )


# The payload's default train.global_batch_size (payload/job.py TrainSpec); infra reads the
# template only as far as it must (the payload validates the whole spec when it starts).
DEFAULT_GLOBAL_BATCH = 32


def _check_replica_batch(
    job_file: str, template: Mapping[str, object], replicas: int, described: str
) -> None:
    """What a multi-replica accelerator (a TPU slice, several GPUs) needs from its job,
    checked before anything is deployed: the global batch splits evenly over every replica
    (the payload checks the same again against the replicas it finds: its backends'
    check_global_batch).
    The output is always gs://<bucket>/runs/<job> (jobspec.render_job_spec; a template with
    its own `output` is refused), which a slice needs: every host reads and worker 0 writes
    there."""
    train = template.get("train")
    train = train if isinstance(train, dict) else {}
    batch = train.get("global_batch_size", DEFAULT_GLOBAL_BATCH)
    if not isinstance(batch, int) or isinstance(batch, bool):
        return  # the payload refuses it with its own message
    if batch % replicas:
        lower = batch // replicas * replicas
        raise ConfigError(
            f"{_k('job')}: {job_file!r}: train.global_batch_size {batch} must be a multiple "
            f"of the {replicas} replicas of {described}; e.g. {max(lower, replicas)} or "
            f"{lower + replicas}"
        )


def _check_job_replicas(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    catalog: Catalog,
) -> None:
    if isinstance(accelerator, GpuConfig):
        if accelerator.count > 1:
            described = f"{accelerator.count} × {accelerator.gpu_name} (one replica per GPU)"
            _check_replica_batch(job_file, template, accelerator.count, described)
        return
    shape = catalog.slice_of(accelerator.accelerator_type)
    if shape is not None:
        described = (
            f"{accelerator.accelerator_type} ({shape.hosts} hosts x {shape.chips_per_host} chips)"
        )
        _check_replica_batch(job_file, template, shape.replicas, described)


# train.backend in a job template (the payload owns the key and validates it again).
BACKENDS = ("tf", "jax", "auto")


def resolve_backend(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    catalog: Catalog,
) -> str:
    """The backend whose environment the accelerator VM installs: the job's train.backend,
    or for auto (or none) jax for a family only the JAX backend trains (jobspec
    JAX_ONLY_FAMILIES, as the payload resolves auto), jax on a slice, jax on a single-host TPU
    VM whose image Google's TF CI does not cover (catalog.yaml tf_ci: false, e.g. v6e) and tf
    everywhere else (a GPU VM included). A slice runs JAX only: Google's TF CI runs TensorFlow
    on slices only through its grpc_tpu_worker container, which is not built here
    (docs/pod-slices.md)."""
    train = template.get("train")
    value = train.get("backend", "auto") if isinstance(train, dict) else "auto"
    if value not in BACKENDS:
        raise ConfigError(
            f"{_k('job')}: {job_file!r}: train.backend {value!r} is not one of: "
            + ", ".join(BACKENDS)
        )
    if value == "auto" and jobspec.model_family(template) in jobspec.JAX_ONLY_FAMILIES:
        value = "jax"
    if isinstance(accelerator, GpuConfig):
        return "jax" if value == "jax" else "tf"
    if accelerator.hosts > 1:
        if value == "tf":
            raise ConfigError(
                f"{_k('job')}: {job_file!r}: train.backend: tf on a "
                f"{accelerator.accelerator_type} slice is not supported: Google's TF CI runs TF "
                "slices only through its grpc_tpu_worker container (not built here); use "
                "train.backend: jax"
            )
        return "jax"
    if value == "auto":
        return "tf" if catalog.images[accelerator.runtime_version].tf_ci else "jax"
    return str(value)


def parse_config(
    *,
    project: str | None,
    stack: str,
    values: Mapping[str, object],
    catalog: Catalog | None = None,
    gpu_catalog: GpuCatalog | None = None,
) -> StackConfig:
    """Validate raw settings (key without namespace -> value) into a StackConfig."""
    catalog = catalog or load_catalog()
    if not project:
        raise ConfigError(
            "gcp:project is required: run `pulumi config set gcp:project <your-project-id>`"
        )
    if not _PROJECT_RE.match(project):
        raise ConfigError(f"gcp:project: {project!r} is not a GCP project id")
    prefix = f"tp-{stack}"
    if not _GCE_NAME_RE.match(prefix) or len(prefix) > MAX_PREFIX:
        raise ConfigError(
            f"stack name {stack!r}: use lowercase letters, digits and '-', starting with a letter "
            f"or digit, at most {MAX_STACK_NAME} characters (service account ids such as "
            f"'tp-<stack>{LONGEST_ACCOUNT_SUFFIX}' are limited to {SERVICE_ACCOUNT_ID_MAX})"
        )
    unknown = sorted(set(values) - set(KEYS_BY_NAME))
    if unknown:
        raise ConfigError(
            f"{_k(unknown[0])}: unknown setting; known: " + ", ".join(sorted(KEYS_BY_NAME))
        )

    accelerator: TpuConfig | GpuConfig
    if _accelerator_kind(values) == "gpu":
        accelerator = _gpu(values, gpu_catalog or load_gpu_catalog(), prefix)
    else:
        accelerator = _tpu(values, catalog, prefix)
    what = accelerator.kind.upper()
    bucket = _bucket(values, project, stack, accelerator.region, what)
    network = _network(values, prefix)
    vpn = _vpn(values, accelerator.region, what)
    machine_type = _string(values, "controllerMachineType")
    if not _MACHINE_RE.match(machine_type):
        raise ConfigError(
            f"{_k('controllerMachineType')}: {machine_type!r} is not a machine type like "
            "e2-standard-4"
        )

    job_file_value = _string(values, "job")
    job_file = (REPO_ROOT / job_file_value).resolve()
    try:
        template = jobspec.load_template(job_file)
    except jobspec.JobTemplateError as error:
        raise ConfigError(f"{_k('job')}: {job_file_value!r}: {error}") from None
    _check_job_replicas(job_file_value, template, accelerator, catalog)
    backend = resolve_backend(job_file_value, template, accelerator, catalog)
    dataflow = _dataflow(values, job_file_value, template, accelerator.region)
    job_plan = _check_job_fits(job_file_value, template, accelerator, bucket.name, backend)

    return StackConfig(
        project=project,
        stack=stack,
        prefix=prefix,
        accelerator=accelerator,
        bucket=bucket,
        network=network,
        vpn=vpn,
        controller_machine_type=machine_type,
        job_file=job_file,
        job_name=template["name"],
        backend=backend,
        dataflow=dataflow,
        job_plan=job_plan,
        accounts_from_bootstrap=_boolean(values, "accountsFromBootstrap"),
    )


def _dataflow(
    values: Mapping[str, object], job_file: str, template: Mapping[str, object], region: str
) -> bool:
    """tpu-pretrain:dataflow, off by default: Dataflow is billed outside a TPU grant and its
    grants (a launcher role on the controller) are a stack's explicit choice. A job that
    encodes on Dataflow needs it on; with it on, a job may still encode locally (the stack
    then only offers Dataflow, e.g. to a launch from your own machine: stack output
    dataflowOptions)."""
    enabled = _boolean(values, "dataflow")
    if not enabled and jobspec.uses_dataflow(template):
        raise ConfigError(
            f"{_k('dataflow')}: the job {job_file!r} encodes on Dataflow (data.beam.runner "
            f"{jobspec.DATAFLOW_RUNNER}); set {_k('dataflow')} to true, or use a local Beam "
            "runner (docs/deploy-gcp.md#dataflow-encoding-at-scale)"
        )
    if enabled and region not in dataflow_regions():
        raise ConfigError(
            f"{_k('dataflow')}: Dataflow has no regional endpoint in {region} (the stack's "
            "region; infra/dataflow_regions.yaml, from Google's Dataflow locations page): "
            "use a stack in a Dataflow region, or encode with a local Beam runner"
        )
    return enabled


def _check_job_fits(
    job_file: str,
    template: Mapping[str, object],
    accelerator: TpuConfig | GpuConfig,
    bucket: str,
    backend: str,
) -> str:
    """The payload's plan of the rendered job on the stack's accelerator (infra/jobfit.py):
    a job that cannot fit is refused here, before any resource exists. The TF backend
    trains data-parallel only, so its jobs are planned with train.sharding: data."""
    # Where the corpus is encoded (data.runner, data.beam) does not change what training
    # holds in memory; the Dataflow options are rendered with the stack's resources later.
    raw_data = template.get("data")
    data = {
        k: v
        for k, v in (raw_data.items() if isinstance(raw_data, Mapping) else ())
        if k not in ("runner", "beam")
    }
    spec = jobspec.render_job_spec({**template, "data": data}, bucket)
    if backend == "tf" and isinstance(spec.get("train"), dict):
        spec["train"] = {**spec["train"], "sharding": "data"}
    if isinstance(accelerator, GpuConfig):
        name = jobfit.plan_accelerator("gpu", "", accelerator.gpu_type, accelerator.count)
    else:
        name = jobfit.plan_accelerator("tpu", accelerator.accelerator_type, "", 1)
    return jobfit.check_job_fits(f"{_k('job')}: {job_file!r}", jobspec.to_json(spec), name).summary


def read_stack_config() -> StackConfig:
    """Read this stack's settings from Pulumi (the only `pulumi.Config` reader)."""

    # Every key of our namespace, including misspelled ones, so that a typo is an error
    # instead of a silently ignored setting.
    present = {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}
    config = pulumi.Config(NAMESPACE)
    values: dict[str, object] = {}
    for full_key in present:
        namespace, _, name = full_key.partition(":")
        if namespace == NAMESPACE:
            value = config.get(name)
            if value is not None:
                values[name] = value
    return parse_config(
        project=pulumi.Config("gcp").get("project"),
        stack=pulumi.get_stack(),
        values=values,
    )
