"""The rule family of the network: what an ingress firewall lets public addresses reach
(SSH/RDP, TensorBoard and the TPU runtime, any other port), custom-mode VPC networks and
subnetwork flow logs. Firewall sources are judged by the addresses they cover, not by how the
ranges are written."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    StackValidationArgs,
    StackValidationPolicy,
)

try:  # inside the repository (tests): the package "policy"
    from .resources import (
        FIREWALL,
        HOP_NETWORK_TAG,
        NETWORK,
        SUBNETWORK,
        Rule,
        get,
        items,
        resource_policy,
    )
except ImportError:  # the pack as the Pulumi CLI runs it: policy/ is the working directory
    from resources import (  # type: ignore[no-redef]
        FIREWALL,
        HOP_NETWORK_TAG,
        NETWORK,
        SUBNETWORK,
        Rule,
        get,
        items,
        resource_policy,
    )

# Source addresses of an ingress rule that are not "public": the RFC 1918 private ranges and
# the Google ranges that Google documents as sources of its own traffic to VMs:
# - 35.235.240.0/20: IAP TCP forwarding ("Using IAP for TCP forwarding": allow ingress from
#   35.235.240.0/20; infra/components/network.py IAP_RANGE);
# - 35.191.0.0/16 and 130.211.0.0/22: Google Cloud health check probers ("Health checks
#   overview", probe IP ranges and firewall rules; pulumi-gcp's getLBIPRanges data source
#   points at the same page).
# Every other address, IPv6 included, is public. Python's ipaddress `is_private` is not used:
# it also calls documentation and shared ranges (e.g. 203.0.113.0/24) private.
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
GOOGLE_SOURCE_RANGES = ("35.235.240.0/20", "35.191.0.0/16", "130.211.0.0/22")
NOT_PUBLIC = tuple(ipaddress.ip_network(r) for r in (*PRIVATE_RANGES, *GOOGLE_SOURCE_RANGES))
# The CIDRs a stack declares for its users are the sources of its WireGuard rule (UDP to the
# VPN hop; stack config vpnAllowedCidrs). Public sources of other rules are accepted inside
# them, but only while the declaration names at most this many public addresses (a /16): a
# declaration of "everywhere" (0.0.0.0/0 for WireGuard is allowed) exempts nothing.
MAX_USER_ADDRESSES = 2**16
# (first port, last port, service) that must never be open to the internet.
ADMIN_PORTS = ((22, 22, "SSH"), (3389, 3389, "RDP"))
# TensorBoard (infra/components/network.py TENSORBOARD_PORT) and the TPU runtime's gRPC
# port 8470 (the port the TPU API reports in a TPU VM's networkEndpoints); 8471-8479 are
# reserved with it here as a margin (a guess: no Google page lists the whole range).
SERVICE_PORTS = ((6006, 6006, "TensorBoard"), (8470, 8479, "TPU runtime"))

# The ingress rules, each named here once: ingress_findings says which one a finding is for.
RULE_SSH_RDP = "no-ssh-rdp-from-internet"
RULE_SERVICE_PORTS = "no-tensorboard-tpu-from-internet"
RULE_PUBLIC_INGRESS = "no-public-ingress"

# One message per rule; tests and users match on them.
MSG_SSH_RDP = "firewall opens SSH/RDP to the internet"
MSG_SERVICE_PORTS = "firewall opens TensorBoard/TPU ports to the internet"
MSG_FLOW_LOGS = "subnetwork must have VPC flow logs enabled"
MSG_AUTO_NETWORK = "auto-mode (default-style) VPC networks are not allowed"
MSG_PUBLIC_INGRESS = "firewall opens ports to public addresses"


def _port_ranges(ports: Any) -> list[tuple[int, int]] | None:
    """None means every port (no ports listed, or one that cannot be read: judged as the
    widest it could be)."""
    listed = [str(port) for port in items(ports)]
    if not listed:
        return None
    ranges = []
    for item in listed:
        low, _, high = item.strip().partition("-")
        try:
            ranges.append((int(low), int(high or low)))
        except ValueError:
            return None
    return ranges


Net = ipaddress.IPv4Network | ipaddress.IPv6Network
_PROTOCOL_NUMBERS = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp", "58": "ipv6-icmp"}


def _collapse(networks: Iterable[Net]) -> list[Net]:
    v4 = [n for n in networks if n.version == 4]
    v6 = [n for n in networks if n.version == 6]
    return [
        *ipaddress.collapse_addresses(v4),
        *ipaddress.collapse_addresses(v6),
    ]


def _subtract(networks: Iterable[Net], removed: Iterable[Net]) -> list[Net]:
    """The addresses of `networks` that are in none of `removed`, collapsed."""
    result = _collapse(networks)
    for cut in removed:
        kept: list[Net] = []
        for network in result:
            if network.version != cut.version or not network.overlaps(cut):
                kept.append(network)
            elif not network.subnet_of(cut):  # type: ignore[arg-type]
                kept.extend(network.address_exclude(cut))  # type: ignore[arg-type]
        result = kept
    return _collapse(result)


def _public(networks: Iterable[Net]) -> list[Net]:
    return _subtract(networks, NOT_PUBLIC)


def _address_count(networks: Iterable[Net]) -> int:
    return sum(n.num_addresses for n in networks)


def _summary(networks: Sequence[Net]) -> str:
    shown = ", ".join(str(n) for n in networks[:3])
    more = f" and {len(networks) - 3} more ranges" if len(networks) > 3 else ""
    return f"{_address_count(networks)} public addresses ({shown}{more})"


def _firewall_sources(props: Mapping[str, Any]) -> tuple[list[Net], list[str], str]:
    """(parsed source ranges, unparseable ones, how the source reads)."""
    ranges = [str(r) for r in items(get(props, "sourceRanges"))]
    no_source = not items(get(props, "sourceTags")) and not items(
        get(props, "sourceServiceAccounts")
    )
    if not ranges:
        if no_source:
            return [ipaddress.ip_network("0.0.0.0/0")], [], "no source (GCE defaults to 0.0.0.0/0)"
        return [], [], "source tags/service accounts only"
    parsed: list[Net] = []
    bad: list[str] = []
    for cidr in ranges:
        try:
            parsed.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            bad.append(cidr)
    shown = " + ".join(ranges[:4]) + (f" + {len(ranges) - 4} more" if len(ranges) > 4 else "")
    return parsed, bad, shown


def _active_ingress(props: Mapping[str, Any]) -> bool:
    direction = str(get(props, "direction") or "INGRESS").upper()
    return direction == "INGRESS" and get(props, "disabled") is not True


def _protocol(allow: Any) -> str:
    protocol = str(get(allow, "protocol") or "").strip().lower()
    return _PROTOCOL_NUMBERS.get(protocol, protocol)


def _is_vpn_entry(props: Mapping[str, Any]) -> bool:
    """The WireGuard rule's shape: one UDP port, to the VPN hop only."""
    allows = items(get(props, "allows"))
    targets = [str(t) for t in items(get(props, "targetTags"))]
    ports = [str(p).strip() for a in allows for p in items(get(a, "ports"))]
    return (
        bool(allows)
        and all(_protocol(a) == "udp" and items(get(a, "ports")) for a in allows)
        and len(set(ports)) == 1
        and ports[0].isdigit()
        and bool(targets)
        and all(t == HOP_NETWORK_TAG for t in targets)
        and not items(get(props, "targetServiceAccounts"))
    )


