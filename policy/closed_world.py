"""The closed world: the rule family that holds every resource to the allowlists of
policy/allowlist.py (its resource types, APIs, IAM grants, custom-role permissions), runs VMs
only as the stack's own accounts, makes grants only on the stack's own resources and keeps
credentials out of providers. Anything not listed is refused."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from . import allowlist
    from .resources import (
        ACCOUNT,
        BUCKET,
        CUSTOM_ROLE_TYPES,
        PROVIDER_PREFIX,
        SECRET,
        SERVICE,
        TPU_TYPES,
        VM_TYPES,
        Rule,
        get,
        is_iam_type,
        items,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    import allowlist  # type: ignore[no-redef]
    from resources import (  # type: ignore[no-redef]
        ACCOUNT,
        BUCKET,
        CUSTOM_ROLE_TYPES,
        PROVIDER_PREFIX,
        SECRET,
        SERVICE,
        TPU_TYPES,
        VM_TYPES,
        Rule,
        get,
        is_iam_type,
        items,
    )

# Provider settings that would make the provider act as another identity than the one the
# workflow authenticated (the deploy account), or with a credential of its own.
PROVIDER_CREDENTIAL_KEYS = (
    "credentials",
    "accessToken",
    "impersonateServiceAccount",
    "impersonateServiceAccountDelegates",
)

# One message per rule; tests and users match on them.
MSG_UNKNOWN_TYPE = "resource type is not on the pack's allowlist"
MSG_UNKNOWN_API = "API is not on the pack's allowlist"
MSG_IAM_GRANT = "IAM grant is not on the pack's allowlist"
MSG_CUSTOM_ROLE = "custom role holds permissions outside the pack's allowlist"
MSG_PROVIDER = "provider must not carry credentials or impersonate another account"
MSG_FOREIGN_TARGET = "IAM grant on a resource this stack does not create"
MSG_VM_ACCOUNT = "VM runs as an account that is not the stack's own"

HOW_TO_ALLOW = (
    "allow it only by a reviewed code change to policy/allowlist.py (with its rules and a "
    "test under tests/policy); no stack setting can allow it"
)


def project_of(urn: str) -> str:
    """The Pulumi project of a URN "urn:pulumi:<stack>::<project>::<type>::<name>"."""
    parts = urn.split("::")
    return parts[1] if len(parts) >= 4 else ""


def profile_of(urn: str) -> allowlist.Profile | None:
    return allowlist.PROFILES.get(project_of(urn))


def _check_allowed_type(
    urn: str, resource_type: str, _props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    profile = profile_of(urn)
    if profile is None:
        known = ", ".join(sorted(allowlist.PROFILES))
        report(
            f"{MSG_UNKNOWN_TYPE}: {resource_type} belongs to Pulumi project "
            f"{project_of(urn)!r}, which the pack does not know (known: {known}); "
            f"{HOW_TO_ALLOW}"
        )
    elif resource_type not in profile.types:
        report(
            f"{MSG_UNKNOWN_TYPE}: {resource_type} is not allowed in project {profile.project}; "
            f"{HOW_TO_ALLOW}"
        )


def _check_allowed_api(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    profile = profile_of(urn)
    if resource_type != SERVICE or profile is None:
        return
    api = get(props, "service")
    if api not in profile.apis:
        report(f"{MSG_UNKNOWN_API}: {api!r} in project {profile.project}; {HOW_TO_ALLOW}")


_CUSTOM_ROLE_NAME = re.compile(r"^projects/[^/]+/roles/([^/]+)$")


def role_key(role: str) -> str:
    """Predefined roles by name; project custom roles as "custom:<roleId>" (the stack's
    project). Organization custom roles keep their full name and match no entry."""
    match = _CUSTOM_ROLE_NAME.match(role)
    return f"custom:{match.group(1)}" if match else role


def _iam_grants(props: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(role, member, condition expression or "") of an IAM member/binding/policy."""
    role = get(props, "role")
    role = role if isinstance(role, str) else ""
    expression = get(props, "condition", "expression")
    condition = expression if isinstance(expression, str) else ""
    member = get(props, "member")
    if isinstance(member, str):
        yield role, member, condition
    for member in items(get(props, "members")):
        yield role, str(member), condition
    policy_data = get(props, "policyData")
    if isinstance(policy_data, str) and policy_data.strip():
        try:
            policy = json.loads(policy_data)
        except json.JSONDecodeError:
            yield "unreadable policyData", "", ""
            return
        for binding in policy.get("bindings", []) if isinstance(policy, dict) else []:
            binding_condition = str((binding.get("condition") or {}).get("expression") or "")
            for member in binding.get("members", []):
                yield str(binding.get("role", "")), str(member), binding_condition


