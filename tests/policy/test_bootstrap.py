"""The GitOps bootstrap program (infra/bootstrap) under Pulumi's mocks: its resources'
inputs, its exports (= the repository variables the workflows read), its config errors, and
the policy pack over it."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pulumi
import pytest
import yaml
from bootstrap_harness import (
    BOOTSTRAP,
    PROJECT_NUMBER,
    Registered,
    Run,
    run_bootstrap,
    stack_config,
)
from fake_github import oidc_claims
from iam_cel import evaluate
from policy_harness import run_pack

ROOT = Path(__file__).resolve().parents[2]
# bootstrap_harness put infra/bootstrap (BOOTSTRAP) on sys.path.
import bootstrap_roles  # noqa: E402
import gitops_bootstrap as bootstrap  # noqa: E402
import iam_conditions  # noqa: E402

SA_DOMAIN = "tpu-pretrain-example.iam.gserviceaccount.com"


@pytest.fixture(scope="module")
def run() -> Run:
    return run_bootstrap()


NS = bootstrap.PROJECT_NAME
REPO = "example-org/tpu-pretrain"


def test_state_bucket(run: Run) -> None:
    [bucket] = run.of_type("gcp:storage/bucket:Bucket")
    inputs = bucket.inputs
    assert inputs["name"] == "tpu-pretrain-example-pulumi-state"
    assert inputs["location"] == "EUROPE-WEST4"
    assert inputs["uniformBucketLevelAccess"] is True
    assert inputs["publicAccessPrevention"] == "enforced"
    assert inputs["versioning"] == {"enabled": True}
    assert inputs["forceDestroy"] is False
    assert {
        rule["condition"].get("daysSinceNoncurrentTime") for rule in inputs["lifecycleRules"]
    } == {
        90,
        None,
    }


def test_kms_key_for_stack_secrets(run: Run) -> None:
    [ring] = run.of_type("gcp:kms/keyRing:KeyRing")
    assert ring.inputs["location"] == "europe-west4"
    [key] = run.of_type("gcp:kms/cryptoKey:CryptoKey")
    assert key.inputs["purpose"] == "ENCRYPT_DECRYPT"
    assert key.inputs["rotationPeriod"] == "7776000s"
    assert key.inputs["keyRing"] == (
        "projects/tpu-pretrain-example/locations/europe-west4/keyRings/tpu-pretrain-state"
    )


def test_workload_identity_provider_accepts_only_this_repository(run: Run) -> None:
    """Name AND numeric repository and owner ids: a repository or owner deleted and re-created
    under the same name has new ids, and its tokens are refused."""
    [provider] = run.of_type("gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider")
    assert provider.inputs["attributeCondition"] == (
        f"assertion.repository == '{REPO}' && assertion.repository_id == '987654321'"
        " && assertion.repository_owner_id == '123456'"
        " && (attribute.preview_caller != 'none'"
        f" || assertion.sub == 'repo:{REPO}:environment:gcp-deploy')"
    )
    assert provider.inputs["oidc"] == {"issuerUri": "https://token.actions.githubusercontent.com"}
    mapping = provider.inputs["attributeMapping"]
    assert mapping["google.subject"] == "assertion.sub"
    assert mapping["attribute.repository"] == "assertion.repository"


@pytest.mark.parametrize("key", ["githubRepositoryId", "githubOwnerId"])
def test_numeric_ids_are_required(key: str) -> None:
    with pytest.raises(pulumi.RunError) as error:
        run_bootstrap({f"{NS}:{key}": None})
    assert str(error.value).startswith(f"{NS}:{key} is not set: set it to ")


def test_who_may_impersonate_which_account(run: Run) -> None:
    pool = f"projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/tpu-pretrain-github"
    for caller in ("pull-request-preview", "main-plan"):
        preview = run.named(f"preview-wif-{caller}").inputs
        assert preview["role"] == "roles/iam.workloadIdentityUser"
        assert preview["serviceAccountId"].endswith(f"tpu-pretrain-preview@{SA_DOMAIN}")
        assert preview["member"] == (
            f"principalSet://iam.googleapis.com/{pool}/attribute.preview_caller/{caller}"
        )
    deploy = run.named("deploy-wif").inputs
    assert deploy["serviceAccountId"].endswith(f"tpu-pretrain-deploy@{SA_DOMAIN}")
    # Environment AND branch: one value of the attribute "<subject>@<ref>".
    assert deploy["member"] == (
        f"principalSet://iam.googleapis.com/{pool}/attribute.sub_ref/"
        f"repo:{REPO}:environment:gcp-deploy@refs/heads/main"
    )
    [provider] = run.of_type("gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider")
    assert provider.inputs["attributeMapping"]["attribute.sub_ref"] == (
        "assertion.sub + '@' + assertion.ref"
    )
    # Exactly these three grants of impersonation, nothing broader; every other grant on an
    # account is the deploy account's stack-account role on a stack's own account, or a
    # stack controller's actAs on its own stack's accounts (below).
    on_accounts = run.of_type("gcp:serviceaccount/iAMMember:IAMMember")
    impersonation = [g for g in on_accounts if g.inputs["role"] == "roles/iam.workloadIdentityUser"]
    assert len(impersonation) == 3
    assert {g.inputs["role"] for g in on_accounts if g not in impersonation} == {
        "projects/tpu-pretrain-example/roles/tpuPretrainStackAccountUser",
        "roles/iam.serviceAccountUser",
    }


def test_no_service_account_keys(run: Run) -> None:
    assert run.of_type("gcp:serviceaccount/key:Key") == []


def _project_roles(run: Run, account: str) -> set[str]:
    return {
        r.inputs["role"]
        for r in run.of_type("gcp:projects/iAMMember:IAMMember")
        if r.inputs["member"] == f"serviceAccount:{account}@{SA_DOMAIN}"
    }


def test_preview_account_is_read_only(run: Run) -> None:
    roles = _project_roles(run, "tpu-pretrain-preview")
    assert roles == set(bootstrap_roles.PREVIEW_PROJECT_ROLES)
    assert all(role.endswith(("viewer", "Viewer")) for role in roles)
    bucket_grants = {
        r.inputs["role"]: r.inputs.get("condition")
        for r in run.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
        if "preview" in r.inputs["member"]
    }
    assert bucket_grants == {"roles/storage.objectViewer": None}


GITHUB_IDS = {"repository_id": "987654321", "owner_id": "123456"}
PREVIEW_YML, DEPLOY_YML = ".github/workflows/preview.yml", ".github/workflows/deploy.yml"
PR_REF = "refs/pull/42/merge"
MAIN = "refs/heads/main"


def _token(workflow: str, event: str, ref: str, **kwargs: str) -> dict[str, str]:
    return oidc_claims(REPO, workflow, event, ref, **{**GITHUB_IDS, **kwargs})


# (token's claims, the CI accounts the provider and the bindings let it impersonate)
TOKENS = [
    ("preview on a pull request", _token(PREVIEW_YML, "pull_request", PR_REF), {"preview"}),
    ("plan on a push to main", _token(DEPLOY_YML, "push", MAIN), {"preview"}),
    ("plan run by hand on main", _token(DEPLOY_YML, "workflow_dispatch", MAIN), {"preview"}),
    ("deploy job on main", _token(DEPLOY_YML, "push", MAIN, environment="gcp-deploy"),
     {"deploy"}),
    ("destroy job on main",
     _token(".github/workflows/destroy.yml", "workflow_dispatch", MAIN, environment="gcp-deploy"),
     {"deploy"}),
    # Refused: another workflow, event or branch.
    ("ci on a pull request", _token(".github/workflows/ci.yml", "pull_request", PR_REF), set()),
    ("ci on a push to main", _token(".github/workflows/ci.yml", "push", MAIN), set()),
    ("a new workflow of a branch", _token(".github/workflows/x.yml", "push", "refs/heads/x"),
     set()),
    ("the preview pushed to a branch", _token(PREVIEW_YML, "push", "refs/heads/x"), set()),
    ("the preview by hand on main", _token(PREVIEW_YML, "workflow_dispatch", MAIN), set()),
    ("the preview as pull_request_target", _token(PREVIEW_YML, "pull_request_target", MAIN),
     set()),
    ("the plan run by hand on a branch",
     _token(DEPLOY_YML, "workflow_dispatch", "refs/heads/x"), set()),
    ("the plan on a pull request", _token(DEPLOY_YML, "pull_request", PR_REF), set()),
    ("a deploy job on a branch",
     _token(DEPLOY_YML, "workflow_dispatch", "refs/heads/x", environment="gcp-deploy"), set()),
    ("the preview in another environment",
     _token(PREVIEW_YML, "pull_request", PR_REF, environment="staging"), set()),
    ("the preview of a re-created repository",
     _token(PREVIEW_YML, "pull_request", PR_REF, repository_id="1"), set()),
]  # fmt: skip


@pytest.mark.parametrize(("case", "claims", "accounts"), TOKENS, ids=[t[0] for t in TOKENS])
def test_the_preview_account_serves_the_preview_on_pull_requests_and_the_plan_on_main(
    run: Run, case: str, claims: dict[str, str], accounts: set[str]
) -> None:
    """GitHub's claims for each job, through the provider's attribute mapping and condition
    (evaluated with CEL) to the bindings' principal sets."""
    assert run.accounts_for(claims) == {f"tpu-pretrain-{a}" for a in accounts}


