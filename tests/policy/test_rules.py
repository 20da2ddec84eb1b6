"""Each rule of the pack, fed hand-built resources: a secure baseline passes every rule, and
each insecure variant is rejected by its rule with that rule's message."""

from __future__ import annotations

import json
from typing import Any

import pytest
from policy_harness import (
    DELETE,
    POLICIES,
    POLICY_BY_NAME,
    check_resource,
    check_stack,
    mutate,
    run_pack,
    urn_for,
)
from pulumi_policy import EnforcementLevel, ResourceValidationPolicy, StackValidationPolicy

from policy import executables, rules, vms
from policy.key_material import find_key_material
from policy.resources import (
    ACCOUNT,
    BUCKET,
    FIREWALL,
    INSTANCE,
    INSTANCE_TEMPLATE,
    KMS_CRYPTO_KEY,
    NETWORK,
    NOTIFICATION_CHANNEL,
    PROJECT_METADATA_ITEM,
    SERVICE_ACCOUNT_KEY,
    SUBNETWORK,
    TPU_VM,
    WIF_PROVIDER,
)

# Accounts shaped like the program's own ("tp-<stack>-<role>"): the grant allowlist names them.
SA = "tp-test-workload@proj-test.iam.gserviceaccount.com"
CONTROLLER_SA = "tp-test-controller@proj-test.iam.gserviceaccount.com"
HOP_SA = "tp-test-vpn-hop@proj-test.iam.gserviceaccount.com"
DEFAULT_SA = "123456789-compute@developer.gserviceaccount.com"
WG_KEY = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk="  # example key from wireguard docs

SHIELDED = {"enableSecureBoot": True, "enableVtpm": True, "enableIntegrityMonitoring": True}
SAFE_METADATA = {
    "enable-oslogin": "TRUE",
    "block-project-ssh-keys": "TRUE",
    "startup-script": "#!/bin/bash\nset -euo pipefail\nsystemctl start tpu-payload\n",
}

BASELINE: dict[str, tuple[str, dict[str, Any]]] = {
    "bucket": (
        BUCKET,
        {
            "location": "EUROPE-WEST4",
            "uniformBucketLevelAccess": True,
            "publicAccessPrevention": "enforced",
            "versioning": {"enabled": True},
        },
    ),
    "controller": (
        INSTANCE,
        {
            "zone": "europe-west4-a",
            "machineType": "e2-standard-4",
            "networkInterfaces": [{"subnetwork": "tpu-subnet"}],
            "serviceAccount": {"email": SA, "scopes": ["cloud-platform"]},
            "shieldedInstanceConfig": dict(SHIELDED),
            "metadata": dict(SAFE_METADATA),
            "labels": {"role": "controller"},
        },
    ),
    "hop": (
        INSTANCE,
        {
            "zone": "asia-northeast3-a",
            "machineType": "e2-small",
            "canIpForward": True,
            "networkInterfaces": [{"subnetwork": "hop-subnet", "accessConfigs": [{"natIp": "x"}]}],
            "serviceAccount": {"email": SA, "scopes": ["cloud-platform"]},
            "shieldedInstanceConfig": dict(SHIELDED),
            "metadata": {
                **SAFE_METADATA,
                "startup-script": f"#!/bin/bash\n[Peer]\nPublicKey = {WG_KEY}\n",
            },
            "tags": ["tpu-pretrain-vpn-hop"],
        },
    ),
    "tpu": (
        TPU_VM,
        {
            "zone": "europe-west4-a",
            "acceleratorType": "v6e-8",
            "runtimeVersion": "v2-alpha-tpuv6e",
            "networkConfig": {
                "network": "vpc",
                "subnetwork": "tpu-subnet",
                "enableExternalIps": False,
            },
            "serviceAccount": {"email": SA, "scopes": ["cloud-platform"]},
            "shieldedInstanceConfig": {"enableSecureBoot": True},
            "metadata": dict(SAFE_METADATA),
            "labels": {"role": "tpu"},
        },
    ),
    "tpu-v3": (
        TPU_VM,
        {
            "zone": "europe-west4-a",
            "acceleratorType": "v3-8",
            "runtimeVersion": "tpu-vm-tf-2.16.1-pjrt",
            "networkConfig": {"network": "vpc", "subnetwork": "tpu-subnet"},
            "serviceAccount": {"email": SA},
            "metadata": dict(SAFE_METADATA),
        },
    ),
    "ssh-from-iap": (
        FIREWALL,
        {
            "direction": "INGRESS",
            "sourceRanges": ["35.235.240.0/20"],
            "allows": [{"protocol": "tcp", "ports": ["22"]}],
        },
    ),
    "wireguard-from-anywhere": (
        FIREWALL,
        {
            "sourceRanges": ["0.0.0.0/0"],
            "allows": [{"protocol": "udp", "ports": ["51820"]}],
            "targetTags": ["tpu-pretrain-vpn-hop"],
        },
    ),
    "internal-all": (
        FIREWALL,
        {"sourceTags": ["tpu-pretrain"], "allows": [{"protocol": "all"}]},
    ),
    "tensorboard-from-hop": (
        FIREWALL,
        {
            "sourceTags": ["tpu-pretrain-vpn-hop"],
            "allows": [{"protocol": "tcp", "ports": ["6006"]}],
        },
    ),
    "ssh-from-private-and-google-ranges": (
        FIREWALL,
        {
            "sourceRanges": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "35.191.0.0/16"],
            "allows": [{"protocol": "tcp", "ports": ["22", "6006", "8470"]}],
        },
    ),
    "bucket-iam": (
        "gcp:storage/bucketIAMMember:BucketIAMMember",
        {"bucket": "b", "role": "roles/storage.objectViewer", "member": f"serviceAccount:{SA}"},
    ),
    "project-iam": (
        "gcp:projects/iAMMember:IAMMember",
        {"project": "proj", "role": "roles/logging.logWriter", "member": f"serviceAccount:{SA}"},
    ),
    "network": (NETWORK, {"autoCreateSubnetworks": False}),
    "subnet": (
        SUBNETWORK,
        {
            "region": "europe-west4",
            "ipCidrRange": "10.8.0.0/24",
            "privateIpGoogleAccess": True,
            "logConfig": {"aggregationInterval": "INTERVAL_5_SEC"},
        },
    ),
    "kms-key": (KMS_CRYPTO_KEY, {"keyRing": "kr", "rotationPeriod": "7776000s"}),
    "wif-provider": (
        WIF_PROVIDER,
        {
            "oidc": {"issuerUri": "https://token.actions.githubusercontent.com"},
            "attributeCondition": "assertion.repository == 'acme/tpu-pretrain'",
        },
    ),
    "sa-user-on-own-workload": (
        "gcp:serviceaccount/iAMMember:IAMMember",
        {
            "serviceAccountId": f"projects/proj-test/serviceAccounts/{SA}",
            "role": "roles/iam.serviceAccountUser",
            "member": f"serviceAccount:{CONTROLLER_SA}",
        },
    ),
    "api": ("gcp:projects/service:Service", {"service": "tpu.googleapis.com"}),
    "email-channel": (
        NOTIFICATION_CHANNEL,
        {"type": "email", "labels": {"email_address": "ops@example.com"}},
    ),
}
# Types of the bootstrap program: their URN names its Pulumi project.
BOOTSTRAP_KEYS = {"kms-key", "wif-provider"}


