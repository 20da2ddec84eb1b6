from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_gcp as gcp


@dataclass(frozen=True)
class PayloadDeliveryArgs:
    bucket: pulumi.Input[str]
    archive_path: Path  # the content-addressed archive built by infra.render
    archive_object: str  # payload/<name>-<sha256>.tar.gz
    job_object: str  # jobs/<job>.json
    job_spec_json: str


class PayloadDelivery(pulumi.ComponentResource):
    """Uploads the payload source archive and the rendered job spec to the bucket. The
    archive name carries its sha256, so a changed payload is a new object and VMs can tell
    which version they run."""

    def __init__(
        self, name: str, args: PayloadDeliveryArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:PayloadDelivery", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.archive = gcp.storage.BucketObject(
            f"{name}-archive",
            bucket=args.bucket,
            name=args.archive_object,
            source=pulumi.FileAsset(str(args.archive_path)),
            content_type="application/gzip",
            opts=child,
        )
        self.job_spec = gcp.storage.BucketObject(
            f"{name}-job-spec",
            bucket=args.bucket,
            name=args.job_object,
            content=args.job_spec_json,
            content_type="application/json",
            opts=child,
        )
        self.payload_uri = pulumi.Output.concat(
            "gs://", self.archive.bucket, "/", self.archive.name
        )
        self.job_uri = pulumi.Output.concat("gs://", self.job_spec.bucket, "/", self.job_spec.name)
        self.register_outputs({"payloadUri": self.payload_uri, "jobUri": self.job_uri})
