from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp


@dataclass(frozen=True)
class TrainingBucketArgs:
    project: str
    name: str
    location: str
    soft_delete_seconds: int
    destroy_with_stack: bool
    object_admin: pulumi.Input[str]  # IAM member of the TPU VM's service account
    controller_object_admin: pulumi.Input[str]  # IAM member of the controller's account
    labels: dict[str, str]


class TrainingBucket(pulumi.ComponentResource):
    """The bucket that holds corpus, payload, job specs and everything a run writes.

    Trained models outlive the stack: unless the stack sets destroyBucketWithStack, the
    bucket is retained on `pulumi destroy` (removed from the state, kept in GCP) and cannot
    be force-destroyed with its contents. Soft delete keeps overwritten or deleted objects
    restorable for the configured days."""

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
            opts=pulumi.ResourceOptions(parent=self, retain_on_delete=keep),
        )
        self.object_admin = gcp.storage.BucketIAMMember(
            f"{name}-object-admin",
            bucket=self.bucket.name,
            role="roles/storage.objectAdmin",
            member=args.object_admin,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.controller_object_admin = gcp.storage.BucketIAMMember(
            f"{name}-object-admin-controller",
            bucket=self.bucket.name,
            role="roles/storage.objectAdmin",
            member=args.controller_object_admin,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.name = self.bucket.name
        self.url = self.bucket.url
        self.register_outputs({"name": self.name, "url": self.url})
