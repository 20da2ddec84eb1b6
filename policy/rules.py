"""Guard rails for tpu-pretrain stacks, as Pulumi CrossGuard policies.

Every rule is MANDATORY: a violation fails `pulumi preview` / `pulumi up`. The rules are
derived from the CIS Google Cloud Platform Foundation Benchmark (section numbers of v3.0
in each description) and from this project's design (docs: ARCHITECTURE.md).

Rules read resource properties in the engine's form: camelCase names as in the provider
schema (`uniformBucketLevelAccess`, `networkInterfaces[].accessConfigs`, ...), mappings and
sequences that may be the policy SDK's read-only proxies. Reading a value that is unknown
during a preview raises the SDK's UnknownValueError, which the engine reports as "can't run
policy during preview" (advisory) and then enforces on `pulumi up`, when the value is known.

The pack is a closed world: policy/allowlist.py lists the resource types, APIs, IAM grants
and custom-role permissions each Pulumi project may have, and the first rules below refuse
anything else. The other rules hold the allowed types to their secure settings. Firewall
sources are judged by the addresses they cover, not by how the ranges are written.

Importing this module builds policy objects only. The pack itself (which starts a gRPC
server and never returns) is built in policy/__main__.py.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyComplianceFramework,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from . import allowlist, executables
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    import allowlist  # type: ignore[no-redef]
    import executables  # type: ignore[no-redef]

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
# Google-managed default accounts that a stack must neither run as nor grant anything on:
# the Compute Engine default account "<project number>-compute@developer.gserviceaccount.com"
# and the App Engine default account "<project id>@appspot.gserviceaccount.com".
DEFAULT_ACCOUNT = re.compile(
    r"(?<![A-Za-z0-9._-])(?:[0-9]+-compute@developer\.gserviceaccount\.com"
    r"|[a-z0-9.:-]+@appspot\.gserviceaccount\.com)",
    re.IGNORECASE,
)
BASIC_ROLES = ("roles/owner", "roles/editor", "roles/viewer")
CUSTOM_ROLE_TYPES = (
    "gcp:projects/iAMCustomRole:IAMCustomRole",
    "gcp:organizations/iAMCustomRole:IAMCustomRole",
)
SERVICE = "gcp:projects/service:Service"
SECRET = "gcp:secretmanager/secret:Secret"  # noqa: S105 (a type token)
ACCOUNT = "gcp:serviceaccount/account:Account"
BUCKET_OBJECT = "gcp:storage/bucketObject:BucketObject"
PROVIDER_PREFIX = "pulumi:providers:"
# Provider settings that would make the provider act as another identity than the one the
# workflow authenticated (the deploy account), or with a credential of its own.
PROVIDER_CREDENTIAL_KEYS = (
    "credentials",
    "accessToken",
    "impersonateServiceAccount",
    "impersonateServiceAccountDelegates",
)

# Source addresses of an ingress rule that are not "public": the RFC 1918 private ranges and
# the Google ranges that Google documents as sources of its own traffic to VMs:
# - 35.235.240.0/20: IAP TCP forwarding ("Using IAP for TCP forwarding": allow ingress from
#   35.235.240.0/20; infra/components/network.py IAP_RANGE);
# - 35.191.0.0/16 and 130.211.0.0/22: Google Cloud health check probers ("Health checks
#   overview", probe IP ranges and firewall rules; pulumi-gcp's getLBIPRanges data source
#   points at the same page).
# Every other address, IPv6 included, is public. Python's ipaddress `is_private` is not used:
# it also calls documentation and shared ranges (e.g. 203.0.113.0/24) private.
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
GOOGLE_SOURCE_RANGES = ("35.235.240.0/20", "35.191.0.0/16", "130.211.0.0/22")
NOT_PUBLIC = tuple(ipaddress.ip_network(r) for r in (*PRIVATE_RANGES, *GOOGLE_SOURCE_RANGES))
# The CIDRs a stack declares for its users are the sources of its WireGuard rule (UDP to the
# VPN hop; stack config vpnAllowedCidrs). Public sources of other rules are accepted inside
# them, but only while the declaration names at most this many public addresses (a /16): a
# declaration of "everywhere" (0.0.0.0/0 for WireGuard is allowed) exempts nothing.
MAX_USER_ADDRESSES = 2**16
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
# Compute Engine VMs with GPUs: N1 with guestAccelerators, or a machine family that carries
# its GPUs (infra/gpu_catalog.yaml). Their NVIDIA kernel module (Deep Learning VM image) is not
# signed for Secure Boot, so secure boot may be off; vTPM and integrity monitoring may not.
GPU_MACHINE_PREFIXES = ("a2-", "a3-", "a4-", "g2-")

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
MSG_REGION = "the accelerator (TPU or GPU VM) and the training bucket must be in one region"
MSG_BUCKET_RECOVERY = "bucket must keep versioning or a soft-delete retention"
MSG_SA_KEY = "user-managed service account keys are not allowed"
MSG_KMS_ROTATION = "KMS keys must rotate at least every 90 days"
MSG_FLOW_LOGS = "subnetwork must have VPC flow logs enabled"
MSG_AUTO_NETWORK = "auto-mode (default-style) VPC networks are not allowed"
MSG_WIF_CONDITION = "workload identity provider must restrict the token with attributeCondition"
MSG_UNKNOWN_TYPE = "resource type is not on the pack's allowlist"
MSG_UNKNOWN_API = "API is not on the pack's allowlist"
MSG_IAM_GRANT = "IAM grant is not on the pack's allowlist"
MSG_CUSTOM_ROLE = "custom role holds permissions outside the pack's allowlist"
MSG_PROVIDER = "provider must not carry credentials or impersonate another account"
MSG_PUBLIC_INGRESS = "firewall opens ports to public addresses"
MSG_FOREIGN_TARGET = "IAM grant on a resource this stack does not create"
MSG_VM_ACCOUNT = "VM runs as an account that is not the stack's own"
HOW_TO_ALLOW = (
    "allow it only by a reviewed code change to policy/allowlist.py (with its rules and a "
    "test under tests/policy); no stack setting can allow it"
)


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


# --- the closed world: allowlists of policy/allowlist.py ------------------------------------
def project_of(urn: str) -> str:
    """The Pulumi project of a URN "urn:pulumi:<stack>::<project>::<type>::<name>"."""
    parts = urn.split("::")
    return parts[1] if len(parts) >= 4 else ""


def profile_of(urn: str) -> allowlist.Profile | None:
    return allowlist.PROFILES.get(project_of(urn))


def _check_allowed_type(
    urn: str, resource_type: str, _props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    profile = profile_of(urn)
    if profile is None:
        known = ", ".join(sorted(allowlist.PROFILES))
        report(
            f"{MSG_UNKNOWN_TYPE}: {resource_type} belongs to Pulumi project "
            f"{project_of(urn)!r}, which the pack does not know (known: {known}); "
            f"{HOW_TO_ALLOW}"
        )
    elif resource_type not in profile.types:
        report(
            f"{MSG_UNKNOWN_TYPE}: {resource_type} is not allowed in project {profile.project}; "
            f"{HOW_TO_ALLOW}"
        )


def _check_allowed_api(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    profile = profile_of(urn)
    if resource_type != SERVICE or profile is None:
        return
    api = _get(props, "service")
    if api not in profile.apis:
        report(f"{MSG_UNKNOWN_API}: {api!r} in project {profile.project}; {HOW_TO_ALLOW}")


_CUSTOM_ROLE_NAME = re.compile(r"^projects/[^/]+/roles/([^/]+)$")


def _role_key(role: str) -> str:
    """Predefined roles by name; project custom roles as "custom:<roleId>" (the stack's
    project). Organization custom roles keep their full name and match no entry."""
    match = _CUSTOM_ROLE_NAME.match(role)
    return f"custom:{match.group(1)}" if match else role


def _iam_grants(props: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(role, member, condition expression or "") of an IAM member/binding/policy."""
    role = _get(props, "role")
    role = role if isinstance(role, str) else ""
    expression = _get(props, "condition", "expression")
    condition = expression if isinstance(expression, str) else ""
    member = _get(props, "member")
    if isinstance(member, str):
        yield role, member, condition
    for member in _items(_get(props, "members")):
        yield role, str(member), condition
    policy_data = _get(props, "policyData")
    if isinstance(policy_data, str) and policy_data.strip():
        try:
            policy = json.loads(policy_data)
        except json.JSONDecodeError:
            yield "unreadable policyData", "", ""
            return
        for binding in policy.get("bindings", []) if isinstance(policy, dict) else []:
            binding_condition = str((binding.get("condition") or {}).get("expression") or "")
            for member in binding.get("members", []):
                yield str(binding.get("role", "")), str(member), binding_condition


