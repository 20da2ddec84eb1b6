"""The rule family "what a VM runs comes only from the deploy identity" (docs/guard-rails.md,
"What a VM runs"): no grant lets a VM's or a Dataflow worker's account write what a VM of
the stack executes or installs, nor another identity what the accelerator VM's trainer reads
back (every job's compilation cache, checkpoints, export), nor any the watchdog's lease.

The table of protected prefixes is infra/executables.py's, copied here: the pack runs from
policy/ without the program (its own environment, policy/requirements.txt), and
tests/policy/test_executables_policy.py checks that the two are the same. A grant that could
write objects is judged by where it is made:
- on a bucket: only roles/storage.objectUser, and only with exactly the condition the program
  writes for that identity and that bucket (objects only, none under a prefix the identity
  may not write); read-only roles pass. Any other role (objectAdmin, objectCreator, the
  legacy bucket roles, a custom role) or any other condition is refused: IAM adds allow
  policies up, so one unconditional grant reopens what every condition closes.
- on a managed folder: only read-only roles (a managed folder's policy adds to the bucket's).
- on the project (or a folder or organization): only roles known to carry no object, folder
  or bucket-policy write (the list below, and custom roles whose allowlisted permissions
  have none), whatever the condition: the pack cannot evaluate a project-level condition
  against every object.
- an object or bucket ACL naming the account as writer or owner.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from . import allowlist
    from .resources import Rule
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    import allowlist  # type: ignore[no-redef]
    from resources import Rule  # type: ignore[no-redef]

NAME = "vm-accounts-write-no-executables"
MSG = "a VM or worker account could write what a VM runs"

OBJECT_TYPE = "storage.googleapis.com/Object"
WORKLOAD, CONTROLLER, DATAFLOW = "workload", "controller", "dataflow"
# (prefix, the identities besides the deploy identity that may write it): infra/executables.py
# PROTECTED.
PROTECTED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("jobs/", ()),
    ("startup/", ()),
    ("payload/", ()),
    ("wheelhouse/", (CONTROLLER,)),
    ("dataflow/staging/", (CONTROLLER,)),
    ("dataflow/tmp/", (CONTROLLER, DATAFLOW)),
    # Of every job ({job}): what the accelerator VM's trainer reads back, and Pulumi's lease.
    ("runs/{job}/compilation-cache/", (WORKLOAD,)),
    ("runs/{job}/checkpoints/", (WORKLOAD,)),
    ("runs/{job}/export/", (WORKLOAD,)),
    ("runs/{job}/bootstrap/tpu-watch-lease", ()),
)
JOB = "{job}"
WRITE_ROLE = "roles/storage.objectUser"
READ_ONLY_ROLES = frozenset(
    {
        "roles/storage.objectViewer",
        "roles/storage.legacyObjectReader",
        "roles/storage.legacyBucketReader",
    }
)
# Predefined project roles the stacks grant their accounts that hold no storage permission
# (Google's role pages: logging, monitoring, dataflow.developer = dataflow.* and project reads).
# roles/dataflow.worker is not among them: it holds storage.objects.create on the whole
# project (the workers get the bootstrap's tpuPretrainDataflowWorker instead).
PROJECT_ROLES_WITHOUT_WRITES = frozenset(
    {"roles/logging.logWriter", "roles/monitoring.metricWriter", "roles/dataflow.developer"}
)
# Permissions that write objects, folders or who may do so.
WRITE_PERMISSION = re.compile(
    r"storage\.(objects\.(create|update|delete|move|restore|setIamPolicy|setRetention|"
    r"overrideUnlockedRetention)|managedFolders\.(create|delete|setIamPolicy)|folders\..*|"
    r"multipartUploads\.create|buckets\.(update|setIamPolicy|delete))|\*"
)
_ACCOUNT = re.compile(
    r"(?:serviceAccount:)?tp-[a-z0-9-]+-(workload|controller|dataflow|vpn-hop)"
    r"@[a-z][a-z0-9-]{4,28}[a-z0-9]\.iam\.gserviceaccount\.com",
    re.IGNORECASE,
)
_CUSTOM_ROLE = re.compile(r"^projects/[^/]+/roles/([^/]+)$")


def protected_from(identity: str) -> list[str]:
    return [prefix for prefix, writers in PROTECTED if identity not in writers]


def _under(bucket: str, prefix: str) -> str:
    objects = f"projects/_/buckets/{bucket}/objects/"
    if JOB in prefix:  # runs/{job}/<path>: extracted as runs{job}/<path>, never "" for a job's
        return f"resource.name.extract('{objects}{prefix.replace('/' + JOB, JOB, 1)}') != ''"
    return f"resource.name.startsWith('{objects}{prefix}')"


def expected_expression(bucket: str, identity: str) -> str:
    """The condition the program writes (infra/executables.py write_expression): objects
    only, and under none of the prefixes the identity may not write."""
    under = " || ".join(_under(bucket, prefix) for prefix in protected_from(identity))
    return f"resource.type == '{OBJECT_TYPE}' && !({under})"


def identity_of(member: str) -> str | None:
    """workload | controller | dataflow | vpn-hop for a stack account, else None."""
    match = _ACCOUNT.fullmatch(member.strip())
    return match.group(1).lower() if match else None


def _get(value: Any, *path: str) -> Any:
    for step in path:
        if isinstance(value, Mapping) and step in value:
            value = value[step]
        else:
            return None
    return value


def _grants(props: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(role, member, condition expression or "") of an IAM member/binding/policy."""
    role = str(_get(props, "role") or "")
    expression = _get(props, "condition", "expression")
    condition = expression if isinstance(expression, str) else ""
    member = _get(props, "member")
    if isinstance(member, str):
        yield role, member, condition
    members = _get(props, "members")
    if isinstance(members, Sequence) and not isinstance(members, str):
        for item in members:
            yield role, str(item), condition
    policy_data = _get(props, "policyData")
    if isinstance(policy_data, str) and policy_data.strip():
        try:
            policy = json.loads(policy_data)
        except json.JSONDecodeError:
            return
        for binding in policy.get("bindings", []) if isinstance(policy, dict) else []:
            bound = str((binding.get("condition") or {}).get("expression") or "")
            for item in binding.get("members", []):
                yield str(binding.get("role", "")), str(item), bound