def _grant_problem(
    profile: allowlist.Profile,
    resource_type: str,
    *,
    props: Mapping[str, Any],
    role: str,
    member: str,
    condition: str,
) -> str | None:
    key = role_key(role)
    candidates = [g for g in profile.grants if resource_type in g.types and g.role == key]
    if not candidates:
        allowed = sorted({g.role for g in profile.grants if resource_type in g.types})
        return (
            f"{role or 'no role'} to {member} on {resource_type}: this role may not be granted "
            f"there in project {profile.project} (allowed: {', '.join(allowed) or 'none'})"
        )
    target = str(get(props, "serviceAccountId") or "")
    for grant in candidates:
        member_match = re.fullmatch(grant.member, member)
        if not member_match:
            continue
        if grant.target is not None:
            target = str(get(props, grant.target_key) or "")
            target_match = re.fullmatch(grant.target, target)
            if not target_match:
                continue
            if grant.same_stack and target_match.group(1) != member_match.group(1):
                continue
        if grant.condition is not None and grant.condition not in condition:
            continue
        return None
    wanted = "; or ".join(
        f"to {g.who}" + (f" with a condition on {g.condition}" if g.condition else "")
        for g in candidates
    )
    on = f" on {target}" if target else ""
    return f"{role} to {member}{on}: allowed only {wanted}"


