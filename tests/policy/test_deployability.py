"""Least privilege that still deploys, and cannot escalate: for every stack (and each with
the TPU watchdog on and off), every resource the program registers under Pulumi's mocks is
deployable by the bootstrap's deploy account, every role the program grants is one that
account may grant, and the account holds nothing the program does not need. The stacks run
as GitOps stacks (tpu-pretrain:accountsFromBootstrap: the bootstrap owns their accounts and
the grants on them), the only ones the deploy account deploys.

Both sides are captured, not hand-kept: the program's resources (tests/infra/harness.py) and
the deploy account's custom roles and grant conditions (the bootstrap program under its
mocks, tests/policy/test_bootstrap.py). The permission table per resource type lives in the
bootstrap (deploy_permissions.py PERMISSIONS_BY_TYPE), and the deployer role is derived from
it (bootstrap_roles.py)."""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import pytest
from bootstrap_harness import Run, run_bootstrap

from policy import allowlist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_files import doc_text
from harness import GITOPS, gpu_stack_names, run_offline, stack_names, tpu_stack_names

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "infra" / "bootstrap"))
import bootstrap_roles
import deploy_permissions
from iam_cel import evaluate

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "tpu-pretrain-example"  # the bootstrap stack's project; stacks run in it here
NEEDS = deploy_permissions.PERMISSIONS_BY_TYPE
PROJECT_GRANTS = ("gcp:projects/iAMMember:IAMMember",)
ACCOUNT_GRANTS = ("gcp:serviceaccount/iAMMember:IAMMember",)
# What only a stack a person deploys makes: the grants on its own accounts, and without
# vpnClientPublicKey the client's key pair (random bytes in that person's state). A GitOps
# stack makes neither (the bootstrap makes the grants; it must bring its client's key).
BY_A_PERSON_ONLY = (*ACCOUNT_GRANTS, "random:index/randomBytes:RandomBytes")
# `gcloud compute tpus <group> <verb>` -> permissions (Cloud TPU REST reference).
GCLOUD_TPU_NEEDS = {
    ("tpu-vm", "describe"): ("tpu.nodes.get",),
    ("tpu-vm", "list"): ("tpu.nodes.list",),
    ("tpu-vm", "create"): ("tpu.nodes.create", "tpu.operations.get"),
    ("tpu-vm", "delete"): ("tpu.nodes.delete", "tpu.operations.get"),
    # The boot state (watch-common.sh vm_failure). Cloud TPU's permission list has no
    # permission of its own for nodes.getGuestAttributes: read as tpu.nodes.get (not checked
    # on GCP).
    ("tpu-vm", "get-guest-attributes"): ("tpu.nodes.get",),
    ("queued-resources", "create"): ("tpu.queuedResources.create", "tpu.operations.get"),
    ("queued-resources", "describe"): ("tpu.queuedResources.get",),
    ("queued-resources", "list"): ("tpu.queuedResources.list",),
    ("queued-resources", "delete"): ("tpu.queuedResources.delete", "tpu.operations.get"),
}


@pytest.fixture(scope="module")
def bootstrap_run() -> Run:
    return run_bootstrap({"gcp:project": PROJECT})


def _roles(run: Run) -> dict[str, set[str]]:
    return {
        r.inputs["roleId"]: set(r.inputs["permissions"])
        for r in run.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
    }


def _deploy_bindings(run: Run) -> list[tuple[str, str | None]]:
    """(role id, condition expression or None) of every binding of the deploy account."""
    return [
        (b.inputs["role"].rsplit("/", 1)[-1], (b.inputs.get("condition") or {}).get("expression"))
        for b in run.of_type("gcp:projects/iAMMember:IAMMember")
        if "tpu-pretrain-deploy@" in b.inputs["member"]
    ]


def _account_grants(run: Run) -> dict[str, str]:
    """Service account (resource name) -> role id the deploy account holds on it."""
    return {
        b.inputs["serviceAccountId"]: b.inputs["role"].rsplit("/", 1)[-1]
        for b in run.of_type("gcp:serviceaccount/iAMMember:IAMMember")
        if "tpu-pretrain-deploy@" in b.inputs["member"]
    }


