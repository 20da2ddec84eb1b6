"""Stack configuration: read once, validated into frozen dataclasses.

`read_stack_config()` is the only place that reads `pulumi.Config`; everything below it
takes a `StackConfig`. `parse_config()` is pure so the rules can be tested directly, and
every rule fails with one line that names the key, the value and what is allowed.

The rooms beneath this door (none imports it): types (the dataclasses), keys
(the declared settings and their readers), accelerators (TPU and GPU against the
catalogs) and job (what the job template must satisfy). Here: the stack's names, its
bucket, network and VPN, and the assembly."""

from __future__ import annotations

import base64
import binascii
import datetime
import re
from collections.abc import Mapping
from pathlib import Path

import pulumi
from pulumi.runtime import config as runtime_config

from infra import jobspec
from infra.catalogs.gpu import GpuCatalog, load_gpu_catalog
from infra.catalogs.tpu import Catalog, load_catalog
from infra.catalogs.vpn_hop import default_hop_zones
from infra.config.accelerators import accelerator_kind, gpu_config, tpu_config
from infra.config.job import check_job_fits, check_job_replicas, dataflow_enabled, resolve_backend
from infra.config.keys import (
    KEYS_BY_NAME,
    NAMESPACE,
    array,
    boolean,
    cidr,
    integer,
    qualified,
    region_of,
    string,
    string_list,
)
from infra.config.types import (
    BucketConfig,
    GpuConfig,
    NetworkConfig,
    StackConfig,
    TpuConfig,
    VpnConfig,
)
from infra.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
IAP_RANGE = "35.235.240.0/20"
_GCE_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Every stack bucket's name ends so: the deploy account's bucket and object powers are
# bound with a condition on it (infra/bootstrap/iam_conditions.py STACK_BUCKET_SUFFIX),
# which keeps the Pulumi state bucket and every other bucket out of its reach.
STACK_BUCKET_SUFFIX = "-tpu-pretrain"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_MACHINE_RE = re.compile(r"^[a-z][a-z0-9]*-[a-z0-9-]+$")
# Every GCP name of a stack starts with "tp-<stack>". Service account ids are the tightest
# limit: 6-30 characters, [a-z][a-z0-9-]*[a-z0-9] (IAM serviceAccounts.create accountId);
# the stack's accounts are "<prefix>-<suffix>" for each suffix below (infra/program.py).
SERVICE_ACCOUNT_ID_MAX = 30
SERVICE_ACCOUNT_SUFFIXES = ("-workload", "-controller", "-vpn-hop", "-dataflow")
LONGEST_ACCOUNT_SUFFIX = max(SERVICE_ACCOUNT_SUFFIXES, key=len)
MAX_PREFIX = SERVICE_ACCOUNT_ID_MAX - len(LONGEST_ACCOUNT_SUFFIX)
MAX_STACK_NAME = MAX_PREFIX - len("tp-")


def _wireguard_key(name: str, value: str) -> str | None:
    if not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ConfigError(
            f"{qualified(name)}: {value!r} is not a WireGuard public key (44 base64 characters, "
            "the output of `wg pubkey`)"
        )
    return value


def _bucket(
    values: Mapping[str, object], project: str, stack: str, region: str, what: str = "TPU"
) -> BucketConfig:
    bucket_name = string(values, "bucketName") or f"{project}-{stack}{STACK_BUCKET_SUFFIX}"
    if not _BUCKET_RE.match(bucket_name) or "goog" in bucket_name:
        raise ConfigError(
            f"{qualified('bucketName')}: {bucket_name!r} is not a valid bucket name "
            "(3-63 characters: lowercase letters, digits, '-', '_', '.')"
        )
    if not bucket_name.endswith(STACK_BUCKET_SUFFIX):
        raise ConfigError(
            f"{qualified('bucketName')}: {bucket_name!r} must end with {STACK_BUCKET_SUFFIX!r}: "
            "the "
            "deploy account may change only buckets named so (docs/guard-rails.md)"
        )
    location = (string(values, "bucketLocation") or region).lower()
    if location != region:
        raise ConfigError(
            f"{qualified('bucketLocation')}: {location.upper()!r} is outside the {what} region "
            f"{region}; set it to {region} (or leave it unset)"
        )
    return BucketConfig(
        name=bucket_name,
        location=location.upper(),
        soft_delete_seconds=integer(values, "bucketSoftDeleteDays", 7, 90) * 86400,
        destroy_with_stack=boolean(values, "destroyBucketWithStack"),
    )


