"""One-time GitOps setup for tpu-pretrain, as its own small Pulumi program.

Creates what the workflows in .github/workflows need before any stack can be previewed:

- the self-managed state bucket (versioned, uniform access, public access prevention),
- a KMS key that encrypts each stack's secrets (rotated every 90 days),
- a Workload Identity pool + GitHub OIDC provider that accepts tokens of ONE repository
  (its name AND its numeric repository and owner ids, so a re-created repository or owner of
  the same name is refused),
- two CI service accounts with no keys:
    preview: read-only; only the preview workflow on a pull request and the deploy
             workflow's plan job on refs/heads/main may use it (PREVIEW_CALLERS); it
             reads the state and writes no object, so no lock of a running deploy;
    deploy:  applies stacks; only jobs in the GitHub environment that gates deploys, AND
             running on refs/heads/main; its permissions are derived from what the
             program's resource types need (PERMISSIONS_BY_TYPE); it acts as the stacks'
             own accounts only (no project-wide actAs) and writes no account's IAM policy,
             changes only the stacks' own VMs and buckets (never the state bucket;
             conditions on resource names), never updates a TPU VM, and grants on the
             project only the roles the stacks grant,
- every stack's service accounts and every grant on their own allow policies (the deploy
  account's actAs, the controller's actAs on the TPU VM's and the Dataflow workers'
  accounts): the stacks adopt the accounts (tpu-pretrain:accountsFromBootstrap) and keep
  them on `pulumi destroy`, so a destroyed stack deploys again with nothing to re-run,
- the TPU and GPU recovery custom roles that stacks with tpuAutoRecover / gpuAutoRecover
  bind to their controller account (the deploy account may grant them, never edit them).

The roles' ids and permissions and the stacks' account names are in bootstrap_roles.py,
the permission table per resource type in deploy_permissions.py, the IAM conditions in
iam_conditions.py. Its outputs are the values of the repository variables the workflows read.
It is never imported by the main program (infra/) and has its own state (see docs/gitops.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_gcp as gcp
import yaml
from bootstrap_roles import (
    CONTROLLER_ACTS_AS,
    DATAFLOW_LAUNCHER_PERMISSIONS,
    DATAFLOW_LAUNCHER_ROLE_ID,
    DATAFLOW_WORKER_PERMISSIONS,
    DATAFLOW_WORKER_ROLE_ID,
    DEPLOYER_PERMISSIONS,
    DEPLOYER_ROLE_ID,
    GPU_RECOVERY_PERMISSIONS,
    GPU_RECOVERY_ROLE_ID,
    IAM_GRANTER_ROLE_ID,
    PREVIEW_PROJECT_ROLES,
    PROJECT_IAM_WRITER_PERMISSIONS,
    RECOVERY_PERMISSIONS,
    RECOVERY_ROLE_ID,
    SERVICE_ACCOUNT_USER,
    STACK_ACCOUNT_SUFFIXES,
    STACK_ACCOUNT_USER_PERMISSIONS,
    STACK_ACCOUNT_USER_ROLE_ID,
    STACK_BUCKET_PERMISSIONS,
    STACK_BUCKET_ROLE_ID,
    STACK_INSTANCE_PERMISSIONS,
    STACK_INSTANCE_ROLE_ID,
    grantable_roles,
    stack_account_display_name,
    stack_account_id,
)
from iam_conditions import (
    STACK_BUCKET_SUFFIX,
    modified_grants_only,
    stack_bucket_condition,
    stack_instance_condition,
)

PROJECT_NAME = "tpu-pretrain-bootstrap"
GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
POOL_ID = "tpu-pretrain-github"
PROVIDER_ID = "github-actions"
PREVIEW_ACCOUNT_ID = "tpu-pretrain-preview"
DEPLOY_ACCOUNT_ID = "tpu-pretrain-deploy"
KEY_RING_ID = "tpu-pretrain-state"
CRYPTO_KEY_ID = "pulumi-secrets"
KEY_ROTATION = "7776000s"  # 90 days (CIS GCP 1.10)
DEPLOY_REF = "refs/heads/main"
# A custom attribute "<token subject>@<git ref>": the deploy binding names one value of it,
# so a job must run in the deploy environment AND on DEPLOY_REF.
DEPLOY_ATTRIBUTE = "sub_ref"
# The workflows whose jobs use the preview account (.github/workflows; tests/policy/
# test_bootstrap.py ties them to the files): the preview on every pull request, and the
# deploy workflow's read-only plan job on DEPLOY_REF (push, or by hand).
PREVIEW_WORKFLOW = ".github/workflows/preview.yml"
PLAN_WORKFLOW = ".github/workflows/deploy.yml"
# A custom attribute that names which of them a token comes from (preview_caller_mapping):
# the preview account's bindings name its two values, every other token maps to NO_CALLER.
PREVIEW_ATTRIBUTE = "preview_caller"
PULL_REQUEST_PREVIEW = "pull-request-preview"
MAIN_PLAN = "main-plan"
PREVIEW_CALLERS = (PULL_REQUEST_PREVIEW, MAIN_PLAN)
NO_CALLER = "none"

# APIs the bootstrap itself and keyless CI authentication need; left enabled on destroy.
APIS = (
    "cloudresourcemanager.googleapis.com",
    "serviceusage.googleapis.com",
    "iam.googleapis.com",
    "iamcredentials.googleapis.com",  # generateAccessToken for the impersonated accounts
    "sts.googleapis.com",  # token exchange of Workload Identity Federation
    "cloudkms.googleapis.com",
    "storage.googleapis.com",
)

# The repository's stack files: one stack per stacks/Pulumi.<stack>.yaml.
STACKS_DIR = Path(__file__).resolve().parents[2] / "stacks"
_ACCOUNT_ID = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")  # IAM: 6-30 characters

ADOPT_KEY = "tpu-pretrain:accountsFromBootstrap"


def stacks_not_adopting(directory: Path = STACKS_DIR) -> tuple[str, ...]:
    """Stack files that do not set ADOPT_KEY to true: such a stack would create and delete
    the accounts itself and write their allow policies, which the deploy account may not."""
    names = []
    for path in sorted(directory.glob("Pulumi.*.yaml")):
        config = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("config") or {}
        if str(config.get(ADOPT_KEY, "")).lower() != "true":
            names.append(path.name[len("Pulumi.") : -len(".yaml")])
    return tuple(names)


def stack_names(directory: Path = STACKS_DIR) -> tuple[str, ...]:
    """The stacks of the repository, each checked: its accounts' ids must be valid."""
    names = tuple(sorted(p.name[len("Pulumi.") : -len(".yaml")]
                         for p in directory.glob("Pulumi.*.yaml")))  # fmt: skip
    for stack in names:
        for suffix in STACK_ACCOUNT_SUFFIXES:
            if not _ACCOUNT_ID.match(stack_account_id(stack, suffix)):
                raise BootstrapConfigError(
                    f"stacks/Pulumi.{stack}.yaml: its account id "
                    f"{stack_account_id(stack, suffix)!r} is not 6-30 lowercase letters, digits "
                    "or '-': rename the stack"
                )
    return names