def _jobs_by_account() -> dict[str, list[tuple[str, list[str], str | None]]]:
    """Per CI account variable: (workflow path, its events, the job's environment) of every
    job that authenticates with it."""
    found: dict[str, list[tuple[str, list[str], str | None]]] = {}
    for path in sorted((ROOT / ".github" / "workflows").glob("*.yml")):
        document = yaml.safe_load(path.read_text())
        events = list(document[True])  # YAML 1.1 reads the key `on` as True
        for job in document["jobs"].values():
            text = json.dumps(job)
            for account in ("GCP_PREVIEW_SERVICE_ACCOUNT", "GCP_DEPLOY_SERVICE_ACCOUNT"):
                if f"vars.{account}" in text:
                    workflow = str(path.relative_to(ROOT))
                    found.setdefault(account, []).append((workflow, events, job.get("environment")))
    return found


def test_every_job_that_uses_a_ci_account_gets_it_and_no_other(run: Run) -> None:
    """The workflows as they are: each job that authenticates as an account gets a token
    for it from every event that starts it (on main where the job runs only there), and the
    preview account is used by the preview on pull requests and the plan on main only."""
    jobs = _jobs_by_account()
    assert [(w, e) for w, e, _ in jobs["GCP_PREVIEW_SERVICE_ACCOUNT"]] == [
        (DEPLOY_YML, ["push", "workflow_dispatch"]),
        (PREVIEW_YML, ["pull_request"]),
    ]
    for account, want in (("GCP_PREVIEW_SERVICE_ACCOUNT", "preview"),
                          ("GCP_DEPLOY_SERVICE_ACCOUNT", "deploy")):  # fmt: skip
        for workflow, events, environment in jobs[account]:
            for event in events:
                ref = PR_REF if event == "pull_request" else MAIN
                kwargs = {"environment": environment} if environment else {}
                claims = _token(workflow, event, ref, **kwargs)
                assert f"tpu-pretrain-{want}" in run.accounts_for(claims), (workflow, event)


