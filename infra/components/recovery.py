from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# The custom role that lets the controller's TPU watchdog (templates/tpu-watch.sh) describe,
# delete and recreate the TPU VM (directly or through a queued resource). It is created once
# per project by the GitOps bootstrap (infra/bootstrap/bootstrap_roles.py RECOVERY_ROLE_ID,
# or the one-time gcloud command in docs/deploy-gcp.md): the deploy account may grant it but
# must not be able to edit it, or it could put any permission into a role it may grant.
RECOVERY_ROLE_ID = "tpuPretrainTpuRecovery"
SERVICE_ACCOUNT_USER = "roles/iam.serviceAccountUser"


def recovery_role_name(project: str) -> str:
    return f"projects/{project}/roles/{RECOVERY_ROLE_ID}"


@dataclass(frozen=True)
class TpuAutoRecoveryArgs:
    project: str
    watchdog_member: pulumi.Input[str]  # serviceAccount:<controller account>
    tpu_service_account_name: pulumi.Input[str]  # projects/<p>/serviceAccounts/<tpu email>
    # tpu-pretrain:accountsFromBootstrap: the GitOps bootstrap owns the TPU VM's account and
    # made the controller's actAs on it (infra/bootstrap/bootstrap_roles.py
    # CONTROLLER_ACTS_AS); the stack writes no account's allow policy.
    act_as_from_bootstrap: bool = False


class TpuAutoRecovery(pulumi.ComponentResource):
    """Least privilege for the TPU watchdog, which runs as the controller's own account (not
    the TPU VM's): the bootstrap's recovery role at project level, and actAs on the TPU VM's
    service account only (a grant on that one account), so a recreated TPU VM runs as the
    same account. Nothing here creates or edits a role. In a GitOps stack the actAs grant is
    the bootstrap's (`act_as_from_bootstrap`): the recovery role, granted here, is what
    turns it into the power to recreate the VM."""

    def __init__(
        self, name: str, args: TpuAutoRecoveryArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:TpuAutoRecovery", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = recovery_role_name(args.project)
        self.project_grant = gcp.projects.IAMMember(
            f"{name}-tpu-nodes",
            project=args.project,
            role=self.role,
            member=args.watchdog_member,
            opts=child,
        )
        self.act_as = (
            None
            if args.act_as_from_bootstrap
            else gcp.serviceaccount.IAMMember(
                f"{name}-act-as",
                service_account_id=args.tpu_service_account_name,
                role=SERVICE_ACCOUNT_USER,
                member=args.watchdog_member,
                opts=child,
            )
        )
        self.register_outputs({"role": self.role})


# The custom role of the GPU watchdog (templates/gpu-watch.sh): `gcloud compute instances
# describe` (compute.instances.get) and `gcloud compute instances start --async`
# (compute.instances.start; --async: no zone-operation polling, so no
# compute.zoneOperations.get). Starting a VM does not attach its service account anew, so
# no actAs: Google's Compute Engine IAM page lists actAs for creating a VM that runs as an
# account, attaching disks to it, setting its metadata, SSH to it and changing its account,
# not for starting it (checked only offline; a 403 shows in gpu-watch.json). Created by the
# bootstrap (infra/bootstrap/bootstrap_roles.py GPU_RECOVERY_ROLE_ID) like the TPU role.
GPU_RECOVERY_ROLE_ID = "tpuPretrainGpuRecovery"


def gpu_recovery_role_name(project: str) -> str:
    return f"projects/{project}/roles/{GPU_RECOVERY_ROLE_ID}"


def instance_condition(
    project: str, zone: str, name: str
) -> gcp.projects.IAMMemberConditionArgsDict:
    """An IAM condition that limits a project-level grant to one VM: Compute Engine
    instances are named projects/<p>/zones/<z>/instances/<name> in IAM conditions (the
    bootstrap's stack_instance_condition uses the same attribute)."""
    return {
        "title": f"only-{name}"[:100],
        "description": f"The GPU watchdog may describe and start {name} only.",
        "expression": f'resource.name == "projects/{project}/zones/{zone}/instances/{name}"',
    }


@dataclass(frozen=True)
class GpuAutoRecoveryArgs:
    project: str
    zone: str
    vm_name: str
    watchdog_member: pulumi.Input[str]  # serviceAccount:<controller account>


class GpuAutoRecovery(pulumi.ComponentResource):
    """Least privilege for the GPU watchdog (the controller's account): the bootstrap's GPU
    recovery role (get, start) on the project, conditional on the one GPU VM's name."""

    def __init__(
        self, name: str, args: GpuAutoRecoveryArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:GpuAutoRecovery", name, None, opts)
        self.role = gpu_recovery_role_name(args.project)
        self.grant = gcp.projects.IAMMember(
            f"{name}-start",
            project=args.project,
            role=self.role,
            member=args.watchdog_member,
            condition=instance_condition(args.project, args.zone, args.vm_name),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"role": self.role})
