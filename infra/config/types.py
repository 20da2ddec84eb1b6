"""What a stack is, once its settings are validated: frozen dataclasses and nothing else.

infra/config/config.py builds a `StackConfig` (`parse_config`); the program, its components and the
smoke run take one. No Pulumi, no catalog: a module that only needs the shapes imports
these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True)
class TpuConfig:
    """A TPU VM or a multi-host TPU slice (gcp.tpu.V2Vm)."""

    kind: ClassVar[str] = "tpu"
    name: str
    zone: str
    region: str
    accelerator_type: str
    generation: str
    runtime_version: str  # the TPU VM base image (catalogs/tpu.yaml)
    python_version: str  # the image's python3, e.g. "3.10" (the wheelhouse targets it)
    preemptible: bool
    spot: bool
    external_ip: bool
    shielded_boot: bool
    auto_recover: bool  # the controller's watchdog recreates a preempted TPU VM
    release_when_done: bool = False  # ...and deletes it once the job's export is complete
    hosts: int = 1  # TPU VMs of the node: > 1 for a multi-host slice (catalogs/tpu.yaml slices)
    chips_per_host: int = 0  # only set for a slice

    @property
    def label(self) -> str:
        return self.accelerator_type


@dataclass(frozen=True)
class GpuConfig:
    """A Compute Engine VM with NVIDIA GPUs (gcp.compute.Instance), validated against
    infra/catalogs/gpu.yaml."""

    kind: ClassVar[str] = "gpu"
    name: str
    zone: str
    region: str
    machine_type: str
    gpu_type: str  # nvidia-tesla-t4
    gpu_name: str  # T4
    count: int
    attached: bool  # N1: guest_accelerators; A2/A3/A4/G2 carry their GPUs
    spot: bool
    image: str  # projects/<project>/global/images/family/<family> (catalogs/gpu.yaml images)
    image_name: str  # its key in the catalog, ubuntu-2204-nvidia-open
    kernel_modules: (
        str  # the NVIDIA kernel-module flavour of the image: open | proprietary | unknown
    )
    driver_repo: str  # NVIDIA's apt keyring package the startup script installs ("" : none)
    driver_packages: tuple[str, ...]  # the driver packages it installs (() : preinstalled)
    boot_disk: str  # the boot disk type the machine type takes (catalogs/gpu.yaml)
    nic_type: str  # the vNIC the machine family needs: GVNIC on A3/A4 ("" : the default)
    python_version: str  # the image's python3
    shielded_boot: bool  # secure boot (vTPM and integrity monitoring are always on)
    precision: str  # Keras mixed-precision policy for this GPU
    quota_metrics: tuple[str, ...]
    # The controller's watchdog starts the VM again when preemption stopped it (gpu-watch.sh).
    auto_recover: bool
    hosts: int = 1
    preemptible: bool = False  # GPU VMs use spot (provisioning_model SPOT), never legacy

    @property
    def label(self) -> str:
        return self.gpu_type


@dataclass(frozen=True)
class BucketConfig:
    name: str
    location: str
    soft_delete_seconds: int
    destroy_with_stack: bool


@dataclass(frozen=True)
class NetworkConfig:
    name: str
    tpu_subnet_cidr: str
    hop_subnet_cidr: str


@dataclass(frozen=True)
class VpnConfig:
    zone: str
    region: str
    allowed_cidrs: tuple[str, ...]
    client_cidr: str
    port: int
    client_public_key: str | None


@dataclass(frozen=True)
class StackConfig:
    project: str
    stack: str
    prefix: str  # prefix of every GCP resource name of this stack
    accelerator: TpuConfig | GpuConfig
    bucket: BucketConfig
    network: NetworkConfig
    vpn: VpnConfig
    controller_machine_type: str
    job_file: Path
    job_name: str
    # The training backend the accelerator VM's environment is built for ("tf" | "jax"):
    # the job's train.backend, or for auto the catalog's choice (resolve_backend).
    backend: str = "tf"
    # tpu-pretrain:dataflow: the stack provides Dataflow (infra/components/dataflow.py).
    dataflow: bool = False
    # tpu-pretrain:accountsFromBootstrap: the GitOps bootstrap created the stack's accounts and
    # every grant on their own allow policies (docs/gitops.md); the stack only adopts them.
    accounts_from_bootstrap: bool = False
    # The payload's plan of the job on the accelerator, in a line (infra/jobfit.py).
    job_plan: str = ""
    # tpu-pretrain:alertEmails: who the alert policies notify (): no alerting resources at all
    # (infra/components/alerts.py).
    alert_emails: tuple[str, ...] = ()
    # tpu-pretrain:grantEnds: the grant's last day (YYYY-MM-DD), rendered into the job spec as
    # grant_ends (infra/jobspec.py render_job_spec); None: not set.
    grant_ends: str | None = None
    # tpu-pretrain:capacityWaitMinutes: the watchdog reports a longer wait for capacity.
    capacity_wait_minutes: int = 60

    @property
    def labels(self) -> dict[str, str]:
        return {"app": "tpu-pretrain", "stack": self.stack, "job": self.job_name}

    @property
    def vm_labels(self) -> dict[str, str]:
        """The VMs' labels: no job (a VM runs whatever job the pointer names, and a TPU VM's
        labels are replaced, not updated: components/tpu.py IN_PLACE_FIELDS)."""
        return {k: v for k, v in self.labels.items() if k != "job"}

    @property
    def tpu(self) -> TpuConfig:
        if not isinstance(self.accelerator, TpuConfig):
            raise TypeError(f"stack {self.stack} trains on a GPU VM, not a TPU")
        return self.accelerator

    @property
    def gpu(self) -> GpuConfig:
        if not isinstance(self.accelerator, GpuConfig):
            raise TypeError(f"stack {self.stack} trains on a TPU, not a GPU VM")
        return self.accelerator