def _urn(key: str, resource_type: str, name: str) -> str:
    project = "tpu-pretrain-bootstrap" if key in BOOTSTRAP_KEYS else "tpu-pretrain"
    return urn_for(resource_type, name, project=project)


def test_pack_has_at_least_twelve_mandatory_rules() -> None:
    assert len(POLICIES) >= 12
    assert all(p.enforcement_level == EnforcementLevel.MANDATORY for p in POLICIES)
    assert set(POLICY_BY_NAME) == set(rules.POLICY_MESSAGES)
    assert any(isinstance(p, StackValidationPolicy) for p in POLICIES)


# What the baseline grants are on: a stack's grants name resources of the same stack.
CONTEXT = [
    (BUCKET, "ctx-bucket", {**BASELINE["bucket"][1], "name": "b"}),
    (ACCOUNT, "ctx-account", {"accountId": "tp-test-workload", "project": "proj-test"}),
]


@pytest.mark.parametrize("key", sorted(BASELINE))
def test_secure_baseline_passes_every_rule(key: str) -> None:
    resource_type, props = BASELINE[key]
    context = [] if key in BOOTSTRAP_KEYS else [(*c, urn_for(c[0], c[1])) for c in CONTEXT]
    violations = run_pack([(resource_type, key, props, _urn(key, resource_type, key)), *context])
    assert violations == []


def _variant(key: str, *changes: tuple[str, Any]) -> tuple[str, dict[str, Any]]:
    resource_type, props = BASELINE[key]
    for path, value in changes:
        props = mutate(props, path, value)
    return resource_type, props