class BootstrapConfigError(ValueError):
    """A bootstrap setting is missing or invalid; the message is one line naming the key."""


@dataclass(frozen=True)
class BootstrapConfig:
    project: str
    region: str
    github_repository: str  # "owner/name"
    github_repository_id: str  # numeric id: survives renames, rejects a re-created repo
    github_owner_id: str  # numeric id of the owner (user or organization), likewise
    state_bucket: str
    deploy_environment: str
    # The stacks whose service accounts the bootstrap creates and lets the deploy account act
    # as: every stacks/Pulumi.<stack>.yaml of the repository (stack_names()).
    stacks: tuple[str, ...] = ()
    # Those of them whose stack file does not adopt the accounts (stacks_not_adopting()).
    not_adopting: tuple[str, ...] = ()


_REPOSITORY = re.compile(r"^[A-Za-z0-9-]{1,39}/[A-Za-z0-9._-]{1,100}$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9_.-]{1,61}[a-z0-9]$")
_ENVIRONMENT = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_NUMERIC_ID = re.compile(r"^[0-9]{1,20}$")


def validate_config(
    *,
    project: str | None,
    region: str | None,
    github_repository: str | None,
    github_repository_id: str | None,
    github_owner_id: str | None,
    state_bucket: str | None,
    deploy_environment: str | None,
) -> BootstrapConfig:
    """Checks every setting; the first bad one raises BootstrapConfigError (one line)."""
    ns = PROJECT_NAME

    def need(key: str, value: str | None, pattern: re.Pattern[str], allowed: str) -> str:
        if not value:
            raise BootstrapConfigError(f"{key} is not set: set it to {allowed}")
        if not pattern.match(value):
            raise BootstrapConfigError(f"{key}: {value!r} is not {allowed}")
        return value

    checked_project = need("gcp:project", project, _PROJECT, "a GCP project id")
    checked_region = need(f"{ns}:region", region, _REGION, "a GCP region such as europe-west4")
    repository = need(
        f"{ns}:githubRepository", github_repository, _REPOSITORY, "'owner/name' of the repository"
    )
    repository_id = need(
        f"{ns}:githubRepositoryId",
        github_repository_id,
        _NUMERIC_ID,
        "the repository's numeric id (`gh api repos/<owner>/<name> --jq .id`)",
    )
    owner_id = need(
        f"{ns}:githubOwnerId",
        github_owner_id,
        _NUMERIC_ID,
        "the owner's numeric id (`gh api repos/<owner>/<name> --jq .owner.id`)",
    )
    bucket = need(
        f"{ns}:stateBucket",
        state_bucket,
        _BUCKET,
        "a bucket name (3-63 lowercase letters, digits, '-', '_', '.')",
    )
    if bucket.startswith("goog") or "google" in bucket:
        raise BootstrapConfigError(f"{ns}:stateBucket: {bucket!r} may not contain 'goog'")
    if bucket.endswith(STACK_BUCKET_SUFFIX):
        raise BootstrapConfigError(
            f"{ns}:stateBucket: {bucket!r} may not end with {STACK_BUCKET_SUFFIX!r}: that is "
            "how the stacks' buckets are named, which the deploy account may change"
        )
    environment = need(
        f"{ns}:deployEnvironment",
        deploy_environment,
        _ENVIRONMENT,
        "a GitHub environment name",
    )
    return BootstrapConfig(
        project=checked_project,
        region=checked_region,
        github_repository=repository,
        github_repository_id=repository_id,
        github_owner_id=owner_id,
        state_bucket=bucket,
        deploy_environment=environment,
        stacks=stack_names(),
        not_adopting=stacks_not_adopting(),
    )