def _grant_problem(
    profile: allowlist.Profile,
    resource_type: str,
    *,
    props: Mapping[str, Any],
    role: str,
    member: str,
    condition: str,
) -> str | None:
    key = _role_key(role)
    candidates = [g for g in profile.grants if resource_type in g.types and g.role == key]
    if not candidates:
        allowed = sorted({g.role for g in profile.grants if resource_type in g.types})
        return (
            f"{role or 'no role'} to {member} on {resource_type}: this role may not be granted "
            f"there in project {profile.project} (allowed: {', '.join(allowed) or 'none'})"
        )
    target = str(_get(props, "serviceAccountId") or "")
    for grant in candidates:
        member_match = re.fullmatch(grant.member, member)
        if not member_match:
            continue
        if grant.target is not None:
            target = str(_get(props, grant.target_key) or "")
            target_match = re.fullmatch(grant.target, target)
            if not target_match:
                continue
            if grant.same_stack and target_match.group(1) != member_match.group(1):
                continue
        if grant.condition is not None and grant.condition not in condition:
            continue
        return None
    wanted = "; or ".join(
        f"to {g.who}" + (f" with a condition on {g.condition}" if g.condition else "")
        for g in candidates
    )
    on = f" on {target}" if target else ""
    return f"{role} to {member}{on}: allowed only {wanted}"


