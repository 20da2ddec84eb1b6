"""The Pulumi program: one StackConfig in, every resource of the stack out.

`define()` is called by __main__.py under the Pulumi engine and by infra.offline under
Pulumi's mocks (tests and `python -m infra.plan`)."""

from __future__ import annotations

from pathlib import Path

import pulumi

from infra import jobspec, render
from infra.components.apis import ProjectApis, ProjectApisArgs
from infra.components.bucket import TrainingBucket, TrainingBucketArgs, kept_bucket_exists
from infra.components.controller import ControllerVm, ControllerVmArgs, WatchLease
from infra.components.delivery import PayloadDelivery, PayloadDeliveryArgs
from infra.components.identity import ServiceIdentity, ServiceIdentityArgs
from infra.components.network import TAG_TPU, TENSORBOARD_PORT, Network, NetworkArgs
from infra.components.recovery import TpuAutoRecovery, TpuAutoRecoveryArgs
from infra.components.tpu import (
    CLOUD_PLATFORM,
    TPU_DESCRIPTION,
    TPU_METADATA,
    TpuVm,
    TpuVmArgs,
)
from infra.components.vpn import VpnHop, VpnHopArgs
from infra.config import StackConfig

BUILD_DIR = render.REPO_ROOT / "build" / "payload"
HOP_MACHINE_TYPE = "e2-small"