# What the bootstrap's grants on the state bucket hold on objects (Google's "IAM roles for
# Cloud Storage": objectViewer reads and lists; objectUser creates, reads, updates and deletes).
OBJECT_PERMISSIONS = {
    "roles/storage.objectViewer": {"storage.objects.get", "storage.objects.list"},
    "roles/storage.objectUser": {
        "storage.objects.create", "storage.objects.delete", "storage.objects.get",
        "storage.objects.list", "storage.objects.restore", "storage.objects.update",
    },
}  # fmt: skip
# Creating an object where one exists (overwriting it) takes storage.objects.delete too
# (Google's "IAM permissions for Cloud Storage"): a lock is removed or replaced only so.
LOCK_WRITES = {"storage.objects.create", "storage.objects.delete", "storage.objects.update"}
STATE = "projects/_/buckets/tpu-pretrain-example-pulumi-state/objects/"
# Pulumi's self-managed backend: .pulumi/locks/<org>/<project>/<stack>/<lock id>.json
# (pulumi/pulumi pkg/backend/diy/lock.go lockPath).
DEPLOY_LOCK = STATE + ".pulumi/locks/organization/tpu-pretrain/v6e-euw4/1f0c-lock.json"


def _object_permissions(resources: list[Registered], account: str, name: str) -> set[str]:
    """What `account` may do to the state bucket's object `name`: each of its grants on the
    bucket whose condition (evaluated with CEL) holds for the object."""
    held: set[str] = set()
    for grant in resources:
        if grant.type_ != "gcp:storage/bucketIAMMember:BucketIAMMember":
            continue
        if grant.inputs["member"] != f"serviceAccount:{account}@{SA_DOMAIN}":
            continue
        condition = grant.inputs.get("condition")
        if condition and not evaluate(
            condition["expression"], "storage.googleapis.com/Object", name
        ):
            continue
        held |= OBJECT_PERMISSIONS[grant.inputs["role"]]
    return held


def test_the_preview_account_can_neither_delete_nor_overwrite_a_deploy_lock(run: Run) -> None:
    preview = _object_permissions(run.resources, "tpu-pretrain-preview", DEPLOY_LOCK)
    assert preview == {"storage.objects.get", "storage.objects.list"}
    assert preview & LOCK_WRITES == set()
    # The deploy account takes and removes its own locks (pulumi up, destroy, refresh).
    assert _object_permissions(run.resources, "tpu-pretrain-deploy", DEPLOY_LOCK) >= LOCK_WRITES
    # The check can fail: the previous release's grant (objectUser on the lock prefix, an
    # IAM condition that holds for the deploy's lock) let the preview delete it.
    lock_prefix = Registered(
        "gcp:storage/bucketIAMMember:BucketIAMMember",
        "preview-state-lock",
        {
            "role": "roles/storage.objectUser",
            "member": f"serviceAccount:tpu-pretrain-preview@{SA_DOMAIN}",
            "condition": {
                "expression": "resource.type == 'storage.googleapis.com/Object'"
                f" && resource.name.startsWith('{STATE}.pulumi/locks/')"
            },
        },
        "",
    )
    widened = _object_permissions(
        [*run.resources, lock_prefix], "tpu-pretrain-preview", DEPLOY_LOCK
    )
    assert widened & LOCK_WRITES == LOCK_WRITES
    assert _object_permissions(
        [*run.resources, lock_prefix], "tpu-pretrain-preview", STATE + ".pulumi/stacks/a.json"
    ) == {"storage.objects.get", "storage.objects.list"}


