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
# What an adopted account's owner (the GitOps bootstrap) sets and the stack never writes:
# pulumi-gcp's camelCase names of the account's two updatable texts.
OWNER_FIELDS = ["displayName", "description"]


def account_display_name(stack: str, suffix: str) -> str:
    """One display name per account, whichever program creates it: the GitOps bootstrap
    writes the same ("tpu-pretrain <stack>: <suffix>", infra/bootstrap/bootstrap_roles.py
    stack_account_display_name; tests/policy/test_bootstrap.py compares them), so neither
    renames what the other made."""
    return f"tpu-pretrain {stack}: {suffix}"


@dataclass(frozen=True)
class ServiceIdentityArgs:
    project: str
    account_id: str
    display_name: str
    # Project-level roles to report on itself; () for an account whose role brings its own
    # (the Dataflow worker account: roles/dataflow.worker, infra/components/dataflow.py).
    reporting_roles: tuple[str, ...] = REPORTING_ROLES
    # tpu-pretrain:accountsFromBootstrap: the GitOps bootstrap created the account and owns
    # it (its name, its allow policy); the stack adopts it and never deletes or renames it.
    adopted: bool = False


class ServiceIdentity(pulumi.ComponentResource):
    """A dedicated service account (never the default compute account). It gets only log
    and metric writing at project level; data access is granted on single resources
    (the bucket) by the components that own them. A VM that runs as it depends
    on the component, and so waits for `settled` (SETTLE_DURATION after the account's
    creation; only on create, a later `pulumi up` does not wait), and so does every IAM
    binding that names it through `member` or `resource_name`.

    An adopted account (`args.adopted`, GitOps) is the bootstrap's: its allow policy holds
    the bootstrap's grants (the deploy account's actAs among them), which a deleted and
    re-created account would not have (a new account of the same name is a new identity,
    Google's "Delete and undelete service accounts"). So `pulumi destroy` keeps it
    (retain_on_delete: dropped from the state, not deleted) and the next `pulumi up` adopts
    the same account again (create_ignore_already_exists); its display name and description
    are the bootstrap's (ignore_changes), so the two programs never rename it back and
    forth."""

    def __init__(
        self, name: str, args: ServiceIdentityArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:ServiceIdentity", name, None, opts)
        self.account = gcp.serviceaccount.Account(
            f"{name}-sa",
            project=args.project,
            account_id=args.account_id,
            display_name=args.display_name,
            # In a GitOps project the bootstrap creates every stack's accounts first and grants
            # the deploy account actAs on each one's own allow policy (infra/bootstrap,
            # docs/gitops.md): the account is adopted, not created a second time.
            create_ignore_already_exists=True,
            opts=pulumi.ResourceOptions(
                parent=self,
                retain_on_delete=args.adopted or None,
                ignore_changes=OWNER_FIELDS if args.adopted else None,
            ),
        )
        self.email = self.account.email
        self.settled = time.Sleep(
            f"{name}-settle",
            create_duration=SETTLE_DURATION,
            # A re-created account (new email) waits again.
            triggers={"email": self.email},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.account]),
        )
        # What IAM bindings name the account by: its member and its resource name. A grant
        # made seconds after the account is created fails the same way a VM does (the account
        # is not visible everywhere yet), so both resolve only after `settled`: an Output
        # carries the resources it was computed from, and Pulumi makes every resource that
        # takes it as an input depend on them (the settle too), so every binding that names the
        # account waits, whichever component creates it (tests/infra/test_infra_fresh_project).
        self.member = pulumi.Output.all(self.email, self.settled.id).apply(
            lambda values: f"serviceAccount:{values[0]}"
        )
        # projects/<project>/serviceAccounts/<email>
        self.resource_name = pulumi.Output.all(self.account.name, self.settled.id).apply(
            lambda values: values[0]
        )
        self.reporting = [
            gcp.projects.IAMMember(
                f"{name}-{role.split('/')[1]}",
                project=args.project,
                role=role,
                member=self.member,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.settled]),
            )
            for role in args.reporting_roles
        ]
        self.register_outputs({"email": self.email, "member": self.member})
