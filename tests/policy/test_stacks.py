"""The pack over every real stack: the resources the program registers under Pulumi's mocks
(tests/infra/harness.py) produce zero violations, and deliberately insecure variants of a
stack, made with stack config overrides or by editing the captured inputs, are rejected by
the intended rule with its message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from policy_harness import Violation, run_pack
from stacks_harness import GPU_STACKS, STACKS, Resource, resources

from policy import rules
from policy.resources import (
    BUCKET,
    FIREWALL,
    HOP_NETWORK_TAG,
    INSTANCE,
    NETWORK,
    SUBNETWORK,
    TPU_VM,
)

BUCKET_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"


def test_every_stack_is_covered() -> None:
    assert len(STACKS) >= 4
    assert {"v3-euw4", "v2-usc1", "v4-usc2", "v6e-euw4"} <= set(STACKS)


@pytest.mark.parametrize("stack", STACKS)
def test_stack_has_zero_violations(stack: str) -> None:
    stack_resources = resources(stack)
    types = {type_ for type_, _, _, _ in stack_resources}
    # The rules must actually see what they guard, or "zero violations" means nothing (a
    # GPU stack's accelerator is an INSTANCE: tests/policy/test_gpu_policy.py).
    accelerator = INSTANCE if stack in GPU_STACKS else TPU_VM
    assert {BUCKET, INSTANCE, accelerator, FIREWALL, SUBNETWORK} <= types
    assert run_pack(stack_resources) == []


ALERT_TYPES = {
    "gcp:monitoring/notificationChannel:NotificationChannel",
    "gcp:monitoring/alertPolicy:AlertPolicy",
}


@pytest.mark.parametrize("stack", ["v6e-euw4", "t4-usc1"])
def test_a_stack_with_alerts_has_zero_violations(stack: str) -> None:
    stack_resources = resources(stack, {"tpu-pretrain:alertEmails": ["ops@example.com"]})
    assert {type_ for type_, _, _, _ in stack_resources} >= ALERT_TYPES
    assert run_pack(stack_resources) == []
    # Its channel turned into a webhook is refused.
    [channel] = [r for r in stack_resources if r[0] in ALERT_TYPES and "email" in r[1]]
    channel[2]["type"] = "webhook_tokenauth"
    channel[2]["labels"] = {"url": "https://collector.example/hook"}
    [violation] = run_pack(stack_resources)
    assert violation.policy == "notification-channels-email-only"
    assert violation.urn == channel[3]


def _only(
    violations: list[Violation],
    rule: str,
    also: tuple[str, ...] = (),
    may_also: tuple[str, ...] = (),
) -> list[Violation]:
    """The violations of `rule` (with its message); `also`: the other rules that must
    fire with it (e.g. a public principal is not on the grant allowlist either), `may_also`
    ones that may."""
    assert violations, f"{rule}: the insecure variant was accepted"
    assert {rule, *also} <= {v.policy for v in violations} <= {rule, *also, *may_also}, violations
    assert all(v.message.startswith(rules.POLICY_MESSAGES[v.policy]) for v in violations), (
        violations
    )
    return [v for v in violations if v.policy == rule]


def _edit(
    stack_resources: list[Resource], type_: str, name_part: str, change: Callable[[dict], None]
) -> list[Resource]:
    matches = [r for r in stack_resources if r[0] == type_ and name_part in r[1]]
    assert len(matches) == 1, f"{type_} {name_part}: {[r[1] for r in matches]}"
    change(matches[0][2])
    return stack_resources


# --- variants through the stack's own configuration -------------------------------------------
@pytest.mark.parametrize("stack", ["v3-euw4", "v6e-euw4"])
def test_tpu_external_ip_from_config_is_rejected(stack: str) -> None:
    violations = run_pack(resources(stack, {"tpu-pretrain:tpuExternalIp": True}))
    [violation] = _only(violations, "no-external-ip-except-vpn-hop")
    assert violation.urn.endswith("::tpu-vm")
    assert "enableExternalIps" in violation.message


def test_wireguard_open_to_the_world_is_not_an_ssh_hole() -> None:
    """UDP WireGuard from anywhere is a user's choice; the rule is about SSH/RDP only."""
    assert run_pack(resources("v4-usc2", {"tpu-pretrain:vpnAllowedCidrs": ["0.0.0.0/0"]})) == []


