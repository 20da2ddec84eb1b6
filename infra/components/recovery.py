from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# The custom role that lets the controller's TPU watchdog (templates/tpu-watch.sh) describe,
# delete and recreate the TPU VM (directly or through a queued resource). It is created once
# per project by the GitOps bootstrap (infra/bootstrap/gitops_bootstrap.py RECOVERY_ROLE_ID,
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


class TpuAutoRecovery(pulumi.ComponentResource):
    """Least privilege for the TPU watchdog, which runs as the controller's own account (not
    the TPU VM's): the bootstrap's recovery role at project level, and actAs on the TPU VM's
    service account only (a grant on that one account), so a recreated TPU VM runs as the
    same account. Nothing here creates or edits a role."""

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
        self.act_as = gcp.serviceaccount.IAMMember(
            f"{name}-act-as",
            service_account_id=args.tpu_service_account_name,
            role=SERVICE_ACCOUNT_USER,
            member=args.watchdog_member,
            opts=child,
        )
        self.register_outputs({"role": self.role})
