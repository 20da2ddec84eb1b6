from __future__ import annotations

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
    service_account_member: pulumi.Input[str]
    labels: dict[str, str]


class VpnHop(pulumi.ComponentResource):
    """A WireGuard VM near the user with a static IP that forwards and masquerades VPN
    traffic into the VPC.

    Keys come from pulumi_random bytes, so they are stable across updates. The server's
    private key lives only in Secret Manager (readable by the hop's own service account,
    on that one secret) and is fetched by the VM at boot; metadata carries public keys only.
    The client configuration is a secret output."""

    def __init__(self, name: str, args: VpnHopArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("tpu-pretrain:index:VpnHop", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        server_seed = random.RandomBytes(f"{name}-server-key", length=32, opts=child)
        server_private: pulumi.Output[str] = pulumi.Output.secret(
            server_seed.base64.apply(wgkeys.private_key)
        )
        # A public key is not a secret; unsecret it so the output is readable.
        self.server_public_key = pulumi.Output.unsecret(server_private.apply(wgkeys.public_key))
        if args.client_public_key is None:
            client_seed = random.RandomBytes(f"{name}-client-key", length=32, opts=child)
            client_private: pulumi.Output[str] = pulumi.Output.secret(
                client_seed.base64.apply(wgkeys.private_key)
            )
            client_public: pulumi.Output[str] = client_private.apply(wgkeys.public_key)
        else:
            client_private = pulumi.Output.from_input(render.OWN_CLIENT_KEY_PLACEHOLDER)
            client_public = pulumi.Output.from_input(args.client_public_key)

        self.secret = gcp.secretmanager.Secret(
            f"{name}-server-key-secret",
            project=args.project,
            secret_id=f"{args.name}-wireguard-server-key",
            replication={"auto": {}},
            labels=args.labels,
            opts=child,
        )
        self.secret_version = gcp.secretmanager.SecretVersion(
            f"{name}-server-key-version",
            secret=self.secret.id,
            secret_data=server_private,
            opts=child,
        )
        self.secret_access = gcp.secretmanager.SecretIamMember(
            f"{name}-server-key-access",
            project=args.project,
            secret_id=self.secret.secret_id,
            role="roles/secretmanager.secretAccessor",
            member=args.service_account_member,
            opts=child,
        )
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
        server = render.WireGuardServer(
            project=args.project,
            secret_id=f"{args.name}-wireguard-server-key",
            port=args.port,
            client_cidr=args.client_cidr,
        )
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
            metadata=hardened_metadata(startup_script),
            tags=[TAG_HOP],
            labels=args.labels,
            allow_stopping_for_update=True,
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[self.secret_version, self.secret_access, *inherited_depends_on(opts)],
            ),
        )
        self.endpoint = pulumi.Output.concat(self.address.address, ":", str(args.port))
        self.client_config: pulumi.Output[str] = pulumi.Output.secret(
            pulumi.Output.all(client_private, self.server_public_key, self.endpoint).apply(
                lambda values: render.render_wireguard_client_config(
                    client_private_key=values[0],
                    server_public_key=values[1],
                    endpoint=values[2],
                    client_cidr=args.client_cidr,
                    allowed_ips=args.vpc_ranges,
                )
            )
        )
        self.register_outputs(
            {
                "endpoint": self.endpoint,
                "serverPublicKey": self.server_public_key,
                "clientConfig": self.client_config,
            }
        )
