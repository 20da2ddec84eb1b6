"""What a stack may contain: the policy pack's closed world, as data.

Everything not listed here is refused by the pack (policy/closed_world.py): a resource type, an
enabled API, an IAM grant (role x principal x resource) or a custom role permission. The
lists are the ones the programs of this repository really create; tests/policy/
test_allowlist.py captures every stack under Pulumi's mocks and fails when a program gains
a type, API or grant that is not listed here, or when an entry here is no longer used.

How to allow something new: change this file in a pull request, with a rule for the new
type in the module of its rule family (policy/vms.py, policy/network.py, ...; policy/rules.py
assembles them) where it has settings that matter for security, and a test in tests/policy.
There is no stack setting, config key or environment variable that widens these lists: the
pack reads nothing but this file and the resources of the stack.

Two Pulumi projects are known, each with its own lists: the main program (`tpu-pretrain`,
infra/) and the one-time GitOps bootstrap (`tpu-pretrain-bootstrap`, infra/bootstrap/),
which a project owner applies by hand. The project is read from each resource's URN
(`urn:pulumi:<stack>::<project>::<type>::<name>`); a resource of any other project is
refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAIN_PROJECT = "tpu-pretrain"
BOOTSTRAP_PROJECT = "tpu-pretrain-bootstrap"

# --- principals ---------------------------------------------------------------------------
# GCP project ids: 6-30 characters, [a-z][a-z0-9-]*[a-z0-9].
_PROJECT_ID = r"[a-z][a-z0-9-]{4,28}[a-z0-9]"
# The main program's service accounts: "tp-<stack>-<role>" (infra/config/config.py: every name of a
# stack starts with "tp-<stack>"; SERVICE_ACCOUNT_SUFFIXES). Group 1 is "tp-<stack>".
# The VMs of a stack run as the first three; "dataflow" is the Dataflow worker account of a
# stack with tpu-pretrain:dataflow (infra/components/dataflow.py), which no VM of the stack
# may run as and which gets only the Dataflow grants below.
VM_ACCOUNT_ROLES = ("workload", "controller", "vpn-hop")
STACK_ACCOUNT_ROLES = (*VM_ACCOUNT_ROLES, "dataflow")


def stack_account(*roles: str) -> str:
    """Regex of a stack service account's email with one of the given roles."""
    alternatives = "|".join(re.escape(role) for role in roles)
    return rf"(tp-[a-z0-9-]+)-(?:{alternatives})@{_PROJECT_ID}\.iam\.gserviceaccount\.com"


# The bootstrap's CI accounts (infra/bootstrap/gitops_bootstrap.py).
def bootstrap_account(*names: str) -> str:
    return rf"(?:{'|'.join(re.escape(n) for n in names)})@{_PROJECT_ID}\.iam\.gserviceaccount\.com"


# A principal set of the bootstrap's own Workload Identity pool (GitHub Actions tokens).
WIF_POOL_PRINCIPAL_SET = (
    r"principalSet://iam\.googleapis\.com/projects/[0-9]+/locations/global/"
    r"workloadIdentityPools/tpu-pretrain-github/attribute\.[a-z_]+/[^\s]+"
)


@dataclass(frozen=True)
class Grant:
    """One allowed IAM grant: `role` on a resource of one of `types`, to a principal that
    fully matches `member`. For service-account IAM types, `target` must fully match the
    account the grant is on (`serviceAccountId`, "projects/<p>/serviceAccounts/<email>"), or
    the resource the property `target_key` names (an Artifact Registry repository's id),
    and with `same_stack` member and target belong to one stack ("tp-<stack>").
    `condition` (a substring) makes an IAM condition mandatory, e.g. the limit on which
    roles a delegated IAM writer may grant. Custom roles are written "custom:<roleId>"."""

    types: tuple[str, ...]
    role: str
    member: str
    why: str
    who: str  # the principals `member` matches, in words (violation messages)
    target: str | None = None
    same_stack: bool = False
    # The property that names the resource the grant is on (`target` is matched against it).
    target_key: str = "serviceAccountId"
    condition: str | None = None


