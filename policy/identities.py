"""The rule family of identities: no public principal (IAM or ACL), no default compute
account, no basic or admin role for a service account, no user-managed key, and Workload
Identity providers that restrict their tokens."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from .resources import (
        BUCKET_OBJECT,
        CIS,
        PROJECT_IAM_TYPES,
        SERVICE_ACCOUNT_KEY,
        STORAGE_ACL_TYPES,
        TPU_TYPES,
        VM_TYPES,
        WIF_PROVIDER,
        Rule,
        get,
        iam_members,
        is_iam_type,
        resource_policy,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    from resources import (  # type: ignore[no-redef]
        BUCKET_OBJECT,
        CIS,
        PROJECT_IAM_TYPES,
        SERVICE_ACCOUNT_KEY,
        STORAGE_ACL_TYPES,
        TPU_TYPES,
        VM_TYPES,
        WIF_PROVIDER,
        Rule,
        get,
        iam_members,
        is_iam_type,
        resource_policy,
    )

PUBLIC_PRINCIPALS = ("allusers", "allauthenticatedusers")
# Google-managed default accounts that a stack must neither run as nor grant anything on:
# the Compute Engine default account "<project number>-compute@developer.gserviceaccount.com"
# and the App Engine default account "<project id>@appspot.gserviceaccount.com".
DEFAULT_ACCOUNT = re.compile(
    r"(?<![A-Za-z0-9._-])(?:[0-9]+-compute@developer\.gserviceaccount\.com"
    r"|[a-z0-9.:-]+@appspot\.gserviceaccount\.com)",
    re.IGNORECASE,
)
BASIC_ROLES = ("roles/owner", "roles/editor", "roles/viewer")

# One message per rule; tests and users match on them.
MSG_PUBLIC_MEMBER = "IAM/ACL grant to a public principal (allUsers/allAuthenticatedUsers)"
MSG_DEFAULT_SA = "the default compute service account must not be used"
MSG_SA_ROLE = "service accounts must not hold basic (owner/editor/viewer) or admin roles"
MSG_SA_KEY = "user-managed service account keys are not allowed"
MSG_WIF_CONDITION = "workload identity provider must restrict the token with attributeCondition"


def _check_default_sa(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if is_iam_type(resource_type):
        for role, member in iam_members(resource_type, props):
            if DEFAULT_ACCOUNT.search(member):
                report(f"{MSG_DEFAULT_SA}: {member} is granted {role or 'a role'}")
        # A grant ON a default account (e.g. actAs on it) lets the grantee run as it.
        for key in ("serviceAccountId", "name", "resource"):
            target = get(props, key)
            if isinstance(target, str) and DEFAULT_ACCOUNT.search(target):
                report(f"{MSG_DEFAULT_SA}: grant on the default account {target}")
        return
    email = get(props, "serviceAccount", "email")
    if resource_type in TPU_TYPES and not email:
        # A TPU VM without an explicit service account runs as the default compute account.
        report(f"{MSG_DEFAULT_SA}: TPU VM without serviceAccount.email runs as the default one")
    elif isinstance(get(props, "serviceAccount"), Mapping) and not email:
        # A GCE VM with a service_account block but no email gets the default compute
        # account (the provider leaves the email to the API, which picks the default).
        report(f"{MSG_DEFAULT_SA}: serviceAccount without email runs as the default one")
    elif isinstance(email, str) and (
        DEFAULT_ACCOUNT.search(email) or email.strip().lower() == "default"
    ):
        report(f"{MSG_DEFAULT_SA}: {email}")


def _role_is_basic_or_admin(role: str) -> bool:
    if role in BASIC_ROLES:
        return True
    # Predefined roles are "roles/<service>.<name>"; custom ones "projects/p/roles/<id>".
    role_id = role.rsplit("/", 1)[-1]
    return "admin" in role_id.lower()


def _check_sa_roles(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    for role, member in iam_members(resource_type, props):
        if member.startswith("serviceAccount:") and _role_is_basic_or_admin(role):
            report(f"{MSG_SA_ROLE}: {member} gets {role} on the project")


def _check_public_members(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type == BUCKET_OBJECT:
        acl = get(props, "predefinedAcl")
        if isinstance(acl, str) and acl.strip().lower().startswith(("public", "authenticated")):
            report(f"{MSG_PUBLIC_MEMBER}: object with predefinedAcl {acl!r}")
        return
    if not (is_iam_type(resource_type) or resource_type in STORAGE_ACL_TYPES):
        return
    for role, member in iam_members(resource_type, props):
        if member.strip().lower() in PUBLIC_PRINCIPALS:
            report(f"{MSG_PUBLIC_MEMBER}: {member} gets {role or 'access'}")


def _check_sa_key(_t: str, _props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    report(f"{MSG_SA_KEY}: use Workload Identity Federation or attached service accounts")


def _check_wif_condition(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    condition = get(props, "attributeCondition")
    if get(props, "oidc") is not None and not (isinstance(condition, str) and condition.strip()):
        report(f"{MSG_WIF_CONDITION}: e.g. assertion.repository == 'owner/repo'")


class PublicMembersPolicy(ResourceValidationPolicy):
    """Applies to every IAM member/binding/policy type of every service, not a fixed list."""

    def __init__(self) -> None:
        super().__init__(
            name="no-public-principals",
            description="No IAM or ACL grant to allUsers/allAuthenticatedUsers on any resource "
            "(CIS GCP 5.1, 1.x)",
            validate=self._validate,
            enforcement_level=EnforcementLevel.MANDATORY,
            framework=CIS,
        )

    @staticmethod
    def _validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        _check_public_members(
            args.resource_type, args.props, lambda message: report_violation(message, None)
        )


class DefaultServiceAccountPolicy(ResourceValidationPolicy):
    """VMs, TPU VMs and every IAM grant: the default compute account is never used."""

    def __init__(self) -> None:
        super().__init__(
            name="no-default-compute-service-account",
            description="VMs and TPU VMs run as a dedicated service account, never the default "
            "compute account, and no IAM grant names it (CIS GCP 4.1, 4.2)",
            validate=self._validate,
            enforcement_level=EnforcementLevel.MANDATORY,
            framework=CIS,
        )

    @staticmethod
    def _validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type in (*VM_TYPES, *TPU_TYPES) or is_iam_type(args.resource_type):
            _check_default_sa(
                args.resource_type, args.props, lambda message: report_violation(message, None)
            )


def rules() -> list[Rule]:
    """The identities' rules, in the pack's order."""
    return [
        Rule(PublicMembersPolicy(), MSG_PUBLIC_MEMBER),
        Rule(DefaultServiceAccountPolicy(), MSG_DEFAULT_SA),
        Rule(
            resource_policy(
                "no-basic-or-admin-roles-for-service-accounts",
                "Project-level grants never give a service account a basic or an admin role.",
                PROJECT_IAM_TYPES,
                _check_sa_roles,
                cis="1.5",
            ),
            MSG_SA_ROLE,
        ),
        Rule(
            resource_policy(
                "no-service-account-keys",
                "No user-managed service account keys (CI uses Workload Identity Federation).",
                (SERVICE_ACCOUNT_KEY,),
                _check_sa_key,
                cis="1.4",
            ),
            MSG_SA_KEY,
        ),
        Rule(
            resource_policy(
                "wif-provider-attribute-condition",
                "Workload identity OIDC providers restrict which tokens they accept.",
                (WIF_PROVIDER,),
                _check_wif_condition,
            ),
            MSG_WIF_CONDITION,
        ),
    ]
