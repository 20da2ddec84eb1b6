from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# cloudresourcemanager: project IAM bindings (projects.getIamPolicy/setIamPolicy) go through
# it and new projects do not have it on. serviceusage: the API that enables the others; it
# is on by default in new projects, and listing it keeps it on (docs/deploy-gcp.md, Prerequisites).
REQUIRED_APIS = (
    "serviceusage.googleapis.com",
    "cloudresourcemanager.googleapis.com",
    "compute.googleapis.com",
    "tpu.googleapis.com",
    "storage.googleapis.com",
    "iam.googleapis.com",
    "iamcredentials.googleapis.com",
    "logging.googleapis.com",
    "monitoring.googleapis.com",
    "iap.googleapis.com",
    "oslogin.googleapis.com",
)


@dataclass(frozen=True)
class ProjectApisArgs:
    project: str
    services: tuple[str, ...] = REQUIRED_APIS


class ProjectApis(pulumi.ComponentResource):
    """The APIs the stack needs. They stay enabled on destroy: other workloads in the
    project may use them, and disabling an API can delete unrelated resources."""

    def __init__(
        self, name: str, args: ProjectApisArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("tpu-pretrain:index:ProjectApis", name, None, opts)
        self.services = [
            gcp.projects.Service(
                f"{name}-{service.split('.')[0]}",
                project=args.project,
                service=service,
                disable_on_destroy=False,
                disable_dependent_services=False,
                opts=pulumi.ResourceOptions(parent=self),
            )
            for service in args.services
        ]
        self.enabled = pulumi.Output.all(*[s.service for s in self.services])
        self.register_outputs({"enabled": self.enabled})