def _iam(resource_type: str, role: str, member: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return resource_type, {"role": role, "member": member, **extra}


# Every way a stack account could write what a VM runs: on the bucket without the exact
# condition (none, loosened, another role beside it, a binding or a whole policy), on a
# managed folder, on the project, by ACL.
_BUCKET_MEMBER = "gcp:storage/bucketIAMMember:BucketIAMMember"
_WRITE_CONDITION = executables.expected_expression("b", "workload")
EXECUTABLE_WRITES: list[tuple[str, tuple[str, dict[str, Any]]]] = [
    ("object-admin", _iam(_BUCKET_MEMBER, "roles/storage.objectAdmin", f"serviceAccount:{SA}",
                          bucket="b")),
    ("object-user-unconditional", _iam(_BUCKET_MEMBER, "roles/storage.objectUser",
                                       f"serviceAccount:{SA}", bucket="b")),
    ("object-user-loosened", _iam(_BUCKET_MEMBER, "roles/storage.objectUser",
                                  f"serviceAccount:{SA}", bucket="b", condition={
                                      "title": "t", "expression": _WRITE_CONDITION.replace(
                                          " || resource.name.startsWith('projects/_/buckets/b/"
                                          "objects/wheelhouse/')", "")})),
    ("object-user-for-another-bucket", _iam(_BUCKET_MEMBER, "roles/storage.objectUser",
                                            f"serviceAccount:{SA}", bucket="b2",
                                            condition={"title": "t",
                                                       "expression": _WRITE_CONDITION})),
    ("object-creator", _iam(_BUCKET_MEMBER, "roles/storage.objectCreator",
                            f"serviceAccount:{CONTROLLER_SA}", bucket="b")),
    ("legacy-bucket-writer", _iam(_BUCKET_MEMBER, "roles/storage.legacyBucketWriter",
                                  f"serviceAccount:{SA}", bucket="b")),
    ("bucket-binding", ("gcp:storage/bucketIAMBinding:BucketIAMBinding",
                        {"bucket": "b", "role": "roles/storage.objectUser",
                         "members": [f"serviceAccount:{SA}"]})),
    ("bucket-policy", ("gcp:storage/bucketIAMPolicy:BucketIAMPolicy",
                       {"bucket": "b", "policyData": json.dumps({"bindings": [
                           {"role": "roles/storage.objectAdmin",
                            "members": [f"serviceAccount:{CONTROLLER_SA}"]}]})})),
    ("hop-reads-the-bucket", _iam(_BUCKET_MEMBER, "roles/storage.objectUser",
                                  f"serviceAccount:{HOP_SA}", bucket="b")),
    ("managed-folder", _iam("gcp:storage/managedFolderIamMember:ManagedFolderIamMember",
                            "roles/storage.objectUser", f"serviceAccount:{SA}", bucket="b",
                            managedFolder="startup/")),
    ("project-object-creator", _variant("project-iam", ("role", "roles/storage.objectCreator"))),
    ("project-dataflow-worker", _variant("project-iam", ("role", "roles/dataflow.worker"))),
    ("project-unknown-custom-role", _variant("project-iam",
                                             ("role", "projects/proj/roles/writer"))),
    ("bucket-acl", ("gcp:storage/bucketACL:BucketACL",
                    {"bucket": "b", "roleEntities": [f"WRITER:user-{SA}"]})),
    ("object-acl", ("gcp:storage/objectAccessControl:ObjectAccessControl",
                    {"bucket": "b", "object": "jobs/current.json", "role": "OWNER",
                     "entity": f"user-{CONTROLLER_SA}"})),
]  # fmt: skip

# (rule, case id, (type, props)): each must be rejected by that rule with its message.
FAILING: list[tuple[str, str, tuple[str, dict[str, Any]]]] = [
    ("allowed-resource-types", "firewall-policy-rule",
     ("gcp:compute/firewallPolicyRule:FirewallPolicyRule", {"action": "allow"})),
    ("allowed-resource-types", "queued-tpu",
     ("gcp:tpu/v2QueuedResource:V2QueuedResource", {"zone": "europe-west4-a"})),
    ("allowed-resource-types", "instance-template", (INSTANCE_TEMPLATE, {})),
    ("allowed-resource-types", "sa-key", (SERVICE_ACCOUNT_KEY, {})),
    ("allowed-resource-types", "hmac-key", ("gcp:storage/hmacKey:HmacKey", {})),
    ("allowed-apis", "cloudfunctions",
     ("gcp:projects/service:Service", {"service": "cloudfunctions.googleapis.com"})),
    ("allowed-iam-grants", "token-creator",
     _variant("project-iam", ("role", "roles/iam.serviceAccountTokenCreator"))),
    ("allowed-iam-grants", "sa-user-on-the-project",
     _variant("project-iam", ("role", "roles/iam.serviceAccountUser"))),
    ("allowed-iam-grants", "project-iam-admin",
     _variant("project-iam", ("role", "roles/resourcemanager.projectIamAdmin"))),
    ("allowed-iam-grants", "logwriter-to-a-user",
     _variant("project-iam", ("member", "user:mallory@example.com"))),
    ("allowed-iam-grants", "unknown-custom-role",
     _variant("project-iam", ("role", "projects/proj-test/roles/myOwnRole"))),
    ("allowed-iam-grants", "sa-user-on-another-stacks-account",
     _variant("sa-user-on-own-workload", ("serviceAccountId",
              "projects/proj-test/serviceAccounts/tp-other-workload@proj-test.iam.gserviceaccount.com"))),
    ("allowed-iam-grants", "sa-user-on-the-default-account",
     _variant("sa-user-on-own-workload", ("serviceAccountId",
              f"projects/proj-test/serviceAccounts/{DEFAULT_SA}"))),
    ("allowed-iam-grants", "binding-type",
     ("gcp:projects/iAMBinding:IAMBinding",
      {"role": "roles/logging.logWriter", "members": [f"serviceAccount:{SA}"]})),
    ("custom-role-permissions", "set-iam-policy",
     ("gcp:projects/iAMCustomRole:IAMCustomRole",
      {"roleId": "helper", "permissions": ["resourcemanager.projects.setIamPolicy"]})),
    ("custom-role-permissions", "harmless-but-unknown",
     ("gcp:projects/iAMCustomRole:IAMCustomRole",
      {"roleId": "viewer", "permissions": ["compute.instances.get"]})),
    ("vm-accounts-are-stack-accounts", "ci-deploy-account",
     _variant("controller", ("serviceAccount.email",
                             "tpu-pretrain-deploy@proj-test.iam.gserviceaccount.com"))),
    ("vm-accounts-are-stack-accounts", "tpu-as-default-account",
     _variant("tpu", ("serviceAccount.email", DEFAULT_SA))),
    ("providers-without-credentials", "impersonation",
     ("pulumi:providers:gcp", {"impersonateServiceAccount": SA})),
    ("no-default-compute-service-account", "grant-on-the-default-account",
     _variant("sa-user-on-own-workload", ("serviceAccountId",
              f"projects/proj-test/serviceAccounts/{DEFAULT_SA}"))),
    ("no-default-compute-service-account", "app-engine-default-account",
     _variant("controller", ("serviceAccount.email", "proj-test@appspot.gserviceaccount.com"))),
    ("bucket-uniform-access", "off", _variant("bucket", ("uniformBucketLevelAccess", False))),
    ("bucket-uniform-access", "unset", _variant("bucket", ("uniformBucketLevelAccess", DELETE))),
    ("bucket-public-access-prevention", "inherited",
     _variant("bucket", ("publicAccessPrevention", "inherited"))),
    ("bucket-public-access-prevention", "unset",
     _variant("bucket", ("publicAccessPrevention", DELETE))),
    ("no-public-principals", "bucket-allUsers",
     _iam("gcp:storage/bucketIAMMember:BucketIAMMember", "roles/storage.objectViewer", "allUsers")),
    ("no-public-principals", "secret-allAuthenticatedUsers",
     _iam("gcp:secretmanager/secretIamMember:SecretIamMember",
          "roles/secretmanager.secretAccessor", "allAuthenticatedUsers")),
    ("no-public-principals", "bucket-binding",
     ("gcp:storage/bucketIAMBinding:BucketIAMBinding",
      {"role": "roles/storage.objectViewer", "members": [f"serviceAccount:{SA}", "allUsers"]})),
    ("no-public-principals", "project-policy-data",
     ("gcp:projects/iAMPolicy:IAMPolicy",
      {"policyData": '{"bindings": [{"role": "roles/viewer", "members": ["allUsers"]}]}'})),
    ("no-public-principals", "bucket-acl",
     ("gcp:storage/bucketACL:BucketACL", {"roleEntities": ["READER:allUsers"]})),
    ("no-default-compute-service-account", "instance",
     _variant("controller", ("serviceAccount.email", DEFAULT_SA))),
    ("no-default-compute-service-account", "instance-alias",
     _variant("controller", ("serviceAccount.email", "default"))),
    ("no-default-compute-service-account", "tpu-explicit",
     _variant("tpu", ("serviceAccount.email", DEFAULT_SA))),
    ("no-default-compute-service-account", "tpu-implicit",
     _variant("tpu", ("serviceAccount", DELETE))),
    ("no-default-compute-service-account", "instance-without-email",
     _variant("controller", ("serviceAccount.email", DELETE))),
    ("no-default-compute-service-account", "iam-grant",
     _iam("gcp:storage/bucketIAMMember:BucketIAMMember", "roles/storage.objectViewer",
          f"serviceAccount:{DEFAULT_SA}")),
    ("no-basic-or-admin-roles-for-service-accounts", "editor",
     _variant("project-iam", ("role", "roles/editor"))),
    ("no-basic-or-admin-roles-for-service-accounts", "owner-binding",
     ("gcp:projects/iAMBinding:IAMBinding",
      {"role": "roles/owner", "members": [f"serviceAccount:{SA}"]})),
    ("no-basic-or-admin-roles-for-service-accounts", "storage-admin",
     _variant("project-iam", ("role", "roles/storage.admin"))),
    ("no-basic-or-admin-roles-for-service-accounts", "instance-admin",
     _variant("project-iam", ("role", "roles/compute.instanceAdmin.v1"))),
    ("no-external-ip-except-vpn-hop", "controller-nat",
     _variant("controller", ("networkInterfaces.0.accessConfigs", [{}]))),
    ("no-external-ip-except-vpn-hop", "hop-without-tag",
     _variant("hop", ("tags", ["tpu-pretrain-controller"]))),
    ("no-external-ip-except-vpn-hop", "tpu",
     _variant("tpu", ("networkConfig.enableExternalIps", True))),
    ("ip-forwarding-only-on-vpn-hop", "controller",
     _variant("controller", ("canIpForward", True))),
    ("ip-forwarding-only-on-vpn-hop", "tpu",
     _variant("tpu", ("networkConfig.canIpForward", True))),
    ("shielded-vm", "no-secure-boot", _variant("controller", ("shieldedInstanceConfig", DELETE))),
    ("shielded-vm", "vtpm-off",
     _variant("controller", ("shieldedInstanceConfig.enableVtpm", False))),
    ("shielded-vm", "tpu-v6e-no-secure-boot",
     _variant("tpu", ("shieldedInstanceConfig", DELETE))),
    ("os-login-enabled", "missing", _variant("controller", ("metadata.enable-oslogin", DELETE))),
    ("os-login-enabled", "false", _variant("tpu", ("metadata.enable-oslogin", "FALSE"))),
    ("os-login-enabled", "ssh-keys",
     _variant("controller", ("metadata.ssh-keys", "alice:ssh-ed25519 AAAA alice"))),
    ("project-ssh-keys-blocked", "missing",
     _variant("controller", ("metadata.block-project-ssh-keys", DELETE))),
    ("project-ssh-keys-blocked", "tpu-false",
     _variant("tpu", ("metadata.block-project-ssh-keys", "false"))),
    ("serial-port-disabled", "instance",
     _variant("controller", ("metadata.serial-port-enable", "TRUE"))),
    ("serial-port-disabled", "tpu", _variant("tpu", ("metadata.serial-port-enable", "1"))),
    ("serial-port-disabled", "project",
     (PROJECT_METADATA_ITEM, {"key": "serial-port-enable", "value": "true"})),
    ("no-key-material-in-metadata", "pem",
     _variant("controller", ("metadata.startup-script",
                             "cat > k <<EOF\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\nEOF\n"))),
    ("no-key-material-in-metadata", "wg-config",
     _variant("hop", ("metadata.startup-script", f"[Interface]\nPrivateKey = {WG_KEY}\n"))),
    ("no-key-material-in-metadata", "bare-wg-key",
     _variant("hop", ("metadata.wg-seed", WG_KEY))),
    ("no-key-material-in-metadata", "key-on-a-line-that-says-public",
     _variant("hop", ("metadata.startup-script", f"echo {WG_KEY} >/etc/wg/k  # not public\n"))),
    ("no-key-material-in-metadata", "private-key-then-peer",
     _variant("hop", ("metadata.startup-script", f"PrivateKey={WG_KEY} peer\n"))),
    ("no-key-material-in-metadata", "key-named-private",
     _variant("tpu", ("metadata.wireguard-private-key", "see secret manager"))),
    ("no-key-material-in-metadata", "startup-script-property",
     _variant("controller", ("metadataStartupScript",
                             "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA"))),
    # The previous release's server key: a secret version made from random bytes.
    ("no-private-key-in-state", "wireguard-key-in-a-secret-version",
     ("gcp:secretmanager/secretVersion:SecretVersion", {"secret": "s", "secretData": WG_KEY})),
    ("no-private-key-in-state", "wg-config-in-a-secret-version",
     ("gcp:secretmanager/secretVersion:SecretVersion",
      {"secret": "s", "secretData": f"[Interface]\nPrivateKey = {WG_KEY}\n"})),
    ("no-private-key-in-state", "pem-in-a-secret-version",
     ("gcp:secretmanager/secretVersion:SecretVersion",
      {"secret": "s", "secretData": "-----BEGIN PRIVATE KEY-----\nMIIE\n"})),
    ("bucket-recoverable", "no-versioning-no-soft-delete",
     _variant("bucket", ("versioning.enabled", False),
              ("softDeletePolicy", {"retentionDurationSeconds": 0}))),
    ("no-service-account-keys", "key", (SERVICE_ACCOUNT_KEY, {"serviceAccountId": SA})),
    ("kms-key-rotation", "none", _variant("kms-key", ("rotationPeriod", DELETE))),
    ("kms-key-rotation", "yearly", _variant("kms-key", ("rotationPeriod", "31536000s"))),
    ("subnet-flow-logs", "none", _variant("subnet", ("logConfig", DELETE))),
    ("no-auto-mode-network", "auto", _variant("network", ("autoCreateSubnetworks", True))),
    ("no-auto-mode-network", "default", _variant("network", ("autoCreateSubnetworks", DELETE))),
    ("wif-provider-attribute-condition", "none",
     _variant("wif-provider", ("attributeCondition", DELETE))),
    # Alerts go out as mail only (policy/alerting.py): no webhook, no token.
    ("notification-channels-email-only", "webhook",
     (NOTIFICATION_CHANNEL, {"type": "webhook_tokenauth", "labels": {"url": "https://x.example"}})),
    ("notification-channels-email-only", "slack-token",
     _variant("email-channel", ("type", "slack"),
              ("sensitiveLabels", {"authToken": "xoxb-1"}))),
    ("notification-channels-email-only", "email-with-a-token",
     _variant("email-channel", ("sensitiveLabels", {"password": "p"}))),
    ("notification-channels-email-only", "email-to-no-address",
     _variant("email-channel", ("labels", {}))),
    # What a VM runs (policy/executables.py): any way a stack account could write it.
    *[("vm-accounts-write-no-executables", case, grant) for case, grant in EXECUTABLE_WRITES],
]  # fmt: skip


# (rule, case id, (type, props)) of firewalls: judged by a stack policy (the stack's user
# CIDRs come from its WireGuard rule), each must be rejected by that rule with its message.
FIREWALL_FAILING: list[tuple[str, str, tuple[str, dict[str, Any]]]] = [
    ("no-ssh-rdp-from-internet", "ssh-world",
     _variant("ssh-from-iap", ("sourceRanges", ["0.0.0.0/0"]))),
    ("no-ssh-rdp-from-internet", "rdp-range-ipv6",
     ("gcp:compute/firewall:Firewall",
      {"sourceRanges": ["::/0"], "allows": [{"protocol": "tcp", "ports": ["3000-4000"]}]})),
    ("no-ssh-rdp-from-internet", "tcp-without-ports",
     ("gcp:compute/firewall:Firewall",
      {"sourceRanges": ["10.0.0.0/8", "0.0.0.0/0"], "allows": [{"protocol": "tcp"}]})),
    ("no-ssh-rdp-from-internet", "all-protocols",
     (FIREWALL, {"sourceRanges": ["0.0.0.0/0"], "allows": [{"protocol": "all"}]})),
    ("no-ssh-rdp-from-internet", "no-source-means-world",
     _variant("ssh-from-iap", ("sourceRanges", DELETE))),
    ("no-ssh-rdp-from-internet", "two-halves-make-the-world",
     _variant("ssh-from-iap", ("sourceRanges", ["0.0.0.0/1", "128.0.0.0/1"]))),
    ("no-ssh-rdp-from-internet", "ipv6-halves",
     _variant("ssh-from-iap", ("sourceRanges", ["::/1", "8000::/1"]))),
    ("no-tensorboard-tpu-from-internet", "tensorboard-world",
     _variant("tensorboard-from-hop", ("sourceRanges", ["0.0.0.0/0"]))),
    ("no-tensorboard-tpu-from-internet", "tpu-port-range-split-world",
     (FIREWALL, {"sourceRanges": ["0.0.0.0/2", "64.0.0.0/2", "128.0.0.0/1"],
                       "allows": [{"protocol": "tcp", "ports": ["8000-9000"]}]})),
    ("no-tensorboard-tpu-from-internet", "all-tcp-no-source",
     (FIREWALL, {"allows": [{"protocol": "tcp"}]})),
    ("no-tensorboard-tpu-from-internet", "tpu-port-from-half-the-internet",
     (FIREWALL, {"sourceRanges": ["0.0.0.0/1"],
                       "allows": [{"protocol": "tcp", "ports": ["8470"]}]})),
    ("no-ssh-rdp-from-internet", "one-public-slash-24",
     _variant("ssh-from-iap", ("sourceRanges", ["35.235.240.0/20", "198.51.100.0/24"]))),
    ("no-ssh-rdp-from-internet", "256-slash-8s",
     _variant("ssh-from-iap", ("sourceRanges", [f"{i}.0.0.0/8" for i in range(256)]))),
    ("no-ssh-rdp-from-internet", "world-minus-private",
     _variant("ssh-from-iap", ("sourceRanges", ["0.0.0.0/5", "8.0.0.0/7", "11.0.0.0/8",
                                                "12.0.0.0/6", "16.0.0.0/4", "32.0.0.0/3",
                                                "64.0.0.0/2", "128.0.0.0/1"]))),
    ("no-ssh-rdp-from-internet", "protocol-number",
     _variant("ssh-from-iap", ("sourceRanges", ["0.0.0.0/0"]),
              ("allows", [{"protocol": "6", "ports": ["20-30"]}]))),
    ("no-public-ingress", "https-from-world",
     (FIREWALL, {"sourceRanges": ["0.0.0.0/0"],
                       "allows": [{"protocol": "tcp", "ports": ["443"]}]})),
    ("no-public-ingress", "udp-to-every-vm",
     (FIREWALL, {"sourceRanges": ["0.0.0.0/0"],
                       "allows": [{"protocol": "udp", "ports": ["51820"]}]})),
    ("no-public-ingress", "icmp-from-a-public-range",
     (FIREWALL, {"sourceRanges": ["1.2.3.0/24"], "allows": [{"protocol": "icmp"}]})),
    ("no-public-ingress", "not-a-range",
     (FIREWALL, {"sourceRanges": ["everyone"],
                       "allows": [{"protocol": "tcp", "ports": ["443"]}]})),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "case"), [(rule, case) for rule, case, _ in FIREWALL_FAILING], ids=str
)
def test_insecure_firewall_is_rejected_with_the_rules_message(rule: str, case: str) -> None:
    resource_type, props = next(r for n, c, r in FIREWALL_FAILING if (n, c) == (rule, case))
    messages = check_stack(
        POLICY_BY_NAME[rule], [(resource_type, case, props, urn_for(resource_type, case))]
    )
    assert messages, f"{rule} accepted {case}"
    assert all(m.startswith(rules.POLICY_MESSAGES[rule]) for m in messages), messages