def test_deploy_account_roles(run: Run) -> None:
    roles = _project_roles(run, "tpu-pretrain-deploy")
    assert roles == {
        "projects/tpu-pretrain-example/roles/tpuPretrainDeployer",
        "projects/tpu-pretrain-example/roles/tpuPretrainIamGranter",
        "projects/tpu-pretrain-example/roles/tpuPretrainStackInstances",
        "projects/tpu-pretrain-example/roles/tpuPretrainStackBuckets",
    }
    deployer = run.named("deployer-role").inputs["permissions"]
    assert len(deployer) == len(set(deployer))
    assert all(re.fullmatch(r"[a-z]+\.[A-Za-z]+\.[A-Za-z]+", p) for p in deployer)
    # Project IAM writes are not in the deployer role; the granter is conditional.
    assert not any(p.startswith("resourcemanager.projects.setIamPolicy") for p in deployer)
    granter = run.named("deploy-iam-granter").inputs["condition"]["expression"]
    assert granter == (
        "api.getAttribute('iam.googleapis.com/modifiedGrantsByRole', [])"
        ".hasOnly(['roles/logging.logWriter', 'roles/monitoring.metricWriter', "
        "'roles/dataflow.developer', "
        "'projects/tpu-pretrain-example/roles/tpuPretrainTpuRecovery', "
        "'projects/tpu-pretrain-example/roles/tpuPretrainGpuRecovery', "
        "'projects/tpu-pretrain-example/roles/tpuPretrainDataflowLauncher', "
        "'projects/tpu-pretrain-example/roles/tpuPretrainDataflowWorker'])"
    )
    # actAs and service-account IAM: never on the project, only on the stacks' own accounts.
    assert not {p for p in deployer if p.startswith("iam.serviceAccounts.") and "IamPolicy" in p}
    assert "iam.serviceAccounts.actAs" not in deployer
    # Changing a VM (its metadata runs code as its account): only the stacks' own VMs.
    assert not {p for p in deployer if p.startswith("compute.instances.")}
    assert run.named("deploy-stack-instances").inputs["condition"]["expression"] == (
        "resource.type == 'compute.googleapis.com/Instance' && resource.name.extract("
        "'projects/tpu-pretrain-example/zones/{zone}/instances/tp-') != ''"
    )
    # No Artifact Registry power at all: the image's builder makes the repository.
    assert not {p for p in deployer if p.startswith("artifactregistry.")}


def test_the_deploy_account_acts_as_each_stack_account_on_that_account(run: Run) -> None:
    """actAs through a grant on each stack account's own allow policy (conditions cannot name
    service accounts), for every stack file of the repository and its four accounts; the
    bootstrap creates them (adopting one a stack made earlier)."""
    stacks = sorted(p.name.split(".")[1] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))
    assert stacks and bootstrap.stack_names() == tuple(stacks)
    wanted = {
        f"tp-{stack}-{suffix}"
        for stack in stacks
        for suffix in bootstrap_roles.STACK_ACCOUNT_SUFFIXES
    }
    accounts = {
        r.inputs["accountId"]: r
        for r in run.of_type("gcp:serviceaccount/account:Account")
        if r.inputs["accountId"].startswith("tp-")
    }
    assert set(accounts) == wanted
    assert all(a.inputs["createIgnoreAlreadyExists"] is True for a in accounts.values())
    grants = [
        g
        for g in run.of_type("gcp:serviceaccount/iAMMember:IAMMember")
        if g.inputs["role"].endswith("/roles/tpuPretrainStackAccountUser")
    ]
    assert {g.inputs["serviceAccountId"].rsplit("/", 1)[-1] for g in grants} == {
        f"{account}@{SA_DOMAIN}" for account in wanted
    }
    assert {g.inputs["member"] for g in grants} == {
        f"serviceAccount:tpu-pretrain-deploy@{SA_DOMAIN}"
    }
    assert not [g for g in grants if g.inputs.get("condition")]
    # and never on the project (a project binding would be actAs on every account)
    assert not [
        r
        for r in run.of_type("gcp:projects/iAMMember:IAMMember")
        if r.inputs["role"].endswith("/roles/tpuPretrainStackAccountUser")
    ]
    # actAs and nothing else: no IAM policy of an account (any role to anyone), no token.
    role = run.named("stack-account-user-role").inputs
    assert role["permissions"] == ["iam.serviceAccounts.actAs"]


