"""The Pulumi program: one StackConfig in, every resource of the stack out.

`define()` is called by __main__.py under the Pulumi engine and by infra.commands.offline under
Pulumi's mocks (tests and `python -m infra.commands.plan`). It wires four parts: the shared
foundation (APIs, network, identities, bucket, payload), the accelerator (a TPU VM, a TPU
slice or a GPU VM: one interface, see `Accelerator`), the controller and the VPN hop; then
the stack outputs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import pulumi

from infra import jobspec
from infra.components import dataflow
from infra.components.alerts import RunAlerts, RunAlertsArgs
from infra.components.apis import REQUIRED_APIS, ProjectApis, ProjectApisArgs
from infra.components.bucket import TrainingBucket, TrainingBucketArgs, kept_bucket_exists
from infra.components.controller import ControllerVm, ControllerVmArgs, WatchLease
from infra.components.delivery import (
    PayloadDelivery,
    PayloadDeliveryArgs,
    StartupDelivery,
    StartupDeliveryArgs,
)
from infra.components.gpu import GpuVm, GpuVmArgs
from infra.components.identity import (
    ServiceIdentity,
    ServiceIdentityArgs,
    account_display_name,
)
from infra.components.network import (
    TAG_TPU,
    TENSORBOARD_PORT,
    Network,
    NetworkArgs,
    subnet_name,
)
from infra.components.recovery import (
    GpuAutoRecovery,
    GpuAutoRecoveryArgs,
    TpuAutoRecovery,
    TpuAutoRecoveryArgs,
)
from infra.components.tpu import (
    CLOUD_PLATFORM,
    TPU_DESCRIPTION,
    TPU_METADATA,
    TpuVm,
    TpuVmArgs,
)
from infra.components.vpn import VpnHop, VpnHopArgs
from infra.config.types import GpuConfig, StackConfig
from infra.render import render

BUILD_DIR = render.REPO_ROOT / "build" / "payload"
HOP_MACHINE_TYPE = "e2-small"


@dataclass(frozen=True)
class Foundation:
    """What every accelerator, the controller and the hop share."""

    apis: ProjectApis
    network: Network
    workload_identity: ServiceIdentity
    controller_identity: ServiceIdentity
    hop_identity: ServiceIdentity
    bucket: TrainingBucket
    delivery: PayloadDelivery
    workload: render.Workload
    ready: list[pulumi.Resource]  # what a VM's first boot needs to exist
    dataflow: dataflow.DataflowAccess | None = None  # tpu-pretrain:dataflow


class AcceleratorVm(Protocol):
    """The component's outputs every accelerator has (TpuVm, GpuVm)."""

    # Read-only (properties), so TpuVm's V2Vm and GpuVm's Instance match.
    @property
    def vm(self) -> pulumi.CustomResource: ...  # .name, .zone, .urn

    @property
    def internal_ip(self) -> pulumi.Output[str | None]: ...  # None: a TPU VM without endpoints

    @property
    def worker_ips(self) -> pulumi.Output[list[str | None]]: ...


@dataclass(frozen=True)
class Accelerator:
    """One accelerator of the stack, whatever its kind: its component, and the watchdog the
    controller runs for it (None when auto-recovery is off)."""

    component: AcceleratorVm
    watch: pulumi.Input[render.TpuWatch | render.GpuWatch] | None
    # The watchdog's grants (TpuAutoRecovery, GpuAutoRecovery); None without a watchdog.
    recovery: pulumi.Resource | None = None


def define(cfg: StackConfig, *, build_dir: Path = BUILD_DIR) -> None:
    base = _foundation(cfg, build_dir)
    watch = _watch(cfg, base)
    base = replace(base, ready=[*base.ready, _startup(cfg, base, watch)])
    accelerator = (
        _gpu_vm(cfg, base, watch)
        if isinstance(cfg.accelerator, GpuConfig)
        else _tpu_vm(cfg, base, watch)
    )
    controller = _controller(cfg, base, accelerator)
    hop = _hop(cfg, base)
    _alerts(cfg, base)
    _export(cfg, base, accelerator, controller, hop)


