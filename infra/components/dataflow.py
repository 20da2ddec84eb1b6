"""Dataflow for encoding at scale (tpu-pretrain:dataflow; docs/deploy-gcp.md, "Dataflow
(encoding at scale)").

What a Dataflow job of the stack needs, and nothing more (Google's "Dataflow security and
permissions" and "Access control with IAM" pages, dataflow/docs/concepts/...):
- a worker service account of its own (never the default compute account): the Dataflow
  Worker role on the project, which Google documents as the role "for a Compute Engine
  service account to execute work units for a Dataflow pipeline" that "should typically only
  be assigned to such an account" (dataflow.workItems.lease/update/sendMessage), as the
  custom role WORKER_ROLE_ID without the role's object create/get on every bucket, and object
  read/write on the stack's bucket only (corpus in, shards out, temp files): read on every
  object, write under the IAM condition of infra/executables.py (never what a VM or the
  launcher runs: the job pointer, startup scripts, payload, job specs, the accelerator
  VM's wheelhouse, the job's staged files). The write role is roles/storage.objectUser
  (objects only, no IAM): Beam writes files under a temp name and renames them (copy +
  delete), so create without delete is not enough;
- the launcher (the controller's account) may create and manage jobs. Google's Dataflow
  roles page (iam/docs/roles-permissions/dataflow) calls Dataflow Admin (roles/dataflow.admin)
  the "minimal role for creating and managing dataflow jobs": it is Dataflow Developer
  (roles/dataflow.developer) plus compute.machineTypes.get, storage.buckets.get and
  storage.objects.create/get/list. The launcher gets Developer and the bootstrap's custom
  role tpuPretrainDataflowLauncher with the two project-level reads (LAUNCHER_EXTRA_PERMISSIONS);
  the objects it needs are those of the stack's bucket, which it holds there already
  (infra/components/bucket.py: read, and write outside what only the deploy identity
  writes; it stages the job's files), so Admin's object permissions on every bucket of the
  project (the Pulumi state bucket among them) are not granted. It may act as the worker
  account, a grant on that one account (never roles/iam.serviceAccountUser on the project,
  which would be actAs on every account of the project);
- workers talk to each other on TCP 12345-12346 (Google's "Configure internet access and
  firewall rules" for Dataflow: an ingress rule between VMs with the network tag `dataflow`,
  which Dataflow puts on its workers); they have no public IPs (job option
  no_use_public_ips, infra.jobspec.dataflow_options) and reach Cloud Storage and Google APIs
  through the subnet's Private Google Access (infra/components/network.py);
- the workers' container image (the payload requires `sdk_container_image` with
  DataflowRunner: its own code is not on PyPI and workers without public IPs install nothing,
  docs/encoding-at-scale.md) lives in an Artifact Registry Docker repository
  "tp-<stack>-dataflow" in the stack's region. The stack neither creates it nor grants on it:
  Artifact Registry is not among the services whose resource names an IAM condition can test
  (Google's "Resource attributes for IAM Conditions"), so the deploy account could only manage
  a repository and its IAM policy with permissions on every repository of the project. The
  person who builds and pushes the image (docs/deploy-gcp.md, "The workers' image") creates
  the repository (tags immutable) and grants the worker account roles/artifactregistry.reader
  on it, a repository-level grant (Artifact Registry's "Integrate with Compute Engine" page
  names the reader role for a VM's account that pulls images); the preview says so in one
  line (infra/program.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import executables
from infra.components.bucket import object_grants
from infra.components.identity import (
    ServiceIdentity,
    ServiceIdentityArgs,
    account_display_name,
)

DATAFLOW_API = "dataflow.googleapis.com"
# Google's roles/dataflow.worker less storage.objects.create and .get, which on the project
# would reach every object of every bucket (what a VM runs included: docs/guard-rails.md,
# "What a VM runs"), and less its compute.* on every VM; a custom role the GitOps bootstrap
# creates (infra/bootstrap/bootstrap_roles.py DATAFLOW_WORKER_PERMISSIONS, or the one-time
# gcloud command in docs/deploy-gcp.md). The workers' objects come from the bucket grants
# below.
WORKER_ROLE_ID = "tpuPretrainDataflowWorker"
LAUNCHER_ROLE = "roles/dataflow.developer"
# What Dataflow Admin adds to Developer at project level, read-only (Google's Dataflow roles
# page); a custom role the GitOps bootstrap creates (infra/bootstrap/bootstrap_roles.py
# DATAFLOW_LAUNCHER_ROLE_ID, or the one-time gcloud command in docs/deploy-gcp.md).
LAUNCHER_EXTRA_ROLE_ID = "tpuPretrainDataflowLauncher"
LAUNCHER_EXTRA_PERMISSIONS = ("compute.machineTypes.get", "storage.buckets.get")
ACT_AS_ROLE = "roles/iam.serviceAccountUser"
# Google's Dataflow firewall page: the tag Dataflow gives its worker VMs, and the ports of
# worker-to-worker traffic (12345 streaming, 12346 batch shuffle without Dataflow Shuffle).
WORKER_TAG = "dataflow"
WORKER_PORTS = "12345-12346"
IMAGE_REGISTRY_API = "artifactregistry.googleapis.com"
IMAGE_READER_ROLE = "roles/artifactregistry.reader"  # granted by the image's builder


def launcher_extra_role_name(project: str) -> str:
    return f"projects/{project}/roles/{LAUNCHER_EXTRA_ROLE_ID}"


def worker_role_name(project: str) -> str:
    return f"projects/{project}/roles/{WORKER_ROLE_ID}"


# The image's name in the repository; its tag is the payload archive's digest (below).
IMAGE_NAME = "encode"


def worker_account_id(prefix: str) -> str:
    return f"{prefix}-dataflow"


def worker_email(prefix: str, project: str) -> str:
    """The worker account's email, as IAM forms it (ACCOUNT_ID@PROJECT.iam.gserviceaccount.com):
    known before the account exists, so the job spec can name it (infra.jobspec)."""
    return f"{worker_account_id(prefix)}@{project}.iam.gserviceaccount.com"


def repository_id(prefix: str) -> str:
    return f"{prefix}-dataflow"


def image_tag(payload_sha256: str) -> str:
    """The image's tag: the first 16 hex digits of the payload archive's sha256, the same as
    in the archive's name (infra.render.render.PayloadArchive, tpu-pretrain-payload-<that>.tar.gz),
    so a job names exactly the image built from the source it runs."""
    return payload_sha256[:16]


def image_uri(region: str, project: str, prefix: str, payload_sha256: str) -> str:
    """Artifact Registry's Docker image path (LOCATION-docker.pkg.dev/PROJECT/REPOSITORY/
    IMAGE:TAG, Artifact Registry's "Push and pull images" page): known before the
    repository exists, so the job spec can name it (infra.jobspec.DataflowTarget)."""
    return (
        f"{region}-docker.pkg.dev/{project}/{repository_id(prefix)}/{IMAGE_NAME}:"
        f"{image_tag(payload_sha256)}"
    )


@dataclass(frozen=True)
class DataflowAccessArgs:
    project: str
    prefix: str  # tp-<stack>
    stack: str
    bucket: pulumi.Input[str]  # the stack's bucket (its name, as an output of the bucket)
    bucket_name: str  # the same name, known to the program (the grant's IAM condition)
    launcher_member: pulumi.Input[str]  # the controller's account (serviceAccount:...)
    network: pulumi.Input[str]  # the stack's VPC (id)
    network_name: str
    # tpu-pretrain:accountsFromBootstrap: the GitOps bootstrap owns the worker account and
    # made the launcher's actAs on it; the stack adopts the account and grants nothing on it.
    accounts_from_bootstrap: bool = False


class DataflowAccess(pulumi.ComponentResource):
    """The worker account with its grants (the worker role, read and write on the bucket),
    the launcher's three grants and the firewall rule between workers. The Dataflow and
    Artifact Registry APIs themselves are in ProjectApis (program.py); the image repository
    is not the stack's (module docstring)."""

    def __init__(
        self, name: str, args: DataflowAccessArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:DataflowAccess", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.worker = ServiceIdentity(
            f"{name}-worker-identity",
            ServiceIdentityArgs(
                project=args.project,
                account_id=worker_account_id(args.prefix),
                display_name=account_display_name(args.stack, "dataflow"),
                # The worker role (what Google documents for a worker account, less its
                # object permissions on every bucket); no other project role.
                reporting_roles=(),
                adopted=args.accounts_from_bootstrap,
            ),
            opts=child,
        )
        self.worker_role = gcp.projects.IAMMember(
            f"{name}-worker",
            project=args.project,
            role=worker_role_name(args.project),
            member=self.worker.member,
            opts=child,
        )
        self.worker_objects = object_grants(
            self,
            f"{name}-worker",
            bucket=args.bucket,
            bucket_name=args.bucket_name,
            identity=executables.DATAFLOW,
            member=self.worker.member,
        )
        self.launcher_role = gcp.projects.IAMMember(
            f"{name}-launcher",
            project=args.project,
            role=LAUNCHER_ROLE,
            member=args.launcher_member,
            opts=child,
        )
        self.launcher_reads = gcp.projects.IAMMember(
            f"{name}-launcher-reads",
            project=args.project,
            role=launcher_extra_role_name(args.project),
            member=args.launcher_member,
            opts=child,
        )
        self.launcher_acts_as_worker = (
            None
            if args.accounts_from_bootstrap
            else gcp.serviceaccount.IAMMember(
                f"{name}-launcher-acts-as-worker",
                service_account_id=self.worker.resource_name,
                role=ACT_AS_ROLE,
                member=args.launcher_member,
                opts=child,
            )
        )
        self.workers_rule = gcp.compute.Firewall(
            f"{name}-allow-workers",
            project=args.project,
            name=f"{args.network_name}-allow-dataflow",
            network=args.network,
            direction="INGRESS",
            allows=[{"protocol": "tcp", "ports": [WORKER_PORTS]}],
            source_tags=[WORKER_TAG],
            target_tags=[WORKER_TAG],
            log_config={"metadata": "INCLUDE_ALL_METADATA"},
            opts=child,
        )
        self.worker_email = self.worker.email
        self.register_outputs({"workerEmail": self.worker_email})