@pytest.mark.parametrize(("rule", "case"), [(rule, case) for rule, case, _ in FAILING], ids=str)
def test_insecure_variant_is_rejected_with_the_rules_message(rule: str, case: str) -> None:
    resource_type, props = next(r for n, c, r in FAILING if (n, c) == (rule, case))
    policy = POLICY_BY_NAME[rule]
    assert isinstance(policy, ResourceValidationPolicy)
    messages = check_resource(policy, resource_type, props)
    assert messages, f"{rule} accepted {case}"
    assert all(m.startswith(rules.POLICY_MESSAGES[rule]) for m in messages), messages


def test_every_resource_rule_has_a_failing_case() -> None:
    resource_rules = {p.name for p in POLICIES if isinstance(p, ResourceValidationPolicy)}
    assert resource_rules == {rule for rule, _, _ in FAILING}
    assert {rule for rule, _, _ in FIREWALL_FAILING} == {
        "no-ssh-rdp-from-internet",
        "no-tensorboard-tpu-from-internet",
        "no-public-ingress",
    }


def test_hop_is_identified_by_its_network_tag_or_label() -> None:
    _, hop = BASELINE["hop"]
    external_ip = POLICY_BY_NAME["no-external-ip-except-vpn-hop"]
    forwarding = POLICY_BY_NAME["ip-forwarding-only-on-vpn-hop"]
    assert not check_resource(external_ip, INSTANCE, hop)
    untagged = mutate(hop, "tags", DELETE)
    assert check_resource(forwarding, INSTANCE, untagged)
    assert check_resource(external_ip, INSTANCE, untagged)
    labelled = mutate(untagged, "labels", {"role": "vpn-hop"})
    assert not check_resource(forwarding, INSTANCE, labelled)
    assert not check_resource(external_ip, INSTANCE, labelled)