def _alerts(cfg: StackConfig, base: Foundation) -> RunAlerts | None:
    """tpu-pretrain:alertEmails: e-mail channels and an alert policy per event of the run;
    without an address, no alerting resource at all."""
    if not cfg.alert_emails:
        return None
    return RunAlerts(
        "alerts",
        RunAlertsArgs(
            project=cfg.project,
            stack=cfg.stack,
            bucket=cfg.bucket.name,
            emails=cfg.alert_emails,
            labels=cfg.vm_labels,
        ),
        # The Monitoring API is one of the stack's (components/apis.py REQUIRED_APIS).
        opts=pulumi.ResourceOptions(depends_on=[base.apis]),
    )


def _foundation(cfg: StackConfig, build_dir: Path) -> Foundation:
    apis = ProjectApis("apis", ProjectApisArgs(project=cfg.project, services=_apis(cfg)))
    after_apis = pulumi.ResourceOptions(depends_on=[apis])
    region = cfg.accelerator.region
    network = Network(
        "network",
        NetworkArgs(
            project=cfg.project,
            name=cfg.network.name,
            tpu_region=region,
            tpu_subnet_cidr=cfg.network.tpu_subnet_cidr,
            hop_region=cfg.vpn.region,
            hop_subnet_cidr=cfg.network.hop_subnet_cidr,
            vpn_client_cidr=cfg.vpn.client_cidr,
            wireguard_port=cfg.vpn.port,
            wireguard_source_cidrs=cfg.vpn.allowed_cidrs,
            accelerator_hosts=cfg.accelerator.hosts,
        ),
        opts=after_apis,
    )
    # The accelerator VM's account (training code) gets bucket objects and nothing else; the
    # controller's account also runs the watchdog, so recovery rights live there. In a GitOps
    # stack they are the bootstrap's, adopted (components/identity.py).
    identities = [
        ServiceIdentity(
            f"{role}-identity",
            ServiceIdentityArgs(
                project=cfg.project,
                account_id=f"{cfg.prefix}-{suffix}",
                display_name=account_display_name(cfg.stack, suffix),
                adopted=cfg.accounts_from_bootstrap,
            ),
            opts=after_apis,
        )
        for role, suffix in (
            ("workload", "workload"),
            ("controller", "controller"),
            ("hop", "vpn-hop"),
        )
    ]
    workload_identity, controller_identity, hop_identity = identities
    bucket = TrainingBucket(
        "training-bucket",
        TrainingBucketArgs(
            project=cfg.project,
            name=cfg.bucket.name,
            location=cfg.bucket.location,
            soft_delete_seconds=cfg.bucket.soft_delete_seconds,
            destroy_with_stack=cfg.bucket.destroy_with_stack,
            workload_member=workload_identity.member,
            controller_member=controller_identity.member,
            labels=cfg.labels,
            adopt=kept_bucket_exists(cfg.project, cfg.bucket.name),
        ),
        opts=after_apis,
    )
    archive = render.build_payload_archive()
    job_spec = jobspec.render_job_spec(
        jobspec.load_template(cfg.job_file),
        cfg.bucket.name,
        _dataflow_target(cfg, archive.sha256),
        grant_ends=cfg.grant_ends,
    )
    delivery = PayloadDelivery(
        "payload",
        PayloadDeliveryArgs(
            bucket=bucket.name,
            archive_path=render.write_archive(archive, build_dir),
            archive_object=archive.object_name,
            job_object=jobspec.job_object_name(cfg.job_name),
            job_spec_json=jobspec.to_json(job_spec),
        ),
    )
    workload = render.Workload(
        bucket=cfg.bucket.name,
        job_name=cfg.job_name,
        payload_object=archive.object_name,
        payload_sha256=archive.sha256,
        host=_host(cfg),
    )
    dataflow_access = _dataflow_access(cfg, network, bucket, controller_identity, after_apis)
    ready: list[pulumi.Resource] = [
        delivery,
        bucket,
        workload_identity,
        controller_identity,
        network.nat,
    ]
    if dataflow_access is not None:  # the controller may launch a Dataflow job at boot
        ready.append(dataflow_access)
    return Foundation(
        apis=apis,
        network=network,
        workload_identity=workload_identity,
        controller_identity=controller_identity,
        hop_identity=hop_identity,
        bucket=bucket,
        delivery=delivery,
        workload=workload,
        # VMs start after their inputs exist, so a first boot finds payload, job, bucket
        # access and the NAT that lets it install packages.
        ready=ready,
        dataflow=dataflow_access,
    )