def test_the_bootstrap_makes_every_grant_on_the_stacks_accounts(run: Run) -> None:
    """What a stack created by a person grants on its own accounts (the controller acts as
    the TPU VM's and the Dataflow workers' accounts), the bootstrap grants for every GitOps
    stack, on that stack's own accounts only; the stacks write none (test_deployability)."""
    grants = [
        g
        for g in run.of_type("gcp:serviceaccount/iAMMember:IAMMember")
        if g.inputs["role"] == "roles/iam.serviceAccountUser"
    ]
    assert {
        (g.inputs["member"], g.inputs["serviceAccountId"].rsplit("/", 1)[-1]) for g in grants
    } == {
        (f"serviceAccount:tp-{stack}-controller@{SA_DOMAIN}", f"tp-{stack}-{target}@{SA_DOMAIN}")
        for stack in bootstrap.stack_names()
        for target in ("workload", "dataflow")
    }
    assert len(grants) == 2 * len(bootstrap.stack_names())
    assert not [g for g in grants if g.inputs.get("condition")]


def test_one_display_name_per_account_in_both_programs(run: Run) -> None:
    """The bootstrap and a stack write the same display name (the stack never changes an
    adopted one either): neither renames what the other made on every run."""
    sys.path.insert(0, str(ROOT))
    from infra.components.identity import OWNER_FIELDS, account_display_name

    accounts = [
        a
        for a in run.of_type("gcp:serviceaccount/account:Account")
        if a.inputs["accountId"].startswith("tp-")
    ]
    assert accounts
    for account in accounts:
        stack, suffix = re.fullmatch(
            r"tp-(.+)-(workload|controller|vpn-hop|dataflow)", account.inputs["accountId"]
        ).groups()  # type: ignore[union-attr]
        assert account.inputs["displayName"] == account_display_name(stack, suffix)
        assert "description" not in account.inputs  # nor a description the stack would write
    assert OWNER_FIELDS == ["displayName", "description"]


def test_stack_files_that_do_not_adopt_their_accounts_are_named(tmp_path: Path) -> None:
    (tmp_path / "Pulumi.adopts.yaml").write_text(
        "config:\n  tpu-pretrain:accountsFromBootstrap: true\n"
    )
    (tmp_path / "Pulumi.quoted.yaml").write_text(
        "config:\n  tpu-pretrain:accountsFromBootstrap: 'true'\n"
    )
    (tmp_path / "Pulumi.owns.yaml").write_text("config:\n  tpu-pretrain:job: x.yaml\n")
    (tmp_path / "Pulumi.off.yaml").write_text(
        "config:\n  tpu-pretrain:accountsFromBootstrap: false\n"
    )
    assert bootstrap.stacks_not_adopting(tmp_path) == ("off", "owns")


def test_a_stack_whose_account_ids_are_too_long_is_refused(tmp_path: Path) -> None:
    (tmp_path / "Pulumi.a-very-long-stack-name-x.yaml").write_text("config: {}\n")
    with pytest.raises(bootstrap.BootstrapConfigError, match="rename the stack"):
        bootstrap.stack_names(tmp_path)


# Every permission the bootstrap's roles hold on the WHOLE project (a binding without an IAM
# condition), reviewed: each is here with the reason it cannot be narrowed, or is harmless.
# A permission the roles gain that is not here fails the test until someone reviews it (and
# docs/guard-rails.md lists the escalations among them).
REVIEWED_PROJECT_WIDE = {
    "reads and waits: no change to anything": (
        "compute.addresses.get", "compute.disks.get", "compute.firewalls.get",
        "compute.globalOperations.get", "compute.images.get", "compute.images.getFromFamily",
        "compute.machineTypes.get", "compute.networks.get", "compute.projects.get",
        "compute.regionOperations.get", "compute.routers.get", "compute.subnetworks.get",
        "compute.zoneOperations.get", "compute.zones.get", "iam.serviceAccounts.get",
        "resourcemanager.projects.get", "serviceusage.operations.get",
        "serviceusage.services.get", "serviceusage.services.list", "storage.buckets.list",
            "tpu.acceleratortypes.list", "tpu.nodes.get", "tpu.operations.get",
        "tpu.runtimeversions.list",
    ),
    "creating: checked on the project, no name to condition on; what is created runs as no "
    "account but one the deploy account may act as (the stacks' own, conditional)": (
        "compute.addresses.create", "compute.disks.create", "compute.firewalls.create",
        "compute.networks.create", "compute.routers.create", "compute.subnetworks.create",
        "iam.serviceAccounts.create", "storage.buckets.create",
        "tpu.nodes.create", "serviceusage.services.enable",
    ),
    "using shared plumbing in what it creates (an image, a subnet, an address)": (
        "compute.addresses.use", "compute.images.useReadOnly", "compute.routers.use",
        "compute.subnetworks.use", "compute.subnetworks.useExternalIp",
    ),
    "ESCALATION (docs/guard-rails.md): changes or deletes any network plumbing of the "
    "project; Compute Engine names could be conditioned, not done yet": (
        "compute.addresses.delete", "compute.addresses.setLabels", "compute.firewalls.delete",
        "compute.firewalls.update", "compute.networks.delete", "compute.networks.update",
        "compute.networks.updatePolicy", "compute.routers.delete", "compute.routers.update",
        "compute.subnetworks.delete", "compute.subnetworks.setPrivateIpGoogleAccess",
        "compute.subnetworks.update",
    ),
    "ESCALATION (docs/guard-rails.md): deletes any TPU VM; Cloud TPU is not on Google's list "
    "of resources an IAM condition can name": ("tpu.nodes.delete",),
    "alerting (tpu-pretrain:alertEmails): changes or deletes any alert policy and channel of "
    "the project, which tells people, runs nothing and holds no secret (e-mail only: the "
    "pack's notification-channels-email-only); Cloud Monitoring is not on Google's list of "
    "resources an IAM condition can name": (
        "logging.notificationRules.create", "logging.notificationRules.delete",
        "logging.notificationRules.get", "logging.notificationRules.update",
        "monitoring.alertPolicies.create", "monitoring.alertPolicies.delete",
        "monitoring.alertPolicies.get", "monitoring.alertPolicies.update",
        "monitoring.notificationChannels.create", "monitoring.notificationChannels.delete",
        "monitoring.notificationChannels.get", "monitoring.notificationChannels.update",
    ),
}  # fmt: skip
# Predefined roles bound project-wide (their permissions are Google's): read-only only.
REVIEWED_PROJECT_WIDE_ROLES = {
    "roles/compute.viewer": "preview: reads Compute Engine resources",
    "roles/tpu.viewer": "preview: reads TPU VMs",
    "roles/iam.serviceAccountViewer": "preview: reads service accounts (no keys, no tokens)",
    "roles/serviceusage.serviceUsageViewer": "preview: which APIs are on",
    "roles/storage.bucketViewer": "preview: bucket settings, no objects",
}


