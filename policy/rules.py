"""Guard rails for tpu-pretrain stacks, as Pulumi CrossGuard policies.

Every rule is MANDATORY: a violation fails `pulumi preview` / `pulumi up`. The rules are
derived from the CIS Google Cloud Platform Foundation Benchmark (section numbers of v3.0
in each description) and from this project's design (docs: ARCHITECTURE.md).

Rules read resource properties in the engine's form: camelCase names as in the provider
schema (`uniformBucketLevelAccess`, `networkInterfaces[].accessConfigs`, ...), mappings and
sequences that may be the policy SDK's read-only proxies. Reading a value that is unknown
during a preview raises the SDK's UnknownValueError, which the engine reports as "can't run
policy during preview" (advisory) and then enforces on `pulumi up`, when the value is known.

The pack is a closed world: policy/allowlist.py lists the resource types, APIs, IAM grants
and custom-role permissions each Pulumi project may have, and the first rules below refuse
anything else. The other rules hold the allowed types to their secure settings. Firewall
sources are judged by the addresses they cover, not by how the ranges are written.

Importing this module builds policy objects only. The pack itself (which starts a gRPC
server and never returns) is built in policy/__main__.py.

The rules live in one module per family beneath this one, which only assembles them (none
imports it): closed_world (the allowlists, grants on the stack's own resources), identities
(principals and accounts), network (ingress, VPC), vms (VM and TPU VM settings, the hop,
regions), key_material, storage (buckets, KMS keys) and executables (what a VM runs); all
read props through resources. Each imports its siblings in two forms: from the package
"policy" (the tests) and as top-level modules (the pack as the CLI runs it, from policy/).
"""

from __future__ import annotations

