from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# Network tags: firewall rules select instances by role. TAG_TPU is the accelerator VM's,
# a TPU VM (every host of a slice) or a GPU VM.
TAG_TPU = "tpu-pretrain-tpu"
TAG_CONTROLLER = "tpu-pretrain-controller"
TAG_HOP = "tpu-pretrain-vpn-hop"
IAP_RANGE = "35.235.240.0/20"
TENSORBOARD_PORT = 6006  # the controller's TensorBoard (templates/controller.sh)


def subnet_name(network_name: str, region: str) -> str:
    """The name of the network's subnet in a region (the Dataflow option `subnetwork` names
    the TPU region's subnet by it)."""
    return f"{network_name}-{region}"


@dataclass(frozen=True)
class NetworkArgs:
    project: str
    name: str
    tpu_region: str
    tpu_subnet_cidr: str
    hop_region: str
    hop_subnet_cidr: str
    vpn_client_cidr: str
    wireguard_port: int
    wireguard_source_cidrs: tuple[str, ...]
    accelerator_hosts: int  # VMs carrying TAG_TPU: > 1 for a multi-host TPU slice


class Network(pulumi.ComponentResource):
    """A VPC with one subnet in the TPU region and one in the VPN hop's region.

    Private Google Access lets VMs without external IPs reach Cloud Storage; Cloud NAT in
    the TPU region lets them install packages from PyPI. Ingress is closed except: SSH from
    the IAP range and the VPN, WireGuard from the configured sources, from the hop (the VPN
    clients it masquerades) SSH and ICMP to the controller and the accelerator VM and
    TensorBoard to the controller only, and, on a multi-host slice, traffic between the
    slice's hosts (JAX's coordination service on worker 0, the runtime's host traffic).

    The controller and the accelerator VM do not reach each other: they meet only in the
    bucket (job spec, status, shards, TensorBoard logs, the export) and through Google's
    APIs (the watchdog), so the VM that runs the training code and its downloads has no
    path to the controller, which holds the recovery rights."""

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("tpu-pretrain:index:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.vpc = gcp.compute.Network(
            f"{name}-vpc",
            project=args.project,
            name=args.name,
            auto_create_subnetworks=False,
            routing_mode="GLOBAL",
            opts=child,
        )
        flow_logs: gcp.compute.SubnetworkLogConfigArgsDict = {
            "aggregation_interval": "INTERVAL_5_SEC",
            "flow_sampling": 0.5,
            "metadata": "INCLUDE_ALL_METADATA",
        }

        def subnet(role: str, region: str, cidr: str) -> gcp.compute.Subnetwork:
            return gcp.compute.Subnetwork(
                f"{name}-{role}-subnet",
                project=args.project,
                name=subnet_name(args.name, region),
                region=region,
                network=self.vpc.id,
                ip_cidr_range=cidr,
                private_ip_google_access=True,
                log_config=flow_logs,
                opts=child,
            )

        self.tpu_subnet = subnet("tpu", args.tpu_region, args.tpu_subnet_cidr)
        self.hop_subnet = subnet("hop", args.hop_region, args.hop_subnet_cidr)
        self.router = gcp.compute.Router(
            f"{name}-router",
            project=args.project,
            name=f"{args.name}-router",
            region=args.tpu_region,
            network=self.vpc.id,
            opts=child,
        )
        self.nat = gcp.compute.RouterNat(
            f"{name}-nat",
            project=args.project,
            name=f"{args.name}-nat",
            region=args.tpu_region,
            router=self.router.name,
            nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="LIST_OF_SUBNETWORKS",
            subnetworks=[
                {"name": self.tpu_subnet.id, "source_ip_ranges_to_nats": ["ALL_IP_RANGES"]}
            ],
            log_config={"enable": True, "filter": "ERRORS_ONLY"},
            opts=child,
        )
        roles = [TAG_TPU, TAG_CONTROLLER, TAG_HOP]
        self.ssh_rule = gcp.compute.Firewall(
            f"{name}-allow-ssh",
            project=args.project,
            name=f"{args.name}-allow-ssh-iap-vpn",
            network=self.vpc.id,
            direction="INGRESS",
            allows=[{"protocol": "tcp", "ports": ["22"]}],
            source_ranges=[IAP_RANGE, args.vpn_client_cidr],
            target_tags=roles,
            log_config={"metadata": "INCLUDE_ALL_METADATA"},
            opts=child,
        )
        self.wireguard_rule = gcp.compute.Firewall(
            f"{name}-allow-wireguard",
            project=args.project,
            name=f"{args.name}-allow-wireguard",
            network=self.vpc.id,
            direction="INGRESS",
            allows=[{"protocol": "udp", "ports": [str(args.wireguard_port)]}],
            source_ranges=list(args.wireguard_source_cidrs),
            target_tags=[TAG_HOP],
            log_config={"metadata": "INCLUDE_ALL_METADATA"},
            opts=child,
        )
        # The hosts of a slice reach each other; a single VM has no peer to let in.
        self.slice_rule = (
            gcp.compute.Firewall(
                f"{name}-allow-slice",
                project=args.project,
                name=f"{args.name}-allow-slice",
                network=self.vpc.id,
                direction="INGRESS",
                allows=[{"protocol": "tcp"}, {"protocol": "udp"}, {"protocol": "icmp"}],
                source_tags=[TAG_TPU],
                target_tags=[TAG_TPU],
                opts=child,
            )
            if args.accelerator_hosts > 1
            else None
        )
        # VPN clients reach the VMs through the hop (it masquerades them): SSH and ping, and
        # TensorBoard on the controller, the one VM that serves it.
        self.hop_rule = gcp.compute.Firewall(
            f"{name}-allow-from-hop",
            project=args.project,
            name=f"{args.name}-allow-from-hop",
            network=self.vpc.id,
            direction="INGRESS",
            allows=[{"protocol": "tcp", "ports": ["22"]}, {"protocol": "icmp"}],
            source_tags=[TAG_HOP],
            target_tags=[TAG_TPU, TAG_CONTROLLER],
            log_config={"metadata": "INCLUDE_ALL_METADATA"},
            opts=child,
        )
        self.tensorboard_rule = gcp.compute.Firewall(
            f"{name}-allow-tensorboard",
            project=args.project,
            name=f"{args.name}-allow-tensorboard-from-hop",
            network=self.vpc.id,
            direction="INGRESS",
            allows=[{"protocol": "tcp", "ports": [str(TENSORBOARD_PORT)]}],
            source_tags=[TAG_HOP],
            target_tags=[TAG_CONTROLLER],
            log_config={"metadata": "INCLUDE_ALL_METADATA"},
            opts=child,
        )
        self.register_outputs(
            {
                "network": self.vpc.id,
                "tpuSubnetwork": self.tpu_subnet.id,
                "hopSubnetwork": self.hop_subnet.id,
            }
        )