def test_older_tpu_generations_need_no_secure_boot() -> None:
    resource_type, props = BASELINE["tpu-v3"]
    assert check_resource(POLICY_BY_NAME["shielded-vm"], resource_type, props) == []


def _firewall(props: dict[str, Any], name: str = "fw") -> tuple[str, str, dict, str]:
    return FIREWALL, name, props, urn_for(FIREWALL, name)


def test_rdp_rule_names_the_port_and_source() -> None:
    props = {"sourceRanges": ["0.0.0.0/0"], "allows": [{"protocol": "tcp", "ports": ["3389"]}]}
    [message] = check_stack(POLICY_BY_NAME["no-ssh-rdp-from-internet"], [_firewall(props)])
    assert "RDP" in message
    assert "port 3389" in message
    assert "0.0.0.0/0" in message


def test_egress_and_disabled_firewalls_are_not_ingress_holes() -> None:
    policy = POLICY_BY_NAME["no-ssh-rdp-from-internet"]
    base = {"sourceRanges": ["0.0.0.0/0"], "allows": [{"protocol": "tcp", "ports": ["22"]}]}
    assert check_stack(policy, [_firewall({**base, "direction": "EGRESS"})]) == []
    assert check_stack(policy, [_firewall({**base, "disabled": True})]) == []
    assert check_stack(policy, [_firewall(base)])


