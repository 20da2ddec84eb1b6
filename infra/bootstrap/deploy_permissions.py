"""The permissions the GitOps deploy account needs per resource type of the main program
(infra/bootstrap/bootstrap_roles.py derives the deploy account's roles from this table)."""

from __future__ import annotations

# Resource type of the main program -> permissions the deploy account needs for it over its
# life (create, read, update, delete, waiting on the operation). Sources: the Cloud REST
# references' "IAM Permissions" of each method and the Terraform provider's per-resource
# permission maps (JamesWoolfenden/pike src/mapping/google/resource/*). The deploy account's
# permissions are DERIVED from this table, nothing is added by hand:
# tests/policy/test_deployability.py runs every stack under Pulumi's mocks and fails when the
# program creates a type missing here, or when a permission of a created type is not held.
PERMISSIONS_BY_TYPE: dict[str, tuple[str, ...]] = {
    "gcp:projects/service:Service": (
        "serviceusage.services.enable",
        "serviceusage.services.get",
        "serviceusage.services.list",
        "serviceusage.operations.get",
        "resourcemanager.projects.get",
    ),
    "gcp:compute/network:Network": (
        "compute.networks.create",
        "compute.networks.delete",
        "compute.networks.get",
        "compute.networks.update",
        "compute.globalOperations.get",
    ),
    "gcp:compute/subnetwork:Subnetwork": (
        "compute.subnetworks.create",
        "compute.subnetworks.delete",
        "compute.subnetworks.get",
        "compute.subnetworks.update",
        "compute.subnetworks.setPrivateIpGoogleAccess",
        "compute.regionOperations.get",
    ),
    "gcp:compute/router:Router": (
        "compute.routers.create",
        "compute.routers.delete",
        "compute.routers.get",
        "compute.routers.update",
        "compute.regionOperations.get",
    ),
    "gcp:compute/routerNat:RouterNat": (
        "compute.routers.get",
        "compute.routers.update",
        "compute.routers.use",
        "compute.subnetworks.use",  # the NAT names the TPU subnet
        "compute.regionOperations.get",
    ),
    "gcp:compute/firewall:Firewall": (
        "compute.firewalls.create",
        "compute.firewalls.delete",
        "compute.firewalls.get",
        "compute.firewalls.update",
        "compute.networks.updatePolicy",
        "compute.globalOperations.get",
    ),
    "gcp:compute/address:Address": (
        "compute.addresses.create",
        "compute.addresses.delete",
        "compute.addresses.get",
        "compute.addresses.setLabels",
        "compute.regionOperations.get",
    ),
    "gcp:compute/instance:Instance": (
        "compute.instances.create",
        "compute.instances.delete",
        "compute.instances.get",
        "compute.instances.start",
        "compute.instances.stop",  # allow_stopping_for_update
        "compute.instances.setMetadata",
        "compute.instances.setLabels",
        "compute.instances.setTags",
        "compute.instances.setMachineType",
        # A GPU VM (infra/components/gpu.py): a changed scheduling (spot/on-demand) and a
        # changed N1 GPU type or count (guest_accelerators), applied while it is stopped.
        "compute.instances.setScheduling",
        "compute.instances.setMachineResources",
        "compute.instances.setServiceAccount",
        "compute.instances.updateShieldedInstanceConfig",
        "compute.instances.setShieldedInstanceIntegrityPolicy",
        "compute.instances.addAccessConfig",
        "compute.instances.deleteAccessConfig",
        "compute.disks.create",
        "compute.disks.get",
        "compute.images.get",
        "compute.images.getFromFamily",
        "compute.images.useReadOnly",
        "compute.subnetworks.use",
        "compute.subnetworks.useExternalIp",  # the VPN hop only (policy pack)
        "compute.addresses.use",  # the VPN hop's static address
        "compute.zoneOperations.get",
        "compute.projects.get",
        "compute.zones.get",
        "compute.machineTypes.get",
        "iam.serviceAccounts.actAs",  # attaching the stack's own account (conditional role)
    ),
    # No tpu.nodes.update: a node's metadata (its startup script) would run as its account
    # at the next boot, and Cloud TPU is not among the services whose resource names an IAM
    # condition can test. Every change replaces the node instead (infra/components/tpu.py).
    "gcp:tpu/v2Vm:V2Vm": (
        "tpu.nodes.create",
        "tpu.nodes.delete",
        "tpu.nodes.get",
        "tpu.operations.get",
        "tpu.acceleratortypes.list",
        "tpu.runtimeversions.list",
        "iam.serviceAccounts.actAs",  # attaching the stack's own account (conditional role)
    ),
    "gcp:storage/bucket:Bucket": (
        "storage.buckets.create",
        "storage.buckets.delete",
        "storage.buckets.get",
        "storage.buckets.list",  # the program looks for a bucket kept by an earlier destroy
        "storage.buckets.update",
    ),
    "gcp:storage/bucketIAMMember:BucketIAMMember": (
        "storage.buckets.getIamPolicy",
        "storage.buckets.setIamPolicy",
    ),
    "gcp:storage/bucketObject:BucketObject": (
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.list",
    ),
    # A GitOps stack adopts the bootstrap's accounts (tpu-pretrain:accountsFromBootstrap,
    # infra/components/identity.py): the create call finds the account (409: adopted), and
    # the stack never deletes (retain_on_delete) or renames (ignore_changes) it, nor writes
    # its allow policy (no gcp:serviceaccount/iAMMember:IAMMember in a GitOps stack: the
    # bootstrap makes those grants). So no iam.serviceAccounts.delete, .update or
    # .setIamPolicy, which could only be held on every account of the project or by a grant
    # on each one.
    "gcp:serviceaccount/account:Account": (
        "iam.serviceAccounts.create",
        "iam.serviceAccounts.get",
    ),
    "gcp:projects/iAMMember:IAMMember": (
        "resourcemanager.projects.getIamPolicy",  # conditional role: listed roles only
        "resourcemanager.projects.setIamPolicy",
    ),
    # tpu-pretrain:alertEmails (infra/components/alerts.py): create, read, update and delete of
    # the e-mail channels and the log-match policies. Google's Logging access-control page
    # ("Permissions for log-based alerting policies"): creating a log-based policy needs
    # monitoring.alertPolicies.create, monitoring.notificationChannels.create and
    # logging.notificationRules.create (Cloud Logging keeps a notification rule for each
    # log-match policy); the rule's update and delete follow the policy's. No .list: the
    # provider reads each by its name (pike's google_monitoring_* maps). No secret: an e-mail
    # channel has no token.
    "gcp:monitoring/notificationChannel:NotificationChannel": (
        "monitoring.notificationChannels.create",
        "monitoring.notificationChannels.delete",
        "monitoring.notificationChannels.get",
        "monitoring.notificationChannels.update",
    ),
    "gcp:monitoring/alertPolicy:AlertPolicy": (
        "monitoring.alertPolicies.create",
        "monitoring.alertPolicies.delete",
        "monitoring.alertPolicies.get",
        "monitoring.alertPolicies.update",
        "logging.notificationRules.create",
        "logging.notificationRules.delete",
        "logging.notificationRules.get",
        "logging.notificationRules.update",
    ),
    # Local providers: no Google API call. (No random:index/randomBytes:RandomBytes: a
    # GitOps stack must set vpnClientPublicKey, so it makes no key; the VPN hop makes its own.)
    "time:index/sleep:Sleep": (),
}
