"""The rule family of VMs and TPU VMs: no external IP or IP forwarding outside the VPN hop,
shielded boot, OS Login, no project-wide SSH keys, no serial port, and where they stand (one
hop, outside every TPU region; the accelerators and the bucket in one region)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    StackValidationArgs,
    StackValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from .resources import (
        BUCKET,
        HOP_MARK,
        INSTANCE,
        PROJECT_METADATA,
        PROJECT_METADATA_ITEM,
        TPU_QUEUED,
        TPU_TYPES,
        TPU_VM,
        VM_TYPES,
        Rule,
        get,
        is_vpn_hop,
        items,
        metadata_true,
        resource_policy,
        vm_metadata,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    from resources import (  # type: ignore[no-redef]
        BUCKET,
        HOP_MARK,
        INSTANCE,
        PROJECT_METADATA,
        PROJECT_METADATA_ITEM,
        TPU_QUEUED,
        TPU_TYPES,
        TPU_VM,
        VM_TYPES,
        Rule,
        get,
        is_vpn_hop,
        items,
        metadata_true,
        resource_policy,
        vm_metadata,
    )

# TPU generations whose TPU VM images support Secure Boot (v4 and later; v2/v3 hosts do
# not offer shielded boot). Accelerator types look like "v4-8", "v5litepod-8", "v6e-8".
TPU_SECURE_BOOT_PREFIXES = ("v4", "v5", "v6", "v7")
# Compute Engine VMs with GPUs: N1 with guestAccelerators, or a machine family that carries
# its GPUs (infra/catalogs/gpu.yaml). Their NVIDIA kernel module (Deep Learning VM image) is not
# signed for Secure Boot, so secure boot may be off; vTPM and integrity monitoring may not.
GPU_MACHINE_PREFIXES = ("a2-", "a3-", "a4-", "g2-")

# One message per rule; tests and users match on them.
MSG_HOP = "the VPN hop exemption allows one compute instance outside the TPU region"
MSG_EXTERNAL_IP = "external IP address outside the VPN hop"
MSG_IP_FORWARD = "IP forwarding outside the VPN hop"
MSG_SHIELDED = "shielded VM: secure boot, vTPM and integrity monitoring must be on"
MSG_OS_LOGIN = "OS Login must be enabled (metadata enable-oslogin=TRUE)"
MSG_PROJECT_SSH_KEYS = (
    "project-wide SSH keys must be blocked (metadata block-project-ssh-keys=TRUE)"
)
MSG_SERIAL_PORT = "interactive serial port access must stay disabled"
MSG_REGION = "the accelerator (TPU or GPU VM) and the training bucket must be in one region"


def _tpu_network_configs(props: Mapping[str, Any]) -> list[Any]:
    configs = [get(props, "networkConfig"), *items(get(props, "networkConfigs"))]
    return [config for config in configs if isinstance(config, Mapping)]


def _check_external_ip(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type in TPU_TYPES:
        for config in _tpu_network_configs(props):
            if get(config, "enableExternalIps") is True:
                report(f"{MSG_EXTERNAL_IP}: TPU VM sets networkConfig.enableExternalIps")
        return
    if is_vpn_hop(props):
        return
    for index, interface in enumerate(items(get(props, "networkInterfaces"))):
        if items(get(interface, "accessConfigs")) or items(get(interface, "ipv6AccessConfigs")):
            report(
                f"{MSG_EXTERNAL_IP}: networkInterfaces[{index}] has an access config; only the "
                f"VM with {HOP_MARK} may have one"
            )


def _check_ip_forward(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type in TPU_TYPES:
        if any(get(c, "canIpForward") is True for c in _tpu_network_configs(props)):
            report(f"{MSG_IP_FORWARD}: TPU VM sets networkConfig.canIpForward")
        return
    if get(props, "canIpForward") is True and not is_vpn_hop(props):
        report(f"{MSG_IP_FORWARD}: canIpForward on a VM without {HOP_MARK}")


def _tpu_supports_secure_boot(props: Mapping[str, Any]) -> bool:
    accelerator = get(props, "acceleratorType")
    if not isinstance(accelerator, str):
        accelerator = str(get(props, "acceleratorConfig", "type") or "").lower()
    return accelerator.lower().startswith(TPU_SECURE_BOOT_PREFIXES)


def has_gpus(props: Mapping[str, Any]) -> bool:
    machine_type = str(get(props, "machineType") or "").rsplit("/", 1)[-1].lower()
    attached = any(
        isinstance(get(a, "count"), (int, float)) and get(a, "count") > 0
        for a in items(get(props, "guestAccelerators"))
    )
    return attached or machine_type.startswith(GPU_MACHINE_PREFIXES)


def _check_shielded(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    config = get(props, "shieldedInstanceConfig")
    if resource_type == INSTANCE and has_gpus(props):
        for key in ("enableVtpm", "enableIntegrityMonitoring"):
            if get(config, key) is not True:
                report(f"{MSG_SHIELDED}: GPU VM: shieldedInstanceConfig.{key} is not true")
        return
    if resource_type in TPU_TYPES:
        if _tpu_supports_secure_boot(props) and get(config, "enableSecureBoot") is not True:
            report(f"{MSG_SHIELDED}: this TPU generation supports secure boot; enable it")
        return
    if get(config, "enableSecureBoot") is not True:
        report(f"{MSG_SHIELDED}: shieldedInstanceConfig.enableSecureBoot is not true")
    for key in ("enableVtpm", "enableIntegrityMonitoring"):
        if get(config, key) is False:
            report(f"{MSG_SHIELDED}: shieldedInstanceConfig.{key} is false")


def _check_os_login(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    metadata = vm_metadata(props)
    if not metadata_true(metadata.get("enable-oslogin")):
        report(f"{MSG_OS_LOGIN}: got {metadata.get('enable-oslogin')!r}")
    for key in ("ssh-keys", "sshKeys"):
        if metadata.get(key):
            report(f"{MSG_OS_LOGIN}: metadata {key} bypasses OS Login; remove it")


def _check_project_ssh_keys(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    metadata = vm_metadata(props)
    if not metadata_true(metadata.get("block-project-ssh-keys")):
        report(f"{MSG_PROJECT_SSH_KEYS}: got {metadata.get('block-project-ssh-keys')!r}")


def _check_serial_port(
    resource_type: str, props: Mapping[str, Any], report: Callable[[str], None]
) -> None:
    if resource_type in (PROJECT_METADATA, PROJECT_METADATA_ITEM):
        if resource_type == PROJECT_METADATA_ITEM:
            entries = {str(get(props, "key")): get(props, "value")}
        else:
            entries = dict(get(props, "metadata") or {})
    else:
        entries = dict(vm_metadata(props))
    if metadata_true(entries.get("serial-port-enable")):
        report(f"{MSG_SERIAL_PORT}: metadata serial-port-enable={entries['serial-port-enable']!r}")


def _region_of_zone(zone: str) -> str:
    return zone.rsplit("-", 1)[0].lower()


def _accelerators(args: StackValidationArgs) -> list[Any]:
    """What trains: TPU VMs (and queued resources) and compute instances with GPUs."""
    return [
        r
        for r in args.resources
        if r.resource_type in (TPU_VM, TPU_QUEUED)
        or (r.resource_type == INSTANCE and has_gpus(r.props))
    ]


def _validate_regions(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    accelerators = _accelerators(args)
    buckets = [r for r in args.resources if r.resource_type == BUCKET]
    if not accelerators or not buckets:
        return
    for accelerator in accelerators:
        zone = get(accelerator.props, "zone")
        if not isinstance(zone, str):
            continue
        region = _region_of_zone(zone)
        what = "GPU VM" if accelerator.resource_type == INSTANCE else "TPU"
        for bucket in buckets:
            location = str(get(bucket.props, "location") or "").lower()
            if location != region:
                report_violation(
                    f"{MSG_REGION}: {what} {accelerator.name} is in {region} ({zone}) but "
                    f"bucket {bucket.name} is in {location or 'an unknown location'}",
                    bucket.urn,
                )


def _validate_single_hop(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    """The resource rules exempt the VM marked as the hop; this makes the mark structural:
    one compute instance at most, and not in a region that holds a TPU (the hop is the VPN
    endpoint near the user, never a VM next to the training data)."""
    marked = [
        r
        for r in args.resources
        if r.resource_type in (*VM_TYPES, *TPU_TYPES, TPU_QUEUED) and is_vpn_hop(r.props)
    ]
    instances = [r for r in marked if r.resource_type == INSTANCE]
    for resource in marked:
        if resource.resource_type != INSTANCE:
            report_violation(
                f"{MSG_HOP}: {resource.resource_type} {resource.name} carries {HOP_MARK}",
                resource.urn,
            )
    if len(instances) > 1:
        names = ", ".join(r.name for r in instances)
        for resource in instances:
            report_violation(
                f"{MSG_HOP}: {len(instances)} VMs carry {HOP_MARK}: {names}", resource.urn
            )
    tpu_regions = {
        _region_of_zone(zone)
        for r in args.resources
        if r.resource_type in (TPU_VM, TPU_QUEUED)
        for zone in [get(r.props, "zone")]
        if isinstance(zone, str)
    }
    for resource in instances:
        zone = get(resource.props, "zone")
        if isinstance(zone, str) and _region_of_zone(zone) in tpu_regions:
            report_violation(
                f"{MSG_HOP}: {resource.name} is in the TPU region {_region_of_zone(zone)}",
                resource.urn,
            )


def rules() -> list[Rule]:
    """The VMs' rules, in the pack's order: each VM's settings, then where the VMs stand."""
    vm_and_tpu = (*VM_TYPES, *TPU_TYPES)
    return [
        Rule(
            resource_policy(
                "no-external-ip-except-vpn-hop",
                f"Only the VPN hop ({HOP_MARK}) has an external IP; TPU VMs never do.",
                vm_and_tpu,
                _check_external_ip,
                cis="4.9",
            ),
            MSG_EXTERNAL_IP,
        ),
        Rule(
            resource_policy(
                "ip-forwarding-only-on-vpn-hop",
                f"Only the VPN hop ({HOP_MARK}) forwards IP packets.",
                vm_and_tpu,
                _check_ip_forward,
                cis="4.6",
            ),
            MSG_IP_FORWARD,
        ),
        Rule(
            resource_policy(
                "shielded-vm",
                "VMs are shielded (secure boot, vTPM, integrity monitoring); TPU VMs use "
                "secure boot where the generation supports it (v4 and later); GPU VMs keep "
                "vTPM and integrity monitoring (their NVIDIA driver is not signed for secure "
                "boot).",
                vm_and_tpu,
                _check_shielded,
                cis="4.8",
            ),
            MSG_SHIELDED,
        ),
        Rule(
            resource_policy(
                "os-login-enabled",
                "VMs and TPU VMs enable OS Login and carry no ssh-keys metadata.",
                vm_and_tpu,
                _check_os_login,
                cis="4.4",
            ),
            MSG_OS_LOGIN,
        ),
        Rule(
            resource_policy(
                "project-ssh-keys-blocked",
                "VMs and TPU VMs block project-wide SSH keys.",
                vm_and_tpu,
                _check_project_ssh_keys,
                cis="4.3",
            ),
            MSG_PROJECT_SSH_KEYS,
        ),
        Rule(
            resource_policy(
                "serial-port-disabled",
                "Interactive serial port access is never enabled (instance or project metadata).",
                (*vm_and_tpu, PROJECT_METADATA, PROJECT_METADATA_ITEM),
                _check_serial_port,
                cis="4.5",
            ),
            MSG_SERIAL_PORT,
        ),
        Rule(
            StackValidationPolicy(
                name="one-vpn-hop-outside-tpu-region",
                description=f"At most one VM carries {HOP_MARK}: a compute instance outside "
                "every TPU region (so the hop's exemptions cannot be claimed by another VM).",
                validate=_validate_single_hop,
                enforcement_level=EnforcementLevel.MANDATORY,
            ),
            MSG_HOP,
        ),
        Rule(
            StackValidationPolicy(
                name="accelerator-and-bucket-same-region",
                description="Every TPU VM, every VM with GPUs and every bucket of a stack are "
                "in one region (no cross-region reads of training data).",
                validate=_validate_regions,
                enforcement_level=EnforcementLevel.MANDATORY,
            ),
            MSG_REGION,
        ),
    ]