def read_config() -> BootstrapConfig:
    """The only place that reads pulumi.Config."""
    config = pulumi.Config()
    return validate_config(
        project=pulumi.Config("gcp").get("project"),
        region=config.get("region"),
        github_repository=config.get("githubRepository"),
        github_repository_id=config.get("githubRepositoryId"),
        github_owner_id=config.get("githubOwnerId"),
        state_bucket=config.get("stateBucket"),
        deploy_environment=config.get("deployEnvironment") or "gcp-deploy",
    )


def preview_caller_mapping(cfg: BootstrapConfig) -> str:
    """PREVIEW_ATTRIBUTE of a token: which preview caller it comes from, or NO_CALLER.

    GitHub's claims ("OIDC token claims"): `workflow_ref` is "<owner>/<repo>/<path of the
    workflow file>@<ref>", `event_name` the event that started the run, `ref` its git ref
    (refs/pull/<n>/merge for a pull request), `sub` "repo:<owner>/<repo>:pull_request" for
    a pull request's job and "repo:<owner>/<repo>:ref:<ref>" for another job without an
    environment. A pull request's preview: PREVIEW_WORKFLOW at a pull request's merge ref,
    started by `pull_request` (not `pull_request_target`, which runs the base's workflow
    with write access). The plan: a job without an environment of PLAN_WORKFLOW on
    DEPLOY_REF, started by a push or by hand. Another workflow, event, branch or an
    environment's job, including a branch that adds `push` to the preview's triggers or a
    new workflow of its own: NO_CALLER. Only standard CEL (==, &&, in, startsWith, endsWith,
    ?:)."""
    repository = cfg.github_repository
    pull_request = f"{repository}/{PREVIEW_WORKFLOW}@refs/pull/"
    plan = f"{repository}/{PLAN_WORKFLOW}@{DEPLOY_REF}"
    return (
        f"(assertion.event_name == 'pull_request'"
        f" && assertion.sub == 'repo:{repository}:pull_request'"
        f" && assertion.workflow_ref.startsWith('{pull_request}')"
        f" && assertion.workflow_ref.endsWith('/merge'))"
        f" ? '{PULL_REQUEST_PREVIEW}'"
        f" : ((assertion.event_name in ['push', 'workflow_dispatch']"
        f" && assertion.sub == 'repo:{repository}:ref:{DEPLOY_REF}'"
        f" && assertion.workflow_ref == '{plan}' && assertion.ref == '{DEPLOY_REF}')"
        f" ? '{MAIN_PLAN}' : '{NO_CALLER}')"
    )


