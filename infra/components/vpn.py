from __future__ import annotations

import shlex
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp
import pulumi_random as random

from infra import wgkeys
from infra.components.controller import CONTROLLER_IMAGE, SHIELDED_VM, hardened_metadata
from infra.components.network import TAG_HOP
from infra.components.tpu import CLOUD_PLATFORM, inherited_depends_on
from infra.render import render


@dataclass(frozen=True)
class VpnHopArgs:
    project: str
    name: str
    zone: str
    region: str
    machine_type: str
    subnetwork: pulumi.Input[str]
    port: int
    client_cidr: str
    vpc_ranges: tuple[str, ...]  # what the client routes through the tunnel
    client_public_key: str | None  # None: generate a client key pair
    service_account_email: pulumi.Input[str]
    labels: dict[str, str]


def server_key_command(project: str, zone: str, instance: str) -> str:
    """The gcloud command that prints the hop's public key, as the hop publishes it."""
    return (
        f"gcloud compute instances get-guest-attributes {instance} --zone {zone} "
        f"--project {project} --query-path={render.WG_PUBLIC_KEY_ATTRIBUTE} "
        f"--format={shlex.quote('value(value)')}"
    )


class VpnHop(pulumi.ComponentResource):
    """A WireGuard VM near the user with a static IP that forwards and masquerades VPN
    traffic into the VPC.

    The hop makes its own key pair at its first boot and keeps the private key on its own
    disk (templates/vpn-hop.sh); only the public key leaves the VM, as a guest attribute
    (render.WG_PUBLIC_KEY_ATTRIBUTE). So the server's private key is in no resource input or
    output, no secret and no Pulumi state: an identity that reads and decrypts the state (the
    GitOps preview account) never holds it, and no grant lets anyone read it. The client's
    key is the user's own (vpnClientPublicKey, which a GitOps stack must set) or, for a stack
    a person deploys without one, made from pulumi_random bytes in that person's state.

    The client configuration is a secret output that carries render.SERVER_KEY_PLACEHOLDER
    for the server's key; `server_key` says where the hop publishes it (`make vpn-config`
    reads it and fills it in). A replaced hop VM (a new disk) makes a new key pair."""

    def __init__(self, name: str, args: VpnHopArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("tpu-pretrain:index:VpnHop", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        if args.client_public_key is None:
            client_seed = random.RandomBytes(f"{name}-client-key", length=32, opts=child)
            client_private: pulumi.Output[str] = pulumi.Output.secret(
                client_seed.base64.apply(wgkeys.private_key)
            )
            client_public: pulumi.Output[str] = client_private.apply(wgkeys.public_key)
        else:
            client_private = pulumi.Output.from_input(render.OWN_CLIENT_KEY_PLACEHOLDER)
            client_public = pulumi.Output.from_input(args.client_public_key)

        self.address = gcp.compute.Address(
            f"{name}-address",
            project=args.project,
            name=f"{args.name}-ip",
            region=args.region,
            address_type="EXTERNAL",
            network_tier="PREMIUM",
            labels=args.labels,
            opts=child,
        )
        server = render.WireGuardServer(port=args.port, client_cidr=args.client_cidr)
        startup_script = pulumi.Output.from_input(client_public).apply(
            lambda key: render.render_vpn_hop_script(server, client_public_key=key)
        )
        self.instance = gcp.compute.Instance(
            f"{name}-vm",
            project=args.project,
            name=args.name,
            zone=args.zone,
            machine_type=args.machine_type,
            can_ip_forward=True,
            boot_disk={
                "initialize_params": {"image": CONTROLLER_IMAGE, "size": 10, "type": "pd-balanced"}
            },
            network_interfaces=[
                {
                    "subnetwork": args.subnetwork,
                    "access_configs": [{"nat_ip": self.address.address, "network_tier": "PREMIUM"}],
                }
            ],
            service_account={"email": args.service_account_email, "scopes": [CLOUD_PLATFORM]},
            shielded_instance_config=SHIELDED_VM,
            # Guest attributes on: the hop publishes its public key as one.
            metadata=hardened_metadata(startup_script, guest_attributes=True),
            tags=[TAG_HOP],
            labels=args.labels,
            allow_stopping_for_update=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=inherited_depends_on(opts)),
        )
        self.endpoint = pulumi.Output.concat(self.address.address, ":", str(args.port))
        self.server_key = {
            "instance": args.name,
            "zone": args.zone,
            "project": args.project,
            "guestAttribute": render.WG_PUBLIC_KEY_ATTRIBUTE,
            "command": server_key_command(args.project, args.zone, args.name),
        }
        self.client_config: pulumi.Output[str] = pulumi.Output.secret(
            pulumi.Output.all(client_private, self.endpoint).apply(
                lambda values: render.render_wireguard_client_config(
                    client_private_key=values[0],
                    server_public_key=render.SERVER_KEY_PLACEHOLDER,
                    endpoint=values[1],
                    client_cidr=args.client_cidr,
                    allowed_ips=args.vpc_ranges,
                )
            )
        )
        self.register_outputs(
            {
                "endpoint": self.endpoint,
                "serverKey": self.server_key,
                "clientConfig": self.client_config,
            }
        )