def _network(values: Mapping[str, object], prefix: str) -> NetworkConfig:
    tpu_subnet = cidr("tpuSubnetCidr", string(values, "tpuSubnetCidr"))
    hop_subnet = cidr("hopSubnetCidr", string(values, "hopSubnetCidr"))
    client_cidr = cidr("vpnClientCidr", string(values, "vpnClientCidr"))
    for left, right, a, b in (
        ("tpuSubnetCidr", "hopSubnetCidr", tpu_subnet, hop_subnet),
        ("tpuSubnetCidr", "vpnClientCidr", tpu_subnet, client_cidr),
        ("hopSubnetCidr", "vpnClientCidr", hop_subnet, client_cidr),
    ):
        if a.overlaps(b):
            raise ConfigError(
                f"{qualified(right)}: {b} overlaps {qualified(left)} {a}; use disjoint ranges"
            )
    for key, net in (
        ("tpuSubnetCidr", tpu_subnet),
        ("hopSubnetCidr", hop_subnet),
        ("vpnClientCidr", client_cidr),
    ):
        if not net.is_private:
            raise ConfigError(f"{qualified(key)}: {net} is not a private (RFC 1918) range")
    return NetworkConfig(
        name=f"{prefix}-vpc", tpu_subnet_cidr=str(tpu_subnet), hop_subnet_cidr=str(hop_subnet)
    )


def _vpn(
    values: Mapping[str, object], tpu_region: str, what: str = "TPU", *, gitops: bool = False
) -> VpnConfig:
    allowed_cidrs = tuple(
        str(cidr(f"vpnAllowedCidrs[{i}]", item))
        for i, item in enumerate(array(values, "vpnAllowedCidrs"))
    )
    vpn_zone = string(values, "vpnZone") or _default_hop_zone(tpu_region, what)
    vpn_region = region_of("vpnZone", vpn_zone)
    if vpn_region == tpu_region:
        raise ConfigError(
            f"{qualified('vpnZone')}: {vpn_zone!r} is in the {what}'s own region {tpu_region}; the "
            "hop belongs in a region near you, outside it (the policy pack's "
            "one-vpn-hop-outside-tpu-region; unset, a stack here gets "
            f"{_default_hop_zone(tpu_region, what)})"
        )
    client_public_key = _wireguard_key("vpnClientPublicKey", string(values, "vpnClientPublicKey"))
    if gitops and client_public_key is None:
        # Without it the program makes the client's key pair from random bytes, in the state,
        # which the GitOps preview identity decrypts (docs/gitops.md).
        raise ConfigError(
            f"{qualified('vpnClientPublicKey')} is required with "
            f"{qualified('accountsFromBootstrap')}: a GitOps stack keeps no private key in its "
            "state; set it to your own WireGuard public key (`wg genkey | tee client.key | "
            "wg pubkey`; keep client.key)"
        )
    return VpnConfig(
        zone=vpn_zone,
        region=vpn_region,
        allowed_cidrs=allowed_cidrs,
        client_cidr=str(cidr("vpnClientCidr", string(values, "vpnClientCidr"))),
        port=integer(values, "vpnPort", 1024, 65535),
        client_public_key=client_public_key,
    )


# An address as Cloud Monitoring's e-mail channel takes it (labels.email_address): one "@",
# no spaces, a dot in the domain. Whether it receives mail only GCP shows
# (docs/verified-offline-vs-gcp.md).
_EMAIL_RE = re.compile(r"^[^@\s\"]+@[^@\s\"]+\.[^@\s\".]+$")
_EMAIL_EXAMPLE = '["you@example.com"]'


def _alert_emails(values: Mapping[str, object]) -> tuple[str, ...]:
    """tpu-pretrain:alertEmails: the addresses the alert policies notify (none: no alerts)."""
    name = "alertEmails"
    emails: list[str] = []
    for i, item in enumerate(string_list(values, name, _EMAIL_EXAMPLE)):
        address = item.strip() if isinstance(item, str) else item
        if not isinstance(address, str) or not _EMAIL_RE.match(address):
            raise ConfigError(
                f"{qualified(name)}[{i}]: {item!r} is not an e-mail address (allowed: a list of "
                f"addresses like {_EMAIL_EXAMPLE}; [] or unset: no alerts)"
            )
        if address.lower() in (e.lower() for e in emails):
            raise ConfigError(f"{qualified(name)}[{i}]: {address!r} is listed twice; list it once")
        emails.append(address)
    return tuple(emails)


_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _grant_ends(values: Mapping[str, object]) -> str | None:
    """tpu-pretrain:grantEnds: the grant's last day, YYYY-MM-DD (None: not set)."""
    value = string(values, "grantEnds")
    if not value:
        return None
    try:
        if not _DATE_RE.match(value):
            raise ValueError(value)
        return datetime.date.fromisoformat(value).isoformat()
    except ValueError:
        raise ConfigError(
            f"{qualified('grantEnds')}: {value!r} is not a date (allowed: YYYY-MM-DD, e.g. "
            "2027-01-31; unset: no grant end)"
        ) from None