def _deploy_permissions(run: Run) -> tuple[set[str], set[str]]:
    """(unconditional, scoped) permissions of the deploy account: project bindings without a
    condition; conditional project bindings and grants on single accounts."""
    roles = _roles(run)
    plain: set[str] = set()
    conditional: set[str] = set()
    for role_id, condition in _deploy_bindings(run):
        (conditional if condition else plain).update(roles[role_id])
    for role_id in _account_grants(run).values():
        conditional.update(roles[role_id])
    return plain, conditional


def _condition_of(run: Run, role_id: str) -> str:
    [condition] = [c for r, c in _deploy_bindings(run) if r == role_id]
    assert condition, role_id
    return condition


def _grantable(expression: str) -> set[str]:
    match = re.search(
        r"api\.getAttribute\('iam\.googleapis\.com/modifiedGrantsByRole', \[\]\)"
        r"\.hasOnly\(\[(.*)\]\)$",
        expression,
    )
    assert match, expression
    return set(re.findall(r"'([^']+)'", match.group(1)))


def _variants() -> list[tuple[str, dict[str, object]]]:
    return (
        [(s, {}) for s in stack_names()]
        + [(s, {"tpu-pretrain:tpuAutoRecover": not_default}) for s, not_default in _flipped()]
        # Dataflow (off by default): one TPU and one GPU stack with it on.
        + [(s, {"tpu-pretrain:dataflow": True}) for s in DATAFLOW_STACKS]
        # Alerts (off by default): one TPU and one GPU stack with an address.
        + [(s, {"tpu-pretrain:alertEmails": ["ops@example.com"]}) for s in ALERT_STACKS]
    )


DATAFLOW_STACKS = ("v3-euw4", "t4-usc1")
ALERT_STACKS = ("v6e-euw4", "l4x2-use1")


def _flipped() -> list[tuple[str, bool]]:
    """Each stack with tpuAutoRecover set against its default (on-demand: on, spot: off)."""
    result = []
    for stack in tpu_stack_names():
        recovery = any(r.type_ == "tpu-pretrain:index:TpuAutoRecovery" for r in _run(stack))
        result.append((stack, not recovery))
    return result


def _run(stack: str, overrides: dict[str, object] | None = None, *, gitops: bool = True):
    """The stack as the deploy account deploys it (a GitOps stack), or with gitops=False as
    a person deploys it (the stack creates its own accounts and the grants on them). Each
    variant runs once per session: the tests here read the same runs."""
    # As JSON text: a cache key, whatever the values (alertEmails is a list).
    return list(_cached_run(stack, json.dumps(overrides or {}, sort_keys=True), gitops))


@functools.cache
def _cached_run(stack: str, overrides: str, gitops: bool):
    config = {"gcp:project": PROJECT, **(GITOPS if gitops else {}), **json.loads(overrides)}
    return tuple(run_offline(stack, config).resources)


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_the_deploy_account_can_deploy_every_resource(stack, overrides, bootstrap_run) -> None:
    plain, conditional = _deploy_permissions(bootstrap_run)
    held = plain | conditional
    missing: dict[str, list[str]] = {}
    for resource in _run(stack, overrides):
        if resource.type_.startswith("tpu-pretrain:"):
            continue
        assert resource.type_ in NEEDS, (
            f"{resource.type_}: add it to PERMISSIONS_BY_TYPE (infra/bootstrap/deploy_permissions"
            ".py) and to the policy pack's allowlist"
        )
        needs = set(NEEDS[resource.type_])
        if needs - held:
            missing[resource.name] = sorted(needs - held)
    assert missing == {}