def _user_cidrs(resources: Sequence[PolicyResource]) -> tuple[list[Net], str]:
    """The public addresses the stack declares for its users (its WireGuard rules' sources),
    or none when that declaration is wider than MAX_USER_ADDRESSES; and how it reads."""
    declared: list[Net] = []
    for resource in resources:
        props = resource.props
        if resource.resource_type == FIREWALL and _active_ingress(props) and _is_vpn_entry(props):
            declared.extend(_firewall_sources(props)[0])
    public = _public(declared)
    if _address_count(public) > MAX_USER_ADDRESSES:
        return [], (
            f"the stack's user CIDRs ({_summary(public)}) are wider than "
            f"{MAX_USER_ADDRESSES} addresses and exempt nothing"
        )
    return public, ", ".join(str(n) for n in public) or "none declared"


def _overlaps(ranges: list[tuple[int, int]] | None, first: int, last: int) -> bool:
    return ranges is None or any(lo <= last and first <= hi for lo, hi in ranges)


def _outside(ranges: list[tuple[int, int]] | None, known: Sequence[tuple[int, int, str]]) -> bool:
    """Whether the port ranges open any port that is in none of `known`."""
    if ranges is None:
        return True
    for low, high in ranges:
        port = low
        while port <= high:
            inside = [k for k in known if k[0] <= port <= k[1]]
            if not inside:
                return True
            port = max(k[1] for k in inside) + 1
    return False


