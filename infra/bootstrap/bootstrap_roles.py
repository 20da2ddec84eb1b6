"""The GitOps bootstrap's roles: the ids and permissions of the custom roles it creates, the
roles its accounts hold on the project or may grant there, the grants on the stacks' accounts,
and those accounts' names.

gitops_bootstrap.py creates them (define); the deploy account's permissions are derived from
deploy_permissions.py (PERMISSIONS_BY_TYPE), its conditions are iam_conditions.py's. Imported
as a top-level module like its siblings: the Pulumi CLI runs the bootstrap from this directory
(__main__.py). The main program (infra/) never imports it: it names the roles it binds itself
(infra/components/recovery.py, dataflow.py, identity.py; tests compare the two).
"""

from __future__ import annotations

from deploy_permissions import PERMISSIONS_BY_TYPE
from iam_conditions import STACK_PREFIX

DEPLOYER_ROLE_ID = "tpuPretrainDeployer"
IAM_GRANTER_ROLE_ID = "tpuPretrainIamGranter"  # project IAM writes, limited roles
STACK_ACCOUNT_USER_ROLE_ID = "tpuPretrainStackAccountUser"  # actAs on the stacks' accounts
STACK_INSTANCE_ROLE_ID = "tpuPretrainStackInstances"  # the stacks' own VMs only
STACK_BUCKET_ROLE_ID = "tpuPretrainStackBuckets"  # the stacks' own buckets and objects only
# The main program binds this role by name (infra/components/recovery.py RECOVERY_ROLE_ID).
RECOVERY_ROLE_ID = "tpuPretrainTpuRecovery"
# ... and this one for GPU stacks (infra/components/recovery.py GPU_RECOVERY_ROLE_ID).
GPU_RECOVERY_ROLE_ID = "tpuPretrainGpuRecovery"
# ... and this one, with roles/dataflow.developer, for the launcher of stacks with
# tpu-pretrain:dataflow (infra/components/dataflow.py LAUNCHER_EXTRA_ROLE_ID).
DATAFLOW_LAUNCHER_ROLE_ID = "tpuPretrainDataflowLauncher"
# ... and this one to the Dataflow workers of those stacks, instead of roles/dataflow.worker
# (infra/components/dataflow.py WORKER_ROLE_ID).
DATAFLOW_WORKER_ROLE_ID = "tpuPretrainDataflowWorker"

# What the controller's TPU watchdog (infra/render/templates/tpu-watch.sh) calls: `gcloud compute
# tpus tpu-vm describe/list/create/delete` and `gcloud compute tpus queued-resources
# create/describe/list/delete`, waiting on their long-running operations. Names as in the
# Cloud TPU REST reference (projects.locations.nodes / queuedResources / operations) and the
# Terraform provider's permission maps; attaching the TPU VM's account to the recreated VM
# needs iam.serviceAccounts.actAs, granted on that one account by the program.
RECOVERY_PERMISSIONS = (
    "tpu.nodes.create",
    "tpu.nodes.delete",
    "tpu.nodes.get",
    "tpu.nodes.list",
    "tpu.operations.get",
    "tpu.queuedResources.create",
    "tpu.queuedResources.delete",
    "tpu.queuedResources.get",
    "tpu.queuedResources.list",
)
# What the controller's GPU watchdog (infra/render/templates/gpu-watch.sh) calls: `gcloud compute
# instances describe`, `start --async` (no operation polling), `get-guest-attributes` (the
# VM's boot state) and `stop --async` (a VM whose boot failed bills while idle). Names as in
# the Compute Engine REST reference (instances.get, .start, .getGuestAttributes, .stop). The
# program grants this role on the project with an IAM condition naming the one GPU VM.
GPU_RECOVERY_PERMISSIONS = (
    "compute.instances.get",
    "compute.instances.getGuestAttributes",
    "compute.instances.start",
    "compute.instances.stop",
)
# What Dataflow Admin, "minimal role for creating and managing dataflow jobs" (Google's
# Dataflow roles page, iam/docs/roles-permissions/dataflow), holds beyond Dataflow Developer
# at project level, less its object permissions on every bucket (the launcher has those on
# the stack's bucket): both read-only.
DATAFLOW_LAUNCHER_PERMISSIONS = (
    "compute.machineTypes.get",
    "storage.buckets.get",
)
# roles/dataflow.worker as Google defines it (its includedPermissions, `gcloud iam roles
# describe roles/dataflow.worker`), less what reaches beyond the worker's own job when granted
# on the project, as this role is:
# - storage.objects.create and .get: every object of every bucket, what a VM of the stack runs
#   included (docs/guard-rails.md, "What a VM runs"); the workers' objects come from their
#   grants on the stack's bucket (infra/components/bucket.py object_grants);
# - compute.instances.delete, compute.instances.setDiskAutoDelete and
#   compute.instanceGroupManagers.update: every VM and instance group of the project (a
#   compromised worker could delete the TPU VM or the controller). The workers do not manage
#   their VMs, the service does, as its own service agent (Google's "Dataflow security and
#   permissions", dataflow/docs/concepts/security-and-permissions): "The Dataflow service
#   fully manages resources in Google Cloud on a per-job basis. This includes spinning up and
#   shutting down Compute Engine instances" (Google's Dataflow quotas page,
#   dataflow/docs/request-quotas). Only a real Dataflow job shows that no worker calls them
#   (docs/verified-offline-vs-gcp.md, "Dataflow").
# What remains, each for the worker's own job:
DATAFLOW_WORKER_PERMISSIONS = (
    # Dataflow's autoscaling: the workers report their metrics and state, read its advice
    "autoscaling.sites.readRecommendations",
    "autoscaling.sites.writeMetrics",
    "autoscaling.sites.writeState",
    # the job a worker runs (its description)
    "dataflow.jobs.get",
    # Dataflow Shuffle (a batch job's group-by-key outside the workers)
    "dataflow.shuffle.read",
    "dataflow.shuffle.write",
    # Streaming Engine's work items: a streaming job's; kept so a streaming job of the stack
    # runs as Google's role would (the encode stage is a batch job)
    "dataflow.streamingWorkItems.ImportState",
    "dataflow.streamingWorkItems.commitWork",
    "dataflow.streamingWorkItems.getData",
    "dataflow.streamingWorkItems.getWork",
    "dataflow.streamingWorkItems.getWorkerMetadata",
    # a batch job's work items: lease one, report progress and completion, send messages
    "dataflow.workItems.lease",
    "dataflow.workItems.sendMessage",
    "dataflow.workItems.update",
    # the workers' logs and metrics
    "logging.logEntries.create",
    "monitoring.timeSeries.create",
    # a bucket's metadata, no object (Beam's Cloud Storage I/O reads a bucket's settings)
    "storage.buckets.get",
)

