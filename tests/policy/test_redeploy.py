"""`pulumi destroy` then `pulumi up` of a GitOps stack deploys again, with nothing to re-run.

Both programs run under Pulumi's mocks (the bootstrap, then the stack as "up"); what the
engine and IAM do with their resources between the runs is replayed on a small model of a
project's service accounts, with the documented rules only:

- `pulumi destroy` calls the provider's Delete for every resource of the stack except those
  with `retainOnDelete`, which it only drops from the state (Pulumi, "retainOnDelete");
- an `up` creates an account; with `createIgnoreAlreadyExists` an existing account of that
  id is adopted as it is (pulumi-gcp's google_service_account: a 409 on create reads the
  existing account instead);
- an account's allow policy goes with the account, and an account created again under the
  same id is a new identity: no grant made to or on the old one applies to it (Google,
  "Delete and undelete service accounts"; here: a new unique id);
- a grant on an account names its member; it holds while that member is the same identity.

What only GCP shows (docs/verified-offline-vs-gcp.md): that the deploy account's grant on the
kept account lets it attach that account to the new VMs after the destroy, as before it.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from bootstrap_harness import run_bootstrap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
from harness import GITOPS, run_offline

PROJECT = "tpu-pretrain-example"  # the bootstrap's project (tests/policy/test_bootstrap.py)
ACCOUNT = "gcp:serviceaccount/account:Account"
ACCOUNT_GRANT = "gcp:serviceaccount/iAMMember:IAMMember"
VMS = ("gcp:compute/instance:Instance", "gcp:tpu/v2Vm:V2Vm")
DEPLOY = f"serviceAccount:tpu-pretrain-deploy@{PROJECT}.iam.gserviceaccount.com"
# A TPU stack with its watchdog and Dataflow on: every grant on its accounts is in play.
STACK, SETTINGS = "v3-euw4", {"tpu-pretrain:tpuAutoRecover": True, "tpu-pretrain:dataflow": True}


def _email(name: str) -> str:
    """serviceAccount:<email> or projects/<p>/serviceAccounts/<email> -> <email>."""
    return name.removeprefix("serviceAccount:").rsplit("/", 1)[-1]


@dataclass
class Project:
    """Service accounts by email -> unique id, and each account's allow policy: a set of
    (role, member email, member's unique id when granted)."""

    accounts: dict[str, int] = field(default_factory=dict)
    policies: dict[int, set[tuple[str, str, int]]] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def create(self, email: str, *, adopt: bool) -> int:
        if email in self.accounts:
            assert adopt, f"{email}: 409 already exists"
            return self.accounts[email]
        uid = self.accounts[email] = next(self._ids)
        self.policies[uid] = set()
        return uid

    def delete(self, email: str) -> None:
        uid = self.accounts.pop(email)
        del self.policies[uid]  # its allow policy goes with it

    def grant(self, account: str, role: str, member: str) -> tuple[int, tuple[str, str, int]]:
        uid = self.accounts[_email(account)]  # IAM refuses a grant on a missing account
        binding = (role, _email(member), self.accounts.get(_email(member), 0))
        self.policies[uid].add(binding)
        return uid, binding

    def revoke(self, uid: int, binding: tuple[str, str, int]) -> None:
        self.policies.get(uid, set()).discard(binding)

    def holds(self, member: str, role_suffix: str, account: str) -> bool:
        """Whether `member` (the same identity as now) holds a role ending so on `account`."""
        uid = self.accounts.get(_email(account))
        if uid is None:
            return False
        return any(
            role.endswith(role_suffix) and who == _email(member) and who_uid in (0, self._uid(who))
            for role, who, who_uid in self.policies[uid]
        )

    def _uid(self, email: str) -> int:
        return self.accounts.get(email, -1)


@dataclass
class Stack:
    """A stack's state: what `up` recorded, for `destroy` to undo."""

    deletes: list = field(default_factory=list)


def bootstrap_up(project: Project) -> None:
    run = run_bootstrap({"gcp:project": PROJECT})
    for r in run.of_type(ACCOUNT):
        project.create(f"{r.inputs['accountId']}@{PROJECT}.iam.gserviceaccount.com", adopt=True)
    for r in run.of_type(ACCOUNT_GRANT):
        if r.inputs["serviceAccountId"].rsplit("/", 1)[-1] in project.accounts:
            project.grant(r.inputs["serviceAccountId"], r.inputs["role"], r.inputs["member"])


def stack_up(project: Project, resources: list, stack: Stack) -> None:
    """Accounts first, then the grants on them (the engine orders them by dependency)."""
    for r in resources:
        if r.type_ == ACCOUNT:
            email = r.outputs["email"]
            project.create(email, adopt=bool(r.inputs.get("createIgnoreAlreadyExists")))
            if not r.options.get("retainOnDelete"):
                stack.deletes.append(("account", email))
    for r in resources:
        if r.type_ == ACCOUNT_GRANT:
            uid, binding = project.grant(
                r.inputs["serviceAccountId"], r.inputs["role"], r.inputs["member"]
            )
            if not r.options.get("retainOnDelete"):
                stack.deletes.append(("grant", (uid, binding)))


def stack_destroy(project: Project, stack: Stack) -> None:
    """Grants before the accounts they are on (dependents are deleted first)."""
    for kind, what in sorted(stack.deletes, key=lambda item: item[0] != "grant"):
        if kind == "grant":
            project.revoke(*what)
        elif what in project.accounts:
            project.delete(what)
    stack.deletes.clear()


def deployable(project: Project, resources: list) -> list[str]:
    """What fails on a deploy: a VM whose account the deploy account may not attach
    (actAs, through the bootstrap's grant on that account), and the controller's actAs on
    the TPU VM's (the watchdog recreates it) and the Dataflow workers' account."""
    problems = []
    for r in resources:
        if r.type_ in VMS:
            account = r.inputs["serviceAccount"]["email"]
            if not project.holds(DEPLOY, "/roles/tpuPretrainStackAccountUser", account):
                problems.append(f"{r.name}: 403 iam.serviceAccounts.actAs on {account}")
    types = {r.type_ for r in resources}
    controller = f"tp-{STACK}-controller@{PROJECT}.iam.gserviceaccount.com"
    for component, target in (
        ("tpu-pretrain:index:TpuAutoRecovery", "workload"),
        ("tpu-pretrain:index:DataflowAccess", "dataflow"),
    ):
        account = f"tp-{STACK}-{target}@{PROJECT}.iam.gserviceaccount.com"
        if component in types and not project.holds(
            controller, "roles/iam.serviceAccountUser", account
        ):
            problems.append(f"controller: no actAs on {account}")
    return problems


def _sequence(settings: dict[str, object]) -> tuple[list[str], list[str], dict[str, bool]]:
    """bootstrap up, stack up, stack destroy, stack up: what fails after the first and the
    second `up`, and which accounts are the same identity after the destroy."""
    project = Project()
    bootstrap_up(project)
    resources = run_offline(STACK, {"gcp:project": PROJECT, **SETTINGS, **settings}).resources
    stack = Stack()
    stack_up(project, resources, stack)
    first = deployable(project, resources)
    before = dict(project.accounts)
    stack_destroy(project, stack)
    stack_up(project, resources, stack)  # the same program, run again
    again = deployable(project, resources)
    same = {email: project.accounts.get(email) == uid for email, uid in before.items()}
    return first, again, same


def test_a_gitops_stack_deploys_again_after_its_destroy() -> None:
    first, again, same = _sequence(GITOPS)
    assert first == []
    assert again == []
    stack_accounts = {e: s for e, s in same.items() if e.startswith(f"tp-{STACK}-")}
    assert len(stack_accounts) == 4 and all(stack_accounts.values()), stack_accounts


def test_the_model_sees_the_old_failure_a_stack_that_deletes_the_bootstraps_accounts() -> None:
    """The same sequence with a stack that owns (and so deletes) the accounts the bootstrap
    made: the second `up` recreates them as new identities, without the bootstrap's grants,
    and the deploy fails on actAs, as issue 39 describes. The check above can fail."""
    first, again, same = _sequence({"tpu-pretrain:accountsFromBootstrap": False})
    assert first == []
    assert f"tpu-vm: 403 iam.serviceAccounts.actAs on tp-{STACK}-workload@{PROJECT}" in " ".join(
        again
    )
    assert not same[f"tp-{STACK}-workload@{PROJECT}.iam.gserviceaccount.com"]


@pytest.mark.parametrize("stack", ["v6e-euw4", "t4-usc1"])
def test_a_gitops_stack_keeps_and_never_renames_what_it_adopted(stack: str) -> None:
    """The destroy semantics, read from the resource options: every account a GitOps stack
    registers is retained on delete and never updated in its texts (the bootstrap's), and the
    stack registers no grant on an account (nothing of the bootstrap's for a destroy to
    revoke). The other resources are the stack's own and go with it, but for the bucket and
    the objects a job pointer may name (infra/components/delivery.py KEEP: retained so that
    a VM that read the previous pointer still finds them)."""
    resources = run_offline(stack, {"gcp:project": PROJECT, **GITOPS}).resources
    accounts = [r for r in resources if r.type_ == ACCOUNT]
    assert accounts
    for account in accounts:
        assert account.options["retainOnDelete"] is True, account.name
        assert account.options["ignoreChanges"] == ["displayName", "description"]
        assert account.inputs["createIgnoreAlreadyExists"] is True
    assert [r.name for r in resources if r.type_ == ACCOUNT_GRANT] == []
    kept = {r.name for r in resources if r.options.get("retainOnDelete")}
    delivery = {
        "payload-archive",
        "payload-job-spec",
        "startup-pointer",
        "startup-controller-script",
        "startup-tpu-script",
        "startup-gpu-script",
    }
    assert kept - {r.name for r in accounts} <= {"training-bucket-bucket", *delivery}
