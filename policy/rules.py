"""Guard rails for tpu-pretrain stacks, as Pulumi CrossGuard policies.

Every rule is MANDATORY: a violation fails `pulumi preview` / `pulumi up`. The rules are
derived from the CIS Google Cloud Platform Foundation Benchmark (section numbers of v3.0
in each description) and from this project's design (docs: ARCHITECTURE.md).

Rules read resource properties in the engine's form: camelCase names as in the provider
schema (`uniformBucketLevelAccess`, `networkInterfaces[].accessConfigs`, ...), mappings and
sequences that may be the policy SDK's read-only proxies. Reading a value that is unknown
during a preview raises the SDK's UnknownValueError, which the engine reports as "can't run
policy during preview" (advisory) and then enforces on `pulumi up`, when the value is known.

Importing this module builds policy objects only. The pack itself (which starts a gRPC
server and never returns) is built in policy/__main__.py.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyComplianceFramework,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

PACK_NAME = "tpu-pretrain-guardrails"

# The VPN hop is the one VM allowed an external IP and IP forwarding. The infra program
# gives it the network tag below (infra/components/network.py TAG_HOP; firewall rules select
# the hop by it). A label role=vpn-hop is accepted too. Nothing else may carry either.
HOP_NETWORK_TAG = "tpu-pretrain-vpn-hop"
HOP_LABEL_KEY = "role"
HOP_LABEL_VALUE = "vpn-hop"
HOP_MARK = f"network tag {HOP_NETWORK_TAG} (or label {HOP_LABEL_KEY}={HOP_LABEL_VALUE})"

# --- resource type tokens (pulumi-gcp 10.x) -------------------------------------------------
BUCKET = "gcp:storage/bucket:Bucket"
INSTANCE = "gcp:compute/instance:Instance"
INSTANCE_TEMPLATE = "gcp:compute/instanceTemplate:InstanceTemplate"
TPU_VM = "gcp:tpu/v2Vm:V2Vm"
TPU_QUEUED = "gcp:tpu/v2QueuedResource:V2QueuedResource"
FIREWALL = "gcp:compute/firewall:Firewall"
NETWORK = "gcp:compute/network:Network"
SUBNETWORK = "gcp:compute/subnetwork:Subnetwork"
PROJECT_METADATA = "gcp:compute/projectMetadata:ProjectMetadata"
PROJECT_METADATA_ITEM = "gcp:compute/projectMetadataItem:ProjectMetadataItem"
SERVICE_ACCOUNT_KEY = "gcp:serviceaccount/key:Key"
KMS_CRYPTO_KEY = "gcp:kms/cryptoKey:CryptoKey"
WIF_PROVIDER = "gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider"
PROJECT_IAM_TYPES = (
    "gcp:projects/iAMMember:IAMMember",
    "gcp:projects/iAMBinding:IAMBinding",
    "gcp:projects/iAMPolicy:IAMPolicy",
)
# Storage ACL resources carry entities such as "READER:allUsers" instead of IAM members.
STORAGE_ACL_TYPES = (
    "gcp:storage/bucketACL:BucketACL",
    "gcp:storage/defaultObjectACL:DefaultObjectACL",
    "gcp:storage/objectACL:ObjectACL",
    "gcp:storage/bucketAccessControl:BucketAccessControl",
    "gcp:storage/defaultObjectAccessControl:DefaultObjectAccessControl",
    "gcp:storage/objectAccessControl:ObjectAccessControl",
)
VM_TYPES = (INSTANCE, INSTANCE_TEMPLATE)
TPU_TYPES = (TPU_VM,)

PUBLIC_PRINCIPALS = ("allusers", "allauthenticatedusers")
DEFAULT_COMPUTE_SA_SUFFIX = "-compute@developer.gserviceaccount.com"
BASIC_ROLES = ("roles/owner", "roles/editor", "roles/viewer")
WORLD_RANGES = ("0.0.0.0/0", "::/0")
# (first port, last port, service) that must never be open to the internet.
ADMIN_PORTS = ((22, 22, "SSH"), (3389, 3389, "RDP"))
# TensorBoard (infra/components/network.py TENSORBOARD_PORT) and the TPU runtime's gRPC
# port 8470 (the port the TPU API reports in a TPU VM's networkEndpoints); 8471-8479 are
# reserved with it here as a margin (a guess: no Google page lists the whole range).
SERVICE_PORTS = ((6006, 6006, "TensorBoard"), (8470, 8479, "TPU runtime"))
MAX_KMS_ROTATION_SECONDS = 90 * 24 * 3600

# TPU generations whose TPU VM images support Secure Boot (v4 and later; v2/v3 hosts do
# not offer shielded boot). Accelerator types look like "v4-8", "v5litepod-8", "v6e-8".
TPU_SECURE_BOOT_PREFIXES = ("v4", "v5", "v6", "v7")

CIS = PolicyComplianceFramework(
    name="CIS Google Cloud Platform Foundation Benchmark",
    version="3.0.0",
    reference="https://www.cisecurity.org/benchmark/google_cloud_computing_platform",
)

# --- messages: one per rule; tests and users match on them ----------------------------------
MSG_UNIFORM_ACCESS = "bucket must enable uniform bucket-level access"
MSG_PAP = "bucket must set publicAccessPrevention to 'enforced'"
MSG_PUBLIC_MEMBER = "IAM/ACL grant to a public principal (allUsers/allAuthenticatedUsers)"
MSG_DEFAULT_SA = "the default compute service account must not be used"
MSG_SA_ROLE = "service accounts must not hold basic (owner/editor/viewer) or admin roles"
MSG_SSH_RDP = "firewall opens SSH/RDP to the internet"
MSG_SERVICE_PORTS = "firewall opens TensorBoard/TPU ports to the internet"
MSG_HOP = "the VPN hop exemption allows one compute instance outside the TPU region"
MSG_EXTERNAL_IP = "external IP address outside the VPN hop"
MSG_IP_FORWARD = "IP forwarding outside the VPN hop"
MSG_SHIELDED = "shielded VM: secure boot, vTPM and integrity monitoring must be on"
MSG_OS_LOGIN = "OS Login must be enabled (metadata enable-oslogin=TRUE)"
MSG_PROJECT_SSH_KEYS = (
    "project-wide SSH keys must be blocked (metadata block-project-ssh-keys=TRUE)"
)
MSG_SERIAL_PORT = "interactive serial port access must stay disabled"
MSG_KEY_MATERIAL = "key material in metadata"
MSG_REGION = "TPU and training bucket must be in the same region"
MSG_BUCKET_RECOVERY = "bucket must keep versioning or a soft-delete retention"
MSG_SA_KEY = "user-managed service account keys are not allowed"
MSG_KMS_ROTATION = "KMS keys must rotate at least every 90 days"
MSG_FLOW_LOGS = "subnetwork must have VPC flow logs enabled"
MSG_AUTO_NETWORK = "auto-mode (default-style) VPC networks are not allowed"
MSG_WIF_CONDITION = "workload identity provider must restrict the token with attributeCondition"


# --- helpers ---------------------------------------------------------------------------------
def _get(value: Any, *path: str | int) -> Any:
    """Walks mappings/sequences; returns None when any step is missing."""
    for step in path:
        if isinstance(step, int):
            if isinstance(value, Sequence) and not isinstance(value, str) and step < len(value):
                value = value[step]
            else:
                return None
        elif isinstance(value, Mapping) and step in value:
            value = value[step]
        else:
            return None
    return value


def _items(value: Any) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return []


def _metadata_true(value: Any) -> bool:
    """GCE reads boolean metadata as TRUE/true/1/y/yes (case-insensitive)."""
    if isinstance(value, bool):
        return value
    return isinstance(value, str) and value.strip().lower() in {"true", "1", "y", "yes"}


def _labels(props: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = _get(props, "labels")
    return labels if isinstance(labels, Mapping) else {}


def _is_vpn_hop(props: Mapping[str, Any]) -> bool:
    tags = [str(tag) for tag in _items(_get(props, "tags"))]
    return HOP_NETWORK_TAG in tags or _labels(props).get(HOP_LABEL_KEY) == HOP_LABEL_VALUE


def _vm_metadata(props: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = _get(props, "metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _resource_policy(
    name: str,
    description: str,
    types: Sequence[str],
    check: Callable[[str, Mapping[str, Any], Callable[[str], None]], None],
    *,
    cis: str | None = None,
) -> ResourceValidationPolicy:
    """A mandatory ResourceValidationPolicy applied to the given resource types only."""

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type not in types:
            return
        check(args.resource_type, args.props, lambda message: report_violation(message, None))

    return ResourceValidationPolicy(
        name=name,
        description=f"{description} (CIS GCP {cis})" if cis else description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
        framework=CIS if cis else None,
    )


def _iam_members(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(role, member) pairs of an IAM member/binding/policy or storage ACL resource."""
    role = _get(props, "role")
    role = role if isinstance(role, str) else ""
    member = _get(props, "member")
    if isinstance(member, str):
        yield role, member
    for member in _items(_get(props, "members")):
        if isinstance(member, str):
            yield role, member
    policy_data = _get(props, "policyData")
    if isinstance(policy_data, str) and policy_data.strip():
        try:
            policy = json.loads(policy_data)
        except json.JSONDecodeError:
            policy = {}
        for binding in policy.get("bindings", []) if isinstance(policy, dict) else []:
            for member in binding.get("members", []):
                yield str(binding.get("role", "")), str(member)
    entity = _get(props, "entity")
    if isinstance(entity, str):
        yield role, entity
    for role_entity in _items(_get(props, "roleEntities")):
        if isinstance(role_entity, str) and ":" in role_entity:
            acl_role, acl_entity = role_entity.split(":", 1)
            yield acl_role, acl_entity