def ingress_findings(resources: Sequence[PolicyResource]) -> Iterator[tuple[str, str, str]]:
    """(policy name, message, urn) for every ingress firewall that lets public addresses
    outside the stack's user CIDRs reach a port. Ranges are judged by the addresses they
    cover (collapsed, private and Google ranges taken out), never by how they are written."""
    users, users_text = _user_cidrs(resources)
    known_ports = (*ADMIN_PORTS, *SERVICE_PORTS)
    for resource in resources:
        if resource.resource_type != FIREWALL or not _active_ingress(resource.props):
            continue
        props = resource.props
        parsed, bad, source_text = _firewall_sources(props)
        for cidr in bad:
            yield (
                RULE_PUBLIC_INGRESS,
                f"{MSG_PUBLIC_INGRESS}: source range {cidr!r} is not an IP range, so what it "
                "covers cannot be judged",
                resource.urn,
            )
        residual = _subtract(_public(parsed), users)
        if not residual:
            continue
        source = f"{source_text}: {_summary(residual)} outside the user CIDRs ({users_text})"
        vpn_entry = _is_vpn_entry(props)
        for allow in items(get(props, "allows")):
            protocol = _protocol(allow)
            ranges = _port_ranges(get(allow, "ports"))
            if protocol in {"tcp", "all"}:
                for rule, ports, message in (
                    (RULE_SSH_RDP, ADMIN_PORTS, MSG_SSH_RDP),
                    (RULE_SERVICE_PORTS, SERVICE_PORTS, MSG_SERVICE_PORTS),
                ):
                    for first, last, service in ports:
                        if _overlaps(ranges, first, last):
                            wanted = f"port {first}" if first == last else f"ports {first}-{last}"
                            shown = "all ports" if ranges is None else wanted
                            text = f"{message}: {service} ({protocol} {shown}) from {source}"
                            yield rule, text, resource.urn
                if protocol == "tcp" and not _outside(ranges, known_ports):
                    continue
            elif protocol == "udp" and vpn_entry:
                continue  # the WireGuard endpoint: authenticated by its keys, meant to be reached
            ports_text = "all ports" if ranges is None else ",".join(items(get(allow, "ports")))
            yield (
                RULE_PUBLIC_INGRESS,
                f"{MSG_PUBLIC_INGRESS}: {protocol or 'no protocol'} {ports_text} from {source}; "
                "only the WireGuard rule (UDP to the VPN hop) may face the internet",
                resource.urn,
            )


def _ingress_policy(name: str, description: str) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        for rule, message, urn in ingress_findings(args.resources):
            if rule == name:
                report_violation(message, urn)

    return StackValidationPolicy(
        name=name,
        description=description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
    )


def _check_flow_logs(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    purpose = get(props, "purpose")
    if purpose not in (None, "PRIVATE", "PRIVATE_RFC_1918"):
        return  # proxy-only and similar subnets carry no VM traffic and reject logConfig
    if not isinstance(get(props, "logConfig"), Mapping):
        report(f"{MSG_FLOW_LOGS}: set log_config")


def _check_auto_network(_t: str, props: Mapping[str, Any], report: Callable[[str], None]) -> None:
    if get(props, "autoCreateSubnetworks") is not False:
        report(f"{MSG_AUTO_NETWORK}: set auto_create_subnetworks=False")


def rules() -> list[Rule]:
    """The network's rules, in the pack's order: the ingress ones first."""
    return [
        Rule(
            _ingress_policy(
                RULE_SSH_RDP,
                "Ingress firewalls never let a public address reach TCP 22/3389 (or all "
                "ports): source ranges are judged by the addresses they cover, whatever their "
                "prefix lengths; only RFC 1918, IAP and health-check ranges, and the stack's "
                "own user CIDRs (its WireGuard sources, a /16 at most) are not public (CIS GCP "
                "3.6, 3.7)",
            ),
            MSG_SSH_RDP,
        ),
        Rule(
            _ingress_policy(
                RULE_SERVICE_PORTS,
                "Ingress firewalls never let a public address reach TensorBoard (6006) or the "
                "TPU runtime ports (8470-8479); they are reached over the VPN.",
            ),
            MSG_SERVICE_PORTS,
        ),
        Rule(
            _ingress_policy(
                RULE_PUBLIC_INGRESS,
                "No other port or protocol faces public addresses either (closed by default): "
                "the one exception is the WireGuard rule, UDP on listed ports to the VPN hop.",
            ),
            MSG_PUBLIC_INGRESS,
        ),
        Rule(
            resource_policy(
                "subnet-flow-logs",
                "Every VM subnetwork has VPC flow logs.",
                (SUBNETWORK,),
                _check_flow_logs,
                cis="3.8",
            ),
            MSG_FLOW_LOGS,
        ),
        Rule(
            resource_policy(
                "no-auto-mode-network",
                "VPC networks are custom-mode (no auto-created subnetworks in every region).",
                (NETWORK,),
                _check_auto_network,
                cis="3.1",
            ),
            MSG_AUTO_NETWORK,
        ),
    ]