def _project_wide(run: Run) -> dict[str, set[str]]:
    """Per unconditional project binding: the permissions it holds (a predefined role: its
    name, since its permissions are Google's)."""
    custom = {
        f"projects/tpu-pretrain-example/roles/{r.inputs['roleId']}": set(r.inputs["permissions"])
        for r in run.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
    }
    held: dict[str, set[str]] = {}
    for binding in run.of_type("gcp:projects/iAMMember:IAMMember"):
        if binding.inputs.get("condition"):
            continue
        role = binding.inputs["role"]
        held.setdefault(binding.inputs["member"], set()).update(custom.get(role, {role}))
    return held


def test_every_project_wide_permission_is_a_reviewed_exception(run: Run) -> None:
    reviewed = {p for perms in REVIEWED_PROJECT_WIDE.values() for p in perms}
    assert len(reviewed) == sum(len(perms) for perms in REVIEWED_PROJECT_WIDE.values())
    held = _project_wide(run)
    deploy = held.pop(f"serviceAccount:tpu-pretrain-deploy@{SA_DOMAIN}")
    preview = held.pop(f"serviceAccount:tpu-pretrain-preview@{SA_DOMAIN}")
    assert held == {}  # nobody else holds anything project-wide
    assert sorted(deploy - reviewed) == []
    assert sorted(preview - set(REVIEWED_PROJECT_WIDE_ROLES)) == []
    # An exception nobody holds any more is taken off the list.
    assert sorted(reviewed - deploy) == []
    # What must never be project-wide: code execution as another account, secret payloads,
    # bucket IAM and objects (the state bucket among them), role editing.
    never = (
        "tpu.nodes.update", "secretmanager.versions.access", "storage.objects.",
        "storage.buckets.setIamPolicy", "secretmanager.secrets.setIamPolicy", "iam.roles.",
        "compute.instances.", "iam.serviceAccounts.actAs", "iam.serviceAccounts.setIamPolicy",
        # a GitOps stack adopts the bootstrap's accounts and never deletes or renames one
        "iam.serviceAccounts.delete", "iam.serviceAccounts.update",
    )  # fmt: skip
    assert sorted(p for p in deploy if p.startswith(never)) == []


def test_the_checker_fails_on_an_unreviewed_permission(run: Run) -> None:
    """The test above can fail: a deployer role with one more permission is caught."""
    widened = [
        Registered(r.type_, r.name, {**r.inputs, "permissions": [*r.inputs["permissions"],
                   "storage.objects.delete"]}, r.urn)
        if r.name == "deployer-role" else r
        for r in run.resources
    ]  # fmt: skip
    deploy = _project_wide(Run(widened, run.exports))[
        f"serviceAccount:tpu-pretrain-deploy@{SA_DOMAIN}"
    ]
    reviewed = {p for perms in REVIEWED_PROJECT_WIDE.values() for p in perms}
    assert sorted(deploy - reviewed) == ["storage.objects.delete"]