def deploy_subject(cfg: BootstrapConfig) -> str:
    """The token subject of a job in the deploy environment (GitHub: an environment job's
    subject is "repo:<owner>/<name>:environment:<env>", with no ref in it)."""
    return f"repo:{cfg.github_repository}:environment:{cfg.deploy_environment}"


def attribute_condition(cfg: BootstrapConfig) -> str:
    """The provider accepts only tokens minted for this repository's workflows: its name and
    the numeric ids GitHub puts in every token (claims repository_id, repository_owner_id),
    which a deleted and re-created repository or owner of the same name does not have; and
    of those only a preview caller's (PREVIEW_ATTRIBUTE, mapped by preview_caller_mapping)
    or a deploy-environment job's. Any other job gets no federated token at all; which
    account each may use is the bindings' to say (below)."""
    return (
        f"assertion.repository == '{cfg.github_repository}'"
        f" && assertion.repository_id == '{cfg.github_repository_id}'"
        f" && assertion.repository_owner_id == '{cfg.github_owner_id}'"
        f" && (attribute.{PREVIEW_ATTRIBUTE} != '{NO_CALLER}'"
        f" || assertion.sub == '{deploy_subject(cfg)}')"
    )


def deploy_principal_value(cfg: BootstrapConfig) -> str:
    """The DEPLOY_ATTRIBUTE value of a job in the deploy environment on DEPLOY_REF."""
    return f"{deploy_subject(cfg)}@{DEPLOY_REF}"


def iam_granter_condition(project: str) -> str:
    """Project IAM writes may add or remove bindings of grantable_roles() only. Google
    documents the attribute for the allow policies of projects, folders and organizations
    ("Set limits on granting roles", iam/docs/setting-limits-on-granting-roles)."""
    return modified_grants_only(grantable_roles(project))