def _project_role_writes(role: str) -> bool:
    if role in PROJECT_ROLES_WITHOUT_WRITES:
        return False
    match = _CUSTOM_ROLE.match(role)
    if match:
        permissions = allowlist.BOOTSTRAP.custom_roles.get(match.group(1))
        return permissions is None or any(WRITE_PERMISSION.fullmatch(p) for p in permissions)
    return True  # a predefined role not known to be without writes: it may hold them


def problems(resource_type: str, props: Mapping[str, Any]) -> Iterator[str]:
    """What makes this resource let a VM or worker account write what a VM runs."""
    lowered = resource_type.lower()
    if "storage/" in lowered and ("acl" in lowered or "accesscontrol" in lowered):
        yield from _acl_problems(props)
        return
    if not any(kind in lowered for kind in ("iammember", "iambinding", "iampolicy")):
        return
    for role, member, condition in _grants(props):
        identity = identity_of(member)
        if identity is None or role in READ_ONLY_ROLES:
            continue
        who = f"{role} to {member}"
        if lowered.startswith("gcp:storage/bucketiam"):
            bucket = str(_get(props, "bucket") or "").removeprefix("b/")
            if identity == "vpn-hop":
                yield f"{who} on bucket {bucket}: the VPN hop's account has no bucket access"
                continue
            expected = expected_expression(bucket, identity)
            if role != WRITE_ROLE or condition.strip() != expected:
                yield (
                    f"{who} on bucket {bucket} lets it write "
                    f"{', '.join(protected_from(identity))}; a stack account writes objects "
                    f"only as {WRITE_ROLE} with the condition {expected!r} "
                    "(infra/executables.py), beside roles/storage.objectViewer"
                )
        elif lowered.startswith("gcp:storage/managedfolderiam"):
            yield f"{who} on a managed folder: stack accounts get read-only roles there"
        elif lowered.startswith(
            ("gcp:projects/", "gcp:folder/", "gcp:organizations/")
        ) and _project_role_writes(role):
            yield (
                f"{who} on the {lowered.split(':')[1].split('/')[0]}: a role the pack does "
                "not know to be without object writes, which would reach every bucket (what a "
                "VM runs included) whatever its condition; grant object writes on the stack's "
                "bucket only"
            )


def _acl_problems(props: Mapping[str, Any]) -> Iterator[str]:
    entries: list[tuple[str, str]] = []
    role, entity = _get(props, "role"), _get(props, "entity")
    if isinstance(entity, str):
        entries.append((str(role or ""), entity))
    role_entities = _get(props, "roleEntities")
    if isinstance(role_entities, Sequence) and not isinstance(role_entities, str):
        for item in role_entities:
            if isinstance(item, str) and ":" in item:
                acl_role, acl_entity = item.split(":", 1)
                entries.append((acl_role, acl_entity))
    for acl_role, acl_entity in entries:
        account = acl_entity.strip().removeprefix("user-")
        if identity_of(account) and acl_role.upper() in ("WRITER", "OWNER"):
            yield f"ACL {acl_role} to {acl_entity}: a stack account may not write objects by ACL"


def _validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    report: Callable[[str], None] = lambda message: report_violation(f"{MSG}: {message}", None)  # noqa: E731
    for problem in problems(args.resource_type, args.props):
        report(problem)


def rules() -> list[Rule]:
    return [
        Rule(
            ResourceValidationPolicy(
                name=NAME,
                description=(
                    "No grant lets a VM's or a Dataflow worker's account write what a VM of the "
                    "stack runs (the job pointer, startup scripts, payload archive, job specs, "
                    "the watchdog's lease; the wheelhouse and Dataflow staging for all but the "
                    "controller; every job's compilation cache, checkpoints and export for all "
                    "but the accelerator VM): on the "
                    "bucket only objectViewer and objectUser with the program's exact "
                    "condition, no object-writing role on the project, a managed folder or by "
                    "ACL."
                ),
                validate=_validate,
                enforcement_level=EnforcementLevel.MANDATORY,
            ),
            MSG,
        ),
    ]
