"""Least privilege that still deploys: for every stack (and each with the TPU watchdog on),
every resource the program registers under Pulumi's mocks is deployable by the bootstrap's
deploy account, and every role the program grants is one that account may grant.

Both sides are captured, not hand-kept: the program's resources (tests/infra/harness.py)
and the deploy account's custom roles and grant condition (the bootstrap program under its
mocks, tests/policy/test_bootstrap.py). What is kept by hand is the table below: which
permissions a resource type needs over its life (create, read, update, delete)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_bootstrap import Run, run_bootstrap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_files import doc_text
from harness import run_offline, stack_names

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "tpu-pretrain-example"  # the bootstrap stack's project; stacks run in it here

# Resource type -> permissions the deploy account needs for it (create, read, update and
# delete, plus waiting on the operation). Sources: the Cloud REST references' "IAM
# Permissions" of each method and the Terraform provider's per-resource permission maps
# (JamesWoolfenden/pike src/mapping/google/resource/*). A type missing here fails the test:
# add its permissions here and to the deploy role (infra/bootstrap/gitops_bootstrap.py).
NEEDS: dict[str, tuple[str, ...]] = {
    "gcp:projects/service:Service": (
        "serviceusage.services.enable",
        "serviceusage.services.get",
        "serviceusage.services.list",
        "serviceusage.operations.get",
        "resourcemanager.projects.get",
    ),
    "gcp:compute/network:Network": (
        "compute.networks.create",
        "compute.networks.delete",
        "compute.networks.get",
        "compute.globalOperations.get",
    ),
    "gcp:compute/subnetwork:Subnetwork": (
        "compute.subnetworks.create",
        "compute.subnetworks.delete",
        "compute.subnetworks.get",
        "compute.subnetworks.update",
        "compute.subnetworks.setPrivateIpGoogleAccess",
        "compute.regionOperations.get",
    ),
    "gcp:compute/router:Router": (
        "compute.routers.create",
        "compute.routers.delete",
        "compute.routers.get",
        "compute.routers.update",
        "compute.regionOperations.get",
    ),
    "gcp:compute/routerNat:RouterNat": (
        "compute.routers.get",
        "compute.routers.update",
        "compute.subnetworks.use",  # the NAT names the TPU subnet
        "compute.regionOperations.get",
    ),
    "gcp:compute/firewall:Firewall": (
        "compute.firewalls.create",
        "compute.firewalls.delete",
        "compute.firewalls.get",
        "compute.firewalls.update",
        "compute.networks.updatePolicy",
        "compute.globalOperations.get",
    ),
    "gcp:compute/address:Address": (
        "compute.addresses.create",
        "compute.addresses.delete",
        "compute.addresses.get",
        "compute.addresses.setLabels",
        "compute.regionOperations.get",
    ),
    "gcp:compute/instance:Instance": (
        "compute.instances.create",
        "compute.instances.delete",
        "compute.instances.get",
        "compute.instances.setMetadata",
        "compute.instances.setLabels",
        "compute.instances.setTags",
        "compute.instances.setServiceAccount",
        "compute.instances.setMachineType",
        "compute.instances.start",
        "compute.instances.stop",  # allow_stopping_for_update
        "compute.disks.create",
        "compute.images.useReadOnly",
        "compute.subnetworks.use",
        "compute.zoneOperations.get",
        "iam.serviceAccounts.actAs",  # attaching the stack's service account
    ),
    "gcp:tpu/v2Vm:V2Vm": (
        "tpu.nodes.create",
        "tpu.nodes.delete",
        "tpu.nodes.get",
        "tpu.nodes.update",
        "tpu.operations.get",
        "iam.serviceAccounts.actAs",
    ),
    "gcp:storage/bucket:Bucket": (
        "storage.buckets.create",
        "storage.buckets.delete",
        "storage.buckets.get",
        "storage.buckets.list",  # finding a bucket kept by an earlier destroy
        "storage.buckets.update",
    ),
    "gcp:storage/bucketIAMMember:BucketIAMMember": (
        "storage.buckets.getIamPolicy",
        "storage.buckets.setIamPolicy",
    ),
    "gcp:storage/bucketObject:BucketObject": (
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
    ),
    "gcp:serviceaccount/account:Account": (
        "iam.serviceAccounts.create",
        "iam.serviceAccounts.delete",
        "iam.serviceAccounts.get",
        "iam.serviceAccounts.update",
    ),
    "gcp:serviceaccount/iAMMember:IAMMember": (
        "iam.serviceAccounts.getIamPolicy",
        "iam.serviceAccounts.setIamPolicy",
    ),
    "gcp:projects/iAMMember:IAMMember": (
        "resourcemanager.projects.getIamPolicy",
        "resourcemanager.projects.setIamPolicy",
    ),
    "gcp:secretmanager/secret:Secret": (
        "secretmanager.secrets.create",
        "secretmanager.secrets.delete",
        "secretmanager.secrets.get",
        "secretmanager.secrets.update",
    ),
    "gcp:secretmanager/secretVersion:SecretVersion": (
        "secretmanager.versions.add",
        "secretmanager.versions.get",
        "secretmanager.versions.access",
        "secretmanager.versions.destroy",
    ),
    "gcp:secretmanager/secretIamMember:SecretIamMember": (
        "secretmanager.secrets.getIamPolicy",
        "secretmanager.secrets.setIamPolicy",
    ),
    # Local providers: no Google API call.
    "random:index/randomBytes:RandomBytes": (),
    "time:index/sleep:Sleep": (),
}
# A VM with an external address (the VPN hop) needs these on top of NEEDS.
EXTERNAL_IP_NEEDS = ("compute.subnetworks.useExternalIp", "compute.addresses.use")
# IAM resources whose role the grant condition must allow (policy writes through the
# conditional granter role); bucket and secret grants are on single resources the stack owns.
CONDITIONAL_GRANTS = ("gcp:projects/iAMMember:IAMMember", "gcp:serviceaccount/iAMMember:IAMMember")
# `gcloud compute tpus <group> <verb>` -> permissions (Cloud TPU REST reference).
GCLOUD_TPU_NEEDS = {
    ("tpu-vm", "describe"): ("tpu.nodes.get",),
    ("tpu-vm", "list"): ("tpu.nodes.list",),
    ("tpu-vm", "create"): ("tpu.nodes.create", "tpu.operations.get"),
    ("tpu-vm", "delete"): ("tpu.nodes.delete", "tpu.operations.get"),
    ("queued-resources", "create"): ("tpu.queuedResources.create", "tpu.operations.get"),
    ("queued-resources", "describe"): ("tpu.queuedResources.get",),
    ("queued-resources", "list"): ("tpu.queuedResources.list",),
    ("queued-resources", "delete"): ("tpu.queuedResources.delete", "tpu.operations.get"),
}


@pytest.fixture(scope="module")
def bootstrap_run() -> Run:
    return run_bootstrap({"gcp:project": PROJECT})


def _role_permissions(run: Run, name: str) -> set[str]:
    return set(run.named(name).inputs["permissions"])


def _deploy_permissions(run: Run) -> tuple[set[str], set[str]]:
    """(unconditional, conditional) permissions of the deploy account, from its bindings."""
    roles = {
        r.inputs["roleId"]: set(r.inputs["permissions"])
        for r in run.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
    }
    plain: set[str] = set()
    conditional: set[str] = set()
    for binding in run.of_type("gcp:projects/iAMMember:IAMMember"):
        if "tpu-pretrain-deploy@" not in binding.inputs["member"]:
            continue
        role_id = binding.inputs["role"].rsplit("/", 1)[-1]
        (conditional if binding.inputs.get("condition") else plain).update(roles[role_id])
    return plain, conditional


def _grantable(run: Run) -> set[str]:
    expression = run.named("deploy-iam-granter").inputs["condition"]["expression"]
    match = re.fullmatch(
        r"api\.getAttribute\('iam\.googleapis\.com/modifiedGrantsByRole', \[\]\)"
        r"\.hasOnly\(\[(.*)\]\)",
        expression,
    )
    assert match, expression
    return set(re.findall(r"'([^']+)'", match.group(1)))


def _variants() -> list[tuple[str, dict[str, object]]]:
    return [(s, {}) for s in stack_names()] + [
        (s, {"tpu-pretrain:tpuAutoRecover": not_default}) for s, not_default in _flipped()
    ]


def _flipped() -> list[tuple[str, bool]]:
    """Each stack with tpuAutoRecover set against its default (on-demand: on, spot: off)."""
    result = []
    for stack in stack_names():
        recovery = any(r.type_ == "gcp:serviceaccount/iAMMember:IAMMember" for r in _run(stack))
        result.append((stack, not recovery))
    return result


def _run(stack: str, overrides: dict[str, object] | None = None):
    return run_offline(stack, {"gcp:project": PROJECT, **(overrides or {})}).resources


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_the_deploy_account_can_deploy_every_resource(stack, overrides, bootstrap_run) -> None:
    plain, conditional = _deploy_permissions(bootstrap_run)
    held = plain | conditional
    missing: dict[str, list[str]] = {}
    for resource in _run(stack, overrides):
        if resource.type_.startswith("tpu-pretrain:"):
            continue
        assert resource.type_ in NEEDS, f"{resource.type_}: add it to NEEDS (and to the role)"
        needs = set(NEEDS[resource.type_])
        if any(nic.get("accessConfigs") for nic in resource.inputs.get("networkInterfaces", [])):
            needs |= set(EXTERNAL_IP_NEEDS)
        if needs - held:
            missing[resource.name] = sorted(needs - held)
    assert missing == {}


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_the_deploy_account_may_grant_every_role_the_program_grants(
    stack, overrides, bootstrap_run
) -> None:
    grantable = _grantable(bootstrap_run)
    granted = {
        (r.name, r.inputs["role"]) for r in _run(stack, overrides) if r.type_ in CONDITIONAL_GRANTS
    }
    assert granted, "the program grants project roles; the check must see them"
    assert {(name, role) for name, role in granted if role not in grantable} == set()


def test_the_deploy_account_cannot_edit_any_role(bootstrap_run) -> None:
    """It may grant the recovery role, so it must not be able to change what it contains."""
    plain, conditional = _deploy_permissions(bootstrap_run)
    assert not {p for p in plain | conditional if p.startswith("iam.roles.")}
    # Policy writes only under the grant condition.
    assert not {p for p in plain if p.endswith(".setIamPolicy") and "projects" in p}
    assert "iam.serviceAccounts.setIamPolicy" not in plain


def test_the_recovery_role_is_the_bootstrap_role_the_program_binds(bootstrap_run) -> None:
    sys.path.insert(0, str(ROOT))
    from infra.components.recovery import recovery_role_name

    roles = {
        r.inputs["roleId"]: r
        for r in bootstrap_run.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
    }
    bound = recovery_role_name(PROJECT)
    assert bound.rsplit("/", 1)[-1] in roles
    assert bound in _grantable(bootstrap_run)


def test_the_recovery_role_covers_what_the_watchdog_runs(bootstrap_run) -> None:
    """Derived from the watchdog script itself: every `gcloud compute tpus` verb it calls."""
    recovery = _role_permissions(bootstrap_run, "tpu-recovery-role")
    script = (ROOT / "infra" / "templates" / "tpu-watch.sh").read_text()
    calls = set(re.findall(r"compute tpus (tpu-vm|queued-resources) ([a-z-]+)", script))
    assert ("tpu-vm", "create") in calls and ("tpu-vm", "describe") in calls
    for call in calls:
        assert call in GCLOUD_TPU_NEEDS, f"gcloud compute tpus {' '.join(call)}: add it"
        assert set(GCLOUD_TPU_NEEDS[call]) <= recovery, call
    # Nothing but TPU nodes, queued resources and their operations: actAs comes from a grant
    # on the TPU VM's one account, never from a project-level role.
    assert all(
        p.startswith(("tpu.nodes.", "tpu.queuedResources.", "tpu.operations.")) for p in recovery
    )


def test_the_documented_command_creates_the_same_recovery_role(bootstrap_run) -> None:
    """Without GitOps, the one-time gcloud command in the docs (Deploy on GCP, Prerequisites)
    makes the role the bootstrap would: same id, same permissions."""
    match = re.search(
        r"gcloud iam roles create (\w+) --project <id> .*?--permissions ([a-zA-Z.,]+)`", doc_text()
    )
    assert match, "docs: the recovery role's gcloud command is missing"
    role = bootstrap_run.named("tpu-recovery-role").inputs
    assert match.group(1) == role["roleId"]
    assert sorted(match.group(2).split(",")) == sorted(role["permissions"])