def test_the_deployer_role_is_derived_from_the_table(bootstrap_run) -> None:
    """Nothing in the deployer role that no resource type needs; the escalating permissions
    only in the conditional roles; the pack's list for the role is the same list."""
    deployer = _roles(bootstrap_run)[bootstrap_roles.DEPLOYER_ROLE_ID]
    table = {p for needs in NEEDS.values() for p in needs}
    assert deployer == table - bootstrap_roles.CONDITIONAL_PERMISSIONS
    assert deployer == set(allowlist.DEPLOYER_PERMISSIONS)
    plain, conditional = _deploy_permissions(bootstrap_run)
    assert plain == deployer
    assert conditional == set(bootstrap_roles.CONDITIONAL_PERMISSIONS)
    # Nothing the deployer holds unconditionally lets it act as, or mint credentials for,
    # another identity, write a project's or account's IAM policy, or edit a role.
    escalating = {
        p
        for p in plain
        if p.startswith(("iam.roles.", "iam.serviceAccountKeys."))
        or p
        in {
            "iam.serviceAccounts.actAs",
            "iam.serviceAccounts.getAccessToken",
            "iam.serviceAccounts.signBlob",
            "iam.serviceAccounts.signJwt",
            "iam.serviceAccounts.implicitDelegation",
            "iam.serviceAccounts.setIamPolicy",
            "resourcemanager.projects.setIamPolicy",
        }
    }
    assert escalating == set()


def test_the_pack_knows_every_custom_role_of_the_bootstrap(bootstrap_run) -> None:
    assert {k: set(v) for k, v in allowlist.BOOTSTRAP.custom_roles.items()} == _roles(bootstrap_run)


def test_the_program_s_types_are_the_table_s_types() -> None:
    """The permission table and the pack's allowlist name the same cloud resource types,
    and both are exactly what the program creates (no stale entry)."""
    created = {
        r.type_
        for stack, overrides in _variants()
        for r in _run(stack, overrides)
        if not r.type_.startswith("tpu-pretrain:")
    }
    assert created == set(NEEDS)
    # A stack a person deploys also writes its accounts' allow policies (the deploy account
    # never does: no iam.serviceAccounts.setIamPolicy in the table) and may make its client's
    # key pair.
    by_a_person = {
        r.type_
        for stack, overrides in _variants()
        for r in _run(stack, overrides, gitops=False)
        if not r.type_.startswith("tpu-pretrain:")
    }
    assert by_a_person - created == set(BY_A_PERSON_ONLY)
    pack_cloud_types = {
        t for t in allowlist.MAIN.types if not t.startswith(("tpu-pretrain:", "pulumi:"))
    }
    assert pack_cloud_types == set(NEEDS) | set(BY_A_PERSON_ONLY)


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_the_deploy_account_may_grant_every_role_the_program_grants(
    stack, overrides, bootstrap_run
) -> None:
    resources = _run(stack, overrides)
    on_project = {(r.name, r.inputs["role"]) for r in resources if r.type_ in PROJECT_GRANTS}
    on_accounts = {
        (r.name, r.inputs["role"], r.inputs["serviceAccountId"])
        for r in resources
        if r.type_ in ACCOUNT_GRANTS
    }
    assert on_project, "the program grants project roles; the check must see them"
    project_roles = _grantable(_condition_of(bootstrap_run, bootstrap_roles.IAM_GRANTER_ROLE_ID))
    assert {(n, role) for n, role in on_project if role not in project_roles} == set()
    # On an account: nothing. The deploy account may not write an account's allow policy
    # (it could grant any role there: IAM documents modifiedGrantsByRole for projects,
    # folders and organizations only); the bootstrap makes those grants.
    assert on_accounts == set()


def test_the_grantable_roles_are_exactly_those_the_program_grants(bootstrap_run) -> None:
    """No spare role in the grant condition: each is granted by some stack variant. The
    grants a stack made by a person makes on its own accounts are the ones the bootstrap
    makes for the GitOps stacks: the controller's actAs on the TPU VM's and the Dataflow
    workers' accounts, and nothing else."""
    project_roles: set[str] = set()
    by_a_person: set[tuple[str, str, str]] = set()
    for stack, overrides in _variants():
        for r in _run(stack, overrides):
            if r.type_ in PROJECT_GRANTS:
                project_roles.add(r.inputs["role"])
        for r in _run(stack, overrides, gitops=False):
            if r.type_ in ACCOUNT_GRANTS:
                suffix = r.inputs["serviceAccountId"].split("@")[0].rsplit("-", 1)[-1]
                member = r.inputs["member"].split("@")[0].rsplit("-", 1)[-1]
                by_a_person.add((member, r.inputs["role"], suffix))
    granter = _grantable(_condition_of(bootstrap_run, bootstrap_roles.IAM_GRANTER_ROLE_ID))
    assert granter == project_roles
    assert "roles/iam.serviceAccountUser" not in granter, "project-wide actAs for anyone"
    assert by_a_person == {
        ("controller", bootstrap_roles.SERVICE_ACCOUNT_USER, target)
        for target in bootstrap_roles.CONTROLLER_ACTS_AS
    }


