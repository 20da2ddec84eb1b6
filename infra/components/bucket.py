from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import executables

# Every object of the bucket, read (get, list): what a VM runs included.
READ_ROLE = "roles/storage.objectViewer"
# Objects only (create, delete, get, list, update, restore; no IAM, no retention), granted
# with the identity's condition of infra/executables.py: nothing another identity executes.
WRITE_ROLE = "roles/storage.objectUser"


def object_grants(
    parent: pulumi.Resource,
    name: str,
    *,
    bucket: pulumi.Input[str],
    bucket_name: str,
    identity: str,
    member: pulumi.Input[str],
) -> list[gcp.storage.BucketIAMMember]:
    """An identity's two grants on the stack's bucket: read everything, write objects
    outside what another identity executes (infra/executables.py write_condition)."""
    child = pulumi.ResourceOptions(parent=parent)
    condition = executables.write_condition(bucket_name, identity)
    return [
        gcp.storage.BucketIAMMember(
            f"{name}-objects-read",
            bucket=bucket,
            role=READ_ROLE,
            member=member,
            opts=child,
        ),
        gcp.storage.BucketIAMMember(
            f"{name}-objects-write",
            bucket=bucket,
            role=WRITE_ROLE,
            member=member,
            condition=gcp.storage.BucketIAMMemberConditionArgs(
                title=condition["title"],
                description=condition["description"],
                expression=condition["expression"],
            ),
            opts=child,
        ),
    ]


@dataclass(frozen=True)
class TrainingBucketArgs:
    project: str
    name: str
    location: str
    soft_delete_seconds: int
    destroy_with_stack: bool
    workload_member: pulumi.Input[str]  # IAM member of the TPU/GPU VM's service account
    controller_member: pulumi.Input[str]  # IAM member of the controller's account
    labels: dict[str, str]
    # The bucket already exists in the project (kept by an earlier `pulumi destroy`): the
    # stack imports it instead of failing to create it (409). See `kept_bucket_exists`.
    adopt: bool = False


def kept_bucket_exists(project: str, name: str) -> bool:
    """Whether the project already has a bucket of this name (a read; storage.buckets.list).

    `pulumi destroy` keeps the bucket (retain_on_delete) and forgets it; a later `up` would
    try to create it again and get 409. With `import` the engine adopts it instead: the
    resource is read, then updated to the program's settings (the engine's import-then-update,
    pulumi/pulumi#19339). While the bucket is in the stack's state with the same id the
    import id is ignored and the resource is treated as usual (pulumi/pulumi#2893), so the
    option is harmless on every later `up`. A bucket of that name in another project is not
    listed: creating it fails as it should."""
    found = gcp.storage.get_buckets(prefix=name, project=project)
    names = [
        getattr(b, "name", None) or (b.get("name") if isinstance(b, dict) else None)
        for b in (found.buckets or [])
    ]
    return name in names


class TrainingBucket(pulumi.ComponentResource):
    """The bucket that holds corpus, payload, job specs and everything a run writes.

    Trained models outlive the stack: unless the stack sets destroyBucketWithStack, the
    bucket is retained on `pulumi destroy` (removed from the state, kept in GCP) and cannot
    be force-destroyed with its contents; the next `pulumi up` adopts it (args.adopt). Soft
    delete keeps overwritten or deleted objects restorable for the configured days."""

    def __init__(
        self, name: str, args: TrainingBucketArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:TrainingBucket", name, None, opts)
        keep = not args.destroy_with_stack
        self.bucket = gcp.storage.Bucket(
            f"{name}-bucket",
            project=args.project,
            name=args.name,
            location=args.location,
            storage_class="STANDARD",
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            soft_delete_policy={"retention_duration_seconds": args.soft_delete_seconds},
            force_destroy=args.destroy_with_stack,
            labels=args.labels,
            opts=pulumi.ResourceOptions(
                parent=self,
                retain_on_delete=keep,
                # The bucket's id in the provider is its name.
                import_=args.name if args.adopt else None,
            ),
        )
        # What a VM executes (the job pointer, the startup scripts, the payload archive, the
        # job specs) is written by the deploy identity alone: infra/executables.py.
        self.grants = [
            grant
            for identity, member in (
                (executables.WORKLOAD, args.workload_member),
                (executables.CONTROLLER, args.controller_member),
            )
            for grant in object_grants(
                self,
                f"{name}-{identity}",
                bucket=self.bucket.name,
                bucket_name=args.name,
                identity=identity,
                member=member,
            )
        ]
        self.name = self.bucket.name
        self.url = self.bucket.url
        self.register_outputs({"name": self.name, "url": self.url})
