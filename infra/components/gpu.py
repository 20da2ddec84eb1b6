from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.components.controller import hardened_metadata
from infra.components.network import TAG_TPU
from infra.components.tpu import CLOUD_PLATFORM, inherited_depends_on

GPU_DESCRIPTION = "tpu-pretrain trainer (GPU)"
# The Deep Learning VM image is ~50 GB; the rest holds the venv (CUDA wheels are ~4 GB), the
# wheelhouse download and local caches.
GPU_BOOT_DISK_GB = 200


@dataclass(frozen=True)
class GpuVmArgs:
    project: str
    name: str
    zone: str
    machine_type: str
    gpu_type: str
    count: int
    attached: bool  # N1: GPUs go in guest_accelerators; A2/A3/A4/G2 types carry them
    spot: bool
    image: str
    boot_disk: str  # pd-balanced, or hyperdisk-balanced where the type takes nothing else
    shielded_boot: bool  # secure boot; vTPM and integrity monitoring are always on
    subnetwork: pulumi.Input[str]
    service_account_email: pulumi.Input[str]
    startup_script: str
    labels: dict[str, str]
    nic_type: str = ""  # GVNIC where the family needs it (catalogs/gpu.yaml); "": the default


def gpu_scheduling(spot: bool) -> gcp.compute.InstanceSchedulingArgsDict:
    """Compute Engine's rules for GPU VMs: no live migration (on_host_maintenance TERMINATE);
    spot is provisioning_model SPOT with preemptible true and automatic_restart false, and a
    termination action: STOP keeps the disk, so the watchdog can start the VM again."""
    if spot:
        return {
            "on_host_maintenance": "TERMINATE",
            "provisioning_model": "SPOT",
            "preemptible": True,
            "automatic_restart": False,
            "instance_termination_action": "STOP",
        }
    return {
        "on_host_maintenance": "TERMINATE",
        "provisioning_model": "STANDARD",
        "preemptible": False,
        "automatic_restart": True,
    }


class GpuVm(pulumi.ComponentResource):
    """A Compute Engine VM with NVIDIA GPUs (gcp.compute.Instance) that trains like the TPU
    VM: the same startup-script pieces, the bucket, a dedicated service account, no external
    IP, the trainer's network tag. Same outputs as TpuVm: `vm` (name, zone), `internal_ip`,
    `worker_ips`. Its startup script is the loader (the same for every job and payload: the
    bucket's job pointer names the rest); machine type and GPU changes stop the VM to update
    it (allow_stopping_for_update)."""

    def __init__(self, name: str, args: GpuVmArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("tpu-pretrain:index:GpuVm", name, None, opts)
        self.vm = gcp.compute.Instance(
            f"{name}-vm",
            project=args.project,
            name=args.name,
            zone=args.zone,
            machine_type=args.machine_type,
            description=GPU_DESCRIPTION,
            boot_disk={
                "initialize_params": {
                    "image": args.image,
                    "size": GPU_BOOT_DISK_GB,
                    "type": args.boot_disk,
                }
            },
            # No access_configs: no external IP (packages come through the NAT).
            # nic_type only where the machine family needs it (A3/A4: GVNIC); unset, Compute
            # Engine's default (VIRTIO_NET) on the others.
            network_interfaces=[
                {"subnetwork": args.subnetwork, "nic_type": args.nic_type}
                if args.nic_type
                else {"subnetwork": args.subnetwork}
            ],
            service_account={"email": args.service_account_email, "scopes": [CLOUD_PLATFORM]},
            scheduling=gpu_scheduling(args.spot),
            shielded_instance_config={
                "enable_secure_boot": args.shielded_boot,
                "enable_vtpm": True,
                "enable_integrity_monitoring": True,
            },
            metadata=hardened_metadata(args.startup_script, guest_attributes=True),
            # The trainer's network tag (firewall rules select the trainer by it, TPU or GPU).
            tags=[TAG_TPU],
            labels=args.labels,
            # None (the default): the machine type carries its GPUs.
            guest_accelerators=(
                [{"type": args.gpu_type, "count": args.count}] if args.attached else None
            ),
            allow_stopping_for_update=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=inherited_depends_on(opts)),
        )
        self.internal_ip = self.vm.network_interfaces.apply(lambda nics: nics[0].network_ip)
        self.worker_ips = self.internal_ip.apply(lambda ip: [ip])
        self.register_outputs(
            {
                "name": self.vm.name,
                "zone": self.vm.zone,
                "internalIp": self.internal_ip,
                "workerIps": self.worker_ips,
            }
        )