# --- Dataflow (tpu-pretrain:dataflow; infra/components/dataflow.py) ---------------------------
def _apis(cfg: StackConfig) -> tuple[str, ...]:
    if not cfg.dataflow:
        return REQUIRED_APIS
    return (*REQUIRED_APIS, dataflow.DATAFLOW_API, dataflow.IMAGE_REGISTRY_API)


def _dataflow_target(cfg: StackConfig, payload_sha256: str) -> jobspec.DataflowTarget | None:
    """Where the stack's Dataflow jobs run: its region (the bucket's), its worker account,
    the region's subnet and the workers' image, tagged with the digest of the payload archive
    the stack uploads. None without tpu-pretrain:dataflow."""
    if not cfg.dataflow:
        return None
    region = cfg.accelerator.region
    return jobspec.DataflowTarget(
        project=cfg.project,
        region=region,
        service_account_email=dataflow.worker_email(cfg.prefix, cfg.project),
        subnet_name=subnet_name(cfg.network.name, region),
        sdk_container_image=dataflow.image_uri(region, cfg.project, cfg.prefix, payload_sha256),
    )


def _dataflow_access(
    cfg: StackConfig,
    network: Network,
    bucket: TrainingBucket,
    launcher: ServiceIdentity,
    opts: pulumi.ResourceOptions,
) -> dataflow.DataflowAccess | None:
    if not cfg.dataflow:
        return None
    return dataflow.DataflowAccess(
        "dataflow",
        dataflow.DataflowAccessArgs(
            project=cfg.project,
            prefix=cfg.prefix,
            stack=cfg.stack,
            bucket=bucket.name,
            bucket_name=cfg.bucket.name,
            launcher_member=launcher.member,
            network=network.vpc.id,
            network_name=cfg.network.name,
            accounts_from_bootstrap=cfg.accounts_from_bootstrap,
        ),
        opts=opts,
    )


def _host(cfg: StackConfig) -> render.TpuHost | render.GpuHost:
    """The accelerator VM as its startup script and the controller's wheelhouse see it."""
    if isinstance(cfg.accelerator, GpuConfig):
        gpu = cfg.accelerator
        return render.GpuHost(
            machine_type=gpu.machine_type,
            gpu_type=gpu.gpu_type,
            gpu_name=gpu.gpu_name,
            count=gpu.count,
            image=gpu.image,
            python_version=gpu.python_version,
            precision=gpu.precision,
            kernel_modules=gpu.kernel_modules,
            driver_repo=gpu.driver_repo,
            driver_packages=gpu.driver_packages,
            secure_boot=gpu.shielded_boot,
            nic_type=gpu.nic_type,
            requirements=render.gpu_requirements_for(cfg.backend),
            backend=cfg.backend,
        )
    tpu = cfg.tpu
    return render.TpuHost(
        accelerator_type=tpu.accelerator_type,
        runtime_version=tpu.runtime_version,
        python_version=tpu.python_version,
        hosts=tpu.hosts,
        secure_boot=tpu.shielded_boot,
        requirements=render.requirements_for(cfg.backend),
        backend=cfg.backend,
    )


def _tpu_args(cfg: StackConfig, base: Foundation) -> TpuVmArgs:
    """The TPU VM's V2Vm arguments: its startup script is the loader, the same for every job
    and payload, so only a change of shape (type, zone, image, network, ...) replaces it."""
    return TpuVmArgs(
        project=cfg.project,
        name=cfg.tpu.name,
        zone=cfg.tpu.zone,
        accelerator_type=cfg.tpu.accelerator_type,
        runtime_version=cfg.tpu.runtime_version,
        preemptible=cfg.tpu.preemptible,
        spot=cfg.tpu.spot,
        external_ip=cfg.tpu.external_ip,
        shielded_boot=cfg.tpu.shielded_boot,
        network=base.network.vpc.id,
        subnetwork=base.network.tpu_subnet.id,
        service_account_email=base.workload_identity.email,
        startup_script=render.render_loader("tpu", cfg.bucket.name),
        labels=cfg.vm_labels | {"accelerator": cfg.tpu.label},
    )