# Read-only project roles of the preview account: enough for the provider's reads during a
# preview (and a `pulumi refresh --preview-only`), no write, no secret payloads, no admin.
PREVIEW_PROJECT_ROLES = (
    "roles/compute.viewer",  # networks, subnets, firewalls, routers, addresses, VMs
    "roles/tpu.viewer",  # TPU VMs, accelerator types, runtime versions
    "roles/iam.serviceAccountViewer",  # the stacks' service accounts
    "roles/serviceusage.serviceUsageViewer",  # which APIs are enabled
    # The training buckets' settings, and the program's look-up of a kept bucket
    # (storage.buckets.list; "view buckets and their metadata" in Google's role list).
    "roles/storage.bucketViewer",
)

# Permissions that would let the deploy account escalate if held project-wide. They are
# held only through the conditional roles below, never through the deployer role.
# Acting as an account: only the stacks' own, through a grant on each one's own allow policy.
# No iam.serviceAccounts.setIamPolicy: with it the deploy account could grant any role on a
# stack account (token creator, key admin) to anyone, and IAM documents no condition on the
# roles granted on an account's policy (modifiedGrantsByRole is documented for projects,
# folders and organizations). The grants on the accounts are the bootstrap's
# (CONTROLLER_ACTS_AS); a GitOps stack writes none (tpu-pretrain:accountsFromBootstrap).
STACK_ACCOUNT_USER_PERMISSIONS = ("iam.serviceAccounts.actAs",)
# The project's IAM policy: only grants/revocations of GRANTABLE_PROJECT_ROLES
# (iam.googleapis.com/modifiedGrantsByRole, documented by Google for projects).
PROJECT_IAM_WRITER_PERMISSIONS = (
    "resourcemanager.projects.getIamPolicy",
    "resourcemanager.projects.setIamPolicy",
)
# Everything that changes (or runs code on) an existing VM: setMetadata alone would let a
# holder run a startup script on ANY VM of the project, as that VM's account (the default
# compute account included). Only on VMs named like the stacks' ("tp-<stack>-..."): a
# condition on the instance's resource name, which Google's "Resource attributes for IAM
# Conditions" lists for Compute Engine instances ("projects/<p>/zones/<z>/instances/<n>").
STACK_INSTANCE_PERMISSIONS = tuple(
    p
    for p in PERMISSIONS_BY_TYPE["gcp:compute/instance:Instance"]
    if p.startswith("compute.instances.")
)
# A bucket's IAM policy and objects: only the stacks' own (the state bucket and every other
# bucket of the project out of reach). Cloud Storage is on Google's "Resource attributes for
# IAM Conditions" page (iam/docs/conditions-resource-attributes), with resource names
# "projects/_/buckets/<bucket>[/objects/<object>]". Creating and listing are checked on the
# project, not on a named resource: those two stay in the deployer role. (No Secret Manager
# permission at all: the stacks keep no secret; the VPN hop makes its own key on its disk.)
STACK_BUCKET_PERMISSIONS = tuple(
    p
    for t in ("gcp:storage/bucket:Bucket", "gcp:storage/bucketIAMMember:BucketIAMMember",
              "gcp:storage/bucketObject:BucketObject")
    for p in PERMISSIONS_BY_TYPE[t]
    if p not in ("storage.buckets.create", "storage.buckets.list")
)  # fmt: skip
CONDITIONAL_PERMISSIONS = (
    frozenset(STACK_ACCOUNT_USER_PERMISSIONS)
    | frozenset(PROJECT_IAM_WRITER_PERMISSIONS)
    | frozenset(STACK_INSTANCE_PERMISSIONS)
    | frozenset(STACK_BUCKET_PERMISSIONS)
)