def test_bucket_powers_reach_only_the_stacks_own_and_no_secret_at_all(run: Run) -> None:
    buckets = run.named("deploy-stack-buckets").inputs["condition"]["expression"]
    # The expression itself, evaluated with CEL: tests/infra/test_iam_conditions.py.
    assert buckets == iam_conditions.stack_bucket_condition()
    assert "matches(" not in buckets
    deployer = set(run.named("deployer-role").inputs["permissions"])
    assert not {p for p in deployer if p.startswith("storage.objects.")}
    assert {p for p in deployer if p.startswith("storage.")} == {
        "storage.buckets.create", "storage.buckets.list",
    }  # fmt: skip
    # The stacks keep no secret (the VPN hop makes its own key on its disk): no account of
    # the bootstrap holds any Secret Manager permission or role.
    custom = [p for r in run.of_type("gcp:projects/iAMCustomRole:IAMCustomRole")
              for p in r.inputs["permissions"]]  # fmt: skip
    assert [p for p in custom if p.startswith("secretmanager.")] == []
    roles = [r.inputs["role"] for r in run.resources if "role" in r.inputs]
    assert [r for r in roles if "secretmanager" in r.lower()] == []


def test_both_accounts_only_unwrap_the_stack_data_key(run: Run) -> None:
    grants = run.of_type("gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember")
    assert {g.inputs["role"] for g in grants} == {"roles/cloudkms.cryptoKeyDecrypter"}
    assert len(grants) == 2


def _workflow_variables() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / ".github" / "workflows").glob("*.yml"):
        names |= set(re.findall(r"vars\.([A-Z0-9_]+)", path.read_text()))
    return names


def test_exports_are_the_workflows_repository_variables(run: Run) -> None:
    variables = run.exports["githubVariables"]
    assert set(variables) == _workflow_variables()
    assert variables == {
        "GCP_PROJECT": "tpu-pretrain-example",
        "GCP_WORKLOAD_IDENTITY_PROVIDER": f"projects/{PROJECT_NUMBER}/locations/global/"
        "workloadIdentityPools/tpu-pretrain-github/providers/github-actions",
        "GCP_PREVIEW_SERVICE_ACCOUNT": f"tpu-pretrain-preview@{SA_DOMAIN}",
        "GCP_DEPLOY_SERVICE_ACCOUNT": f"tpu-pretrain-deploy@{SA_DOMAIN}",
        "PULUMI_STATE_BUCKET": "tpu-pretrain-example-pulumi-state",
        "PULUMI_SECRETS_PROVIDER": "gcpkms://projects/tpu-pretrain-example/locations/europe-west4/"
        "keyRings/tpu-pretrain-state/cryptoKeys/pulumi-secrets",
    }


def test_deploy_environment_matches_the_workflows(run: Run) -> None:
    for name in ("deploy.yml", "destroy.yml"):
        text = (ROOT / ".github" / "workflows" / name).read_text()
        assert f"environment: {run.exports['deployEnvironment']}\n" in text


def test_policy_pack_passes_on_the_bootstrap(run: Run) -> None:
    resources = [(r.type_, r.name, r.inputs, r.urn) for r in run.resources]
    assert run_pack(resources) == []


