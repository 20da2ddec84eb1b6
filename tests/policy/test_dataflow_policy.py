"""The pack and Dataflow (tpu-pretrain:dataflow): a stack with it on passes with zero
violations, and each of its grants and its firewall rule, widened by one step, is refused
by the rule that guards it (policy/allowlist.py: the Dataflow grants name one member, and
actAs on the worker account exists only as a grant on that account)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from policy_harness import Violation, run_pack, urn_for
from stacks_harness import Resource, resources

from policy import network

ON = {"tpu-pretrain:dataflow": True}
STACK = "v3-euw4"
PROJECT = "tpu-pretrain-test"  # the offline harness's project
WORKER = f"tp-{STACK}-dataflow@{PROJECT}.iam.gserviceaccount.com"
CONTROLLER = f"serviceAccount:tp-{STACK}-controller@{PROJECT}.iam.gserviceaccount.com"
WORKLOAD = f"serviceAccount:tp-{STACK}-workload@{PROJECT}.iam.gserviceaccount.com"


@pytest.mark.parametrize("stack", [STACK, "t4-usc1", "v6e-euw4"])
def test_a_stack_with_dataflow_passes(stack: str) -> None:
    stack_resources = resources(stack, ON)
    names = {name for _, name, _, _ in stack_resources}
    # The pack really sees the Dataflow resources (or zero violations means nothing).
    assert {
        "dataflow-worker",
        "dataflow-launcher-acts-as-worker",
        "dataflow-allow-workers",
        "dataflow-launcher-reads",
    } <= names
    assert run_pack(stack_resources) == []


def _edited(name: str, change: Callable[[dict[str, Any]], None]) -> tuple[list[Violation], str]:
    """The stack with Dataflow on, one of its resources edited; (violations, its urn)."""
    stack_resources = resources(STACK, ON)
    [target] = [r for r in stack_resources if r[1] == name]
    change(target[2])
    return run_pack(stack_resources), target[3]


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda props: props.update(values)


WIDENED = {
    "worker-role-to-the-controller": ("dataflow-worker", _set(member=CONTROLLER)),
    "worker-role-to-the-workload": ("dataflow-worker", _set(member=WORKLOAD)),
    "worker-gets-dataflow-admin": ("dataflow-worker", _set(role="roles/dataflow.admin")),
    "worker-gets-bucket-admin": (
        "dataflow-worker-objects-read",
        _set(role="roles/storage.admin"),
    ),
    "worker-bucket-role-to-the-workload": (
        "dataflow-worker-objects-read",
        _set(member=WORKLOAD, role="roles/storage.objectAdmin"),
    ),
    "worker-gets-the-predefined-worker-role": (
        "dataflow-worker",
        _set(role="roles/dataflow.worker"),
    ),
    "launcher-role-to-the-worker": (
        "dataflow-launcher",
        _set(member=f"serviceAccount:{WORKER}"),
    ),
    "launcher-role-to-the-workload": ("dataflow-launcher", _set(member=WORKLOAD)),
    "launcher-gets-dataflow-admin": ("dataflow-launcher", _set(role="roles/dataflow.admin")),
    "act-as-worker-to-the-workload": ("dataflow-launcher-acts-as-worker", _set(member=WORKLOAD)),
    "act-as-worker-to-a-user": (
        "dataflow-launcher-acts-as-worker",
        _set(member="user:someone@example.com"),
    ),
    "act-as-another-stacks-worker": (
        "dataflow-launcher-acts-as-worker",
        _set(
            serviceAccountId=f"projects/{PROJECT}/serviceAccounts/"
            f"tp-other-dataflow@{PROJECT}.iam.gserviceaccount.com"
        ),
    ),
    "launcher-reads-to-the-worker": (
        "dataflow-launcher-reads",
        _set(member=f"serviceAccount:{WORKER}"),
    ),
    "launcher-reads-become-the-deployer-role": (
        "dataflow-launcher-reads",
        _set(role=f"projects/{PROJECT}/roles/tpuPretrainDeployer"),
    ),
    "act-as-worker-becomes-token-creator": (
        "dataflow-launcher-acts-as-worker",
        _set(role="roles/iam.serviceAccountTokenCreator"),
    ),
}


@pytest.mark.parametrize(("name", "change"), WIDENED.values(), ids=list(WIDENED))
def test_a_widened_dataflow_grant_is_refused(
    name: str, change: Callable[[dict[str, Any]], None]
) -> None:
    violations, urn = _edited(name, change)
    assert violations, f"{name}: the widened grant was accepted"
    assert {v.urn for v in violations} == {urn}, violations
    policies = {v.policy for v in violations}
    # The grant allowlist refuses each; some also break another rule (an admin role to an
    # account, a grant on an account the stack does not create).
    assert "allowed-iam-grants" in policies, violations
    assert policies <= {
        "allowed-iam-grants",
        "no-public-principals",
        "no-basic-or-admin-roles-for-service-accounts",
        "grants-on-own-resources",
        # a role that writes objects (on the bucket without the condition, or on the project)
        "vm-accounts-write-no-executables",
    }


def _extra(type_: str, props: dict[str, Any]) -> Resource:
    return type_, "extra", props, urn_for(type_, "extra", stack=STACK)


def test_act_as_granted_on_the_project_is_refused() -> None:
    """serviceAccountUser exists only as a grant on the worker account: on the project it
    would let the controller act as every account of the project."""
    extra = _extra(
        "gcp:projects/iAMMember:IAMMember",
        {"project": PROJECT, "role": "roles/iam.serviceAccountUser", "member": CONTROLLER},
    )
    violations = run_pack([*resources(STACK, ON), extra])
    # Acting as every account of the project is also a way to write what a VM runs.
    assert [v.policy for v in violations] == [
        "allowed-iam-grants",
        "vm-accounts-write-no-executables",
    ]
    assert "roles/iam.serviceAccountUser" in violations[0].message


@pytest.mark.parametrize("role", ["roles/artifactregistry.reader", "roles/artifactregistry.writer"])
def test_artifact_registry_roles_on_the_project_are_refused(role: str) -> None:
    """The image is read on the stack's repository only: on the project the worker account
    would read every repository of the project."""
    extra = _extra(
        "gcp:projects/iAMMember:IAMMember",
        {"project": PROJECT, "role": role, "member": f"serviceAccount:{WORKER}"},
    )
    violations = run_pack([*resources(STACK, ON), extra])
    # A project role the pack does not know to be without object writes is refused by the
    # rule on what a VM runs as well (closed by default).
    assert [v.policy for v in violations] == [
        "allowed-iam-grants",
        "vm-accounts-write-no-executables",
    ]


@pytest.mark.parametrize("role", ["roles/artifactregistry.reader", "roles/artifactregistry.writer"])
def test_a_stack_makes_no_grant_on_a_repository(role: str) -> None:
    """The image's repository and its reader grant are made by the person who builds the
    image (docs/deploy-gcp.md): a repository grant in a stack, to anyone, is refused."""
    extra = _extra(
        "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember",
        {
            "project": PROJECT,
            "location": "europe-west4",
            "repository": f"tp-{STACK}-dataflow",
            "role": role,
            "member": f"serviceAccount:{WORKER}",
        },
    )
    violations = run_pack([*resources(STACK, ON), extra])
    assert "allowed-resource-types" in {v.policy for v in violations}


def test_the_worker_account_gets_no_other_project_role() -> None:
    """Log and metric writing go to the VMs' accounts; the worker account has only the
    worker role (tpuPretrainDataflowWorker) on the project."""
    extra = _extra(
        "gcp:projects/iAMMember:IAMMember",
        {
            "project": PROJECT,
            "role": "roles/logging.logWriter",
            "member": f"serviceAccount:{WORKER}",
        },
    )
    violations = run_pack([*resources(STACK, ON), extra])
    assert [v.policy for v in violations] == ["allowed-iam-grants"]


def test_a_vm_of_the_stack_may_not_run_as_the_worker_account() -> None:
    stack_resources = resources(STACK, ON)
    [controller] = [r for r in stack_resources if r[1] == "controller-vm"]
    controller[2]["serviceAccount"]["email"] = WORKER
    violations = run_pack(stack_resources)
    assert {v.policy for v in violations} == {"vm-accounts-are-stack-accounts"}


@pytest.mark.parametrize("source", ["0.0.0.0/0", "198.51.100.0/24"])  # not the stack's user CIDRs
def test_the_workers_rule_opened_to_public_addresses_is_refused(source: str) -> None:
    violations, urn = _edited("dataflow-allow-workers", _set(sourceRanges=[source]))
    assert {v.policy for v in violations} == {"no-public-ingress"}
    assert all(v.urn == urn for v in violations)
    assert all(v.message.startswith(network.MSG_PUBLIC_INGRESS) for v in violations)