# --- variants by editing what the program registered ------------------------------------------
def _set(path: str, value: Any) -> Callable[[dict], None]:
    def change(props: dict) -> None:
        node = props
        *parents, last = path.split(".")
        for step in parents:
            node = node[int(step)] if step.isdigit() else node.setdefault(step, {})
        node[last] = value

    return change


def _drop(key: str) -> Callable[[dict], None]:
    return lambda props: props.pop(key)


MUTATIONS: list[tuple[str, str, str, Callable[[dict], None]]] = [
    ("bucket-uniform-access", BUCKET, "training", _set("uniformBucketLevelAccess", False)),
    ("bucket-public-access-prevention", BUCKET, "training",
     _set("publicAccessPrevention", "inherited")),
    ("no-public-principals", "gcp:storage/bucketIAMMember:BucketIAMMember",
     "controller-objects-read", _set("member", "allUsers")),
    # What a VM runs (policy/executables.py): the write grant's condition gone, loosened, or
    # another role beside it; a project role that writes every bucket.
    ("vm-accounts-write-no-executables", BUCKET_MEMBER, "workload-objects-write",
     _drop("condition")),
    ("vm-accounts-write-no-executables", BUCKET_MEMBER, "workload-objects-write",
     _set("condition.expression", "resource.type == 'storage.googleapis.com/Object'")),
    ("vm-accounts-write-no-executables", BUCKET_MEMBER, "controller-objects-write",
     lambda props: props["condition"].update(
         expression=props["condition"]["expression"].split(" && !")[0]
         + " && !resource.name.startsWith('projects/_/buckets/x/objects/startup/')")),
    ("vm-accounts-write-no-executables", BUCKET_MEMBER, "workload-objects-read",
     _set("role", "roles/storage.objectAdmin")),
    ("vm-accounts-write-no-executables", BUCKET_MEMBER, "controller-objects-read",
     _set("role", "roles/storage.legacyBucketWriter")),
    ("vm-accounts-write-no-executables", "gcp:projects/iAMMember:IAMMember",
     "workload-identity-logging", _set("role", "roles/storage.objectCreator")),
    ("no-default-compute-service-account", TPU_VM, "tpu",
     _set("serviceAccount.email", "42-compute@developer.gserviceaccount.com")),
    ("no-default-compute-service-account", INSTANCE, "controller",
     _set("serviceAccount.email", "default")),
    ("no-default-compute-service-account", INSTANCE, "controller",
     lambda props: props["serviceAccount"].pop("email")),
    ("no-ssh-rdp-from-internet", FIREWALL, "allow-ssh",
     _set("sourceRanges", ["0.0.0.0/1", "128.0.0.0/1"])),
    ("no-tensorboard-tpu-from-internet", FIREWALL, "allow-from-hop",
     lambda props: props.update(sourceRanges=["0.0.0.0/1", "128.0.0.0/1"],
                                allows=[{"protocol": "tcp", "ports": ["6006"]}])),
    ("one-vpn-hop-outside-tpu-region", INSTANCE, "controller",
     lambda props: props.update(tags=[*props["tags"], HOP_NETWORK_TAG])),
    ("no-basic-or-admin-roles-for-service-accounts", "gcp:projects/iAMMember:IAMMember",
     "workload-identity-logging", _set("role", "roles/editor")),
    ("no-ssh-rdp-from-internet", FIREWALL, "allow-ssh", _set("sourceRanges", ["0.0.0.0/0"])),
    ("no-external-ip-except-vpn-hop", INSTANCE, "controller",
     _set("networkInterfaces.0.accessConfigs", [{"networkTier": "PREMIUM"}])),
    ("ip-forwarding-only-on-vpn-hop", INSTANCE, "controller", _set("canIpForward", True)),
    ("shielded-vm", INSTANCE, "controller",
     _set("shieldedInstanceConfig.enableSecureBoot", False)),
    ("os-login-enabled", INSTANCE, "vpn-hop", _set("metadata.enable-oslogin", "FALSE")),
    ("project-ssh-keys-blocked", TPU_VM, "tpu", _set("metadata.block-project-ssh-keys", "0")),
    ("serial-port-disabled", INSTANCE, "controller",
     _set("metadata.serial-port-enable", "TRUE")),
    ("bucket-recoverable", BUCKET, "training",
     _set("softDeletePolicy.retentionDurationSeconds", 0)),
    ("no-key-material-in-metadata", TPU_VM, "tpu",
     _set("metadata.wg-key", "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=")),
    ("subnet-flow-logs", SUBNETWORK, "tpu-subnet", _drop("logConfig")),
    ("no-auto-mode-network", NETWORK, "vpc", _set("autoCreateSubnetworks", True)),
    ("accelerator-and-bucket-same-region", BUCKET, "training", _set("location", "US")),
]  # fmt: skip


