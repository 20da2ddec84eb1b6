from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.components.network import TAG_CONTROLLER
from infra.components.tpu import CLOUD_PLATFORM, inherited_depends_on
from infra.render import render

CONTROLLER_IMAGE = "debian-cloud/debian-12"


# Every GCE VM of a stack (controller, VPN hop): shielded boot, OS Login, no project-wide
# SSH keys, no serial console. The policy pack enforces the same settings.
SHIELDED_VM: gcp.compute.InstanceShieldedInstanceConfigArgsDict = {
    "enable_secure_boot": True,
    "enable_vtpm": True,
    "enable_integrity_monitoring": True,
}


def hardened_metadata(
    startup_script: pulumi.Input[str], *, guest_attributes: bool = False
) -> dict[str, pulumi.Input[str]]:
    """`guest_attributes`: the VM writes guest attributes, so they are on. A VM that boots the
    stable loader leaves its boot state in one for the watchdog (infra/render/render.py
    BOOT_ATTRIBUTE); the VPN hop publishes its public key in one (WG_PUBLIC_KEY_ATTRIBUTE)."""
    return {
        "enable-oslogin": "TRUE",
        "block-project-ssh-keys": "TRUE",
        "serial-port-enable": "FALSE",
        **(render.GUEST_ATTRIBUTES_METADATA if guest_attributes else {}),
        "startup-script": startup_script,
    }


@dataclass(frozen=True)
class WatchLease:
    """The accelerator's watchdog acts only while this bucket object exists
    (templates/watch-common.sh: tpu-watch.sh, gpu-watch.sh)."""

    bucket: pulumi.Input[str]
    object_name: str
    vm_name: str  # the TPU VM or GPU VM the watchdog recreates or starts


@dataclass(frozen=True)
class ControllerVmArgs:
    project: str
    name: str
    zone: str
    machine_type: str
    subnetwork: pulumi.Input[str]
    service_account_email: pulumi.Input[str]
    startup_script: pulumi.Input[str]
    labels: dict[str, str]
    watch_lease: WatchLease | None = None


class ControllerVm(pulumi.ComponentResource):
    """A small CPU VM next to the TPU: tokenizer training and encoding, TensorBoard over
    the bucket's logs, operations. No external IP; SSH through IAP or the VPN with OS Login."""

    def __init__(
        self, name: str, args: ControllerVmArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:ControllerVm", name, None, opts)
        self.instance = gcp.compute.Instance(
            f"{name}-vm",
            project=args.project,
            name=args.name,
            zone=args.zone,
            machine_type=args.machine_type,
            boot_disk={
                "initialize_params": {"image": CONTROLLER_IMAGE, "size": 50, "type": "pd-balanced"}
            },
            network_interfaces=[{"subnetwork": args.subnetwork}],
            service_account={"email": args.service_account_email, "scopes": [CLOUD_PLATFORM]},
            shielded_instance_config=SHIELDED_VM,
            metadata=hardened_metadata(args.startup_script, guest_attributes=True),
            tags=[TAG_CONTROLLER],
            labels=args.labels,
            allow_stopping_for_update=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=inherited_depends_on(opts)),
        )
        self.internal_ip = self.instance.network_interfaces.apply(lambda nics: nics[0].network_ip)
        if args.watch_lease is not None:
            # Created after the VM, so `pulumi destroy` deletes it first: the watchdog sees the
            # stack going away (its next tick, or its shutdown hook while the VM is deleted),
            # cancels a TPU's queued resource and stops, before Pulumi deletes the accelerator
            # VM (the program makes the controller depend on it, so that VM goes last).
            lease = args.watch_lease
            gcp.storage.BucketObject(
                f"{name}-tpu-watch-lease",
                bucket=lease.bucket,
                name=lease.object_name,
                content=f"The watchdog on {args.name} may recreate or start {lease.vm_name} "
                "while this object exists. Pulumi owns it: `pulumi destroy` deletes it first.\n",
                content_type="text/plain",
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.instance]),
            )
        self.register_outputs({"name": self.instance.name, "internalIp": self.internal_ip})