from pulumi_policy import (
    EnforcementLevel,
    ResourceValidationPolicy,
    StackValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from . import (
        closed_world,
        executables,
        identities,
        key_material,
        network,
        resources,
        storage,
        vms,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    import closed_world  # type: ignore[no-redef]
    import executables  # type: ignore[no-redef]
    import identities  # type: ignore[no-redef]
    import key_material  # type: ignore[no-redef]
    import network  # type: ignore[no-redef]
    import resources  # type: ignore[no-redef]
    import storage  # type: ignore[no-redef]
    import vms  # type: ignore[no-redef]

PACK_NAME = "tpu-pretrain-guardrails"


def build_policies() -> list[ResourceValidationPolicy | StackValidationPolicy]:
    vm_and_tpu = (*resources.VM_TYPES, *resources.TPU_TYPES)
    return [
        closed_world._any_resource_policy(
            "allowed-resource-types",
            "Every resource's type is on the allowlist of its Pulumi project "
            "(policy/allowlist.py); anything else is refused (closed world).",
            closed_world._check_allowed_type,
        ),
        closed_world._any_resource_policy(
            "allowed-apis",
            "Only the APIs the program needs may be enabled (policy/allowlist.py).",
            closed_world._check_allowed_api,
        ),
        closed_world._any_resource_policy(
            "allowed-iam-grants",
            "Every IAM grant (role x principal x resource) is on the allowlist; custom roles "
            "by role id, service-account grants by the account they are on.",
            closed_world._check_allowed_grants,
        ),
        executables.build_policy(),
        closed_world._any_resource_policy(
            "custom-role-permissions",
            "A custom role exists only under an allowed role id and holds only the "
            "permissions listed for it (setIamPolicy, actAs, token or key creation, role "
            "editing are named as escalation paths).",
            closed_world._check_custom_role,
        ),
        closed_world._any_resource_policy(
            "vm-accounts-are-stack-accounts",
            "VMs and TPU VMs run as the stack's own service accounts, never as another "
            "account of the project (a CI account, another stack's, a default one).",
            closed_world._check_vm_account,
        ),
        closed_world._any_resource_policy(
            "providers-without-credentials",
            "Providers use the identity the workflow authenticated: no credentials, access "
            "token or impersonation of their own.",
            closed_world._check_provider,
        ),
        resources._resource_policy(
            "bucket-uniform-access",
            "Buckets use uniform bucket-level access (no object ACLs).",
            (resources.BUCKET,),
            storage._check_uniform_access,
            cis="5.2",
        ),
        resources._resource_policy(
            "bucket-public-access-prevention",
            "Buckets enforce public access prevention.",
            (resources.BUCKET,),
            storage._check_pap,
            cis="5.1",
        ),
        identities.PublicMembersPolicy(),
        identities.DefaultServiceAccountPolicy(),
        resources._resource_policy(
            "no-basic-or-admin-roles-for-service-accounts",
            "Project-level grants never give a service account a basic or an admin role.",
            resources.PROJECT_IAM_TYPES,
            identities._check_sa_roles,
            cis="1.5",
        ),
        network._ingress_policy(
            "no-ssh-rdp-from-internet",
            "Ingress firewalls never let a public address reach TCP 22/3389 (or all ports): "
            "source ranges are judged by the addresses they cover, whatever their prefix "
            "lengths; only RFC 1918, IAP and health-check ranges, and the stack's own user "
            "CIDRs (its WireGuard sources, a /16 at most) are not public (CIS GCP 3.6, 3.7)",
        ),
        network._ingress_policy(
            "no-tensorboard-tpu-from-internet",
            "Ingress firewalls never let a public address reach TensorBoard (6006) or the TPU "
            "runtime ports (8470-8479); they are reached over the VPN.",
        ),
        network._ingress_policy(
            "no-public-ingress",
            "No other port or protocol faces public addresses either (closed by default): "
            "the one exception is the WireGuard rule, UDP on listed ports to the VPN hop.",
        ),
        resources._resource_policy(
            "no-external-ip-except-vpn-hop",
            f"Only the VPN hop ({resources.HOP_MARK}) has an external IP; TPU VMs never do.",
            vm_and_tpu,
            vms._check_external_ip,
            cis="4.9",
        ),
        resources._resource_policy(
            "ip-forwarding-only-on-vpn-hop",
            f"Only the VPN hop ({resources.HOP_MARK}) forwards IP packets.",
            vm_and_tpu,
            vms._check_ip_forward,
            cis="4.6",
        ),
        resources._resource_policy(
            "shielded-vm",
            "VMs are shielded (secure boot, vTPM, integrity monitoring); TPU VMs use secure "
            "boot where the generation supports it (v4 and later); GPU VMs keep vTPM and "
            "integrity monitoring (their NVIDIA driver is not signed for secure boot).",
            vm_and_tpu,
            vms._check_shielded,
            cis="4.8",
        ),
        resources._resource_policy(
            "os-login-enabled",
            "VMs and TPU VMs enable OS Login and carry no ssh-keys metadata.",
            vm_and_tpu,
            vms._check_os_login,
            cis="4.4",
        ),
        resources._resource_policy(
            "project-ssh-keys-blocked",
            "VMs and TPU VMs block project-wide SSH keys.",
            vm_and_tpu,
            vms._check_project_ssh_keys,
            cis="4.3",
        ),
        resources._resource_policy(
            "serial-port-disabled",
            "Interactive serial port access is never enabled (instance or project metadata).",
            (*vm_and_tpu, resources.PROJECT_METADATA, resources.PROJECT_METADATA_ITEM),
            vms._check_serial_port,
            cis="4.5",
        ),
        resources._resource_policy(
            "no-key-material-in-metadata",
            "Metadata and startup scripts carry no private keys (PEM blocks, WireGuard keys); "
            "keys live in Secret Manager.",
            (*vm_and_tpu, resources.PROJECT_METADATA, resources.PROJECT_METADATA_ITEM),
            key_material._check_key_material,
        ),
        resources._resource_policy(
            "bucket-recoverable",
            "Buckets keep object versioning or a soft-delete window so a bad write can be undone.",
            (resources.BUCKET,),
            storage._check_bucket_recovery,
        ),
        resources._resource_policy(
            "no-service-account-keys",
            "No user-managed service account keys (CI uses Workload Identity Federation).",
            (resources.SERVICE_ACCOUNT_KEY,),
            identities._check_sa_key,
            cis="1.4",
        ),
        resources._resource_policy(
            "kms-key-rotation",
            "Symmetric KMS keys rotate at least every 90 days.",
            (resources.KMS_CRYPTO_KEY,),
            storage._check_kms_rotation,
            cis="1.10",
        ),
        resources._resource_policy(
            "subnet-flow-logs",
            "Every VM subnetwork has VPC flow logs.",
            (resources.SUBNETWORK,),
            network._check_flow_logs,
            cis="3.8",
        ),
        resources._resource_policy(
            "no-auto-mode-network",
            "VPC networks are custom-mode (no auto-created subnetworks in every region).",
            (resources.NETWORK,),
            network._check_auto_network,
            cis="3.1",
        ),
        resources._resource_policy(
            "wif-provider-attribute-condition",
            "Workload identity OIDC providers restrict which tokens they accept.",
            (resources.WIF_PROVIDER,),
            identities._check_wif_condition,
        ),
        StackValidationPolicy(
            name="one-vpn-hop-outside-tpu-region",
            description=f"At most one VM carries {resources.HOP_MARK}: a compute instance "
            "outside every TPU region (so the hop's exemptions cannot be claimed by another VM).",
            validate=vms._validate_single_hop,
            enforcement_level=EnforcementLevel.MANDATORY,
        ),
        StackValidationPolicy(
            name="grants-on-own-resources",
            description="Bucket, secret, service-account and image-repository grants are on "
            "resources the same stack creates (never on the state bucket or another stack's "
            "account).",
            validate=closed_world._validate_own_targets,
            enforcement_level=EnforcementLevel.MANDATORY,
        ),
        StackValidationPolicy(
            name="accelerator-and-bucket-same-region",
            description="Every TPU VM, every VM with GPUs and every bucket of a stack are in "
            "one region (no cross-region reads of training data).",
            validate=vms._validate_regions,
            enforcement_level=EnforcementLevel.MANDATORY,
        ),
    ]


POLICY_MESSAGES = {
    "allowed-resource-types": closed_world.MSG_UNKNOWN_TYPE,
    "allowed-apis": closed_world.MSG_UNKNOWN_API,
    "allowed-iam-grants": closed_world.MSG_IAM_GRANT,
    "custom-role-permissions": closed_world.MSG_CUSTOM_ROLE,
    executables.NAME: executables.MSG,
    "providers-without-credentials": closed_world.MSG_PROVIDER,
    "no-public-ingress": network.MSG_PUBLIC_INGRESS,
    "grants-on-own-resources": closed_world.MSG_FOREIGN_TARGET,
    "vm-accounts-are-stack-accounts": closed_world.MSG_VM_ACCOUNT,
    "bucket-uniform-access": storage.MSG_UNIFORM_ACCESS,
    "bucket-public-access-prevention": storage.MSG_PAP,
    "no-public-principals": identities.MSG_PUBLIC_MEMBER,
    "no-default-compute-service-account": identities.MSG_DEFAULT_SA,
    "no-basic-or-admin-roles-for-service-accounts": identities.MSG_SA_ROLE,
    "no-ssh-rdp-from-internet": network.MSG_SSH_RDP,
    "no-tensorboard-tpu-from-internet": network.MSG_SERVICE_PORTS,
    "no-external-ip-except-vpn-hop": vms.MSG_EXTERNAL_IP,
    "ip-forwarding-only-on-vpn-hop": vms.MSG_IP_FORWARD,
    "shielded-vm": vms.MSG_SHIELDED,
    "os-login-enabled": vms.MSG_OS_LOGIN,
    "project-ssh-keys-blocked": vms.MSG_PROJECT_SSH_KEYS,
    "serial-port-disabled": vms.MSG_SERIAL_PORT,
    "no-key-material-in-metadata": key_material.MSG_KEY_MATERIAL,
    "bucket-recoverable": storage.MSG_BUCKET_RECOVERY,
    "no-service-account-keys": identities.MSG_SA_KEY,
    "kms-key-rotation": storage.MSG_KMS_ROTATION,
    "subnet-flow-logs": network.MSG_FLOW_LOGS,
    "no-auto-mode-network": network.MSG_AUTO_NETWORK,
    "wif-provider-attribute-condition": identities.MSG_WIF_CONDITION,
    "accelerator-and-bucket-same-region": vms.MSG_REGION,
    "one-vpn-hop-outside-tpu-region": vms.MSG_HOP,
}
