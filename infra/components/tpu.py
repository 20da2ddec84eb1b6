from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.components.network import TAG_TPU
from infra.render import render

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
TPU_DESCRIPTION = "tpu-pretrain trainer"
# OS Login + no project-wide keys: policy pack rules os-login-enabled and
# project-ssh-keys-blocked (CIS 4.3, 4.4) apply to TPU VMs too. The controller's watchdog
# recreates a preempted TPU VM with exactly these settings (infra/render/render.py TpuWatch).
# Like every VM of the stack (controller.hardened_metadata): OS Login, no project SSH keys,
# no interactive serial port; guest attributes on, where the loader leaves its boot state for
# the watchdog (infra/render/render.py BOOT_ATTRIBUTE).
TPU_METADATA = {
    "enable-oslogin": "TRUE",
    "block-project-ssh-keys": "TRUE",
    "serial-port-enable": "FALSE",
    **render.GUEST_ATTRIBUTES_METADATA,
}


def inherited_depends_on(opts: pulumi.ResourceOptions | None) -> list[pulumi.Resource]:
    """A VM waits for what its component waits for (payload, job spec, bucket access), so
    its first boot finds them; children do not inherit the component's depends_on."""
    deps = opts.depends_on if opts is not None else None
    if deps is None:
        return []
    return list(deps) if isinstance(deps, (list, tuple)) else [deps]  # type: ignore[list-item]


@dataclass(frozen=True)
class TpuVmArgs:
    project: str
    name: str
    zone: str
    accelerator_type: str
    runtime_version: str
    preemptible: bool
    spot: bool
    external_ip: bool
    shielded_boot: bool
    network: pulumi.Input[str]
    subnetwork: pulumi.Input[str]
    service_account_email: pulumi.Input[str]
    startup_script: str
    labels: dict[str, str]


# The V2Vm inputs the provider would update in place (tpu.nodes.update). The deploy account
# does not hold that permission: a node's metadata is a startup script that runs as the
# node's account at its next boot, and Cloud TPU is not among the services whose resource
# names an IAM condition can test (docs/guard-rails.md), so the permission would reach every
# TPU VM of the project. A change to one of these replaces the node instead.
IN_PLACE_FIELDS = ("description", "labels", "metadata", "tags", "dataDisks")


class TpuVm(pulumi.ComponentResource):
    """The TPU VM (gcp.tpu.V2Vm). Every change replaces it (IN_PLACE_FIELDS: no in-place
    update, so the deploy account needs no tpu.nodes.update), deleting the old node first
    (the name is fixed), and training resumes from the bucket's checkpoints. Its startup
    script is the loader (render.render_loader), the same for every job and payload: a new
    job or payload rewrites the bucket's job pointer, not this node (docs/deploy-gcp.md).
    With tpuAutoRecover, the controller's watchdog (templates/tpu-watch.sh) recreates a
    preempted VM under the same name with these same settings."""

    def __init__(self, name: str, args: TpuVmArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("tpu-pretrain:index:TpuVm", name, None, opts)
        self.vm = gcp.tpu.V2Vm(
            f"{name}-vm",
            project=args.project,
            name=args.name,
            zone=args.zone,
            accelerator_type=args.accelerator_type,
            runtime_version=args.runtime_version,
            description=TPU_DESCRIPTION,
            network_config={
                "network": args.network,
                "subnetwork": args.subnetwork,
                "enable_external_ips": args.external_ip,
                "can_ip_forward": False,
            },
            scheduling_config={"preemptible": args.preemptible, "spot": args.spot},
            service_account={"email": args.service_account_email, "scopes": [CLOUD_PLATFORM]},
            metadata={**TPU_METADATA, "startup-script": args.startup_script},
            labels=args.labels,
            tags=[TAG_TPU],
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=inherited_depends_on(opts),
                replace_on_changes=list(IN_PLACE_FIELDS),
                delete_before_replace=True,
            ),
            # None (the default): no shielded_instance_config at all.
            shielded_instance_config={"enable_secure_boot": True} if args.shielded_boot else None,
        )
        self.internal_ip = self.vm.network_endpoints.apply(
            lambda endpoints: endpoints[0].ip_address if endpoints else None
        )
        # One endpoint per host, in worker order (a slice has several; worker 0 first).
        self.worker_ips = self.vm.network_endpoints.apply(
            lambda endpoints: [endpoint.ip_address for endpoint in endpoints or []]
        )
        self.register_outputs(
            {
                "name": self.vm.name,
                "zone": self.vm.zone,
                "internalIp": self.internal_ip,
                "workerIps": self.worker_ips,
            }
        )