@dataclass(frozen=True)
class Profile:
    project: str
    # Resource type -> what governs it (the rules of the pack that apply to it).
    types: dict[str, str]
    # APIs the program may enable (gcp:projects/service:Service `service`).
    apis: frozenset[str]
    grants: tuple[Grant, ...]
    # Custom roles the program may create: roleId -> every permission it may hold.
    custom_roles: dict[str, frozenset[str]] = field(default_factory=dict)


PROJECT_IAM_MEMBER = "gcp:projects/iAMMember:IAMMember"
SA_IAM_MEMBER = "gcp:serviceaccount/iAMMember:IAMMember"
BUCKET_IAM_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"
CRYPTO_KEY_IAM_MEMBER = "gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember"
REPOSITORY = "gcp:artifactregistry/repository:Repository"
REPOSITORY_IAM_MEMBER = "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember"
CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"
NOTIFICATION_CHANNEL = "gcp:monitoring/notificationChannel:NotificationChannel"

_COMMON_TYPES = {
    "pulumi:pulumi:Stack": "the stack itself (no cloud resource)",
    "pulumi:providers:gcp": "provider: providers-without-credentials",
}

# --- the main program (infra/) ------------------------------------------------------------
MAIN_TYPES = {
    **_COMMON_TYPES,
    "pulumi:providers:random": "provider (local, no cloud call)",
    "pulumi:providers:time": "provider (local, no cloud call)",
    # Component resources of infra/components (no cloud resource of their own).
    **{
        f"tpu-pretrain:index:{name}": "component of infra/components"
        for name in (
            "ControllerVm",
            "DataflowAccess",
            "GpuAutoRecovery",
            "GpuVm",
            "Network",
            "PayloadDelivery",
            "ProjectApis",
            "RunAlerts",
            "ServiceIdentity",
            "StartupDelivery",
            "TpuAutoRecovery",
            "TpuVm",
            "TrainingBucket",
            "VpnHop",
        )
    },
    "gcp:projects/service:Service": "allowed-apis",
    "gcp:compute/network:Network": "no-auto-mode-network",
    "gcp:compute/subnetwork:Subnetwork": "subnet-flow-logs",
    "gcp:compute/router:Router": "Cloud Router of the NAT (no ingress of its own)",
    "gcp:compute/routerNat:RouterNat": "egress NAT for VMs without external IPs",
    "gcp:compute/firewall:Firewall": "no-ssh-rdp-from-internet, no-tensorboard-tpu-from-"
    "internet, no-public-ingress (source ranges judged by the addresses they cover)",
    "gcp:compute/address:Address": "the VPN hop's static IP (one-vpn-hop-outside-tpu-region)",
    "gcp:compute/instance:Instance": "no-external-ip-except-vpn-hop, ip-forwarding-only-on-"
    "vpn-hop, shielded-vm, os-login-enabled, project-ssh-keys-blocked, serial-port-disabled, "
    "no-key-material-in-metadata, no-default-compute-service-account, accelerator-and-bucket-"
    "same-region (a VM with GPUs)",
    "gcp:tpu/v2Vm:V2Vm": "the same VM rules as instances, accelerator-and-bucket-same-region",
    "gcp:storage/bucket:Bucket": "bucket-uniform-access, bucket-public-access-prevention, "
    "bucket-recoverable, accelerator-and-bucket-same-region",
    "gcp:storage/bucketObject:BucketObject": "payload archive and job spec in the bucket",
    "gcp:serviceaccount/account:Account": "the stack's dedicated service accounts",
    PROJECT_IAM_MEMBER: "allowed-iam-grants",
    SA_IAM_MEMBER: "allowed-iam-grants",
    BUCKET_IAM_MEMBER: "allowed-iam-grants",
    # A stack a person deploys without vpnClientPublicKey: the client's key pair, in that
    # person's state (a GitOps stack must set the key: infra/config/config.py). The hop
    # makes its own key on its disk (infra/components/vpn.py).
    "random:index/randomBytes:RandomBytes": "local random bytes (the VPN client's key of a "
    "stack a person deploys), no cloud call",
    "time:index/sleep:Sleep": "local wait (IAM propagation), no cloud call",
    # tpu-pretrain:alertEmails (infra/components/alerts.py): the run's alerts.
    NOTIFICATION_CHANNEL: "notification-channels-email-only",
    "gcp:monitoring/alertPolicy:AlertPolicy": "an alert on one event of the run, to the "
    "stack's mail channels (no code, no secret)",
}