def _is_iam_type(resource_type: str) -> bool:
    lowered = resource_type.lower()
    return any(kind in lowered for kind in ("iammember", "iambinding", "iampolicy"))


# --- rules -----------------------------------------------------------------------------------
def _check_uniform_access(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    if _get(props, "uniformBucketLevelAccess") is not True:
        report(f"{MSG_UNIFORM_ACCESS}: set uniform_bucket_level_access=True")


def _check_pap(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    value = _get(props, "publicAccessPrevention")
    if value != "enforced":
        report(f"{MSG_PAP}: got {value!r}")


def _check_default_sa(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if _is_iam_type(resource_type):
        for role, member in _iam_members(resource_type, props):
            if member.lower().endswith(DEFAULT_COMPUTE_SA_SUFFIX):
                report(f"{MSG_DEFAULT_SA}: {member} is granted {role or 'a role'}")
        return
    email = _get(props, "serviceAccount", "email")
    if resource_type in TPU_TYPES and not email:
        # A TPU VM without an explicit service account runs as the default compute account.
        report(f"{MSG_DEFAULT_SA}: TPU VM without serviceAccount.email runs as the default one")
    elif isinstance(_get(props, "serviceAccount"), Mapping) and not email:
        # A GCE VM with a service_account block but no email gets the default compute
        # account (the provider leaves the email to the API, which picks the default).
        report(f"{MSG_DEFAULT_SA}: serviceAccount without email runs as the default one")
    elif isinstance(email, str) and (
        email.lower().endswith(DEFAULT_COMPUTE_SA_SUFFIX) or email.lower() == "default"
    ):
        report(f"{MSG_DEFAULT_SA}: {email}")


def _role_is_basic_or_admin(role: str) -> bool:
    if role in BASIC_ROLES:
        return True
    # Predefined roles are "roles/<service>.<name>"; custom ones "projects/p/roles/<id>".
    role_id = role.rsplit("/", 1)[-1]
    return "admin" in role_id.lower()


def _check_sa_roles(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    for role, member in _iam_members(resource_type, props):
        if member.startswith("serviceAccount:") and _role_is_basic_or_admin(role):
            report(f"{MSG_SA_ROLE}: {member} gets {role} on the project")


def _check_public_members(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if not (_is_iam_type(resource_type) or resource_type in STORAGE_ACL_TYPES):
        return
    for role, member in _iam_members(resource_type, props):
        if member.strip().lower() in PUBLIC_PRINCIPALS:
            report(f"{MSG_PUBLIC_MEMBER}: {member} gets {role or 'access'}")


def _port_ranges(ports: Any) -> list[tuple[int, int]] | None:
    """None means every port (no ports listed)."""
    listed = [str(port) for port in _items(ports)]
    if not listed:
        return None
    ranges = []
    for item in listed:
        low, _, high = item.partition("-")
        ranges.append((int(low), int(high or low)))
    return ranges


def _world_source(props: Mapping[str, Any]) -> str | None:
    """The source ranges when, together, they cover every IPv4 or every IPv6 address
    (0.0.0.0/0, or 0.0.0.0/1 + 128.0.0.0/1, ...); None otherwise."""
    ranges = [str(r) for r in _items(_get(props, "sourceRanges"))]
    no_source = not _items(_get(props, "sourceTags")) and not _items(
        _get(props, "sourceServiceAccounts")
    )
    if not ranges and no_source:
        return "no source (GCE defaults to 0.0.0.0/0)"
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    for cidr in ranges:
        try:
            network = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            continue
        (v4 if network.version == 4 else v6).append(network)  # type: ignore[arg-type]
    for family in (v4, v6):
        if any(n.prefixlen == 0 for n in ipaddress.collapse_addresses(family)):  # type: ignore[type-var]
            return " + ".join(str(n) for n in family)
    return None


def _check_world_ingress(
    ports: Sequence[tuple[int, int, str]], message: str
) -> Callable[[str, Mapping[str, Any], Callable[[str], None]], None]:
    def check(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
        direction = _get(props, "direction") or "INGRESS"
        if direction != "INGRESS" or _get(props, "disabled") is True:
            return
        source = _world_source(props)
        if source is None:
            return
        for allow in _items(_get(props, "allows")):
            protocol = str(_get(allow, "protocol") or "").lower()
            if protocol not in {"tcp", "all", "6"}:
                continue
            ranges = _port_ranges(_get(allow, "ports"))
            for first, last, service in ports:
                if ranges is None or any(lo <= last and first <= hi for lo, hi in ranges):
                    wanted = f"port {first}" if first == last else f"ports {first}-{last}"
                    shown = "all ports" if ranges is None else wanted
                    report(f"{message}: {service} ({protocol} {shown}) from {source}")

    return check


def _tpu_network_configs(props: Mapping[str, Any]) -> list[Any]:
    configs = [_get(props, "networkConfig"), *_items(_get(props, "networkConfigs"))]
    return [config for config in configs if isinstance(config, Mapping)]


def _check_external_ip(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type in TPU_TYPES:
        for config in _tpu_network_configs(props):
            if _get(config, "enableExternalIps") is True:
                report(f"{MSG_EXTERNAL_IP}: TPU VM sets networkConfig.enableExternalIps")
        return
    if _is_vpn_hop(props):
        return
    for index, interface in enumerate(_items(_get(props, "networkInterfaces"))):
        if _items(_get(interface, "accessConfigs")) or _items(_get(interface, "ipv6AccessConfigs")):
            report(
                f"{MSG_EXTERNAL_IP}: networkInterfaces[{index}] has an access config; only the "
                f"VM with {HOP_MARK} may have one"
            )


def _check_ip_forward(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type in TPU_TYPES:
        if any(_get(c, "canIpForward") is True for c in _tpu_network_configs(props)):
            report(f"{MSG_IP_FORWARD}: TPU VM sets networkConfig.canIpForward")
        return
    if _get(props, "canIpForward") is True and not _is_vpn_hop(props):
        report(f"{MSG_IP_FORWARD}: canIpForward on a VM without {HOP_MARK}")


def _tpu_supports_secure_boot(props: Mapping[str, Any]) -> bool:
    accelerator = _get(props, "acceleratorType")
    if not isinstance(accelerator, str):
        accelerator = str(_get(props, "acceleratorConfig", "type") or "").lower()
    return accelerator.lower().startswith(TPU_SECURE_BOOT_PREFIXES)


def _check_shielded(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    config = _get(props, "shieldedInstanceConfig")
    if resource_type in TPU_TYPES:
        if _tpu_supports_secure_boot(props) and _get(config, "enableSecureBoot") is not True:
            report(f"{MSG_SHIELDED}: this TPU generation supports secure boot; enable it")
        return
    if _get(config, "enableSecureBoot") is not True:
        report(f"{MSG_SHIELDED}: shieldedInstanceConfig.enableSecureBoot is not true")
    for key in ("enableVtpm", "enableIntegrityMonitoring"):
        if _get(config, key) is False:
            report(f"{MSG_SHIELDED}: shieldedInstanceConfig.{key} is false")


def _check_os_login(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    metadata = _vm_metadata(props)
    if not _metadata_true(metadata.get("enable-oslogin")):
        report(f"{MSG_OS_LOGIN}: got {metadata.get('enable-oslogin')!r}")
    for key in ("ssh-keys", "sshKeys"):
        if metadata.get(key):
            report(f"{MSG_OS_LOGIN}: metadata {key} bypasses OS Login; remove it")


def _check_project_ssh_keys(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    metadata = _vm_metadata(props)
    if not _metadata_true(metadata.get("block-project-ssh-keys")):
        report(f"{MSG_PROJECT_SSH_KEYS}: got {metadata.get('block-project-ssh-keys')!r}")


def _check_serial_port(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type in (PROJECT_METADATA, PROJECT_METADATA_ITEM):
        if resource_type == PROJECT_METADATA_ITEM:
            entries = {str(_get(props, "key")): _get(props, "value")}
        else:
            entries = dict(_get(props, "metadata") or {})
    else:
        entries = dict(_vm_metadata(props))
    if _metadata_true(entries.get("serial-port-enable")):
        report(f"{MSG_SERIAL_PORT}: metadata serial-port-enable={entries['serial-port-enable']!r}")


_PEM_PRIVATE = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
# A literal value after "PrivateKey =" (a WireGuard config with the key inline). A shell or
# template variable there (`PrivateKey = ${private_key}`) is a key read at boot from Secret
# Manager, which is the design.
_WG_PRIVATE_LINE = re.compile(r"^\s*PrivateKey\s*=\s*(?![$%{<\s])\S", re.MULTILINE | re.IGNORECASE)
_BASE64_32 = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{43}=(?![A-Za-z0-9+/=])")
# A WireGuard public key has the same shape as a private one. A key is taken as public only
# when it is the value of a public-key field: the text right before it on its line ends in
# "PublicKey =", "..._PUBLIC_KEY=", "pubkey:" or "peer " (`wg set wg0 peer <key>`). The word
# "public" or "peer" elsewhere on the line proves nothing.
_PUBLIC_FIELD = re.compile(r"(public[ _-]?key|pubkey|\bpeer)[\s\"']*[=:]?[\s\"']*$", re.IGNORECASE)


def find_key_material(text: str) -> list[str]:
    """Reasons why `text` looks like it carries private key material."""
    reasons = []
    if _PEM_PRIVATE.search(text):
        reasons.append("PEM private key block")
    if _WG_PRIVATE_LINE.search(text):
        reasons.append("WireGuard 'PrivateKey =' line with a literal key")
    for line in text.splitlines():
        for match in _BASE64_32.finditer(line):
            if _PUBLIC_FIELD.search(line[: match.start()]):
                continue  # the value of a public-key field: fine to publish
            try:
                decoded = base64.b64decode(match.group(0), validate=True)
            except (binascii.Error, ValueError):
                continue
            if len(decoded) == 32:
                reasons.append("base64 32-byte key (WireGuard private key shape)")
                break
    return reasons


def _check_key_material(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    texts: dict[str, Any] = {}
    if resource_type == PROJECT_METADATA_ITEM:
        texts[str(_get(props, "key"))] = _get(props, "value")
    elif resource_type == PROJECT_METADATA:
        texts.update(dict(_get(props, "metadata") or {}))
    else:
        texts.update(dict(_vm_metadata(props)))
        texts["metadataStartupScript"] = _get(props, "metadataStartupScript")
    for key, value in texts.items():
        if not isinstance(value, str):
            continue
        key_lower = key.lower()
        if "private" in key_lower and "key" in key_lower and value.strip():
            report(f"{MSG_KEY_MATERIAL}: metadata key {key!r} names a private key")
        for reason in find_key_material(value):
            report(f"{MSG_KEY_MATERIAL}: {reason} in {key!r}; keep keys in Secret Manager")


def _check_bucket_recovery(
    _t: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    versioned = _get(props, "versioning", "enabled") is True
    retention = _get(props, "softDeletePolicy", "retentionDurationSeconds")
    # GCS applies a 7-day soft delete when softDeletePolicy is absent; 0 turns it off.
    soft_delete = retention is None or (isinstance(retention, int | float) and retention > 0)
    if not (versioned or soft_delete):
        report(f"{MSG_BUCKET_RECOVERY}: versioning is off and soft delete is disabled")


def _check_sa_key(_t: str, _props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    report(f"{MSG_SA_KEY}: use Workload Identity Federation or attached service accounts")


def _duration_seconds(value: Any) -> float | None:
    if isinstance(value, str) and value.endswith("s"):
        try:
            return float(value[:-1])
        except ValueError:
            return None
    return None


def _check_kms_rotation(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    purpose = _get(props, "purpose") or "ENCRYPT_DECRYPT"
    if purpose != "ENCRYPT_DECRYPT":
        return  # only symmetric keys support automatic rotation
    seconds = _duration_seconds(_get(props, "rotationPeriod"))
    if seconds is None or seconds > MAX_KMS_ROTATION_SECONDS:
        report(f"{MSG_KMS_ROTATION}: rotationPeriod={_get(props, 'rotationPeriod')!r}")


def _check_flow_logs(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    purpose = _get(props, "purpose")
    if purpose not in (None, "PRIVATE", "PRIVATE_RFC_1918"):
        return  # proxy-only and similar subnets carry no VM traffic and reject logConfig
    if not isinstance(_get(props, "logConfig"), Mapping):
        report(f"{MSG_FLOW_LOGS}: set log_config")


def _check_auto_network(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    if _get(props, "autoCreateSubnetworks") is not False:
        report(f"{MSG_AUTO_NETWORK}: set auto_create_subnetworks=False")


def _check_wif_condition(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    condition = _get(props, "attributeCondition")
    if _get(props, "oidc") is not None and not (isinstance(condition, str) and condition.strip()):
        report(f"{MSG_WIF_CONDITION}: e.g. assertion.repository == 'owner/repo'")


def _region_of_zone(zone: str) -> str:
    return zone.rsplit("-", 1)[0].lower()


def _validate_regions(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    tpus = [r for r in args.resources if r.resource_type in (TPU_VM, TPU_QUEUED)]
    buckets = [r for r in args.resources if r.resource_type == BUCKET]
    if not tpus or not buckets:
        return
    for tpu in tpus:
        zone = _get(tpu.props, "zone")
        if not isinstance(zone, str):
            continue
        region = _region_of_zone(zone)
        for bucket in buckets:
            location = str(_get(bucket.props, "location") or "").lower()
            if location != region:
                report_violation(
                    f"{MSG_REGION}: TPU {tpu.name} is in {region} ({zone}) but bucket "
                    f"{bucket.name} is in {location or 'an unknown location'}",
                    bucket.urn,
                )


def _validate_single_hop(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    """The resource rules exempt the VM marked as the hop; this makes the mark structural:
    one compute instance at most, and not in a region that holds a TPU (the hop is the VPN
    endpoint near the user, never a VM next to the training data)."""
    marked = [
        r
        for r in args.resources
        if r.resource_type in (*VM_TYPES, *TPU_TYPES, TPU_QUEUED) and _is_vpn_hop(r.props)
    ]
    instances = [r for r in marked if r.resource_type == INSTANCE]
    for resource in marked:
        if resource.resource_type != INSTANCE:
            report_violation(
                f"{MSG_HOP}: {resource.resource_type} {resource.name} carries {HOP_MARK}",
                resource.urn,
            )
    if len(instances) > 1:
        names = ", ".join(r.name for r in instances)
        for resource in instances:
            report_violation(
                f"{MSG_HOP}: {len(instances)} VMs carry {HOP_MARK}: {names}", resource.urn
            )
    tpu_regions = {
        _region_of_zone(zone)
        for r in args.resources
        if r.resource_type in (TPU_VM, TPU_QUEUED)
        for zone in [_get(r.props, "zone")]
        if isinstance(zone, str)
    }
    for resource in instances:
        zone = _get(resource.props, "zone")
        if isinstance(zone, str) and _region_of_zone(zone) in tpu_regions:
            report_violation(
                f"{MSG_HOP}: {resource.name} is in the TPU region {_region_of_zone(zone)}",
                resource.urn,
            )


def build_policies() -> list[ResourceValidationPolicy | StackValidationPolicy]:
    vm_and_tpu = (*VM_TYPES, *TPU_TYPES)
    return [
        _resource_policy(
            "bucket-uniform-access",
            "Buckets use uniform bucket-level access (no object ACLs).",
            (BUCKET,),
            _check_uniform_access,
            cis="5.2",
        ),
        _resource_policy(
            "bucket-public-access-prevention",
            "Buckets enforce public access prevention.",
            (BUCKET,),
            _check_pap,
            cis="5.1",
        ),
        PublicMembersPolicy(),
        DefaultServiceAccountPolicy(),
        _resource_policy(
            "no-basic-or-admin-roles-for-service-accounts",
            "Project-level grants never give a service account a basic or an admin role.",
            PROJECT_IAM_TYPES,
            _check_sa_roles,
            cis="1.5",
        ),
        _resource_policy(
            "no-ssh-rdp-from-internet",
            "Ingress firewalls never open TCP 22/3389 (or all ports) to the whole internet "
            "(0.0.0.0/0, ::/0, or ranges that add up to it).",
            (FIREWALL,),
            _check_world_ingress(ADMIN_PORTS, MSG_SSH_RDP),
            cis="3.6, 3.7",
        ),
        _resource_policy(
            "no-tensorboard-tpu-from-internet",
            "Ingress firewalls never open TensorBoard (6006) or the TPU runtime ports "
            "(8470-8479) to the whole internet; they are reached over the VPN.",
            (FIREWALL,),
            _check_world_ingress(SERVICE_PORTS, MSG_SERVICE_PORTS),
        ),
        _resource_policy(
            "no-external-ip-except-vpn-hop",
            f"Only the VPN hop ({HOP_MARK}) has an external IP; TPU VMs never do.",
            vm_and_tpu,
            _check_external_ip,
            cis="4.9",
        ),
        _resource_policy(
            "ip-forwarding-only-on-vpn-hop",
            f"Only the VPN hop ({HOP_MARK}) forwards IP packets.",
            vm_and_tpu,
            _check_ip_forward,
            cis="4.6",
        ),
        _resource_policy(
            "shielded-vm",
            "VMs are shielded (secure boot, vTPM, integrity monitoring); TPU VMs use secure "
            "boot where the generation supports it (v4 and later).",
            vm_and_tpu,
            _check_shielded,
            cis="4.8",
        ),
        _resource_policy(
            "os-login-enabled",
            "VMs and TPU VMs enable OS Login and carry no ssh-keys metadata.",
            vm_and_tpu,
            _check_os_login,
            cis="4.4",
        ),
        _resource_policy(
            "project-ssh-keys-blocked",
            "VMs and TPU VMs block project-wide SSH keys.",
            vm_and_tpu,
            _check_project_ssh_keys,
            cis="4.3",
        ),
        _resource_policy(
            "serial-port-disabled",
            "Interactive serial port access is never enabled (instance or project metadata).",
            (*vm_and_tpu, PROJECT_METADATA, PROJECT_METADATA_ITEM),
            _check_serial_port,
            cis="4.5",
        ),
        _resource_policy(
            "no-key-material-in-metadata",
            "Metadata and startup scripts carry no private keys (PEM blocks, WireGuard keys); "
            "keys live in Secret Manager.",
            (*vm_and_tpu, PROJECT_METADATA, PROJECT_METADATA_ITEM),
            _check_key_material,
        ),
        _resource_policy(
            "bucket-recoverable",
            "Buckets keep object versioning or a soft-delete window so a bad write can be undone.",
            (BUCKET,),
            _check_bucket_recovery,
        ),
        _resource_policy(
            "no-service-account-keys",
            "No user-managed service account keys (CI uses Workload Identity Federation).",
            (SERVICE_ACCOUNT_KEY,),
            _check_sa_key,
            cis="1.4",
        ),
        _resource_policy(
            "kms-key-rotation",
            "Symmetric KMS keys rotate at least every 90 days.",
            (KMS_CRYPTO_KEY,),
            _check_kms_rotation,
            cis="1.10",
        ),
        _resource_policy(
            "subnet-flow-logs",
            "Every VM subnetwork has VPC flow logs.",
            (SUBNETWORK,),
            _check_flow_logs,
            cis="3.8",
        ),
        _resource_policy(
            "no-auto-mode-network",
            "VPC networks are custom-mode (no auto-created subnetworks in every region).",
            (NETWORK,),
            _check_auto_network,
            cis="3.1",
        ),
        _resource_policy(
            "wif-provider-attribute-condition",
            "Workload identity OIDC providers restrict which tokens they accept.",
            (WIF_PROVIDER,),
            _check_wif_condition,
        ),
        StackValidationPolicy(
            name="one-vpn-hop-outside-tpu-region",
            description=f"At most one VM carries {HOP_MARK}: a compute instance outside every "
            "TPU region (so the hop's exemptions cannot be claimed by another VM).",
            validate=_validate_single_hop,
            enforcement_level=EnforcementLevel.MANDATORY,
        ),
        StackValidationPolicy(
            name="tpu-and-bucket-same-region",
            description="Every TPU VM and every bucket of a stack are in one region "
            "(no cross-region reads of training data).",
            validate=_validate_regions,
            enforcement_level=EnforcementLevel.MANDATORY,
        ),
    ]


class PublicMembersPolicy(ResourceValidationPolicy):
    """Applies to every IAM member/binding/policy type of every service, not a fixed list."""

    def __init__(self) -> None:
        super().__init__(
            name="no-public-principals",
            description="No IAM or ACL grant to allUsers/allAuthenticatedUsers on any resource "
            "(CIS GCP 5.1, 1.x)",
            validate=self._validate,
            enforcement_level=EnforcementLevel.MANDATORY,
            framework=CIS,
        )

    @staticmethod
    def _validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        _check_public_members(
            args.resource_type, args.props, lambda message: report_violation(message, None)
        )


class DefaultServiceAccountPolicy(ResourceValidationPolicy):
    """VMs, TPU VMs and every IAM grant: the default compute account is never used."""

    def __init__(self) -> None:
        super().__init__(
            name="no-default-compute-service-account",
            description="VMs and TPU VMs run as a dedicated service account, never the default "
            "compute account, and no IAM grant names it (CIS GCP 4.1, 4.2)",
            validate=self._validate,
            enforcement_level=EnforcementLevel.MANDATORY,
            framework=CIS,
        )

    @staticmethod
    def _validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type in (*VM_TYPES, *TPU_TYPES) or _is_iam_type(args.resource_type):
            _check_default_sa(
                args.resource_type, args.props, lambda message: report_violation(message, None)
            )


POLICY_MESSAGES = {
    "bucket-uniform-access": MSG_UNIFORM_ACCESS,
    "bucket-public-access-prevention": MSG_PAP,
    "no-public-principals": MSG_PUBLIC_MEMBER,
    "no-default-compute-service-account": MSG_DEFAULT_SA,
    "no-basic-or-admin-roles-for-service-accounts": MSG_SA_ROLE,
    "no-ssh-rdp-from-internet": MSG_SSH_RDP,
    "no-tensorboard-tpu-from-internet": MSG_SERVICE_PORTS,
    "no-external-ip-except-vpn-hop": MSG_EXTERNAL_IP,
    "ip-forwarding-only-on-vpn-hop": MSG_IP_FORWARD,
    "shielded-vm": MSG_SHIELDED,
    "os-login-enabled": MSG_OS_LOGIN,
    "project-ssh-keys-blocked": MSG_PROJECT_SSH_KEYS,
    "serial-port-disabled": MSG_SERIAL_PORT,
    "no-key-material-in-metadata": MSG_KEY_MATERIAL,
    "bucket-recoverable": MSG_BUCKET_RECOVERY,
    "no-service-account-keys": MSG_SA_KEY,
    "kms-key-rotation": MSG_KMS_ROTATION,
    "subnet-flow-logs": MSG_FLOW_LOGS,
    "no-auto-mode-network": MSG_AUTO_NETWORK,
    "wif-provider-attribute-condition": MSG_WIF_CONDITION,
    "tpu-and-bucket-same-region": MSG_REGION,
    "one-vpn-hop-outside-tpu-region": MSG_HOP,
}