def test_act_as_covers_the_stacks_accounts_and_nothing_else(bootstrap_run) -> None:
    """The deploy account may act as every account a stack creates, and as no other: not
    the default compute or App Engine accounts, not the CI accounts, not another project's.
    It holds actAs only through grants on single accounts, each a stack's own."""
    held = _account_grants(bootstrap_run)
    created = {
        f"projects/{PROJECT}/serviceAccounts/{r.inputs['accountId']}@{PROJECT}"
        ".iam.gserviceaccount.com"
        for stack, overrides in _variants()
        for r in _run(stack, overrides)
        if r.type_ == "gcp:serviceaccount/account:Account"
    }
    # three per stack, and the Dataflow worker account of the stacks with Dataflow on
    assert len(created) == 3 * len(stack_names()) + len(DATAFLOW_STACKS)
    assert created <= set(held), sorted(created - set(held))
    stack_account = re.compile(
        rf"projects/{PROJECT}/serviceAccounts/tp-[a-z0-9-]+-"
        rf"(workload|controller|vpn-hop|dataflow)@{PROJECT}\.iam\.gserviceaccount\.com"
    )
    assert [a for a in held if not stack_account.fullmatch(a)] == []
    assert set(held.values()) == {bootstrap_roles.STACK_ACCOUNT_USER_ROLE_ID}
    plain, _ = _deploy_permissions(bootstrap_run)
    assert "iam.serviceAccounts.actAs" not in plain


def test_vm_changes_cover_the_stacks_vms_and_nothing_else(bootstrap_run) -> None:
    condition = _condition_of(bootstrap_run, bootstrap_roles.STACK_INSTANCE_ROLE_ID)
    instance = "compute.googleapis.com/Instance"
    vms = {
        f"projects/{PROJECT}/zones/{r.inputs['zone']}/instances/{r.inputs['name']}"
        for stack, overrides in _variants()
        for r in _run(stack, overrides)
        if r.type_ == "gcp:compute/instance:Instance"
    }
    # controller and hop in every stack, and a GPU stack's GPU VM
    assert len(vms) == 2 * len(stack_names()) + len(gpu_stack_names())
    assert [vm for vm in vms if not evaluate(condition, instance, vm)] == []
    for kind, other in (
        (instance, f"projects/{PROJECT}/zones/europe-west4-a/instances/build-runner"),
        (instance, f"projects/{PROJECT}/zones/europe-west4-a/instances/gke-pool-1-abc"),
        ("compute.googleapis.com/Disk", f"projects/{PROJECT}/zones/europe-west4-a/disks/tp-x"),
    ):
        assert not evaluate(condition, kind, other), other
    # Every permission that acts on an instance is behind this condition.
    plain, _ = _deploy_permissions(bootstrap_run)
    assert not {p for p in plain if p.startswith("compute.instances.")}


def test_the_stack_account_names_match_the_program() -> None:
    sys.path.insert(0, str(ROOT))
    from infra.config import config

    assert tuple(f"-{s}" for s in bootstrap_roles.STACK_ACCOUNT_SUFFIXES) == (
        config.SERVICE_ACCOUNT_SUFFIXES
    )
    assert allowlist.STACK_ACCOUNT_ROLES == bootstrap_roles.STACK_ACCOUNT_SUFFIXES


def test_the_deploy_account_cannot_edit_any_role(bootstrap_run) -> None:
    """It may grant the recovery role, so it must not be able to change what it contains."""
    plain, conditional = _deploy_permissions(bootstrap_run)
    assert not {p for p in plain | conditional if p.startswith("iam.roles.")}