MAIN_APIS = frozenset(
    {
        "cloudresourcemanager.googleapis.com",
        "artifactregistry.googleapis.com",  # tpu-pretrain:dataflow only (the workers' image)
        "compute.googleapis.com",
        "dataflow.googleapis.com",  # tpu-pretrain:dataflow only
        "iam.googleapis.com",
        "iamcredentials.googleapis.com",
        "iap.googleapis.com",
        "logging.googleapis.com",
        "monitoring.googleapis.com",
        "oslogin.googleapis.com",
        "serviceusage.googleapis.com",
        "storage.googleapis.com",
        "tpu.googleapis.com",
    }
)

# The TPU recovery custom role is created by the bootstrap (never by a stack) and bound by
# stacks with tpuAutoRecover (infra/components/recovery.py RECOVERY_ROLE_ID).
RECOVERY_ROLE_ID = "tpuPretrainTpuRecovery"
RECOVERY_PERMISSIONS = frozenset(
    {
        "tpu.nodes.create",
        "tpu.nodes.delete",
        "tpu.nodes.get",
        "tpu.nodes.list",
        "tpu.operations.get",
        "tpu.queuedResources.create",
        "tpu.queuedResources.delete",
        "tpu.queuedResources.get",
        "tpu.queuedResources.list",
    }
)
# The GPU recovery role: the same, for stacks with gpuAutoRecover (recovery.py
# GPU_RECOVERY_ROLE_ID), granted with a condition naming the one GPU VM.
GPU_RECOVERY_ROLE_ID = "tpuPretrainGpuRecovery"
GPU_RECOVERY_PERMISSIONS = frozenset(
    {
        "compute.instances.get",
        "compute.instances.getGuestAttributes",  # the VM's boot state
        "compute.instances.start",
        "compute.instances.stop",  # a VM whose boot failed bills while idle
    }
)
# The Dataflow launcher's project-level reads (infra/components/dataflow.py
# LAUNCHER_EXTRA_ROLE_ID; what Dataflow Admin adds to Developer, less object permissions).
DATAFLOW_LAUNCHER_ROLE_ID = "tpuPretrainDataflowLauncher"
DATAFLOW_LAUNCHER_PERMISSIONS = frozenset({"compute.machineTypes.get", "storage.buckets.get"})
# The Dataflow workers' role: roles/dataflow.worker less storage.objects.create and .get and
# its compute.* permissions on every VM of the project (infra/bootstrap/bootstrap_roles.py
# DATAFLOW_WORKER_PERMISSIONS says why; infra/components/dataflow.py WORKER_ROLE_ID;
# policy/executables.py refuses any project role that writes objects).
DATAFLOW_WORKER_ROLE_ID = "tpuPretrainDataflowWorker"
DATAFLOW_WORKER_PERMISSIONS = frozenset(
    {
        "autoscaling.sites.readRecommendations",
        "autoscaling.sites.writeMetrics",
        "autoscaling.sites.writeState",
        "dataflow.jobs.get",
        "dataflow.shuffle.read",
        "dataflow.shuffle.write",
        "dataflow.streamingWorkItems.ImportState",
        "dataflow.streamingWorkItems.commitWork",
        "dataflow.streamingWorkItems.getData",
        "dataflow.streamingWorkItems.getWork",
        "dataflow.streamingWorkItems.getWorkerMetadata",
        "dataflow.workItems.lease",
        "dataflow.workItems.sendMessage",
        "dataflow.workItems.update",
        "logging.logEntries.create",
        "monitoring.timeSeries.create",
        "storage.buckets.get",
    }
)

