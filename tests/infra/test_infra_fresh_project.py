"""A first `pulumi up` in a fresh project: what the program's own resources need from the
project (APIs, name lengths) checked on the resources it registers under Pulumi's mocks."""

from __future__ import annotations

import re

import pytest
from harness import of_type, run_offline, stack_names, tpu_stack_names

from infra.config.config import MAX_STACK_NAME, SERVICE_ACCOUNT_ID_MAX

# Which API serves each pulumi-gcp module (the middle of "gcp:<module>/<resource>:<Type>").
# Providers that run locally (random, time) call no Google API. A resource type of a module
# missing here fails the test below: add its API to the program's list and to this table.
API_OF_MODULE = {
    "compute": "compute.googleapis.com",
    "tpu": "tpu.googleapis.com",
    "storage": "storage.googleapis.com",
    "serviceaccount": "iam.googleapis.com",
    # Notification channels and alert policies (tpu-pretrain:alertEmails): Cloud Monitoring's
    # projects.notificationChannels and projects.alertPolicies.
    "monitoring": "monitoring.googleapis.com",
    # projects.IAMMember reads/writes the project's IAM policy through Resource Manager
    # (projects.getIamPolicy/setIamPolicy); projects.Service goes through Service Usage.
    "projects/iAMMember": "cloudresourcemanager.googleapis.com",
    "projects/service": "serviceusage.googleapis.com",
}
LOCAL_PROVIDERS = ("random:", "time:")
_SA_ID = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")  # IAM accountId: 6-30 characters


def _api_of(resource_type: str) -> str | None:
    if resource_type.startswith(LOCAL_PROVIDERS):
        return None
    provider, module_path, _ = resource_type.split(":")
    assert provider == "gcp", resource_type
    module, resource = module_path.split("/")
    return API_OF_MODULE.get(f"{module}/{resource}") or API_OF_MODULE[module]


def _variants() -> list[tuple[str, dict[str, object]]]:
    """Every stack, each TPU stack with the watchdog on (its resources differ), and a TPU and
    a GPU stack with alerts."""
    return (
        [(s, {}) for s in stack_names()]
        + [(s, {"tpu-pretrain:tpuAutoRecover": True}) for s in tpu_stack_names()]
        + [(s, {"tpu-pretrain:alertEmails": ["ops@example.com"]}) for s in ("v3-euw4", "t4-usc1")]
    )


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_every_resource_type_has_its_api_enabled_by_the_stack(stack, overrides):
    run = run_offline(stack, overrides)
    enabled = {r.inputs["service"] for r in of_type(run.resources, "gcp:projects/service:Service")}
    types = {r.type_ for r in run.resources if not r.type_.startswith("tpu-pretrain:")}
    needed = {api for api in map(_api_of, types) if api}
    assert needed <= enabled, f"not enabled: {sorted(needed - enabled)}"
    # The APIs are enabled before anything that uses them: every Google resource outside the
    # API component depends on it (directly or through its parent component).
    services = {r.urn for r in of_type(run.resources, "gcp:projects/service:Service")}
    by_urn = {r.urn: r for r in run.resources}
    apis_component = next(r.urn for r in run.resources if r.name == "apis")

    def waits_for_apis(urn: str) -> bool:
        resource = by_urn[urn]
        deps = set(resource.options.get("dependencies", []))
        if apis_component in deps or deps & services:
            return True
        parent = resource.options.get("parent")
        return bool(parent) and parent in by_urn and waits_for_apis(parent)

    for resource in run.resources:
        if resource.type_.startswith("tpu-pretrain:") or resource.urn in services:
            continue
        if not _api_of(resource.type_):
            continue
        assert waits_for_apis(resource.urn) or _depends_on_a_waiting(resource, by_urn), (
            resource.name
        )


def _depends_on_a_waiting(resource, by_urn) -> bool:
    """Bucket objects take the bucket's name as input: they wait for the bucket (which waits
    for the APIs) through that dependency."""
    return any(
        dep in by_urn and by_urn[dep].type_ == "gcp:storage/bucket:Bucket"
        for dep in resource.options.get("dependencies", [])
    )


def test_the_longest_stack_name_fits_every_service_account_id():
    name = "s" + "1" * (MAX_STACK_NAME - 1)
    run = run_offline("v6e-euw4", stack_name=name)
    ids = [
        r.inputs["accountId"] for r in of_type(run.resources, "gcp:serviceaccount/account:Account")
    ]
    assert len(ids) == 3
    assert max(map(len, ids)) == SERVICE_ACCOUNT_ID_MAX  # the limit is tight, not generous
    for account_id in ids:
        assert _SA_ID.fullmatch(account_id), account_id


@pytest.mark.parametrize("name", ["s" + "1" * MAX_STACK_NAME, "Prod", "a_b", "x-"])
def test_a_stack_name_that_cannot_fit_is_a_one_line_error(name):
    message = _stack_name_error(name)
    assert message.startswith(f"stack name {name!r}: use lowercase letters, digits and '-'")
    assert f"at most {MAX_STACK_NAME} characters" in message
    assert "service account ids" in message


def _stack_name_error(name: str) -> str:
    from infra.errors import ConfigError

    try:
        run_offline("v6e-euw4", stack_name=name)
    except ConfigError as error:
        assert "\n" not in str(error)
        return str(error)
    raise AssertionError(f"stack name {name!r} was accepted")


