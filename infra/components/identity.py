from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# Project-level roles a VM needs to report on itself; nothing that reaches data.
REPORTING_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter")


@dataclass(frozen=True)
class ServiceIdentityArgs:
    project: str
    account_id: str
    display_name: str


class ServiceIdentity(pulumi.ComponentResource):
    """A dedicated service account (never the default compute account). It gets only log
    and metric writing at project level; data access is granted on single resources
    (the bucket, one secret) by the components that own them."""

    def __init__(
        self, name: str, args: ServiceIdentityArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:ServiceIdentity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.account = gcp.serviceaccount.Account(
            f"{name}-sa",
            project=args.project,
            account_id=args.account_id,
            display_name=args.display_name,
            opts=child,
        )
        self.email = self.account.email
        self.resource_name = self.account.name  # projects/<project>/serviceAccounts/<email>
        self.member = self.account.email.apply(lambda email: f"serviceAccount:{email}")
        self.reporting = [
            gcp.projects.IAMMember(
                f"{name}-{role.split('/')[1]}",
                project=args.project,
                role=role,
                member=self.member,
                opts=child,
            )
            for role in REPORTING_ROLES
        ]
        self.register_outputs({"email": self.email, "member": self.member})