def define(cfg: StackConfig, *, build_dir: Path = BUILD_DIR) -> None:
    apis = ProjectApis("apis", ProjectApisArgs(project=cfg.project))
    after_apis = pulumi.ResourceOptions(depends_on=[apis])

    network = Network(
        "network",
        NetworkArgs(
            project=cfg.project,
            name=cfg.network.name,
            tpu_region=cfg.tpu.region,
            tpu_subnet_cidr=cfg.network.tpu_subnet_cidr,
            hop_region=cfg.vpn.region,
            hop_subnet_cidr=cfg.network.hop_subnet_cidr,
            vpn_client_cidr=cfg.vpn.client_cidr,
            wireguard_port=cfg.vpn.port,
            wireguard_source_cidrs=cfg.vpn.allowed_cidrs,
        ),
        opts=after_apis,
    )
    # The TPU VM's account (training code) gets bucket objects and nothing else; the
    # controller's account also runs the TPU watchdog, so recovery rights live there.
    workload_identity = ServiceIdentity(
        "workload-identity",
        ServiceIdentityArgs(
            project=cfg.project,
            account_id=f"{cfg.prefix}-workload",
            display_name=f"tpu-pretrain {cfg.stack}: TPU VM",
        ),
        opts=after_apis,
    )
    controller_identity = ServiceIdentity(
        "controller-identity",
        ServiceIdentityArgs(
            project=cfg.project,
            account_id=f"{cfg.prefix}-controller",
            display_name=f"tpu-pretrain {cfg.stack}: controller and TPU watchdog",
        ),
        opts=after_apis,
    )
    hop_identity = ServiceIdentity(
        "hop-identity",
        ServiceIdentityArgs(
            project=cfg.project,
            account_id=f"{cfg.prefix}-vpn-hop",
            display_name=f"tpu-pretrain {cfg.stack}: WireGuard hop",
        ),
        opts=after_apis,
    )
    bucket = TrainingBucket(
        "training-bucket",
        TrainingBucketArgs(
            project=cfg.project,
            name=cfg.bucket.name,
            location=cfg.bucket.location,
            soft_delete_seconds=cfg.bucket.soft_delete_seconds,
            destroy_with_stack=cfg.bucket.destroy_with_stack,
            object_admin=workload_identity.member,
            controller_object_admin=controller_identity.member,
            labels=cfg.labels,
            adopt=kept_bucket_exists(cfg.project, cfg.bucket.name),
        ),
        opts=after_apis,
    )

    archive = render.build_payload_archive()
    job_spec = jobspec.render_job_spec(jobspec.load_template(cfg.job_file), cfg.bucket.name)
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
        tpu=render.TpuHost(
            accelerator_type=cfg.tpu.accelerator_type,
            runtime_version=cfg.tpu.runtime_version,
            python_version=cfg.tpu.python_version,
            hosts=cfg.tpu.hosts,
        ),
    )
    # VMs start after their inputs exist, so a first boot finds payload, job, bucket access
    # and the NAT that lets it install packages.
    ready = [delivery, bucket, workload_identity, controller_identity, network.nat]

    tpu_args = TpuVmArgs(
        project=cfg.project,
        name=cfg.tpu.name,
        zone=cfg.tpu.zone,
        accelerator_type=cfg.tpu.accelerator_type,
        runtime_version=cfg.tpu.runtime_version,
        preemptible=cfg.tpu.preemptible,
        spot=cfg.tpu.spot,
        external_ip=cfg.tpu.external_ip,
        shielded_boot=cfg.tpu.shielded_boot,
        network=network.vpc.id,
        subnetwork=network.tpu_subnet.id,
        service_account_email=workload_identity.email,
        startup_script=render.render_tpu_script(workload),
        labels=cfg.labels | {"accelerator": cfg.tpu.accelerator_type},
    )
    tpu = TpuVm("tpu", tpu_args, opts=pulumi.ResourceOptions(depends_on=ready))
    controller_ready = list(ready)
    if cfg.tpu.auto_recover:
        # The watchdog must never outlive the stack: the controller is created after the TPU
        # VM and so destroyed before it (see the lease below).
        controller_ready.append(tpu)
        recovery = TpuAutoRecovery(
            "tpu-recovery",
            TpuAutoRecoveryArgs(
                project=cfg.project,
                watchdog_member=controller_identity.member,
                tpu_service_account_name=workload_identity.resource_name,
            ),
            opts=after_apis,
        )
        controller_ready.append(recovery)
        controller_script: pulumi.Input[str] = pulumi.Output.all(
            tpu_args.network, tpu_args.subnetwork, tpu_args.service_account_email
        ).apply(
            lambda v: render.render_controller_script(
                workload,
                _tpu_watch(
                    tpu_args,
                    *v,
                    release_when_done=cfg.tpu.release_when_done,
                    hosts=cfg.tpu.hosts,
                ),
            )
        )
    else:
        controller_script = render.render_controller_script(workload)

    controller = ControllerVm(
        "controller",
        ControllerVmArgs(
            project=cfg.project,
            name=f"{cfg.prefix}-controller",
            zone=cfg.tpu.zone,
            machine_type=cfg.controller_machine_type,
            subnetwork=network.tpu_subnet.id,
            service_account_email=controller_identity.email,
            startup_script=controller_script,
            labels=cfg.labels,
            watch_lease=(
                WatchLease(
                    bucket=bucket.name,
                    object_name=jobspec.watch_lease_object_name(cfg.job_name),
                    tpu_name=cfg.tpu.name,
                )
                if cfg.tpu.auto_recover
                else None
            ),
        ),
        opts=pulumi.ResourceOptions(depends_on=controller_ready),
    )
    hop = VpnHop(
        "vpn-hop",
        VpnHopArgs(
            project=cfg.project,
            name=f"{cfg.prefix}-vpn-hop",
            zone=cfg.vpn.zone,
            region=cfg.vpn.region,
            machine_type=HOP_MACHINE_TYPE,
            subnetwork=network.hop_subnet.id,
            port=cfg.vpn.port,
            client_cidr=cfg.vpn.client_cidr,
            vpc_ranges=(cfg.network.tpu_subnet_cidr, cfg.network.hop_subnet_cidr),
            client_public_key=cfg.vpn.client_public_key,
            service_account_email=hop_identity.email,
            service_account_member=hop_identity.member,
            labels=cfg.labels,
        ),
        # Its VM boots once its account has settled (ServiceIdentity.settled).
        opts=pulumi.ResourceOptions(depends_on=[apis, hop_identity]),
    )

    pulumi.export("tpuName", tpu.vm.name)
    pulumi.export("tpuZone", tpu.vm.zone)
    pulumi.export("tpuInternalIp", tpu.internal_ip)
    # Every host's IP in worker order (one on a single-host type; a slice lists them all).
    pulumi.export("tpuWorkerIps", tpu.worker_ips)
    pulumi.export("controllerInternalIp", controller.internal_ip)
    pulumi.export("bucketUrl", bucket.url)
    pulumi.export("jobSpecUri", delivery.job_uri)
    pulumi.export("payloadUri", delivery.payload_uri)
    pulumi.export("statusUri", jobspec.status_uri(cfg.bucket.name, cfg.job_name))
    pulumi.export(
        "tensorboardUrl",
        controller.internal_ip.apply(lambda ip: f"http://{ip}:{TENSORBOARD_PORT} (over the VPN)"),
    )
    ssh = ssh_commands(cfg)
    pulumi.export("sshCommands", ssh)
    # `pulumi up` updates a changed startup script (new payload, new job) in place without
    # running it; run it now instead of waiting for a reboot.
    rerun = "--command 'sudo google_metadata_script_runner startup'"
    # A slice's hosts all run the startup script: re-run it on every worker.
    tpu_rerun = ssh["tpuAllWorkers"] if "tpuAllWorkers" in ssh else ssh["tpu"]
    pulumi.export(
        "rerunStartupCommands",
        {"controller": f"{ssh['controller']} {rerun}", "tpu": f"{tpu_rerun} {rerun}"},
    )
    # A preempted or spot TPU VM cannot be restarted and holds quota until it is deleted;
    # check its state, and replace it (training resumes from the bucket's checkpoints).
    recovery_commands: dict[str, pulumi.Input[str]] = {
        "check": f"gcloud compute tpus tpu-vm describe {cfg.tpu.name} --zone {cfg.tpu.zone} "
        f"--project {cfg.project} --format='value(state)'",
        "replace": tpu.vm.urn.apply(lambda urn: f"pulumi up --replace '{urn}'"),
    }
    if cfg.tpu.auto_recover:
        recovery_commands["watchdog"] = (
            f"on: the controller checks the TPU VM every {render.TPU_WATCH_INTERVAL} and "
            "recreates it when PREEMPTED or TERMINATED (at most once per "
            f"{render.TPU_RECREATE_MIN_SECONDS}s; without capacity "
            + (
                "it retries with growing waits"
                if cfg.tpu.preemptible
                else f"it waits in the queued resource {render.queued_resource_name(cfg.tpu.name)}"
            )
            + "; never once the job's export is complete); status "
            f"{jobspec.run_root(cfg.bucket.name, cfg.job_name)}/bootstrap/tpu-watch.json, "
            "logs: journalctl -u tpu-pretrain-tpu-watch.service on the controller"
        )
    else:
        recovery_commands["watchdog"] = (
            "off (tpu-pretrain:tpuAutoRecover=false): replace a preempted TPU VM by hand"
        )
    pulumi.export("tpuRecovery", recovery_commands)
    pulumi.export("vpnEndpoint", hop.endpoint)
    pulumi.export("vpnServerPublicKey", hop.server_public_key)
    pulumi.export("vpnClientConfig", hop.client_config)