def _seconds(duration: str) -> int:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return int(match.group(1))


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_every_vm_waits_for_its_service_account_to_settle(stack, overrides):
    """Each VM (TPU VM, controller, hop) is created at least 60 s after the service account it
    runs as (Google's tpu_v2_vm_full example waits 60 s for IAM's eventual consistency)."""
    run = run_offline(stack, overrides)
    accounts = {
        r.outputs["email"]: r.urn
        for r in of_type(run.resources, "gcp:serviceaccount/account:Account")
    }
    sleeps = of_type(run.resources, "time:index/sleep:Sleep")
    vms = of_type(run.resources, "gcp:compute/instance:Instance") + of_type(
        run.resources, "gcp:tpu/v2Vm:V2Vm"
    )
    assert len(vms) == 3
    for vm in vms:
        account = accounts[vm.inputs["serviceAccount"]["email"]]
        waits = [
            s
            for s in sleeps
            if account in s.options["dependencies"]
            and s.urn in vm.options["dependencies"]
            and _seconds(s.inputs["createDuration"]) >= 60
        ]
        assert waits, f"{vm.name} does not wait after creating its service account"
        # A re-created account (new email) waits again.
        assert all(
            vm.inputs["serviceAccount"]["email"] in s.inputs["triggers"].values() for s in waits
        )


BUCKET = "gcp:storage/bucket:Bucket"


def _bucket(stack: str, existing: frozenset[str] = frozenset(), overrides=None):
    run = run_offline(stack, overrides, existing_buckets=existing)
    (bucket,) = of_type(run.resources, BUCKET)
    return bucket


@pytest.mark.parametrize("stack", stack_names())
def test_up_after_destroy_adopts_the_kept_bucket(stack):
    """`destroy` keeps the bucket; the next `up` finds it in the project and imports it (then
    applies the program's settings) instead of failing to create it with 409."""
    fresh = _bucket(stack)
    name = fresh.inputs["name"]
    assert fresh.options["importId"] is None  # a fresh project: created
    kept = _bucket(stack, frozenset({name, f"{name}-archive"}))
    assert kept.options["importId"] == name  # the provider's id of a bucket is its name
    assert kept.inputs == fresh.inputs  # the program's settings, applied after the import
    assert kept.options["retainOnDelete"] is True  # and kept again by the next destroy


def test_a_bucket_that_only_shares_the_prefix_is_not_adopted():
    name = _bucket("v3-euw4").inputs["name"]
    assert _bucket("v3-euw4", frozenset({f"{name}-old", name[:-1]})).options["importId"] is None


def _iam_resources(run) -> list:
    """Every IAM grant the program registers: pulumi-gcp's *IAMMember / *IamMember /
    *IAMBinding / *IamBinding types (project, bucket, service account, ...)."""
    return [r for r in run.resources if re.search(r":(\w*(IAM|Iam)(Member|Binding))$", r.type_)]


@pytest.mark.parametrize(("stack", "overrides"), _variants())
def test_every_iam_grant_naming_a_new_service_account_waits_for_its_settle(stack, overrides):
    """A grant to (or on) a service account created seconds earlier fails like a VM would:
    every IAM member/binding whose member or target is one of the program's new accounts
    depends on that account's settle (at least 60 s after it is created)."""
    run = run_offline(stack, overrides)
    accounts = of_type(run.resources, "gcp:serviceaccount/account:Account")
    settle_of = {}
    for sleep in of_type(run.resources, "time:index/sleep:Sleep"):
        (account,) = [a for a in accounts if a.urn in sleep.options["dependencies"]]
        assert _seconds(sleep.inputs["createDuration"]) >= 60
        settle_of[account.outputs["email"]] = sleep.urn
        settle_of[account.outputs["name"]] = sleep.urn
    assert len(settle_of) == 2 * len(accounts) == 6  # one settle per account
    grants = _iam_resources(run)
    naming = 0
    for grant in grants:
        names = {grant.inputs.get("member", ""), grant.inputs.get("serviceAccountId", "")}
        emails = {n.removeprefix("serviceAccount:") for n in names if n}
        settles = {settle_of[e] for e in emails if e in settle_of}
        if not settles:
            continue
        naming += 1
        missing = settles - set(grant.options["dependencies"])
        assert not missing, f"{grant.name} ({grant.type_}) does not wait for {missing}"
    # Reporting roles (2 per account), the bucket (read and write for 2 accounts: 4), and
    # with the TPU watchdog its project role and its act-as on the TPU VM's account (2), with
    # the GPU watchdog its conditional project role (1): all of them.
    types = {r.type_ for r in run.resources}
    watchdog = 2 * ("tpu-pretrain:index:TpuAutoRecovery" in types) + (
        "tpu-pretrain:index:GpuAutoRecovery" in types
    )
    assert naming == len(grants) == 2 * len(accounts) + 4 + watchdog, [g.name for g in grants]


@pytest.mark.parametrize("stack", ["v6e-euw4", "t4-usc1"])
def test_every_stack_account_is_adopted_so_the_bootstraps_act_as_grant_holds(stack):
    """In a GitOps project the bootstrap creates each stack's accounts and grants the deploy
    account actAs on each one's own allow policy (IAM conditions cannot name accounts); the
    program adopts an existing account instead of failing on it, and never grants actAs to
    anyone but its own controller (the grants on its accounts are the program's, none to the
    deploy account)."""
    run = run_offline(stack, {"tpu-pretrain:tpuAutoRecover": True} if stack[0] == "v" else None)
    accounts = of_type(run.resources, "gcp:serviceaccount/account:Account")
    assert accounts
    assert all(a.inputs["createIgnoreAlreadyExists"] is True for a in accounts)
    grants = of_type(run.resources, "gcp:serviceaccount/iAMMember:IAMMember")
    assert all(
        g.inputs["member"].startswith(f"serviceAccount:tp-{stack}-controller@") for g in grants
    )