def define(cfg: BootstrapConfig) -> None:
    """Registers every bootstrap resource and exports the GitHub repository variables."""
    project = cfg.project
    keep = pulumi.ResourceOptions(protect=True)

    apis = [
        gcp.projects.Service(
            f"api-{api.split('.')[0]}",
            project=project,
            service=api,
            disable_on_destroy=False,
            disable_dependent_services=False,
        )
        for api in APIS
    ]
    after_apis = pulumi.ResourceOptions(depends_on=apis)

    # --- state bucket -------------------------------------------------------------------
    bucket = gcp.storage.Bucket(
        "state-bucket",
        project=project,
        name=cfg.state_bucket,
        location=cfg.region.upper(),
        storage_class="STANDARD",
        uniform_bucket_level_access=True,
        public_access_prevention="enforced",
        versioning={"enabled": True},
        # Old state versions are kept for 90 days after they are replaced, 100 at most.
        lifecycle_rules=[
            {
                "action": {"type": "Delete"},
                "condition": {"days_since_noncurrent_time": 90, "with_state": "ARCHIVED"},
            },
            {
                "action": {"type": "Delete"},
                "condition": {"num_newer_versions": 100, "with_state": "ARCHIVED"},
            },
        ],
        force_destroy=False,
        labels={"app": "tpu-pretrain", "purpose": "pulumi-state"},
        opts=pulumi.ResourceOptions.merge(keep, after_apis),
    )

    # --- KMS key for stack secrets ------------------------------------------------------
    key_ring = gcp.kms.KeyRing(
        "state-key-ring",
        project=project,
        name=KEY_RING_ID,
        location=cfg.region,
        opts=pulumi.ResourceOptions.merge(keep, after_apis),
    )
    crypto_key = gcp.kms.CryptoKey(
        "state-key",
        name=CRYPTO_KEY_ID,
        key_ring=key_ring.id,
        purpose="ENCRYPT_DECRYPT",
        rotation_period=KEY_ROTATION,
        labels={"app": "tpu-pretrain", "purpose": "pulumi-secrets"},
        opts=keep,
    )

    # --- Workload Identity Federation -------------------------------------------------
    pool = gcp.iam.WorkloadIdentityPool(
        "github-pool",
        project=project,
        workload_identity_pool_id=POOL_ID,
        display_name="GitHub Actions",
        description=f"Workflows of {cfg.github_repository}",
        opts=after_apis,
    )
    provider = gcp.iam.WorkloadIdentityPoolProvider(
        "github-provider",
        project=project,
        workload_identity_pool_id=pool.workload_identity_pool_id,
        workload_identity_pool_provider_id=PROVIDER_ID,
        display_name="GitHub OIDC",
        attribute_mapping={
            "google.subject": "assertion.sub",
            "attribute.repository": "assertion.repository",
            "attribute.repository_id": "assertion.repository_id",
            "attribute.ref": "assertion.ref",
            f"attribute.{DEPLOY_ATTRIBUTE}": "assertion.sub + '@' + assertion.ref",
            f"attribute.{PREVIEW_ATTRIBUTE}": preview_caller_mapping(cfg),
        },
        attribute_condition=attribute_condition(cfg),
        oidc={"issuer_uri": GITHUB_ISSUER},
    )

    # --- CI service accounts ----------------------------------------------------------
    preview = gcp.serviceaccount.Account(
        "preview-sa",
        project=project,
        account_id=PREVIEW_ACCOUNT_ID,
        display_name="tpu-pretrain CI preview (read-only)",
        opts=after_apis,
    )
    deploy = gcp.serviceaccount.Account(
        "deploy-sa",
        project=project,
        account_id=DEPLOY_ACCOUNT_ID,
        display_name="tpu-pretrain CI deploy",
        opts=after_apis,
    )
    preview_member = preview.email.apply(lambda email: f"serviceAccount:{email}")
    deploy_member = deploy.email.apply(lambda email: f"serviceAccount:{email}")

    # The preview account: a pull request's preview and the deploy workflow's plan job on
    # main, each one value of PREVIEW_ATTRIBUTE; no other workflow, event or branch.
    for caller in PREVIEW_CALLERS:
        gcp.serviceaccount.IAMMember(
            f"preview-wif-{caller}",
            service_account_id=preview.name,
            role="roles/iam.workloadIdentityUser",
            member=pulumi.Output.concat(
                "principalSet://iam.googleapis.com/",
                pool.name,
                f"/attribute.{PREVIEW_ATTRIBUTE}/{caller}",
            ),
        )
    # Deploys: only jobs that run in the deploy environment AND on refs/heads/main (the
    # environment's protection rules are repository settings; this holds even if they are
    # loosened). The token's subject carries the environment, its ref claim the branch.
    gcp.serviceaccount.IAMMember(
        "deploy-wif",
        service_account_id=deploy.name,
        role="roles/iam.workloadIdentityUser",
        member=pool.name.apply(
            lambda name: (
                f"principalSet://iam.googleapis.com/{name}/attribute.{DEPLOY_ATTRIBUTE}/"
                f"{deploy_principal_value(cfg)}"
            )
        ),
    )

    # --- state bucket and key access (resource level, not project level) ----------------
    # The preview account only reads: `pulumi preview` takes no lock in a self-managed
    # backend and writes nothing there (pulumi/pulumi pkg/backend/diy/backend.go: Preview
    # runs apply with DryRun, no Lock; only update, refresh, destroy, import do). So it can
    # neither delete nor overwrite the lock of a running deploy (.pulumi/locks/...): that
    # takes storage.objects.delete, which it holds on no object.
    gcp.storage.BucketIAMMember(
        "preview-state-read",
        bucket=bucket.name,
        role="roles/storage.objectViewer",
        member=preview_member,
    )
    gcp.storage.BucketIAMMember(
        "deploy-state-write",
        bucket=bucket.name,
        role="roles/storage.objectUser",
        member=deploy_member,
    )
    for name, member in (("preview", preview_member), ("deploy", deploy_member)):
        # Stacks are created by a person (`pulumi stack init --secrets-provider gcpkms://`),
        # which wraps the stack's data key; CI only unwraps it.
        gcp.kms.CryptoKeyIAMMember(
            f"{name}-state-key-decrypt",
            crypto_key_id=crypto_key.id,
            role="roles/cloudkms.cryptoKeyDecrypter",
            member=member,
        )

    # --- project roles ----------------------------------------------------------------
    for role in PREVIEW_PROJECT_ROLES:
        gcp.projects.IAMMember(
            f"preview-{role.removeprefix('roles/')}",
            project=project,
            role=role,
            member=preview_member,
        )
    deployer_role = gcp.projects.IAMCustomRole(
        "deployer-role",
        project=project,
        role_id=DEPLOYER_ROLE_ID,
        title="tpu-pretrain deployer",
        description="What `pulumi up/destroy` of a tpu-pretrain stack needs (infra/bootstrap).",
        permissions=list(DEPLOYER_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    granter_role = gcp.projects.IAMCustomRole(
        "iam-granter-role",
        project=project,
        role_id=IAM_GRANTER_ROLE_ID,
        title="tpu-pretrain IAM granter",
        description="Project IAM reads/writes, bound only with a condition on granted roles.",
        permissions=list(PROJECT_IAM_WRITER_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    gcp.projects.IAMMember(
        "deploy-deployer",
        project=project,
        role=deployer_role.name,
        member=deploy_member,
    )
    gcp.projects.IAMMember(
        "deploy-iam-granter",
        project=project,
        role=granter_role.name,
        member=deploy_member,
        condition={
            "title": "only-stack-roles",
            "description": "May grant/revoke only log/metric writing and TPU/GPU recovery.",
            "expression": iam_granter_condition(project),
        },
    )
    stack_instance_role = gcp.projects.IAMCustomRole(
        "stack-instance-role",
        project=project,
        role_id=STACK_INSTANCE_ROLE_ID,
        title="tpu-pretrain stack instances",
        description="Create and change the stacks' own VMs (conditional on their names).",
        permissions=list(STACK_INSTANCE_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    gcp.projects.IAMMember(
        "deploy-stack-instances",
        project=project,
        role=stack_instance_role.name,
        member=deploy_member,
        condition={
            "title": "stack-instances-only",
            "description": "VMs named tp-<stack>-... only.",
            "expression": stack_instance_condition(project),
        },
    )
    # Custom roles bound to the deploy account only under a condition on resource names.
    scoped_roles: tuple[
        tuple[str, str, str, tuple[str, ...], gcp.projects.IAMMemberConditionArgsDict], ...
    ] = (
        (
            "stack-bucket-role",
            STACK_BUCKET_ROLE_ID,
            "tpu-pretrain stack buckets",
            STACK_BUCKET_PERMISSIONS,
            {
                "title": "stack-buckets-only",
                "description": f"Buckets named <name>{STACK_BUCKET_SUFFIX} and their objects "
                "only; never the state bucket.",
                "expression": stack_bucket_condition(),
            },
        ),
    )
    for role_name, role_id, title, permissions, condition in scoped_roles:
        custom_role = gcp.projects.IAMCustomRole(
            role_name,
            project=project,
            role_id=role_id,
            title=title,
            description=f"{title} (bound only with a condition on resource names).",
            permissions=list(permissions),
            stage="GA",
            opts=after_apis,
        )
        gcp.projects.IAMMember(
            f"deploy-{role_name.removesuffix('-role')}s",
            project=project,
            role=custom_role.name,
            member=deploy_member,
            condition=condition,
        )
    # No project-wide actAs, and no condition on accounts (IAM service accounts are not on
    # Google's "Resource attributes for IAM Conditions" page: a condition on their names never
    # grants). The deploy account holds actAs on each stack's own accounts through a grant on
    # that account's own allow policy, made here by the project Owner who runs the bootstrap:
    # the only identity that can grant on an account without holding setIamPolicy on every
    # account of the project. So the bootstrap creates the stacks' accounts (every stack file
    # in stacks/) before their first deploy, and makes every grant on them; the main program
    # adopts them and keeps them on destroy (infra/components/identity.py), so the grants
    # here outlive any number of destroys and deploys of the stack.
    stack_account_role = gcp.projects.IAMCustomRole(
        "stack-account-user-role",
        project=project,
        role_id=STACK_ACCOUNT_USER_ROLE_ID,
        title="tpu-pretrain stack account user",
        description="actAs on one stack account (granted on that account).",
        permissions=list(STACK_ACCOUNT_USER_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    for stack in cfg.not_adopting:
        pulumi.log.warn(
            f"stacks/Pulumi.{stack}.yaml does not set {ADOPT_KEY}: true: its deploy would "
            "write the allow policies of accounts the deploy account may only act as, and its "
            "destroy would delete them; set it (docs/gitops.md)"
        )
    for stack in cfg.stacks:
        accounts = {}
        for suffix in STACK_ACCOUNT_SUFFIXES:
            account_id = stack_account_id(stack, suffix)
            accounts[suffix] = account = gcp.serviceaccount.Account(
                f"stack-{stack}-{suffix}",
                project=project,
                account_id=account_id,
                display_name=stack_account_display_name(stack, suffix),
                # An account a stack created before this bootstrap knew it is adopted.
                create_ignore_already_exists=True,
                opts=after_apis,
            )
            gcp.serviceaccount.IAMMember(
                f"deploy-on-{stack}-{suffix}",
                service_account_id=account.name,
                role=stack_account_role.name,
                member=deploy_member,
            )
        for target in CONTROLLER_ACTS_AS:
            gcp.serviceaccount.IAMMember(
                f"controller-on-{stack}-{target}",
                service_account_id=accounts[target].name,
                role=SERVICE_ACCOUNT_USER,
                member=accounts["controller"].email.apply(lambda email: f"serviceAccount:{email}"),
            )
    # Created here, not by the stacks: the deploy account may grant it (above) but holds no
    # iam.roles.* permission, so it cannot widen a role it is allowed to grant.
    gcp.projects.IAMCustomRole(
        "tpu-recovery-role",
        project=project,
        role_id=RECOVERY_ROLE_ID,
        title="tpu-pretrain TPU recovery",
        description="Describe, delete and recreate a stack's preempted TPU VM (the watchdog).",
        permissions=list(RECOVERY_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    gcp.projects.IAMCustomRole(
        "gpu-recovery-role",
        project=project,
        role_id=GPU_RECOVERY_ROLE_ID,
        title="tpu-pretrain GPU recovery",
        description="Describe, start and stop a stack's spot GPU VM (the watchdog).",
        permissions=list(GPU_RECOVERY_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    gcp.projects.IAMCustomRole(
        "dataflow-launcher-role",
        project=project,
        role_id=DATAFLOW_LAUNCHER_ROLE_ID,
        title="tpu-pretrain Dataflow launcher",
        description="What Dataflow Admin adds to Developer at project level, read-only.",
        permissions=list(DATAFLOW_LAUNCHER_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )
    gcp.projects.IAMCustomRole(
        "dataflow-worker-role",
        project=project,
        role_id=DATAFLOW_WORKER_ROLE_ID,
        title="tpu-pretrain Dataflow worker",
        description="roles/dataflow.worker without its object and VM permissions on the project.",
        permissions=list(DATAFLOW_WORKER_PERMISSIONS),
        stage="GA",
        opts=after_apis,
    )

    # --- the values of the GitHub repository variables --------------------------------
    pulumi.export(
        "githubVariables",
        {
            "GCP_PROJECT": project,
            "GCP_WORKLOAD_IDENTITY_PROVIDER": provider.name,
            "GCP_PREVIEW_SERVICE_ACCOUNT": preview.email,
            "GCP_DEPLOY_SERVICE_ACCOUNT": deploy.email,
            "PULUMI_STATE_BUCKET": bucket.name,
            "PULUMI_SECRETS_PROVIDER": crypto_key.id.apply(lambda key: f"gcpkms://{key}"),
        },
    )
    pulumi.export("deployEnvironment", cfg.deploy_environment)