def test_key_material_detector() -> None:
    assert find_key_material(f"PublicKey = {WG_KEY}") == []
    assert find_key_material(f"peer_public_key={WG_KEY}") == []
    assert find_key_material(f"readonly WG_CLIENT_PUBLIC_KEY={WG_KEY}") == []
    assert find_key_material(f"wg set wg0 peer {WG_KEY} allowed-ips 10.250.0.2/32") == []
    # A public-looking word elsewhere on the line exempts nothing.
    assert find_key_material(f"seed={WG_KEY}  # public") != []
    assert find_key_material(f"peer_seed={WG_KEY}") != []
    assert find_key_material(f"PublicKey = {WG_KEY} PrivateKey = {WG_KEY}") != []
    assert find_key_material(f"key={WG_KEY}")
    # 44 base64 characters that do not decode to 32 bytes are not a WireGuard key.
    assert find_key_material("sha=" + "A" * 42 + "==") == []
    assert find_key_material("-----BEGIN EC PRIVATE KEY-----") == ["PEM private key block"]
    assert find_key_material("-----BEGIN PUBLIC KEY-----") == []
    # The hop's script writes wg0.conf from a key it reads at boot: no key in the script.
    assert find_key_material("[Interface]\nPrivateKey = ${private_key}\n") == []
    assert find_key_material("PrivateKey = {{ key }}") == []
    assert find_key_material("PrivateKey = notbase64butliteral") == [
        "WireGuard 'PrivateKey =' line with a literal key"
    ]