# A grant that breaks a specific rule is, in addition, not on the grant allowlist.
ALSO = {
    "no-public-principals": ("allowed-iam-grants",),
    "no-basic-or-admin-roles-for-service-accounts": ("allowed-iam-grants",),
}
# Most of them are not on the grant allowlist either (its condition check is a substring;
# a dropped condition, another role); an admin role on the project is named by that rule too.
MAY_ALSO_EXECUTABLES = (
    "allowed-iam-grants",
    "no-basic-or-admin-roles-for-service-accounts",
)
# A VM that runs as a named default account does not run as one of the stack's own either
# (without an email it runs as the default one, which only the first rule can tell).
MAY_ALSO = {
    "no-default-compute-service-account": ("vm-accounts-are-stack-accounts",),
    "vm-accounts-write-no-executables": MAY_ALSO_EXECUTABLES,
    # roles/editor on the project writes every bucket: named by both rules.
    "no-basic-or-admin-roles-for-service-accounts": ("vm-accounts-write-no-executables",),
}


@pytest.mark.parametrize(
    ("rule", "type_", "name_part", "change"),
    MUTATIONS,
    ids=[f"{rule}-{name}" for rule, _, name, _ in MUTATIONS],
)
def test_insecure_variant_of_a_real_stack_is_rejected(
    rule: str, type_: str, name_part: str, change: Callable[[dict], None]
) -> None:
    for stack in ("v3-euw4", "v6e-euw4"):
        edited = _edit(resources(stack), type_, name_part, change)
        _only(run_pack(edited), rule, ALSO.get(rule, ()), MAY_ALSO.get(rule, ()))


def test_hop_loses_its_exemptions_without_its_tag() -> None:
    def untag(props: dict) -> None:
        props["tags"] = [tag for tag in props["tags"] if tag != HOP_NETWORK_TAG]

    edited = _edit(resources("v2-usc1"), INSTANCE, "vpn-hop", untag)
    violations = run_pack(edited)
    assert {v.policy for v in violations} == {
        "no-external-ip-except-vpn-hop",
        "ip-forwarding-only-on-vpn-hop",
    }


def test_a_hop_moved_into_the_tpu_region_loses_its_exemption() -> None:
    stack_resources = resources("v6e-euw4")
    tpu_zone = next(r[2]["zone"] for r in stack_resources if r[0] == TPU_VM)
    edited = _edit(stack_resources, INSTANCE, "vpn-hop", lambda p: p.update(zone=tpu_zone))
    [violation] = _only(run_pack(edited), "one-vpn-hop-outside-tpu-region")
    assert violation.urn.endswith("::vpn-hop-vm")
