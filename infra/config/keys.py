"""The stack settings: the keys Pulumi.yaml declares and how a raw value of each is read.

Every reader fails with one line that names the key (`tpu-pretrain:<name>`), the value and what
is allowed. infra/config/config.py and the rules beside it (accelerators, job) read
settings only through these."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from infra.config.project import cli_text
from infra.errors import ConfigError

NAMESPACE = "tpu-pretrain"


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
        "Zone of the TPU VM, e.g. europe-west4-a (see infra/catalogs/tpu.yaml).",
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
        "TPU VM base image for the generation, e.g. v2-alpha-tpuv5 (see infra/catalogs/tpu.yaml).",
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
    # "unset" here (infra/config/project.py).
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
        "GPU stacks: zone of the GPU VM, e.g. us-central1-a (see infra/catalogs/gpu.yaml).",
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
        "GPU stacks: boot image, a key of infra/catalogs/gpu.yaml images (default: the GPU's own).",
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
        "capacityWaitMinutes",
        "integer",
        "With a watchdog (tpuAutoRecover, gpuAutoRecover): minutes a request for the "
        "accelerator may wait for capacity before a capacity-wait event reports it (1-10080).",
        60,
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
    Key(
        "vpnZone",
        "string",
        "Zone of the WireGuard hop, near you, outside the accelerator's region (default: the "
        "zone infra/catalogs/vpn_hop.yaml names for that region).",
        "",
    ),
    Key("vpnAllowedCidrs", "array", "Source CIDRs allowed to reach WireGuard (UDP)."),
    Key("vpnClientCidr", "string", "Addresses of VPN clients inside the tunnel.", "10.250.0.0/24"),
    Key("vpnPort", "integer", "WireGuard UDP port.", 51820),
    Key(
        "vpnClientPublicKey",
        "string",
        "Your own WireGuard public key (`wg pubkey`); required with accountsFromBootstrap. "
        "If unset, a client key pair is generated and kept in the stack's state.",
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
    Key(
        "alertEmails",
        "array",
        "E-mail addresses the stack's alert policies notify of the run's events (docs/"
        "operating.md#alerts); empty: no alerts.",
        [],
    ),
    Key(
        "grantEnds",
        "string",
        "The grant's last day, YYYY-MM-DD: the run's ETA is checked against it (default: none).",
        "",
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


def qualified(name: str) -> str:
    return f"{NAMESPACE}:{name}"


def _value(values: Mapping[str, object], name: str) -> object:
    key = KEYS_BY_NAME[name]
    raw = values.get(name)
    if raw is None or raw == "":
        if key.default is None or key.required_for:
            example = {"vpnAllowedCidrs": '["203.0.113.0/24"]'}.get(name, "")
            hint = f" (e.g. {example})" if example else ""
            raise ConfigError(f"{qualified(name)} is required{hint}: {key.description}")
        return key.default
    return raw


def unset(values: Mapping[str, object], name: str) -> bool:
    """Not set, or set to its Pulumi.yaml default ("" for the keys without a fixed one),
    compared as the CLI passes values (text)."""
    raw = values.get(name)
    default = KEYS_BY_NAME[name].default
    return raw is None or cli_text(raw) in ("", "" if default is None else cli_text(default))


def string(values: Mapping[str, object], name: str) -> str:
    value = _value(values, name)
    if not isinstance(value, str):
        raise ConfigError(f"{qualified(name)}: {value!r} must be a string")
    return value.strip()


def boolean(values: Mapping[str, object], name: str) -> bool:
    value = _value(values, name)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{qualified(name)}: {value!r} must be true or false")


def integer(values: Mapping[str, object], name: str, low: int, high: int) -> int:
    value = _value(values, name)
    number: int | None = None
    # bool is an int to Python, not a count to a user.
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            number = int(value)
        except ValueError:
            number = None
    if number is None or not low <= number <= high:
        raise ConfigError(f"{qualified(name)}: {value!r} must be an integer from {low} to {high}")
    return number


def _list_value(values: Mapping[str, object], name: str) -> object:
    """A list key's value: a list in the stack file, or the CLI's JSON text of one (None when
    that text is not JSON)."""
    value = _value(values, name)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def array(values: Mapping[str, object], name: str) -> list[object]:
    value = _list_value(values, name)
    if not isinstance(value, list) or not value:
        raise ConfigError(f'{qualified(name)}: must be a non-empty list, e.g. ["203.0.113.0/24"]')
    return value


def string_list(values: Mapping[str, object], name: str, example: str) -> list[object]:
    """A list that may be empty (a list in the stack file, or the CLI's JSON text of one)."""
    value = _list_value(values, name)
    if not isinstance(value, list):
        raise ConfigError(f"{qualified(name)}: must be a list, e.g. {example} (or [] for none)")
    return value


def cidr(name: str, value: object) -> ipaddress.IPv4Network:
    try:
        if not isinstance(value, str) or "/" not in value:
            raise ValueError(value)
        return ipaddress.IPv4Network(value, strict=True)
    except ValueError:
        raise ConfigError(
            f"{qualified(name)}: {value!r} is not an IPv4 CIDR like 203.0.113.0/24"
        ) from None


def region_of(name: str, zone: str) -> str:
    match = _ZONE_RE.match(zone)
    if not match:
        raise ConfigError(f"{qualified(name)}: {zone!r} is not a zone name like europe-west4-a")
    return match.group(1)