def test_a_secret_version_without_a_key_and_one_still_unknown_pass_the_state_rule() -> None:
    """The rule judges key material, not secret versions: a token passes (the allowlist
    decides whether the stack may have the type at all), and so does a payload the preview
    does not know yet."""
    policy = POLICY_BY_NAME["no-private-key-in-state"]
    assert isinstance(policy, ResourceValidationPolicy)
    version = "gcp:secretmanager/secretVersion:SecretVersion"
    assert check_resource(policy, version, {"secret": "s", "secretData": "hunter2"}) == []
    assert check_resource(policy, version, {"secret": "s"}) == []
    [message] = check_resource(policy, version, {"secret": "s", "secretData": WG_KEY})
    assert message == (
        "private key in the Pulumi state: base64 32-byte key (WireGuard private key shape) in a "
        "secret version's secretData, which the state keeps and whoever previews the stack "
        "decrypts; make the key where it is used and publish only its public half, as the VPN "
        "hop does (infra/components/vpn.py)"
    )


def _stack_resource(key: str, name: str, **changes: Any) -> tuple[str, str, dict, str]:
    resource_type, props = BASELINE[key]
    for path, value in changes.items():
        props = mutate(props, path, value)
    return resource_type, name, props, urn_for(resource_type, name)


def test_tpu_and_bucket_in_one_region_pass() -> None:
    policy = POLICY_BY_NAME["accelerator-and-bucket-same-region"]
    resources = [_stack_resource("tpu", "tpu"), _stack_resource("bucket", "bucket")]
    assert check_stack(policy, resources) == []
    # A stack without a TPU (e.g. the bootstrap) has nothing to compare.
    assert check_stack(policy, [_stack_resource("bucket", "state")]) == []


