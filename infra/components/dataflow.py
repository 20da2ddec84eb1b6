"""Dataflow for encoding at scale (tpu-pretrain:dataflow; docs/deploy-gcp.md, "Dataflow
(encoding at scale)").

What a Dataflow job of the stack needs, and nothing more (Google's "Dataflow security and
permissions" and "Access control with IAM" pages, dataflow/docs/concepts/...):
- a worker service account of its own (never the default compute account): the Dataflow
  Worker role on the project, which Google documents as the role "for a Compute Engine
  service account to execute work units for a Dataflow pipeline" that "should typically only
  be assigned to such an account" (dataflow.workItems.lease/update/sendMessage), and object
  read/write on the stack's bucket only (corpus in, shards out, staging and temp files);
- the launcher (the controller's account) may create and manage jobs (roles/dataflow.developer:
  dataflow.* and resourcemanager.projects.get/list). Google calls Dataflow Admin the minimal
  set for running jobs; it adds compute.machineTypes.get, storage.buckets.get and object
  create/get/list on every bucket of the project: the controller has the objects of the
  stack's bucket already (storage.objectAdmin), and whether a launch needs the other two is
  what only a real job shows (docs/verified-offline-vs-gcp.md). It may act as the worker
  account, a grant
  on that one account (never roles/iam.serviceAccountUser on the project, which would be
  actAs on every account of the project);
- workers talk to each other on TCP 12345-12346 (Google's "Configure internet access and
  firewall rules" for Dataflow: an ingress rule between VMs with the network tag `dataflow`,
  which Dataflow puts on its workers); they have no public IPs (job option
  no_use_public_ips, infra.jobspec.dataflow_options) and reach Cloud Storage and Google APIs
  through the subnet's Private Google Access (infra/components/network.py);
- the workers' container image (the payload requires `sdk_container_image` with
  DataflowRunner: its own code is not on PyPI and workers without public IPs install nothing,
  docs/encoding-at-scale.md): an Artifact Registry Docker repository of the stack in its
  region, which only the worker account may read (roles/artifactregistry.reader on that
  repository: Artifact Registry's "Integrate with Compute Engine" page names the reader role
  for a VM's account that pulls images, and a repository-level grant for one repository;
  that Dataflow workers pull as the worker account is what only a real job shows). No account of the
  stack may write it: the user builds and pushes the image (docs/deploy-gcp.md), with a
  writer grant on this one repository that the stack does not make; a writer grant to the
  controller would let whatever runs there replace the code every worker runs as the
  worker account, and the controller has no Docker to build with.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.components.identity import ServiceIdentity, ServiceIdentityArgs

DATAFLOW_API = "dataflow.googleapis.com"
WORKER_ROLE = "roles/dataflow.worker"
LAUNCHER_ROLE = "roles/dataflow.developer"
ACT_AS_ROLE = "roles/iam.serviceAccountUser"
# Objects only (get, list, create, delete, update), no IAM: Beam writes files under a temp
# name and renames them (copy + delete), so create without delete is not enough.
WORKER_BUCKET_ROLE = "roles/storage.objectUser"
# Google's Dataflow firewall page: the tag Dataflow gives its worker VMs, and the ports of
# worker-to-worker traffic (12345 streaming, 12346 batch shuffle without Dataflow Shuffle).
WORKER_TAG = "dataflow"
WORKER_PORTS = "12345-12346"
IMAGE_REGISTRY_API = "artifactregistry.googleapis.com"
IMAGE_READER_ROLE = "roles/artifactregistry.reader"
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
    in the archive's name (infra.render.PayloadArchive, tpu-pretrain-payload-<that>.tar.gz),
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
    bucket: pulumi.Input[str]  # the stack's bucket name
    launcher_member: pulumi.Input[str]  # the controller's account (serviceAccount:...)
    network: pulumi.Input[str]  # the stack's VPC (id)
    network_name: str
    region: str  # the stack's region (the bucket's): the image repository's location
    labels: dict[str, str]


class DataflowAccess(pulumi.ComponentResource):
    """The worker account with its two grants, the launcher's two grants, the firewall rule
    between workers, and the workers' image repository with its one read grant. The Dataflow
    and Artifact Registry APIs themselves are in ProjectApis (program.py)."""

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
                display_name=f"tpu-pretrain {args.stack}: Dataflow workers",
                # roles/dataflow.worker is what Google documents for a worker account; no
                # other project role.
                reporting_roles=(),
            ),
            opts=child,
        )
        self.worker_role = gcp.projects.IAMMember(
            f"{name}-worker",
            project=args.project,
            role=WORKER_ROLE,
            member=self.worker.member,
            opts=child,
        )
        self.worker_objects = gcp.storage.BucketIAMMember(
            f"{name}-worker-objects",
            bucket=args.bucket,
            role=WORKER_BUCKET_ROLE,
            member=self.worker.member,
            opts=child,
        )
        self.launcher_role = gcp.projects.IAMMember(
            f"{name}-launcher",
            project=args.project,
            role=LAUNCHER_ROLE,
            member=args.launcher_member,
            opts=child,
        )
        self.launcher_acts_as_worker = gcp.serviceaccount.IAMMember(
            f"{name}-launcher-acts-as-worker",
            service_account_id=self.worker.resource_name,
            role=ACT_AS_ROLE,
            member=args.launcher_member,
            opts=child,
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
        # Inputs as pulumi-gcp 10.2 documents them (artifactregistry/repository.py): format
        # DOCKER, mode STANDARD_REPOSITORY (its default, written out: not a remote or virtual
        # repository that would pull from elsewhere), docker_config.immutable_tags.
        self.image_repository = gcp.artifactregistry.Repository(
            f"{name}-images",
            project=args.project,
            location=args.region,
            repository_id=repository_id(args.prefix),
            format="DOCKER",
            mode="STANDARD_REPOSITORY",
            description=f"tpu-pretrain {args.stack}: the Dataflow workers' container image",
            # A tag, once pushed, always names the same image: the tag is the payload's
            # digest, so a job can never run an image rebuilt from other source under it.
            docker_config={"immutable_tags": True},
            labels=args.labels,
            opts=child,
        )
        # No cleanup policy: a job spec of an earlier payload version names its own image,
        # and deleting it would break a re-run of that job; old images are deleted by hand.
        self.image_reader = gcp.artifactregistry.RepositoryIamMember(
            f"{name}-image-reader",
            project=args.project,
            location=self.image_repository.location,
            repository=self.image_repository.repository_id,
            role=IMAGE_READER_ROLE,
            member=self.worker.member,
            opts=child,
        )
        self.worker_email = self.worker.email
        self.register_outputs(
            {"workerEmail": self.worker_email, "imageRepository": self.image_repository.name}
        )