def _check_allowed_grants(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    profile = profile_of(urn)
    if profile is None or not is_iam_type(resource_type):
        return
    for role, member, condition in _iam_grants(props):
        problem = _grant_problem(
            profile, resource_type, props=props, role=role, member=member, condition=condition
        )
        if problem:
            report(f"{MSG_IAM_GRANT}: {problem}; {HOW_TO_ALLOW}")


def dangerous_permissions(permissions: Iterable[str]) -> list[str]:
    return sorted(
        p
        for p in permissions
        if any(re.fullmatch(pattern, p) for pattern in allowlist.DANGEROUS_PERMISSION_PATTERNS)
    )


def _check_custom_role(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type not in CUSTOM_ROLE_TYPES:
        return
    profile = profile_of(urn)
    role_id = str(get(props, "roleId") or "")
    permissions = {str(p) for p in items(get(props, "permissions"))}
    allowed = profile.custom_roles.get(role_id) if profile else None
    extra = sorted(permissions - (allowed or frozenset()))
    if allowed is not None and not extra:
        return
    dangerous = dangerous_permissions(extra)
    where = f"project {profile.project}" if profile else f"project {project_of(urn)!r}"
    what = (
        f"custom role {role_id!r} is not allowed in {where}"
        if allowed is None
        else f"custom role {role_id!r} may not hold {', '.join(extra)}"
    )
    danger = f"; it can escalate through {', '.join(dangerous)}" if dangerous else ""
    report(f"{MSG_CUSTOM_ROLE}: {what}{danger}; {HOW_TO_ALLOW}")


def _check_vm_account(
    urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type not in (*VM_TYPES, *TPU_TYPES):
        return
    email = get(props, "serviceAccount", "email")
    if isinstance(email, str) and not re.fullmatch(allowlist.VM_ACCOUNT, email):
        report(
            f"{MSG_VM_ACCOUNT}: {resource_type} runs as {email}; a VM of "
            f"project {project_of(urn)!r} runs as one of its stack's own accounts "
            "(tp-<stack>-<role>)"
        )


def _check_provider(
    _urn: str, resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if not resource_type.startswith(PROVIDER_PREFIX):
        return
    for key in PROVIDER_CREDENTIAL_KEYS:
        if get(props, key) not in (None, "", []):
            report(f"{MSG_PROVIDER}: {resource_type} sets {key}")


def _any_resource_policy(
    name: str,
    description: str,
    check: Callable[[str, str, Mapping[str, Any], Callable[[str], None]], None],
) -> ResourceValidationPolicy:
    """A mandatory policy over every resource, whatever its type (closed by default)."""

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        check(
            args.urn,
            args.resource_type,
            args.props,
            lambda message: report_violation(message, None),
        )

    return ResourceValidationPolicy(
        name=name,
        description=description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
    )


def _validate_own_targets(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    """Grants on buckets, secrets and service accounts name ones this stack creates: an
    allowed role on someone else's resource (the state bucket, another stack's account) is
    a grant the program never makes."""
    buckets = {
        str(get(r.props, "name"))
        for r in args.resources
        if r.resource_type == BUCKET and get(r.props, "name")
    }
    secrets = {
        str(get(r.props, "secretId"))
        for r in args.resources
        if r.resource_type == SECRET and get(r.props, "secretId")
    }
    accounts = {
        (str(get(r.props, "accountId")), get(r.props, "project"))
        for r in args.resources
        if r.resource_type == ACCOUNT
    }
    repositories = {
        (str(get(r.props, "repositoryId")), get(r.props, "location"))
        for r in args.resources
        if r.resource_type == allowlist.REPOSITORY
    }
    for resource in args.resources:
        type_, props = resource.resource_type, resource.props
        lowered = type_.lower()
        if not is_iam_type(type_):
            continue
        if lowered.startswith("gcp:storage/bucketiam"):
            bucket = str(get(props, "bucket") or "").removeprefix("b/")
            if bucket not in buckets:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: bucket {bucket!r} is not a bucket of this stack",
                    resource.urn,
                )
        elif lowered.startswith("gcp:secretmanager/secretiam"):
            secret = str(get(props, "secretId") or "").rsplit("/", 1)[-1]
            if secret not in secrets:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: secret {secret!r} is not a secret of this stack",
                    resource.urn,
                )
        elif lowered.startswith("gcp:artifactregistry/repositoryiam"):
            repository = str(get(props, "repository") or "").rsplit("/", 1)[-1]
            if (repository, get(props, "location")) not in repositories:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: Artifact Registry repository {repository!r} in "
                    f"{get(props, 'location')!r} is not a repository of this stack",
                    resource.urn,
                )
        elif lowered.startswith("gcp:serviceaccount/iam"):
            target = str(get(props, "serviceAccountId") or "").rsplit("/", 1)[-1]
            local, _, domain = target.partition("@")
            own = any(
                local == account_id
                and (project is None or domain == f"{project}.iam.gserviceaccount.com")
                for account_id, project in accounts
            )
            if not own:
                report_violation(
                    f"{MSG_FOREIGN_TARGET}: service account {target!r} is not an account of "
                    "this stack",
                    resource.urn,
                )


def rules() -> list[Rule]:
    """The closed world's rules, in the pack's order: the allowlists first."""
    return [
        Rule(
            _any_resource_policy(
                "allowed-resource-types",
                "Every resource's type is on the allowlist of its Pulumi project "
                "(policy/allowlist.py); anything else is refused (closed world).",
                _check_allowed_type,
            ),
            MSG_UNKNOWN_TYPE,
        ),
        Rule(
            _any_resource_policy(
                "allowed-apis",
                "Only the APIs the program needs may be enabled (policy/allowlist.py).",
                _check_allowed_api,
            ),
            MSG_UNKNOWN_API,
        ),
        Rule(
            _any_resource_policy(
                "allowed-iam-grants",
                "Every IAM grant (role x principal x resource) is on the allowlist; custom "
                "roles by role id, service-account grants by the account they are on.",
                _check_allowed_grants,
            ),
            MSG_IAM_GRANT,
        ),
        Rule(
            _any_resource_policy(
                "custom-role-permissions",
                "A custom role exists only under an allowed role id and holds only the "
                "permissions listed for it (setIamPolicy, actAs, token or key creation, role "
                "editing are named as escalation paths).",
                _check_custom_role,
            ),
            MSG_CUSTOM_ROLE,
        ),
        Rule(
            _any_resource_policy(
                "vm-accounts-are-stack-accounts",
                "VMs and TPU VMs run as the stack's own service accounts, never as another "
                "account of the project (a CI account, another stack's, a default one).",
                _check_vm_account,
            ),
            MSG_VM_ACCOUNT,
        ),
        Rule(
            _any_resource_policy(
                "providers-without-credentials",
                "Providers use the identity the workflow authenticated: no credentials, "
                "access token or impersonation of their own.",
                _check_provider,
            ),
            MSG_PROVIDER,
        ),
        Rule(
            StackValidationPolicy(
                name="grants-on-own-resources",
                description="Bucket, secret, service-account and image-repository grants are "
                "on resources the same stack creates (never on the state bucket or another "
                "stack's account).",
                validate=_validate_own_targets,
                enforcement_level=EnforcementLevel.MANDATORY,
            ),
            MSG_FOREIGN_TARGET,
        ),
    ]