def test_policy_pack_rejects_a_weakened_bootstrap(run: Run) -> None:
    resources = [(r.type_, r.name, json.loads(json.dumps(r.inputs)), r.urn) for r in run.resources]
    for type_, _, inputs, _ in resources:
        if type_ == "gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider":
            inputs.pop("attributeCondition")
        if type_ == "gcp:projects/iAMMember:IAMMember" and inputs["role"].endswith("Deployer"):
            inputs["role"] = "roles/editor"
    violations = {v.policy for v in run_pack(resources)}
    assert violations == {
        "wif-provider-attribute-condition",
        "no-basic-or-admin-roles-for-service-accounts",
        "allowed-iam-grants",
    }


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        # The deployer role gains a permission that is not on the pack's list for it.
        (
            lambda r: (
                r.named("deployer-role")
                .inputs["permissions"]
                .append("iam.serviceAccounts.getAccessToken")
            ),
            "custom-role-permissions",
        ),
        # The stack-account role granted on an account that is not a stack's (the CI deploy
        # account itself: actAs on it would be a way around the deploy environment's gate).
        (
            lambda r: r.named("deploy-on-v6e-euw4-workload").inputs.update(
                serviceAccountId=f"projects/tpu-pretrain-example/serviceAccounts/"
                f"tpu-pretrain-deploy@{SA_DOMAIN}"
            ),
            "allowed-iam-grants",
        ),
        # The project IAM writer loses its limit on granted roles.
        (lambda r: r.named("deploy-iam-granter").inputs.pop("condition"), "allowed-iam-grants"),
        # The stack-account role regains the IAM policy of the accounts (any role to anyone).
        (
            lambda r: (
                r.named("stack-account-user-role")
                .inputs["permissions"]
                .append("iam.serviceAccounts.setIamPolicy")
            ),
            "custom-role-permissions",
        ),
        # The preview account writes the state bucket's lock files again (it could delete a
        # running deploy's lock).
        (
            lambda r: r.resources.append(
                Registered(
                    "gcp:storage/bucketIAMMember:BucketIAMMember",
                    "preview-state-lock",
                    {
                        "bucket": "tpu-pretrain-example-pulumi-state",
                        "role": "roles/storage.objectUser",
                        "member": f"serviceAccount:tpu-pretrain-preview@{SA_DOMAIN}",
                        "condition": {
                            "title": "pulumi-locks-only",
                            "expression": "resource.name.startsWith('projects/_/buckets/"
                            "tpu-pretrain-example-pulumi-state/objects/.pulumi/locks/')",
                        },
                    },
                    r.named("preview-state-read").urn.replace(
                        "preview-state-read", "preview-state-lock"
                    ),
                )
            ),
            "allowed-iam-grants",
        ),
        # A controller's actAs on another stack's TPU VM account.
        (
            lambda r: r.named("controller-on-v6e-euw4-workload").inputs.update(
                serviceAccountId=f"projects/tpu-pretrain-example/serviceAccounts/"
                f"tp-v5e-euw4-workload@{SA_DOMAIN}"
            ),
            "allowed-iam-grants",
        ),
    ],
    ids=[
        "deployer-gains-token-creation",
        "actas-on-a-foreign-account",
        "granter-unlimited",
        "account-iam-writes",
        "preview-writes-locks",
        "controller-on-another-stack",
    ],
)
def test_policy_pack_rejects_a_deploy_identity_that_could_escalate(change, rule) -> None:
    weakened = run_bootstrap()
    change(weakened)
    resources = [(r.type_, r.name, r.inputs, r.urn) for r in weakened.resources]
    violations = run_pack(resources)
    assert {v.policy for v in violations} == {rule}, violations


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        (f"{NS}:githubRepository", "just-a-name", f"{NS}:githubRepository: 'just-a-name' is not"),
        (f"{NS}:githubRepository", None, f"{NS}:githubRepository is not set"),
        (f"{NS}:githubRepositoryId", "abc", f"{NS}:githubRepositoryId: 'abc' is not"),
        (f"{NS}:githubOwnerId", "org", f"{NS}:githubOwnerId: 'org' is not the owner's"),
        (f"{NS}:stateBucket", "Bad_Bucket", f"{NS}:stateBucket: 'Bad_Bucket' is not"),
        (f"{NS}:stateBucket", "my-google-state", "may not contain 'goog'"),
        (
            f"{NS}:stateBucket",
            "team-state-tpu-pretrain",
            f"{NS}:stateBucket: 'team-state-tpu-pretrain' may not end with '-tpu-pretrain': "
            "that is how the stacks' buckets are named, which the deploy account may change",
        ),
        (f"{NS}:region", "europe-west4-a", f"{NS}:region: 'europe-west4-a' is not a GCP region"),
        ("gcp:project", None, "gcp:project is not set"),
    ],
)
def test_config_errors_name_the_key(key: str, value: str | None, fragment: str) -> None:
    config = stack_config()
    if value is None:
        config.pop(key)
    else:
        config[key] = value
    kwargs = {
        "project": config.get("gcp:project"),
        "region": config.get(f"{NS}:region"),
        "github_repository": config.get(f"{NS}:githubRepository"),
        "github_repository_id": config.get(f"{NS}:githubRepositoryId"),
        "github_owner_id": config.get(f"{NS}:githubOwnerId"),
        "state_bucket": config.get(f"{NS}:stateBucket"),
        "deploy_environment": config.get(f"{NS}:deployEnvironment"),
    }
    with pytest.raises(bootstrap.BootstrapConfigError) as error:
        bootstrap.validate_config(**kwargs)
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message


def test_config_error_is_a_one_line_run_error() -> None:
    """pulumi.RunError: the CLI prints the message without a Python traceback."""
    with pytest.raises(pulumi.RunError) as error:
        run_bootstrap({f"{NS}:githubRepository": "no slash"})
    assert str(error.value) == (
        f"{NS}:githubRepository: 'no slash' is not 'owner/name' of the repository"
    )


def test_stack_file_sets_only_declared_keys() -> None:
    project = yaml.safe_load((BOOTSTRAP / "Pulumi.yaml").read_text())
    assert project["name"] == bootstrap.PROJECT_NAME
    declared = {f"{NS}:{key}" for key in project["config"]}
    stack_keys = set(stack_config()) - {"gcp:project"}
    assert stack_keys <= declared
    read_in_code = set(
        re.findall(r'config\.get\("(\w+)"\)', (BOOTSTRAP / "gitops_bootstrap.py").read_text())
    )
    assert {f"{NS}:{key}" for key in read_in_code} == declared


def test_main_program_never_imports_the_bootstrap() -> None:
    offenders = []
    for path in (ROOT / "infra").rglob("*.py"):
        if BOOTSTRAP in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any("bootstrap" in name for name in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    assert not (BOOTSTRAP / "__init__.py").exists(), "bootstrap must not be a package of infra"