def _default_hop_zone(region: str, what: str) -> str:
    """The hop's zone for a stack that does not set vpnZone: the catalog's zone beside the
    accelerator's region (infra/catalogs/vpn_hop.yaml says why not in it)."""
    zone = default_hop_zones().get(region)
    if zone is None:
        raise ConfigError(
            f"{qualified('vpnZone')} is required for a {what} in {region} (infra/catalogs/"
            "vpn_hop.yaml has no default zone for that region): set a zone near you outside "
            f"{region}, e.g. pulumi config set {qualified('vpnZone')} <zone>"
        )
    return zone


def parse_config(
    *,
    project: str | None,
    stack: str,
    values: Mapping[str, object],
    catalog: Catalog | None = None,
    gpu_catalog: GpuCatalog | None = None,
) -> StackConfig:
    """Validate raw settings (key without namespace -> value) into a StackConfig."""
    catalog = catalog or load_catalog()
    if not project:
        raise ConfigError(
            "gcp:project is required: run `pulumi config set gcp:project <your-project-id>`"
        )
    if not _PROJECT_RE.match(project):
        raise ConfigError(f"gcp:project: {project!r} is not a GCP project id")
    prefix = f"tp-{stack}"
    if not _GCE_NAME_RE.match(prefix) or len(prefix) > MAX_PREFIX:
        raise ConfigError(
            f"stack name {stack!r}: use lowercase letters, digits and '-', starting with a letter "
            f"or digit, at most {MAX_STACK_NAME} characters (service account ids such as "
            f"'tp-<stack>{LONGEST_ACCOUNT_SUFFIX}' are limited to {SERVICE_ACCOUNT_ID_MAX})"
        )
    unknown = sorted(set(values) - set(KEYS_BY_NAME))
    if unknown:
        raise ConfigError(
            f"{qualified(unknown[0])}: unknown setting; known: " + ", ".join(sorted(KEYS_BY_NAME))
        )

    accelerator: TpuConfig | GpuConfig
    if accelerator_kind(values) == "gpu":
        accelerator = gpu_config(values, gpu_catalog or load_gpu_catalog(), prefix)
    else:
        accelerator = tpu_config(values, catalog, prefix)
    what = accelerator.kind.upper()
    bucket = _bucket(values, project, stack, accelerator.region, what)
    network = _network(values, prefix)
    accounts_from_bootstrap = boolean(values, "accountsFromBootstrap")
    vpn = _vpn(values, accelerator.region, what, gitops=accounts_from_bootstrap)
    capacity_wait_minutes = integer(values, "capacityWaitMinutes", 1, 7 * 24 * 60)
    machine_type = string(values, "controllerMachineType")
    if not _MACHINE_RE.match(machine_type):
        raise ConfigError(
            f"{qualified('controllerMachineType')}: {machine_type!r} is not a machine type like "
            "e2-standard-4"
        )

    job_file_value = string(values, "job")
    job_file = (REPO_ROOT / job_file_value).resolve()
    try:
        template = jobspec.load_template(job_file)
    except jobspec.JobTemplateError as error:
        raise ConfigError(f"{qualified('job')}: {job_file_value!r}: {error}") from None
    grant_ends = _grant_ends(values)
    if grant_ends is not None and "grant_ends" in template:
        raise ConfigError(
            f"{qualified('job')}: {job_file_value!r}: grant_ends is set by the stack's "
            f"{qualified('grantEnds')} ({grant_ends}); remove it from the template"
        )
    check_job_replicas(job_file_value, template, accelerator, catalog)
    backend = resolve_backend(job_file_value, template, accelerator, catalog)
    dataflow = dataflow_enabled(values, job_file_value, template, accelerator.region)
    job_plan = check_job_fits(job_file_value, template, accelerator, bucket.name, backend)

    return StackConfig(
        project=project,
        stack=stack,
        prefix=prefix,
        accelerator=accelerator,
        bucket=bucket,
        network=network,
        vpn=vpn,
        controller_machine_type=machine_type,
        job_file=job_file,
        job_name=template["name"],
        backend=backend,
        dataflow=dataflow,
        job_plan=job_plan,
        accounts_from_bootstrap=accounts_from_bootstrap,
        alert_emails=_alert_emails(values),
        grant_ends=grant_ends,
        capacity_wait_minutes=capacity_wait_minutes,
    )


def read_stack_config() -> StackConfig:
    """Read this stack's settings from Pulumi (the only `pulumi.Config` reader)."""

    # Every key of our namespace, including misspelled ones, so that a typo is an error
    # instead of a silently ignored setting.
    present = {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}
    config = pulumi.Config(NAMESPACE)
    values: dict[str, object] = {}
    for full_key in present:
        namespace, _, name = full_key.partition(":")
        if namespace == NAMESPACE:
            value = config.get(name)
            if value is not None:
                values[name] = value
    return parse_config(
        project=pulumi.Config("gcp").get("project"),
        stack=pulumi.get_stack(),
        values=values,
    )
