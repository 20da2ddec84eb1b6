"""The IAM condition expressions of the bootstrap's conditional bindings.

Written only with what Google's "Attribute reference for IAM Conditions"
(iam/docs/conditions-attribute-reference, "resource.name attribute") documents for
`resource.name`: `startsWith()`, `endsWith()`, `extract()`, `==` and `!=` (no `matches()`),
each scoped by `resource.type` as that page strongly recommends, so a bucket clause is never
satisfied by an object's name and the reverse. Resource types and name formats are those of
Google's "Resource attributes for IAM Conditions" (iam/docs/conditions-resource-attributes):

    storage.googleapis.com/Bucket            projects/_/buckets/<bucket>
    storage.googleapis.com/Object            projects/_/buckets/<bucket>/objects/<object>
    compute.googleapis.com/Instance          projects/<project-id>/zones/<zone>/instances/<vm>

Cloud Storage names carry "_", never the project.
Service accounts, Artifact Registry and Cloud TPU are not on that page ("Other services and
resource types do not recognize resource attributes"): nothing here names them; the
bootstrap grants on those resources themselves.

`extract(template)`: the characters between the first occurrence of the template's prefix
and the first subsequent occurrence of its suffix, or the empty string when either is
missing (the page's table). tests/infra/test_iam_conditions.py evaluates every expression
with a CEL evaluator against the documented name formats, names that must not match
included. Whether IAM accepts each one is shown by the bootstrap's setIamPolicy (IAM refuses
an expression with an undeclared function when it is written) and by `make smoke`'s
preflight (docs/verified-offline-vs-gcp.md).
"""

from __future__ import annotations

BUCKET_TYPE = "storage.googleapis.com/Bucket"
OBJECT_TYPE = "storage.googleapis.com/Object"
INSTANCE_TYPE = "compute.googleapis.com/Instance"

# Every GCP name of a stack starts with "tp-<stack>" (infra/config/config.py).
STACK_PREFIX = "tp-"
# A stack's bucket name ends so (infra/config/config.py STACK_BUCKET_SUFFIX refuses any other), and
# the state bucket's may not (validate_config).
STACK_BUCKET_SUFFIX = "-tpu-pretrain"

# The functions a condition here may call, by Google's attribute reference: on resource.name
# (and on a value extracted from it) startsWith/endsWith/extract; api.getAttribute and the
# list's hasOnly for iam.googleapis.com/modifiedGrantsByRole ("Set limits on granting roles").
DOCUMENTED_FUNCTIONS = frozenset({"startsWith", "endsWith", "extract", "getAttribute", "hasOnly"})


def stack_instance_condition(project: str) -> str:
    """The stacks' VMs in this project: instances named tp-<stack>-... in any zone. A VM of
    the project with another name (the default compute account's, another team's) is out of
    reach: its metadata, account, tags and power state."""
    return (
        f"resource.type == '{INSTANCE_TYPE}'"
        f" && resource.name.extract('projects/{project}/zones/{{zone}}/instances/{STACK_PREFIX}')"
        " != ''"
    )


def stack_bucket_condition() -> str:
    """The stacks' buckets (name ends with STACK_BUCKET_SUFFIX) and the objects in them; never
    the state bucket. An object's clause extracts its bucket (bucket names hold no "/", so the
    first "/objects/" after "/buckets/" ends it): an object whose own name contains
    "-tpu-pretrain/objects/" in another bucket does not match. List permissions
    (storage.objects.list) are checked on the bucket, so they pass through its clause."""
    return (
        f"(resource.type == '{BUCKET_TYPE}'"
        " && resource.name.startsWith('projects/_/buckets/')"
        # nothing after the bucket's name (no "/": not an object's or folder's name)
        " && resource.name.extract('projects/_/buckets/{bucket}/') == ''"
        f" && resource.name.endsWith('{STACK_BUCKET_SUFFIX}'))"
        f" || (resource.type == '{OBJECT_TYPE}'"
        " && resource.name.extract('projects/_/buckets/{bucket}/objects/')"
        f".endsWith('{STACK_BUCKET_SUFFIX}'))"
    )


def modified_grants_only(roles: tuple[str, ...]) -> str:
    """Grants and revocations of these roles only (iam.googleapis.com/modifiedGrantsByRole,
    documented for the allow policies of projects, folders and organizations)."""
    listed = ", ".join(f"'{role}'" for role in roles)
    return f"api.getAttribute('iam.googleapis.com/modifiedGrantsByRole', []).hasOnly([{listed}])"