_ANY_STACK_ACCOUNT = stack_account(*VM_ACCOUNT_ROLES)
_DATAFLOW_WORKER = stack_account("dataflow")
# The accounts a VM or TPU VM of a stack may run as: the stack's own. Attaching an account
# gives everyone who can log in to the VM that account's powers, so it is a grant too.
VM_ACCOUNT = _ANY_STACK_ACCOUNT
MAIN_GRANTS = (
    Grant(
        (PROJECT_IAM_MEMBER,),
        "roles/logging.logWriter",
        rf"serviceAccount:{_ANY_STACK_ACCOUNT}",
        "every stack account writes its logs",
        "the stack's own accounts tp-<stack>-<role>",
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        "roles/monitoring.metricWriter",
        rf"serviceAccount:{_ANY_STACK_ACCOUNT}",
        "every stack account writes its metrics",
        "the stack's own accounts tp-<stack>-<role>",
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{RECOVERY_ROLE_ID}",
        rf"serviceAccount:{stack_account('controller')}",
        "the controller's TPU watchdog recreates a preempted TPU VM",
        "the stack's controller account tp-<stack>-controller",
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{GPU_RECOVERY_ROLE_ID}",
        rf"serviceAccount:{stack_account('controller')}",
        "the controller's GPU watchdog starts the stopped spot GPU VM again",
        "the stack's controller account tp-<stack>-controller",
        condition="/instances/tp-",
    ),
    Grant(
        (SA_IAM_MEMBER,),
        "roles/iam.serviceAccountUser",
        rf"serviceAccount:{stack_account('controller')}",
        "the watchdog attaches the TPU VM's account to the VM it recreates",
        "the stack's controller account, on the same stack's tp-<stack>-workload account",
        target=rf"projects/{_PROJECT_ID}/serviceAccounts/{stack_account('workload')}",
        same_stack=True,
    ),
    # The bucket: every object read; objects written under the IAM condition that keeps
    # each identity off what another one runs (policy/executables.py checks the condition
    # exactly; infra/executables.py writes it).
    Grant(
        (BUCKET_IAM_MEMBER,),
        "roles/storage.objectViewer",
        rf"serviceAccount:{stack_account('controller', 'workload', 'dataflow')}",
        "the accelerator VM, the controller and the Dataflow workers read the training bucket",
        "the stack's tp-<stack>-controller, -workload and -dataflow accounts",
    ),
    Grant(
        (BUCKET_IAM_MEMBER,),
        "roles/storage.objectUser",
        rf"serviceAccount:{stack_account('controller', 'workload', 'dataflow')}",
        "they write objects, never what another identity runs",
        "the stack's tp-<stack>-controller, -workload and -dataflow accounts",
        condition="resource.type == 'storage.googleapis.com/Object' && !(resource.name",
    ),
    # tpu-pretrain:dataflow (infra/components/dataflow.py; Google's Dataflow security and
    # access-control pages): the worker role to the worker account only, objects of the
    # stack's bucket to it, and the launcher's two grants to the controller: Dataflow
    # Developer on the project and actAs on its own stack's worker account (never on the
    # project).
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{DATAFLOW_WORKER_ROLE_ID}",
        rf"serviceAccount:{_DATAFLOW_WORKER}",
        "Dataflow workers lease and report work items of the stack's jobs",
        "the stack's Dataflow worker account tp-<stack>-dataflow",
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        "roles/dataflow.developer",
        rf"serviceAccount:{stack_account('controller')}",
        "the controller launches and watches the stack's Dataflow jobs",
        "the stack's controller account tp-<stack>-controller",
    ),
    # What Dataflow Admin (Google's minimal role for creating and managing jobs) adds to
    # Developer at project level, read-only: the bootstrap's tpuPretrainDataflowLauncher.
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{DATAFLOW_LAUNCHER_ROLE_ID}",
        rf"serviceAccount:{stack_account('controller')}",
        "the controller's Dataflow launch reads machine types and the staging bucket",
        "the stack's controller account tp-<stack>-controller",
    ),
    Grant(
        (SA_IAM_MEMBER,),
        "roles/iam.serviceAccountUser",
        rf"serviceAccount:{stack_account('controller')}",
        "the controller runs Dataflow jobs as the stack's worker account",
        "the stack's controller account, on the same stack's tp-<stack>-dataflow account",
        target=rf"projects/{_PROJECT_ID}/serviceAccounts/{_DATAFLOW_WORKER}",
        same_stack=True,
    ),
)

MAIN = Profile(project=MAIN_PROJECT, types=MAIN_TYPES, apis=MAIN_APIS, grants=MAIN_GRANTS)

