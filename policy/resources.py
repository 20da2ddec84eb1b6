"""What every rule of the pack reads: the resource type tokens (pulumi-gcp 10.x), the VPN
hop's mark, the CIS framework, the helpers that read a resource's props in the engine's
form (camelCase names, mappings and sequences that may be the policy SDK's read-only
proxies), and what a rule family exports: its `Rule`s, each a policy with the message its
violations start with. Imports no other module of the pack."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from pulumi_policy import (
    EnforcementLevel,
    PolicyComplianceFramework,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationPolicy,
)

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

CUSTOM_ROLE_TYPES = (
    "gcp:projects/iAMCustomRole:IAMCustomRole",
    "gcp:organizations/iAMCustomRole:IAMCustomRole",
)
SERVICE = "gcp:projects/service:Service"
SECRET = "gcp:secretmanager/secret:Secret"  # noqa: S105 (a type token)
SECRET_VERSION = "gcp:secretmanager/secretVersion:SecretVersion"  # noqa: S105 (a type token)
ACCOUNT = "gcp:serviceaccount/account:Account"
BUCKET_OBJECT = "gcp:storage/bucketObject:BucketObject"
NOTIFICATION_CHANNEL = "gcp:monitoring/notificationChannel:NotificationChannel"
PROVIDER_PREFIX = "pulumi:providers:"

CIS = PolicyComplianceFramework(
    name="CIS Google Cloud Platform Foundation Benchmark",
    version="3.0.0",
    reference="https://www.cisecurity.org/benchmark/google_cloud_computing_platform",
)


class Rule(NamedTuple):
    """One rule of the pack: its policy (which holds the rule's name) and the message every
    violation it reports starts with (tests and users match on it)."""

    policy: ResourceValidationPolicy | StackValidationPolicy
    message: str


# --- helpers ---------------------------------------------------------------------------------
def get(value: Any, *path: str | int) -> Any:
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


def items(value: Any) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return []


def metadata_true(value: Any) -> bool:
    """GCE reads boolean metadata as TRUE/true/1/y/yes (case-insensitive)."""
    if isinstance(value, bool):
        return value
    return isinstance(value, str) and value.strip().lower() in {"true", "1", "y", "yes"}


def _labels(props: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = get(props, "labels")
    return labels if isinstance(labels, Mapping) else {}


def is_vpn_hop(props: Mapping[str, Any]) -> bool:
    tags = [str(tag) for tag in items(get(props, "tags"))]
    return HOP_NETWORK_TAG in tags or _labels(props).get(HOP_LABEL_KEY) == HOP_LABEL_VALUE


def vm_metadata(props: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = get(props, "metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def resource_policy(
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


def iam_members(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(role, member) pairs of an IAM member/binding/policy or storage ACL resource."""
    role = get(props, "role")
    role = role if isinstance(role, str) else ""
    member = get(props, "member")
    if isinstance(member, str):
        yield role, member
    for member in items(get(props, "members")):
        if isinstance(member, str):
            yield role, member
    policy_data = get(props, "policyData")
    if isinstance(policy_data, str) and policy_data.strip():
        try:
            policy = json.loads(policy_data)
        except json.JSONDecodeError:
            policy = {}
        for binding in policy.get("bindings", []) if isinstance(policy, dict) else []:
            for member in binding.get("members", []):
                yield str(binding.get("role", "")), str(member)
    entity = get(props, "entity")
    if isinstance(entity, str):
        yield role, entity
    for role_entity in items(get(props, "roleEntities")):
        if isinstance(role_entity, str) and ":" in role_entity:
            acl_role, acl_entity = role_entity.split(":", 1)
            yield acl_role, acl_entity


def is_iam_type(resource_type: str) -> bool:
    lowered = resource_type.lower()
    return any(kind in lowered for kind in ("iammember", "iambinding", "iampolicy"))