def _check_allowed_grants(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    profile = profile_of(urn)
    if profile is None or not _is_iam_type(resource_type):
        return
    for role, member, condition in _iam_grants(props):
        problem = _grant_problem(
            profile, resource_type, props=props, role=role, member=member, condition=condition
        )
        if problem:
            report(f"{MSG_IAM_GRANT}: {problem}; {HOW_TO_ALLOW}")


def dangerous_permissions(permissions: Iterable[str]) -> list[str]:
    return sorted(
        p
        for p in permissions
        if any(re.fullmatch(pattern, p) for pattern in allowlist.DANGEROUS_PERMISSION_PATTERNS)
    )


def _check_custom_role(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type not in CUSTOM_ROLE_TYPES:
        return
    profile = profile_of(urn)
    role_id = str(_get(props, "roleId") or "")
    permissions = {str(p) for p in _items(_get(props, "permissions"))}
    allowed = profile.custom_roles.get(role_id) if profile else None
    extra = sorted(permissions - (allowed or frozenset()))
    if allowed is not None and not extra:
        return
    dangerous = dangerous_permissions(extra)
    where = f"project {profile.project}" if profile else f"project {project_of(urn)!r}"
    what = (
        f"custom role {role_id!r} is not allowed in {where}"
        if allowed is None
        else f"custom role {role_id!r} may not hold {', '.join(extra)}"
    )
    danger = f"; it can escalate through {', '.join(dangerous)}" if dangerous else ""
    report(f"{MSG_CUSTOM_ROLE}: {what}{danger}; {HOW_TO_ALLOW}")


def _check_vm_account(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type not in (*VM_TYPES, *TPU_TYPES):
        return
    email = _get(props, "serviceAccount", "email")
    if isinstance(email, str) and not re.fullmatch(allowlist.VM_ACCOUNT, email):
        report(
            f"{MSG_VM_ACCOUNT}: {resource_type} runs as {email}; a VM of "
            f"project {project_of(urn)!r} runs as one of its stack's own accounts "
            "(tp-<stack>-<role>)"
        )


def _check_provider(
    _urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if not resource_type.startswith(PROVIDER_PREFIX):
        return
    for key in PROVIDER_CREDENTIAL_KEYS:
        if _get(props, key) not in (None, "", []):
            report(f"{MSG_PROVIDER}: {resource_type} sets {key}")


def _any_resource_policy(
    name: str,
    description: str,
    check: Callable[[str, str, Mapping[str, Any], Callable[[str], None]], None],
) -> ResourceValidationPolicy:
    """A mandatory policy over every resource, whatever its type (closed by default)."""

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        check(
            args.urn,
            args.resource_type,
            args.props,
            lambda message: report_violation(message, None),
        )

    return ResourceValidationPolicy(
        name=name,
        description=description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
    )


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
            if DEFAULT_ACCOUNT.search(member):
                report(f"{MSG_DEFAULT_SA}: {member} is granted {role or 'a role'}")
        # A grant ON a default account (e.g. actAs on it) lets the grantee run as it.
        for key in ("serviceAccountId", "name", "resource"):
            target = _get(props, key)
            if isinstance(target, str) and DEFAULT_ACCOUNT.search(target):
                report(f"{MSG_DEFAULT_SA}: grant on the default account {target}")
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
        DEFAULT_ACCOUNT.search(email) or email.strip().lower() == "default"
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
    if resource_type == BUCKET_OBJECT:
        acl = _get(props, "predefinedAcl")
        if isinstance(acl, str) and acl.strip().lower().startswith(("public", "authenticated")):
            report(f"{MSG_PUBLIC_MEMBER}: object with predefinedAcl {acl!r}")
        return
    if not (_is_iam_type(resource_type) or resource_type in STORAGE_ACL_TYPES):
        return
    for role, member in _iam_members(resource_type, props):
        if member.strip().lower() in PUBLIC_PRINCIPALS:
            report(f"{MSG_PUBLIC_MEMBER}: {member} gets {role or 'access'}")


def _port_ranges(ports: Any) -> list[tuple[int, int]] | None:
    """None means every port (no ports listed, or one that cannot be read: judged as the
    widest it could be)."""
    listed = [str(port) for port in _items(ports)]
    if not listed:
        return None
    ranges = []
    for item in listed:
        low, _, high = item.strip().partition("-")
        try:
            ranges.append((int(low), int(high or low)))
        except ValueError:
            return None
    return ranges


Net = ipaddress.IPv4Network | ipaddress.IPv6Network
_PROTOCOL_NUMBERS = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp", "58": "ipv6-icmp"}


def _collapse(networks: Iterable[Net]) -> list[Net]:
    v4 = [n for n in networks if n.version == 4]
    v6 = [n for n in networks if n.version == 6]
    return [
        *ipaddress.collapse_addresses(v4),
        *ipaddress.collapse_addresses(v6),
    ]


def _subtract(networks: Iterable[Net], removed: Iterable[Net]) -> list[Net]:
    """The addresses of `networks` that are in none of `removed`, collapsed."""
    result = _collapse(networks)
    for cut in removed:
        kept: list[Net] = []
        for network in result:
            if network.version != cut.version or not network.overlaps(cut):
                kept.append(network)
            elif not network.subnet_of(cut):  # type: ignore[arg-type]
                kept.extend(network.address_exclude(cut))  # type: ignore[arg-type]
        result = kept
    return _collapse(result)


def _public(networks: Iterable[Net]) -> list[Net]:
    return _subtract(networks, NOT_PUBLIC)


def _address_count(networks: Iterable[Net]) -> int:
    return sum(n.num_addresses for n in networks)


def _summary(networks: Sequence[Net]) -> str:
    shown = ", ".join(str(n) for n in networks[:3])
    more = f" and {len(networks) - 3} more ranges" if len(networks) > 3 else ""
    return f"{_address_count(networks)} public addresses ({shown}{more})"


def _firewall_sources(props: Mapping[str, Any]) -> tuple[list[Net], list[str], str]:
    """(parsed source ranges, unparseable ones, how the source reads)."""
    ranges = [str(r) for r in _items(_get(props, "sourceRanges"))]
    no_source = not _items(_get(props, "sourceTags")) and not _items(
        _get(props, "sourceServiceAccounts")
    )
    if not ranges:
        if no_source:
            return [ipaddress.ip_network("0.0.0.0/0")], [], "no source (GCE defaults to 0.0.0.0/0)"
        return [], [], "source tags/service accounts only"
    parsed: list[Net] = []
    bad: list[str] = []
    for cidr in ranges:
        try:
            parsed.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            bad.append(cidr)
    shown = " + ".join(ranges[:4]) + (f" + {len(ranges) - 4} more" if len(ranges) > 4 else "")
    return parsed, bad, shown


def _active_ingress(props: Mapping[str, Any]) -> bool:
    direction = str(_get(props, "direction") or "INGRESS").upper()
    return direction == "INGRESS" and _get(props, "disabled") is not True


def _protocol(allow: Any) -> str:
    protocol = str(_get(allow, "protocol") or "").strip().lower()
    return _PROTOCOL_NUMBERS.get(protocol, protocol)


def _is_vpn_entry(props: Mapping[str, Any]) -> bool:
    """The WireGuard rule's shape: one UDP port, to the VPN hop only."""
    allows = _items(_get(props, "allows"))
    targets = [str(t) for t in _items(_get(props, "targetTags"))]
    ports = [str(p).strip() for a in allows for p in _items(_get(a, "ports"))]
    return (
        bool(allows)
        and all(_protocol(a) == "udp" and _items(_get(a, "ports")) for a in allows)
        and len(set(ports)) == 1
        and ports[0].isdigit()
        and bool(targets)
        and all(t == HOP_NETWORK_TAG for t in targets)
        and not _items(_get(props, "targetServiceAccounts"))
    )


def _user_cidrs(resources: Sequence[PolicyResource]) -> tuple[list[Net], str]:
    """The public addresses the stack declares for its users (its WireGuard rules' sources),
    or none when that declaration is wider than MAX_USER_ADDRESSES; and how it reads."""
    declared: list[Net] = []
    for resource in resources:
        props = resource.props
        if resource.resource_type == FIREWALL and _active_ingress(props) and _is_vpn_entry(props):
            declared.extend(_firewall_sources(props)[0])
    public = _public(declared)
    if _address_count(public) > MAX_USER_ADDRESSES:
        return [], (
            f"the stack's user CIDRs ({_summary(public)}) are wider than "
            f"{MAX_USER_ADDRESSES} addresses and exempt nothing"
        )
    return public, ", ".join(str(n) for n in public) or "none declared"


def _overlaps(ranges: list[tuple[int, int]] | None, first: int, last: int) -> bool:
    return ranges is None or any(lo <= last and first <= hi for lo, hi in ranges)


def _outside(ranges: list[tuple[int, int]] | None, known: Sequence[tuple[int, int, str]]) -> bool:
    """Whether the port ranges open any port that is in none of `known`."""
    if ranges is None:
        return True
    for low, high in ranges:
        port = low
        while port <= high:
            inside = [k for k in known if k[0] <= port <= k[1]]
            if not inside:
                return True
            port = max(k[1] for k in inside) + 1
    return False


def ingress_findings(resources: Sequence[PolicyResource]) -> Iterator[tuple[str, str, str]]:
    """(policy name, message, urn) for every ingress firewall that lets public addresses
    outside the stack's user CIDRs reach a port. Ranges are judged by the addresses they
    cover (collapsed, private and Google ranges taken out), never by how they are written."""
    users, users_text = _user_cidrs(resources)
    known_ports = (*ADMIN_PORTS, *SERVICE_PORTS)
    for resource in resources:
        if resource.resource_type != FIREWALL or not _active_ingress(resource.props):
            continue
        props = resource.props
        parsed, bad, source_text = _firewall_sources(props)
        for cidr in bad:
            yield (
                "no-public-ingress",
                f"{MSG_PUBLIC_INGRESS}: source range {cidr!r} is not an IP range, so what it "
                "covers cannot be judged",
                resource.urn,
            )
        residual = _subtract(_public(parsed), users)
        if not residual:
            continue
        source = f"{source_text}: {_summary(residual)} outside the user CIDRs ({users_text})"
        vpn_entry = _is_vpn_entry(props)
        for allow in _items(_get(props, "allows")):
            protocol = _protocol(allow)
            ranges = _port_ranges(_get(allow, "ports"))
            if protocol in {"tcp", "all"}:
                for rule, ports, message in (
                    ("no-ssh-rdp-from-internet", ADMIN_PORTS, MSG_SSH_RDP),
                    ("no-tensorboard-tpu-from-internet", SERVICE_PORTS, MSG_SERVICE_PORTS),
                ):
                    for first, last, service in ports:
                        if _overlaps(ranges, first, last):
                            wanted = f"port {first}" if first == last else f"ports {first}-{last}"
                            shown = "all ports" if ranges is None else wanted
                            text = f"{message}: {service} ({protocol} {shown}) from {source}"
                            yield rule, text, resource.urn
                if protocol == "tcp" and not _outside(ranges, known_ports):
                    continue
            elif protocol == "udp" and vpn_entry:
                continue  # the WireGuard endpoint: authenticated by its keys, meant to be reached
            ports_text = "all ports" if ranges is None else ",".join(_items(_get(allow, "ports")))
            yield (
                "no-public-ingress",
                f"{MSG_PUBLIC_INGRESS}: {protocol or 'no protocol'} {ports_text} from {source}; "
                "only the WireGuard rule (UDP to the VPN hop) may face the internet",
                resource.urn,
            )


def _ingress_policy(name: str, description: str) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        for rule, message, urn in ingress_findings(args.resources):
            if rule == name:
                report_violation(message, urn)

    return StackValidationPolicy(
        name=name,
        description=description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
    )


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


def _has_gpus(props: Mapping[str, Any]) -> bool:
    machine_type = str(_get(props, "machineType") or "").rsplit("/", 1)[-1].lower()
    attached = any(
        isinstance(_get(a, "count"), (int, float)) and _get(a, "count") > 0
        for a in _items(_get(props, "guestAccelerators"))
    )
    return attached or machine_type.startswith(GPU_MACHINE_PREFIXES)


def _check_shielded(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    config = _get(props, "shieldedInstanceConfig")
    if resource_type == INSTANCE and _has_gpus(props):
        for key in ("enableVtpm", "enableIntegrityMonitoring"):
            if _get(config, key) is not True:
                report(f"{MSG_SHIELDED}: GPU VM: shieldedInstanceConfig.{key} is not true")
        return
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


def _accelerators(args: StackValidationArgs) -> list[Any]:
    """What trains: TPU VMs (and queued resources) and compute instances with GPUs."""
    return [
        r
        for r in args.resources
        if r.resource_type in (TPU_VM, TPU_QUEUED)
        or (r.resource_type == INSTANCE and _has_gpus(r.props))
    ]


def _validate_regions(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    accelerators = _accelerators(args)
    buckets = [r for r in args.resources if r.resource_type == BUCKET]
    if not accelerators or not buckets:
        return
    for accelerator in accelerators:
        zone = _get(accelerator.props, "zone")
        if not isinstance(zone, str):
            continue
        region = _region_of_zone(zone)
        what = "GPU VM" if accelerator.resource_type == INSTANCE else "TPU"
        for bucket in buckets:
            location = str(_get(bucket.props, "location") or "").lower()
            if location != region:
                report_violation(
                    f"{MSG_REGION}: {what} {accelerator.name} is in {region} ({zone}) but "
                    f"bucket {bucket.name} is in {location or 'an unknown location'}",
                    bucket.urn,
                )


def _validate_own_targets(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    """Grants on buckets, secrets and service accounts name ones this stack creates: an
    allowed role on someone else's resource (the state bucket, another stack's account) is
    a grant the program never makes."""
    buckets = {
        str(_get(r.props, "name"))
        for r in args.resources
        if r.resource_type == BUCKET and _get(r.props, "name")
    }
    secrets = {
        str(_get(r.props, "secretId"))
        for r in args.resources
        if r.resource_type == SECRET and _get(r.props, "secretId")
    }
    accounts = {
        (str(_get(r.props, "accountId")), _get(r.props, "project"))
        for r in args.resources
        if r.resource_type == ACCOUNT
    }
    repositories = {
        (str(_get(r.props, "repositoryId")), _get(r.props, "location"))
        for r in args.resources
        if r.resource_type == allowlist.REPOSITORY
    }
    for resource in args.resources:
        type_, props = resource.resource_type, resource.props
        lowered = type_.lower()
        if not _is_iam_type(type_):
            continue
        if lowered.startswith("gcp:storage/bucketiam"):
            bucket = str(_get(props, "bucket") or "").removeprefix("b/")
            if bucket not in buckets:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: bucket {bucket!r} is not a bucket of this stack",
                    resource.urn,
                )
        elif lowered.startswith("gcp:secretmanager/secretiam"):
            secret = str(_get(props, "secretId") or "").rsplit("/", 1)[-1]
            if secret not in secrets:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: secret {secret!r} is not a secret of this stack",
                    resource.urn,
                )
        elif lowered.startswith("gcp:artifactregistry/repositoryiam"):
            repository = str(_get(props, "repository") or "").rsplit("/", 1)[-1]
            if (repository, _get(props, "location")) not in repositories:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: Artifact Registry repository {repository!r} in "
                    f"{_get(props, 'location')!r} is not a repository of this stack",
                    resource.urn,
                )
        elif lowered.startswith("gcp:serviceaccount/iam"):
            target = str(_get(props, "serviceAccountId") or "").rsplit("/", 1)[-1]
            local, _, domain = target.partition("@")
            own = any(
                local == account_id
                and (project is None or domain == f"{project}.iam.gserviceaccount.com")
                for account_id, project in accounts
            )
            if not own:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: service account {target!r} is not an account of "
                    "this stack",
                    resource.urn,
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
        _any_resource_policy(
            "allowed-resource-types",
            "Every resource's type is on the allowlist of its Pulumi project "
            "(policy/allowlist.py); anything else is refused (closed world).",
            _check_allowed_type,
        ),
        _any_resource_policy(
            "allowed-apis",
            "Only the APIs the program needs may be enabled (policy/allowlist.py).",
            _check_allowed_api,
        ),
        _any_resource_policy(
            "allowed-iam-grants",
            "Every IAM grant (role x principal x resource) is on the allowlist; custom roles "
            "by role id, service-account grants by the account they are on.",
            _check_allowed_grants,
        ),
        executables.build_policy(),
        _any_resource_policy(
            "custom-role-permissions",
            "A custom role exists only under an allowed role id and holds only the "
            "permissions listed for it (setIamPolicy, actAs, token or key creation, role "
            "editing are named as escalation paths).",
            _check_custom_role,
        ),
        _any_resource_policy(
            "vm-accounts-are-stack-accounts",
            "VMs and TPU VMs run as the stack's own service accounts, never as another "
            "account of the project (a CI account, another stack's, a default one).",
            _check_vm_account,
        ),
        _any_resource_policy(
            "providers-without-credentials",
            "Providers use the identity the workflow authenticated: no credentials, access "
            "token or impersonation of their own.",
            _check_provider,
        ),
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
        _ingress_policy(
            "no-ssh-rdp-from-internet",
            "Ingress firewalls never let a public address reach TCP 22/3389 (or all ports): "
            "source ranges are judged by the addresses they cover, whatever their prefix "
            "lengths; only RFC 1918, IAP and health-check ranges, and the stack's own user "
            "CIDRs (its WireGuard sources, a /16 at most) are not public (CIS GCP 3.6, 3.7)",
        ),
        _ingress_policy(
            "no-tensorboard-tpu-from-internet",
            "Ingress firewalls never let a public address reach TensorBoard (6006) or the TPU "
            "runtime ports (8470-8479); they are reached over the VPN.",
        ),
        _ingress_policy(
            "no-public-ingress",
            "No other port or protocol faces public addresses either (closed by default): "
            "the one exception is the WireGuard rule, UDP on listed ports to the VPN hop.",
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
            "boot where the generation supports it (v4 and later); GPU VMs keep vTPM and "
            "integrity monitoring (their NVIDIA driver is not signed for secure boot).",
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
            name="grants-on-own-resources",
            description="Bucket, secret, service-account and image-repository grants are on "
            "resources the same stack creates (never on the state bucket or another stack's "
            "account).",
            validate=_validate_own_targets,
            enforcement_level=EnforcementLevel.MANDATORY,
        ),
        StackValidationPolicy(
            name="accelerator-and-bucket-same-region",
            description="Every TPU VM, every VM with GPUs and every bucket of a stack are in "
            "one region (no cross-region reads of training data).",
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
    "allowed-resource-types": MSG_UNKNOWN_TYPE,
    "allowed-apis": MSG_UNKNOWN_API,
    "allowed-iam-grants": MSG_IAM_GRANT,
    "custom-role-permissions": MSG_CUSTOM_ROLE,
    executables.NAME: executables.MSG,
    "providers-without-credentials": MSG_PROVIDER,
    "no-public-ingress": MSG_PUBLIC_INGRESS,
    "grants-on-own-resources": MSG_FOREIGN_TARGET,
    "vm-accounts-are-stack-accounts": MSG_VM_ACCOUNT,
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
    "accelerator-and-bucket-same-region": MSG_REGION,
    "one-vpn-hop-outside-tpu-region": MSG_HOP,
}