# --- the GitOps bootstrap (infra/bootstrap/) ------------------------------------------------
BOOTSTRAP_TYPES = {
    **_COMMON_TYPES,
    "gcp:projects/service:Service": "allowed-apis",
    "gcp:storage/bucket:Bucket": "bucket-uniform-access, bucket-public-access-prevention, "
    "bucket-recoverable (the Pulumi state bucket)",
    "gcp:kms/keyRing:KeyRing": "holds the stacks' secrets key",
    "gcp:kms/cryptoKey:CryptoKey": "kms-key-rotation",
    "gcp:iam/workloadIdentityPool:WorkloadIdentityPool": "GitHub Actions federation",
    "gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider": (
        "wif-provider-attribute-condition"
    ),
    "gcp:serviceaccount/account:Account": "the CI preview and deploy accounts, and the stacks' "
    "accounts (so the grants on each are the bootstrap's: the deploy account's actAs, the "
    "controller's)",
    CUSTOM_ROLE: "custom-role-permissions",
    PROJECT_IAM_MEMBER: "allowed-iam-grants",
    SA_IAM_MEMBER: "allowed-iam-grants",
    BUCKET_IAM_MEMBER: "allowed-iam-grants",
    CRYPTO_KEY_IAM_MEMBER: "allowed-iam-grants",
}

BOOTSTRAP_APIS = frozenset(
    {
        "cloudresourcemanager.googleapis.com",
        "serviceusage.googleapis.com",
        "iam.googleapis.com",
        "iamcredentials.googleapis.com",
        "sts.googleapis.com",
        "cloudkms.googleapis.com",
        "storage.googleapis.com",
    }
)

DEPLOYER_ROLE_ID = "tpuPretrainDeployer"
PROJECT_IAM_WRITER_ROLE_ID = "tpuPretrainIamGranter"
STACK_ACCOUNT_USER_ROLE_ID = "tpuPretrainStackAccountUser"
STACK_INSTANCE_ROLE_ID = "tpuPretrainStackInstances"
STACK_BUCKET_ROLE_ID = "tpuPretrainStackBuckets"

# The deploy account's unconditional permissions: what the main program's resource types
# need (infra/bootstrap/deploy_permissions.py PERMISSIONS_BY_TYPE; tests/policy/
# test_deployability.py checks that the two lists are the same). No IAM policy write on a
# project or a service account, no actAs, no change to a VM, no bucket or object beyond
# creating and listing (those come with conditions), no Secret Manager permission, no change
# to a TPU VM (tpu.nodes.update: every change replaces it), no token or key creation, no role
# editing, no deleting or renaming a service account (a GitOps stack adopts the bootstrap's
# and keeps them).
DEPLOYER_PERMISSIONS = frozenset(
    {
        "compute.addresses.create",
        "compute.addresses.delete",
        "compute.addresses.get",
        "compute.addresses.setLabels",
        "compute.addresses.use",
        "compute.disks.create",
        "compute.disks.get",
        "compute.firewalls.create",
        "compute.firewalls.delete",
        "compute.firewalls.get",
        "compute.firewalls.update",
        "compute.globalOperations.get",
        "compute.images.get",
        "compute.images.getFromFamily",
        "compute.images.useReadOnly",
        "compute.machineTypes.get",
        "compute.networks.create",
        "compute.networks.delete",
        "compute.networks.get",
        "compute.networks.update",
        "compute.networks.updatePolicy",
        "compute.projects.get",
        "compute.regionOperations.get",
        "compute.routers.create",
        "compute.routers.delete",
        "compute.routers.get",
        "compute.routers.update",
        "compute.routers.use",
        "compute.subnetworks.create",
        "compute.subnetworks.delete",
        "compute.subnetworks.get",
        "compute.subnetworks.setPrivateIpGoogleAccess",
        "compute.subnetworks.update",
        "compute.subnetworks.use",
        "compute.subnetworks.useExternalIp",
        "compute.zoneOperations.get",
        "compute.zones.get",
        "iam.serviceAccounts.create",
        "iam.serviceAccounts.get",
        "logging.notificationRules.create",
        "logging.notificationRules.delete",
        "logging.notificationRules.get",
        "logging.notificationRules.update",
        "monitoring.alertPolicies.create",
        "monitoring.alertPolicies.delete",
        "monitoring.alertPolicies.get",
        "monitoring.alertPolicies.update",
        "monitoring.notificationChannels.create",
        "monitoring.notificationChannels.delete",
        "monitoring.notificationChannels.get",
        "monitoring.notificationChannels.update",
        "resourcemanager.projects.get",
        "serviceusage.operations.get",
        "serviceusage.services.enable",
        "serviceusage.services.get",
        "serviceusage.services.list",
        "storage.buckets.create",
        "storage.buckets.list",
        "tpu.acceleratortypes.list",
        "tpu.nodes.create",
        "tpu.nodes.delete",
        "tpu.nodes.get",
        "tpu.operations.get",
        "tpu.runtimeversions.list",
    }
)
STACK_INSTANCE_PERMISSIONS = frozenset(
    {
        "compute.instances.addAccessConfig",
        "compute.instances.create",
        "compute.instances.delete",
        "compute.instances.deleteAccessConfig",
        "compute.instances.get",
        "compute.instances.setLabels",
        "compute.instances.setMachineResources",
        "compute.instances.setMachineType",
        "compute.instances.setMetadata",
        "compute.instances.setScheduling",
        "compute.instances.setServiceAccount",
        "compute.instances.setShieldedInstanceIntegrityPolicy",
        "compute.instances.setTags",
        "compute.instances.start",
        "compute.instances.stop",
        "compute.instances.updateShieldedInstanceConfig",
    }
)
STACK_BUCKET_PERMISSIONS = frozenset(
    {
        "storage.buckets.delete",
        "storage.buckets.get",
        "storage.buckets.getIamPolicy",
        "storage.buckets.setIamPolicy",
        "storage.buckets.update",
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.list",
    }
)
PROJECT_IAM_WRITER_PERMISSIONS = frozenset(
    {"resourcemanager.projects.getIamPolicy", "resourcemanager.projects.setIamPolicy"}
)
# actAs only: never the IAM policy of a stack account (it could grant any role there, and IAM
# documents no limit on the roles granted on an account's policy); the bootstrap makes every
# grant on the stacks' accounts (infra/bootstrap/bootstrap_roles.py CONTROLLER_ACTS_AS).
STACK_ACCOUNT_USER_PERMISSIONS = frozenset({"iam.serviceAccounts.actAs"})