def _watch(
    cfg: StackConfig, base: Foundation
) -> pulumi.Output[render.TpuWatch] | render.GpuWatch | None:
    """The controller's watchdog of the accelerator (None when auto-recovery is off)."""
    if isinstance(cfg.accelerator, GpuConfig):
        gpu = cfg.gpu
        if not gpu.auto_recover:
            return None
        return render.GpuWatch(
            project=cfg.project,
            name=gpu.name,
            zone=gpu.zone,
            capacity_wait_minutes=cfg.capacity_wait_minutes,
        )
    if not cfg.tpu.auto_recover:
        return None
    tpu_args = _tpu_args(cfg, base)
    return pulumi.Output.all(
        tpu_args.network, tpu_args.subnetwork, tpu_args.service_account_email
    ).apply(
        lambda v: _tpu_watch(
            tpu_args,
            *v,
            release_when_done=cfg.tpu.release_when_done,
            hosts=cfg.tpu.hosts,
            capacity_wait_minutes=cfg.capacity_wait_minutes,
        )
    )


def _startup(
    cfg: StackConfig,
    base: Foundation,
    watch: pulumi.Output[render.TpuWatch] | render.GpuWatch | None,
) -> StartupDelivery:
    """The rendered startup scripts of the accelerator VM and the controller, and the job
    pointer the VMs' loaders read (components/delivery.py StartupDelivery)."""
    workload = base.workload
    if isinstance(cfg.accelerator, GpuConfig):
        scripts: dict[str, pulumi.Input[str]] = {"gpu": render.render_gpu_script(workload)}
    else:
        scripts = {"tpu": render.render_tpu_script(workload)}
    if watch is None:
        scripts["controller"] = render.render_controller_script(workload)
    else:
        scripts["controller"] = pulumi.Output.from_input(watch).apply(
            lambda resolved: render.render_controller_script(workload, resolved)
        )
    return StartupDelivery(
        "startup",
        StartupDeliveryArgs(
            bucket=base.bucket.name,
            scripts=scripts,
            pointer=lambda rendered: render.render_pointer(workload, rendered),
        ),
        # The pointer names the payload archive and the job spec: they exist first.
        opts=pulumi.ResourceOptions(depends_on=[base.delivery, base.bucket]),
    )


def _tpu_vm(
    cfg: StackConfig,
    base: Foundation,
    watch: pulumi.Output[render.TpuWatch] | render.GpuWatch | None,
) -> Accelerator:
    tpu_args = _tpu_args(cfg, base)
    tpu = TpuVm("tpu", tpu_args, opts=pulumi.ResourceOptions(depends_on=base.ready))
    if watch is None:
        return Accelerator(component=tpu, watch=None)
    recovery = TpuAutoRecovery(
        "tpu-recovery",
        TpuAutoRecoveryArgs(
            project=cfg.project,
            watchdog_member=base.controller_identity.member,
            tpu_service_account_name=base.workload_identity.resource_name,
            act_as_from_bootstrap=cfg.accounts_from_bootstrap,
        ),
        opts=pulumi.ResourceOptions(depends_on=[base.apis]),
    )
    return Accelerator(component=tpu, watch=watch, recovery=recovery)


def _gpu_vm(
    cfg: StackConfig,
    base: Foundation,
    watch: pulumi.Output[render.TpuWatch] | render.GpuWatch | None,
) -> Accelerator:
    gpu = cfg.gpu
    vm = GpuVm(
        "gpu",
        GpuVmArgs(
            project=cfg.project,
            name=gpu.name,
            zone=gpu.zone,
            machine_type=gpu.machine_type,
            gpu_type=gpu.gpu_type,
            count=gpu.count,
            attached=gpu.attached,
            spot=gpu.spot,
            image=gpu.image,
            boot_disk=gpu.boot_disk,
            nic_type=gpu.nic_type,
            shielded_boot=gpu.shielded_boot,
            subnetwork=base.network.tpu_subnet.id,
            service_account_email=base.workload_identity.email,
            startup_script=render.render_loader("gpu", cfg.bucket.name),
            labels=cfg.vm_labels | {"accelerator": gpu.label},
        ),
        opts=pulumi.ResourceOptions(depends_on=base.ready),
    )
    if watch is None:
        return Accelerator(component=vm, watch=None)
    recovery = GpuAutoRecovery(
        "gpu-recovery",
        GpuAutoRecoveryArgs(
            project=cfg.project,
            zone=gpu.zone,
            vm_name=gpu.name,
            watchdog_member=base.controller_identity.member,
        ),
        opts=pulumi.ResourceOptions(depends_on=[base.apis]),
    )
    return Accelerator(component=vm, watch=watch, recovery=recovery)


