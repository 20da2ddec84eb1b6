from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# What the controller's TPU watchdog (templates/tpu-watch.sh) calls: `gcloud compute tpus
# tpu-vm describe/delete/create` (nodes.get/delete/create) and waits for their long-running
# operations (operations.get). Attaching the workload service account to the new VM needs
# iam.serviceAccounts.actAs, granted on that one account (roles/iam.serviceAccountUser).
RECOVERY_PERMISSIONS = (
    "tpu.nodes.create",
    "tpu.nodes.delete",
    "tpu.nodes.get",
    "tpu.operations.get",
)
SERVICE_ACCOUNT_USER = "roles/iam.serviceAccountUser"


def recovery_role_id(stack: str) -> str:
    """A custom role id: letters, digits, '_' and '.' only (3-64 characters)."""
    return "tpuPretrainRecover_" + stack.replace("-", "_")


@dataclass(frozen=True)
class TpuAutoRecoveryArgs:
    project: str
    stack: str
    service_account_name: pulumi.Input[str]  # projects/<p>/serviceAccounts/<email>
    service_account_member: pulumi.Input[str]  # serviceAccount:<email>


class TpuAutoRecovery(pulumi.ComponentResource):
    """Least privilege for the TPU watchdog: a custom role with only the TPU permissions it
    uses, bound at project level to the workload account, plus actAs on that account itself
    (an account-level grant, not a project-wide one)."""

    def __init__(
        self, name: str, args: TpuAutoRecoveryArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:TpuAutoRecovery", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = gcp.projects.IAMCustomRole(
            f"{name}-role",
            project=args.project,
            role_id=recovery_role_id(args.stack),
            title=f"tpu-pretrain {args.stack}: TPU VM recovery",
            description="Describe, delete and recreate the stack's preempted TPU VM.",
            permissions=list(RECOVERY_PERMISSIONS),
            stage="GA",
            opts=child,
        )
        self.project_grant = gcp.projects.IAMMember(
            f"{name}-tpu-nodes",
            project=args.project,
            role=self.role.name,
            member=args.service_account_member,
            opts=child,
        )
        self.act_as = gcp.serviceaccount.IAMMember(
            f"{name}-act-as",
            service_account_id=args.service_account_name,
            role=SERVICE_ACCOUNT_USER,
            member=args.service_account_member,
            opts=child,
        )
        self.register_outputs({"role": self.role.name})
