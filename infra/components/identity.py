from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp
import pulumiverse_time as time

# A VM created seconds after its service account can fail: the new account is not yet
# visible everywhere (IAM is eventually consistent). Google's own example for this case,
# the Terraform provider's tpu_v2_vm_full (GoogleCloudPlatform/magic-modules
# mmv1/templates/terraform/examples/tpu_v2_vm_full.tf.tmpl), waits 60 s with a time_sleep
# after creating the account; the VMs here wait for `settled` the same way.
SETTLE_DURATION = "60s"

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
    (the bucket, one secret) by the components that own them. A VM that runs as it depends
    on the component, and so waits for `settled` (SETTLE_DURATION after the account's
    creation; only on create, a later `pulumi up` does not wait)."""

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
        self.settled = time.Sleep(
            f"{name}-settle",
            create_duration=SETTLE_DURATION,
            # A re-created account (new email) waits again.
            triggers={"email": self.email},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.account]),
        )
        self.register_outputs({"email": self.email, "member": self.member})