_PREVIEW = rf"serviceAccount:{bootstrap_account('tpu-pretrain-preview')}"
_DEPLOY = rf"serviceAccount:{bootstrap_account('tpu-pretrain-deploy')}"
_CI = rf"serviceAccount:{bootstrap_account('tpu-pretrain-preview', 'tpu-pretrain-deploy')}"
_VIEWER_ROLES = (
    "roles/compute.viewer",
    "roles/tpu.viewer",
    "roles/iam.serviceAccountViewer",
    "roles/serviceusage.serviceUsageViewer",
    "roles/storage.bucketViewer",
)
BOOTSTRAP_GRANTS = (
    *(
        Grant(
            (PROJECT_IAM_MEMBER,),
            role,
            _PREVIEW,
            "the preview account reads the project",
            "the CI preview account",
        )
        for role in _VIEWER_ROLES
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{DEPLOYER_ROLE_ID}",
        _DEPLOY,
        "the deploy account creates the stacks' resources",
        "the CI deploy account",
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{PROJECT_IAM_WRITER_ROLE_ID}",
        _DEPLOY,
        "project IAM writes, limited to the roles the stacks grant",
        "the CI deploy account",
        condition="iam.googleapis.com/modifiedGrantsByRole",
    ),
    # actAs on one stack account, granted on that account's own policy (IAM conditions
    # cannot name service accounts), on the stacks' accounts only.
    Grant(
        (SA_IAM_MEMBER,),
        f"custom:{STACK_ACCOUNT_USER_ROLE_ID}",
        _DEPLOY,
        "actAs on one stack account, granted on that account",
        "the CI deploy account, on a stack's own tp-<stack>-<role> account",
        target=rf"projects/{_PROJECT_ID}/serviceAccounts/{stack_account(*STACK_ACCOUNT_ROLES)}",
    ),
    # The grants a stack created by a person makes on its own accounts (MAIN_GRANTS), made
    # here for the GitOps stacks, which write no account's policy: the same role, member and
    # target, within one stack.
    Grant(
        (SA_IAM_MEMBER,),
        "roles/iam.serviceAccountUser",
        rf"serviceAccount:{stack_account('controller')}",
        "the TPU watchdog recreates the TPU VM as its account; the controller launches "
        "Dataflow jobs as the workers' account",
        "a stack's controller account, on the same stack's tp-<stack>-workload or "
        "tp-<stack>-dataflow account",
        target=rf"projects/{_PROJECT_ID}/serviceAccounts/{stack_account('workload', 'dataflow')}",
        same_stack=True,
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{STACK_INSTANCE_ROLE_ID}",
        _DEPLOY,
        "creates and changes the stacks' own VMs only",
        "the CI deploy account",
        condition="resource.name",
    ),
    Grant(
        (PROJECT_IAM_MEMBER,),
        f"custom:{STACK_BUCKET_ROLE_ID}",
        _DEPLOY,
        "the stacks' own buckets and objects only (never the state bucket)",
        "the CI deploy account",
        condition="resource.name",
    ),
    Grant(
        (SA_IAM_MEMBER,),
        "roles/iam.workloadIdentityUser",
        WIF_POOL_PRINCIPAL_SET,
        "GitHub Actions jobs of the repository impersonate the CI accounts (the preview's "
        "callers and the deploy environment's jobs: the provider's mapping says which)",
        "a principal set of the bootstrap's GitHub workload identity pool, on a CI account",
        target=rf"projects/{_PROJECT_ID}/serviceAccounts/"
        rf"{bootstrap_account('tpu-pretrain-preview', 'tpu-pretrain-deploy')}",
    ),
    Grant(
        (BUCKET_IAM_MEMBER,),
        "roles/storage.objectViewer",
        _PREVIEW,
        "reads the state (no write: a preview takes no lock, so it cannot remove a deploy's)",
        "the CI preview account",
    ),
    Grant(
        (BUCKET_IAM_MEMBER,),
        "roles/storage.objectUser",
        _DEPLOY,
        "writes the state",
        "the CI deploy account",
    ),
    Grant(
        (CRYPTO_KEY_IAM_MEMBER,),
        "roles/cloudkms.cryptoKeyDecrypter",
        _CI,
        "unwraps the stacks' secrets data key",
        "the CI preview and deploy accounts",
    ),
)