def _controller(cfg: StackConfig, base: Foundation, accelerator: Accelerator) -> ControllerVm:
    controller_ready = list(base.ready)
    if accelerator.watch is not None:
        # The watchdog must never outlive the stack: the controller is created after the
        # accelerator VM and so destroyed before it (see the lease below).
        controller_ready.append(accelerator.component)  # type: ignore[arg-type]
        if accelerator.recovery is not None:  # the watchdog's grants, before it runs
            controller_ready.append(accelerator.recovery)
    # The loader; its script (with the watchdog) is in the bucket (_startup).
    controller_script = render.render_loader("controller", cfg.bucket.name)
    return ControllerVm(
        "controller",
        ControllerVmArgs(
            project=cfg.project,
            name=f"{cfg.prefix}-controller",
            zone=cfg.accelerator.zone,
            machine_type=cfg.controller_machine_type,
            subnetwork=base.network.tpu_subnet.id,
            service_account_email=base.controller_identity.email,
            startup_script=controller_script,
            labels=cfg.vm_labels,
            watch_lease=(
                WatchLease(
                    bucket=base.bucket.name,
                    object_name=jobspec.watch_lease_object_name(cfg.job_name),
                    vm_name=cfg.accelerator.name,
                )
                if accelerator.watch is not None
                else None
            ),
        ),
        opts=pulumi.ResourceOptions(depends_on=controller_ready),
    )


def _hop(cfg: StackConfig, base: Foundation) -> VpnHop:
    return VpnHop(
        "vpn-hop",
        VpnHopArgs(
            project=cfg.project,
            name=f"{cfg.prefix}-vpn-hop",
            zone=cfg.vpn.zone,
            region=cfg.vpn.region,
            machine_type=HOP_MACHINE_TYPE,
            subnetwork=base.network.hop_subnet.id,
            port=cfg.vpn.port,
            client_cidr=cfg.vpn.client_cidr,
            vpc_ranges=(cfg.network.tpu_subnet_cidr, cfg.network.hop_subnet_cidr),
            client_public_key=cfg.vpn.client_public_key,
            service_account_email=base.hop_identity.email,
            labels=cfg.vm_labels,
        ),
        # Its VM boots once its account has settled (ServiceIdentity.settled).
        opts=pulumi.ResourceOptions(depends_on=[base.apis, base.hop_identity]),
    )


def _export(
    cfg: StackConfig,
    base: Foundation,
    accelerator: Accelerator,
    controller: ControllerVm,
    hop: VpnHop,
) -> None:
    """Stack outputs. The accelerator's are named by its kind (tpuName, gpuName, ...)."""
    kind = cfg.accelerator.kind
    vm = accelerator.component
    pulumi.export(f"{kind}Name", vm.vm.name)  # type: ignore[attr-defined]
    pulumi.export(f"{kind}Zone", vm.vm.zone)  # type: ignore[attr-defined]
    pulumi.export(f"{kind}InternalIp", vm.internal_ip)
    # Every host's IP in worker order (one on a single host; a slice lists them all).
    pulumi.export(f"{kind}WorkerIps", vm.worker_ips)
    pulumi.export("controllerInternalIp", controller.internal_ip)
    pulumi.export("bucketUrl", base.bucket.url)
    pulumi.export("jobSpecUri", base.delivery.job_uri)
    pulumi.export("payloadUri", base.delivery.payload_uri)
    pulumi.export("statusUri", jobspec.status_uri(cfg.bucket.name, cfg.job_name))
    pulumi.export("jobPlan", cfg.job_plan)
    pulumi.export(
        "tensorboardUrl",
        controller.internal_ip.apply(lambda ip: f"http://{ip}:{TENSORBOARD_PORT} (over the VPN)"),
    )
    ssh = ssh_commands(cfg)
    pulumi.export("sshCommands", ssh)
    # A new payload or job changes no VM: `pulumi up` rewrites the job pointer
    # (jobs/current.json) and each VM's loader runs what it names at the VM's next start;
    # run it now instead of waiting (docs/deploy-gcp.md; re-running is harmless).
    rerun = "--command 'sudo google_metadata_script_runner startup'"
    # A slice's hosts all run the startup script: re-run it on every worker.
    vm_rerun = ssh.get("tpuAllWorkers", ssh[kind])
    pulumi.export(
        "rerunStartupCommands",
        {"controller": f"{ssh['controller']} {rerun}", kind: f"{vm_rerun} {rerun}"},
    )
    if isinstance(cfg.accelerator, GpuConfig):
        pulumi.export("gpuRecovery", gpu_recovery_commands(cfg, vm.vm.urn))
        pulumi.export("gpuQuota", gpu_quota(cfg))
    else:
        pulumi.export("tpuRecovery", tpu_recovery_commands(cfg, vm.vm.urn))
    target = _dataflow_target(cfg, base.workload.payload_sha256)
    if target is not None:
        # What a launch from your own machine passes (the job spec carries the same when the
        # job encodes on Dataflow); the launcher needs the controller's Dataflow grants.
        pulumi.export("dataflowOptions", jobspec.dataflow_options(target, cfg.bucket.name))
        # The stack does not build the workers' image (infra/components/dataflow.py): say so.
        pulumi.log.warn(dataflow_image_note(cfg.stack, target.sdk_container_image))
    pulumi.export("vpnEndpoint", hop.endpoint)
    # The hop makes its key pair at its first boot: where it publishes the public key, which
    # `make vpn-config` puts into vpnClientConfig (its placeholder until then).
    pulumi.export("vpnServerKey", hop.server_key)
    pulumi.export("vpnClientConfig", hop.client_config)