# The deployer role: every permission of the table that is not conditional, sorted.
DEPLOYER_PERMISSIONS = tuple(
    sorted({p for needs in PERMISSIONS_BY_TYPE.values() for p in needs} - CONDITIONAL_PERMISSIONS)
)

# The roles the program grants on the project (ServiceIdentity: log and metric writing; the
# recovery role for the watchdog). roles/iam.serviceAccountUser is NOT among them: granted on
# the project it would be actAs on every account of the project. The program grants it on
# the TPU VM's own account only, through the stack-account role.
GRANTABLE_PROJECT_ROLES = (
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    # Stacks with tpu-pretrain:dataflow (infra/components/dataflow.py): the launcher role to
    # its controller (the policy pack refuses it to any other member); the workers get the
    # custom role below (dataflow_worker_role_name), never roles/dataflow.worker.
    "roles/dataflow.developer",
)
# The grants on the stacks' accounts that a stack created by a person makes itself
# (infra/components/recovery.py, dataflow.py) and the bootstrap makes for a GitOps stack:
# the controller acts as the TPU VM's account (the TPU watchdog recreates the VM as it) and
# as the Dataflow workers' account (it launches their jobs). Made for every stack, whether
# or not its watchdog or Dataflow is on: actAs alone runs nothing; what uses it is the
# recovery role or roles/dataflow.developer on the project, which the stack grants only
# when it needs them, under the granter's modifiedGrantsByRole condition.
SERVICE_ACCOUNT_USER = "roles/iam.serviceAccountUser"
CONTROLLER_ACTS_AS = ("workload", "dataflow")

# The main program's service accounts are "tp-<stack>-<suffix>" (infra/config/config.py: every GCP
# name of a stack starts with "tp-<stack>"; SERVICE_ACCOUNT_SUFFIXES), all in the stacks'
# project. tests/policy/test_deployability.py checks these against infra/config/config.py and the
# captured accounts of every stack.
STACK_ACCOUNT_PREFIX = STACK_PREFIX
STACK_ACCOUNT_SUFFIXES = ("workload", "controller", "vpn-hop", "dataflow")


def stack_account_id(stack: str, suffix: str) -> str:
    return f"{STACK_ACCOUNT_PREFIX}{stack}-{suffix}"


def stack_account_display_name(stack: str, suffix: str) -> str:
    """The account's display name; the main program writes the same when it creates one
    (infra/components/identity.py account_display_name) and never changes an adopted one."""
    return f"tpu-pretrain {stack}: {suffix}"


def recovery_role_name(project: str) -> str:
    return f"projects/{project}/roles/{RECOVERY_ROLE_ID}"


def gpu_recovery_role_name(project: str) -> str:
    return f"projects/{project}/roles/{GPU_RECOVERY_ROLE_ID}"


def dataflow_launcher_role_name(project: str) -> str:
    return f"projects/{project}/roles/{DATAFLOW_LAUNCHER_ROLE_ID}"


def dataflow_worker_role_name(project: str) -> str:
    return f"projects/{project}/roles/{DATAFLOW_WORKER_ROLE_ID}"


def grantable_roles(project: str) -> tuple[str, ...]:
    """Every role the deploy account may grant or revoke on the project."""
    return (
        *GRANTABLE_PROJECT_ROLES,
        recovery_role_name(project),
        gpu_recovery_role_name(project),
        dataflow_launcher_role_name(project),
        dataflow_worker_role_name(project),
    )
