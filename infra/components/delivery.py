from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_gcp as gcp

from infra.render import render


@dataclass(frozen=True)
class PayloadDeliveryArgs:
    bucket: pulumi.Input[str]
    archive_path: Path  # the content-addressed archive built by infra.render
    archive_object: str  # payload/<name>-<sha256>.tar.gz
    job_object: str  # jobs/<job>.json
    job_spec_json: str


# What a pointer names is never deleted by `pulumi up` (retain_on_delete: a replaced or
# dropped object leaves the stack's state, not the bucket). A VM that read the previous
# pointer a moment before `pulumi up` switched it still finds the script and archive it
# names; and an object whose content changes under the same name (the pointer, a job spec)
# is overwritten in one write instead of deleted and created again (the provider replaces an
# object with an explicit name by deleting it first). Superseded scripts and archives are
# content-addressed and small (the archive ~200 KB); docs/gitops.md says how to prune them.
KEEP = pulumi.ResourceOptions(retain_on_delete=True)


class PayloadDelivery(pulumi.ComponentResource):
    """Uploads the payload source archive and the rendered job spec to the bucket. The
    archive name carries its sha256, so a changed payload is a new object and VMs can tell
    which version they run."""

    def __init__(
        self, name: str, args: PayloadDeliveryArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:PayloadDelivery", name, None, opts)
        child = pulumi.ResourceOptions.merge(KEEP, pulumi.ResourceOptions(parent=self))
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


@dataclass(frozen=True)
class StartupDeliveryArgs:
    bucket: pulumi.Input[str]
    # role -> its rendered startup script (render_tpu_script, render_gpu_script,
    # render_controller_script); the controller's is an Output (its watchdog's network ids).
    scripts: Mapping[str, pulumi.Input[str]]
    pointer: Callable[[Mapping[str, str]], str]  # scripts -> jobs/current.json (render_pointer)


class StartupDelivery(pulumi.ComponentResource):
    """Each role's rendered startup script as a bucket object named by its digest
    (startup/<role>-<sha>.sh), and the job pointer jobs/current.json that names them, the
    payload archive and the job (infra/render/render.py render_pointer). The VMs' metadata
    holds only the loader (templates/loader.sh), which reads the pointer on every boot: a new
    payload or job rewrites these objects and no VM input."""

    def __init__(
        self, name: str, args: StartupDeliveryArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:StartupDelivery", name, None, opts)
        child = pulumi.ResourceOptions.merge(KEEP, pulumi.ResourceOptions(parent=self))
        roles = sorted(args.scripts)
        scripts = [pulumi.Output.from_input(args.scripts[role]) for role in roles]
        self.scripts = [
            gcp.storage.BucketObject(
                f"{name}-{role}-script",
                bucket=args.bucket,
                name=script.apply(functools.partial(render.startup_object_name, role)),
                content=script,
                content_type="text/x-shellscript",
                opts=child,
            )
            for role, script in zip(roles, scripts, strict=True)
        ]
        content = pulumi.Output.all(*scripts).apply(
            lambda texts: args.pointer(dict(zip(roles, texts, strict=True)))
        )
        # Written after the scripts it names, so a VM never reads a pointer to a missing one.
        self.pointer = gcp.storage.BucketObject(
            f"{name}-pointer",
            bucket=args.bucket,
            name=render.POINTER_OBJECT,
            content=content,
            content_type="application/json",
            opts=pulumi.ResourceOptions.merge(
                child, pulumi.ResourceOptions(depends_on=list(self.scripts))
            ),
        )
        self.pointer_uri = pulumi.Output.concat(
            "gs://", self.pointer.bucket, "/", self.pointer.name
        )
        self.register_outputs({"pointerUri": self.pointer_uri})