def dataflow_image_note(stack: str, image: str) -> str:
    """One line at preview and up: the image a Dataflow job of this payload runs, which the
    stack neither builds nor can see."""
    return (
        f"Dataflow: jobs of this payload run the image {image}, which the stack does not build; "
        f"if it is missing, create its repository and build and push it as docs/deploy-gcp.md "
        f'says ("The workers\' image", stack {stack})'
    )


def tpu_recovery_commands(
    cfg: StackConfig, urn: pulumi.Output[str]
) -> dict[str, pulumi.Input[str]]:
    """A preempted or spot TPU VM cannot be restarted and holds quota until it is deleted;
    check its state, and replace it (training resumes from the bucket's checkpoints)."""
    commands: dict[str, pulumi.Input[str]] = {
        "check": f"gcloud compute tpus tpu-vm describe {cfg.tpu.name} --zone {cfg.tpu.zone} "
        f"--project {cfg.project} --format='value(state)'",
        "replace": urn.apply(lambda urn: f"pulumi up --replace '{urn}'"),
    }
    if cfg.tpu.auto_recover:
        commands["watchdog"] = (
            f"on: the controller checks the TPU VM every {render.WATCH_INTERVAL} and "
            "recreates it when PREEMPTED or TERMINATED (at most once per "
            f"{render.TPU_RECREATE_MIN_SECONDS}s; without capacity "
            + (
                "it retries with growing waits"
                if cfg.tpu.preemptible
                else f"it waits in the queued resource {render.queued_resource_name(cfg.tpu.name)}"
            )
            + "; never once the job's export is complete; a VM whose boot failed, its "
            "loader's guest attribute says, is deleted and not recreated); status "
            f"{jobspec.run_root(cfg.bucket.name, cfg.job_name)}/bootstrap/tpu-watch.json, "
            "logs: journalctl -u tpu-pretrain-tpu-watch.service on the controller"
        )
    else:
        commands["watchdog"] = (
            "off (tpu-pretrain:tpuAutoRecover=false): replace a preempted TPU VM by hand"
        )
    return commands


def gpu_recovery_commands(
    cfg: StackConfig, urn: pulumi.Output[str]
) -> dict[str, pulumi.Input[str]]:
    """A spot GPU VM is stopped when preempted (instance_termination_action STOP): its disk
    and its checkpoints in the bucket stay; starting it again resumes training."""
    gpu = cfg.gpu
    where = f"{gpu.name} --zone {gpu.zone} --project {cfg.project}"
    return {
        "check": f"gcloud compute instances describe {where} --format='value(status)'",
        "start": f"gcloud compute instances start {where}",
        "replace": urn.apply(lambda urn: f"pulumi up --replace '{urn}'"),
        "watchdog": (
            f"on: the controller checks the GPU VM every {render.WATCH_INTERVAL} and starts it "
            "again when preemption stopped it (TERMINATED), until the job's export is "
            "complete; a VM whose boot failed (its loader's guest attribute) is stopped and "
            f"not started again; status {jobspec.run_root(cfg.bucket.name, cfg.job_name)}"
            "/bootstrap/gpu-watch.json, logs: journalctl -u tpu-pretrain-gpu-watch.service on "
            "the controller"
            if gpu.auto_recover
            else "off (tpu-pretrain:gpuAutoRecover=false): start a stopped GPU VM by hand "
            "(the check and start commands)"
        ),
    }