@pytest.mark.parametrize("location", ["US-CENTRAL1", "EU", "europe-west1"])
def test_tpu_and_bucket_in_different_regions_are_rejected(location: str) -> None:
    policy = POLICY_BY_NAME["accelerator-and-bucket-same-region"]
    resources = [
        _stack_resource("tpu", "tpu"),
        _stack_resource("bucket", "bucket", location=location),
    ]
    [message] = check_stack(policy, resources)
    assert message.startswith(vms.MSG_REGION)
    assert "europe-west4" in message
    assert location.lower() in message


def test_unknown_values_during_preview_are_left_to_the_engine() -> None:
    """An unknown input raises the SDK's UnknownValueError, which the analyzer turns into an
    advisory "can't run during preview" note; the rule runs for real on `pulumi up`."""
    from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, UnknownValueError

    props = {"role": "roles/storage.objectViewer", "member": UNKNOWN_STRING_VALUE}
    with pytest.raises(UnknownValueError):
        check_resource(
            POLICY_BY_NAME["no-public-principals"],
            "gcp:storage/bucketIAMMember:BucketIAMMember",
            props,
        )


# --- the VPN hop's exemption is structural ----------------------------------------------------
HOP_RULE = "one-vpn-hop-outside-tpu-region"


def test_one_hop_outside_the_tpu_region_passes() -> None:
    resources = [
        _stack_resource("tpu", "tpu"),
        _stack_resource("controller", "controller"),
        _stack_resource("hop", "hop"),
    ]
    assert check_stack(POLICY_BY_NAME[HOP_RULE], resources) == []
    assert check_stack(POLICY_BY_NAME[HOP_RULE], [_stack_resource("bucket", "state")]) == []


HOP_CASES = [
    (
        "second-hop",
        [_stack_resource("hop", "hop"), _stack_resource("hop", "hop-2", zone="us-west1-b")],
        "2 VMs carry",
    ),
    (
        "controller-claims-the-tag",
        [
            _stack_resource("hop", "hop"),
            _stack_resource("controller", "controller", tags=["tpu-pretrain-vpn-hop"]),
        ],
        "2 VMs carry",
    ),
    (
        "hop-in-the-tpu-region",
        [_stack_resource("tpu", "tpu"), _stack_resource("hop", "hop", zone="europe-west4-b")],
        "hop is in the TPU region europe-west4",
    ),
    (
        "tpu-claims-the-label",
        [_stack_resource("tpu", "tpu", labels={"role": "vpn-hop"})],
        f"{TPU_VM} tpu carries",
    ),
    (
        "template-claims-the-tag",
        [
            (
                "gcp:compute/instanceTemplate:InstanceTemplate",
                "tmpl",
                {"tags": ["tpu-pretrain-vpn-hop"]},
                urn_for("gcp:compute/instanceTemplate:InstanceTemplate", "tmpl"),
            )
        ],
        "InstanceTemplate tmpl carries",
    ),
]


@pytest.mark.parametrize(
    ("case", "resources", "fragment"), HOP_CASES, ids=[case[0] for case in HOP_CASES]
)
def test_the_hop_exemption_cannot_be_claimed(case: str, resources: list, fragment: str) -> None:
    messages = check_stack(POLICY_BY_NAME[HOP_RULE], resources)
    assert messages, case
    assert all(m.startswith(vms.MSG_HOP) for m in messages)
    assert any(fragment in m for m in messages), messages