def ssh_commands(cfg: StackConfig) -> dict[str, str]:
    """SSH commands that work as printed. `gcloud compute ssh` has --tunnel-through-iap in
    GA; `gcloud compute tpus tpu-vm ssh` has it only in the alpha track (GA offers
    --internal-ip alone), so the TPU VM is reached through `gcloud alpha` over IAP, or with
    the GA command and --internal-ip over the WireGuard VPN. Flags are checked against
    gcloud's own definitions in tests/infra/data/gcloud_flags.yaml."""
    where = f"--project {cfg.project}"
    tpu = f"compute tpus tpu-vm ssh {cfg.tpu.name} --zone {cfg.tpu.zone} {where}"
    commands = {
        "controller": f"gcloud compute ssh {cfg.prefix}-controller --zone {cfg.tpu.zone} "
        f"{where} --tunnel-through-iap",
        "tpu": f"gcloud alpha {tpu} --tunnel-through-iap",
        "tpuOverVpn": f"gcloud {tpu} --internal-ip",
        "vpnHop": f"gcloud compute ssh {cfg.prefix}-vpn-hop --zone {cfg.vpn.zone} "
        f"{where} --tunnel-through-iap",
    }
    if cfg.tpu.hosts > 1:
        # On a slice `tpu` reaches worker 0 (gcloud's default --worker, where the trainer
        # runs); --worker=all runs a --command on every host.
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
    )