BOOTSTRAP = Profile(
    project=BOOTSTRAP_PROJECT,
    types=BOOTSTRAP_TYPES,
    apis=BOOTSTRAP_APIS,
    grants=BOOTSTRAP_GRANTS,
    custom_roles={
        DEPLOYER_ROLE_ID: DEPLOYER_PERMISSIONS,
        PROJECT_IAM_WRITER_ROLE_ID: PROJECT_IAM_WRITER_PERMISSIONS,
        STACK_ACCOUNT_USER_ROLE_ID: STACK_ACCOUNT_USER_PERMISSIONS,
        STACK_INSTANCE_ROLE_ID: STACK_INSTANCE_PERMISSIONS,
        STACK_BUCKET_ROLE_ID: STACK_BUCKET_PERMISSIONS,
        RECOVERY_ROLE_ID: RECOVERY_PERMISSIONS,
        GPU_RECOVERY_ROLE_ID: GPU_RECOVERY_PERMISSIONS,
        DATAFLOW_LAUNCHER_ROLE_ID: DATAFLOW_LAUNCHER_PERMISSIONS,
        DATAFLOW_WORKER_ROLE_ID: DATAFLOW_WORKER_PERMISSIONS,
    },
)

PROFILES = {profile.project: profile for profile in (MAIN, BOOTSTRAP)}

# Permissions that let a holder act as, or mint credentials for, another identity, change
# who may do what, or edit roles. A custom role holding one is named as dangerous in the
# violation (it is refused anyway unless its profile lists it for that role id).
DANGEROUS_PERMISSION_PATTERNS = (
    r".*\.setIamPolicy",
    r"iam\.serviceAccounts\.(actAs|getAccessToken|getOpenIdToken|implicitDelegation|"
    r"signBlob|signJwt|setIamPolicy)",
    r"iam\.serviceAccountKeys\..*",
    r"iam\.roles\..*",
    r"iam\.workloadIdentityPool.*",
    r"resourcemanager\.projects\.(setIamPolicy|delete|move)",
    r"orgpolicy\..*",
    r"storage\.hmacKeys\..*",
    r"apikeys\..*",
    r"deploymentmanager\..*",
    r"cloudbuild\..*",
    r"cloudfunctions\..*",
    r"run\..*",
)