def gpu_quota(cfg: StackConfig) -> dict[str, str]:
    """Quota preflight: GPU quotas start at 0 on a new project. `needs` names the two rows
    that must allow this VM; two read-only commands list them with limit and usage: the
    project's quotas (`checkProject`: GPUS_ALL_REGIONS is a project quota, which `regions
    describe` never lists) and the region's (`check`: the GPU's own quota). Request the ones
    below it (IAM & Admin > Quotas) before `pulumi up`."""
    gpu = cfg.gpu
    global_metric, regional = gpu.quota_metrics
    table = "--flatten quotas --format 'table(quotas.metric,quotas.limit,quotas.usage)'"
    return {
        "needs": f"{gpu.count} of {global_metric} (the project) and {regional} in {gpu.region}",
        "check": f"gcloud compute regions describe {gpu.region} --project {cfg.project} {table}",
        "checkProject": f"gcloud compute project-info describe --project {cfg.project} {table}",
    }


def ssh_commands(cfg: StackConfig) -> dict[str, str]:
    """SSH commands that work as printed. `gcloud compute ssh` has --tunnel-through-iap in
    GA; `gcloud compute tpus tpu-vm ssh` has it only in the alpha track (GA offers
    --internal-ip alone), so the TPU VM is reached through `gcloud alpha` over IAP, or with
    the GA command and --internal-ip over the WireGuard VPN. Flags are checked against
    gcloud's own definitions in tests/infra/data/gcloud_flags.yaml."""
    where = f"--project {cfg.project}"
    accelerator = cfg.accelerator
    commands = {
        "controller": f"gcloud compute ssh {cfg.prefix}-controller --zone {accelerator.zone} "
        f"{where} --tunnel-through-iap",
        "vpnHop": f"gcloud compute ssh {cfg.prefix}-vpn-hop --zone {cfg.vpn.zone} "
        f"{where} --tunnel-through-iap",
    }
    if isinstance(accelerator, GpuConfig):
        # A GPU VM is a Compute Engine VM: GA `gcloud compute ssh` does both.
        gpu = f"gcloud compute ssh {accelerator.name} --zone {accelerator.zone} {where}"
        commands |= {"gpu": f"{gpu} --tunnel-through-iap", "gpuOverVpn": f"{gpu} --internal-ip"}
        return commands
    tpu = f"compute tpus tpu-vm ssh {accelerator.name} --zone {accelerator.zone} {where}"
    commands |= {
        "tpu": f"gcloud alpha {tpu} --tunnel-through-iap",
        "tpuOverVpn": f"gcloud {tpu} --internal-ip",
    }
    if accelerator.hosts > 1:
        # On a slice `tpu` reaches worker 0 (gcloud's default --worker: the JAX process that
        # writes status, checkpoints and the export); --worker=all runs a --command on every
        # host.
        commands["tpuAllWorkers"] = f"gcloud alpha {tpu} --tunnel-through-iap --worker=all"
    return commands


def _tpu_watch(
    args: TpuVmArgs,
    network: str,
    subnetwork: str,
    service_account_email: str,
    *,
    release_when_done: bool,
    hosts: int = 1,
    capacity_wait_minutes: int = render.CAPACITY_WAIT_MINUTES,
) -> render.TpuWatch:
    """The watchdog recreates the TPU VM from the very arguments of its gcp.tpu.V2Vm."""
    return render.TpuWatch(
        project=args.project,
        name=args.name,
        zone=args.zone,
        accelerator_type=args.accelerator_type,
        runtime_version=args.runtime_version,
        network=network,
        subnetwork=subnetwork,
        external_ip=args.external_ip,
        preemptible=args.preemptible,
        spot=args.spot,
        shielded_boot=args.shielded_boot,
        service_account_email=service_account_email,
        scopes=(CLOUD_PLATFORM,),
        description=TPU_DESCRIPTION,
        labels=args.labels,
        tags=(TAG_TPU,),
        metadata=TPU_METADATA,
        startup_script=args.startup_script,
        release_when_done=release_when_done,
        hosts=hosts,
        capacity_wait_minutes=capacity_wait_minutes,
    )