def test_the_recovery_role_is_the_bootstrap_role_the_program_binds(bootstrap_run) -> None:
    sys.path.insert(0, str(ROOT))
    from infra.components.recovery import recovery_role_name

    roles = {
        r.inputs["roleId"]: r
        for r in bootstrap_run.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
    }
    bound = recovery_role_name(PROJECT)
    assert bound.rsplit("/", 1)[-1] in roles
    assert bound in _grantable(_condition_of(bootstrap_run, bootstrap_roles.IAM_GRANTER_ROLE_ID))


def test_the_recovery_role_covers_what_the_watchdog_runs(bootstrap_run) -> None:
    """Derived from the watchdog script itself: every `gcloud compute tpus` verb it calls."""
    recovery = set(bootstrap_run.named("tpu-recovery-role").inputs["permissions"])
    script = (ROOT / "infra" / "render" / "templates" / "tpu-watch.sh").read_text()
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


# `gcloud compute instances <verb>` -> the permissions it needs (Compute Engine REST
# reference: instances.get, instances.start; --async: no zone-operation polling).
GCLOUD_INSTANCE_NEEDS = {
    "describe": ("compute.instances.get",),
    "start": ("compute.instances.start",),
    "get-guest-attributes": ("compute.instances.getGuestAttributes",),
    "stop": ("compute.instances.stop",),
}


def test_the_gpu_recovery_role_is_exactly_what_the_gpu_watchdog_runs(bootstrap_run) -> None:
    """Derived from the GPU watchdog itself: every `gcloud compute instances` verb it calls,
    and nothing more (no create, delete, setMetadata, actAs)."""
    sys.path.insert(0, str(ROOT))
    from infra.components.recovery import gpu_recovery_role_name

    role = bootstrap_run.named("gpu-recovery-role").inputs
    assert role["roleId"] == gpu_recovery_role_name(PROJECT).rsplit("/", 1)[-1]
    assert gpu_recovery_role_name(PROJECT) in _grantable(
        _condition_of(bootstrap_run, bootstrap_roles.IAM_GRANTER_ROLE_ID)
    )
    script = (ROOT / "infra" / "render" / "templates" / "gpu-watch.sh").read_text()
    verbs = set(
        re.findall(r"(?:gcloud_once|vm_state|vm_failure) compute instances ([a-z-]+)", script)
    )
    assert verbs == {"describe", "start", "get-guest-attributes", "stop"}
    needs = {p for verb in verbs for p in GCLOUD_INSTANCE_NEEDS[verb]}
    assert set(role["permissions"]) == needs
    assert "--async" in re.search(r"gcloud_once compute instances start .*", script).group(0)


def test_the_documented_command_creates_the_same_recovery_role(bootstrap_run) -> None:
    """Without GitOps, the one-time gcloud command in the docs (Deploy on GCP, Prerequisites)
    makes each recovery role the bootstrap would: same id, same permissions."""
    documented = {
        role_id: sorted(permissions.split(","))
        for role_id, permissions in re.findall(
            r"gcloud iam roles create (\w+) --project <id> .*?--permissions ([a-zA-Z.,]+)`",
            doc_text(),
        )
    }
    roles = [bootstrap_run.named(n).inputs for n in ("tpu-recovery-role", "gpu-recovery-role")]
    assert documented == {r["roleId"]: sorted(r["permissions"]) for r in roles}


def test_the_documented_commands_create_the_same_dataflow_roles(bootstrap_run) -> None:
    """Without GitOps, the one-time gcloud commands of the Dataflow section (Deploy on GCP)
    make the launcher's and the workers' roles the bootstrap would. Granted on the project,
    the workers' role reaches no object and no VM there (Dataflow's service, not its
    workers, creates and deletes the worker VMs: bootstrap_roles.py)."""
    documented = {
        role_id: sorted(permissions.split(","))
        for role_id, permissions in re.findall(
            r"gcloud iam roles create (tpuPretrainDataflow\w+) --project <project> "
            r".*?--permissions ([a-zA-Z.,]+)",
            doc_text(),
        )
    }
    roles = [
        bootstrap_run.named(n).inputs for n in ("dataflow-launcher-role", "dataflow-worker-role")
    ]
    assert documented == {r["roleId"]: sorted(r["permissions"]) for r in roles}
    worker = bootstrap_run.named("dataflow-worker-role").inputs["permissions"]
    assert [p for p in worker if p.startswith(("compute.", "storage.objects."))] == []
