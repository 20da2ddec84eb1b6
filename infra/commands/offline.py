"""Run the real program under Pulumi's mocks: no cloud account, no Pulumi CLI.

Each run gets a fresh contextvars context and event loop, so Pulumi's settings, config,
root stack and mocks never leak from one run into the next; tests can run every stack in
one process. The mocks answer like GCP would for the outputs the program reads (service
account emails, IPs, URLs); everything else echoes the inputs."""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc as pulumi_rpc
from pulumi.runtime import settings as pulumi_settings
from pulumi.runtime.config import set_all_config
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.catalogs.tpu import load_catalog
from infra.config.config import REPO_ROOT, read_stack_config
from infra.config.project import cli_config
from infra.errors import ConfigError
from infra.program import BUILD_DIR, define

STACKS_DIR = REPO_ROOT / "stacks"
PROJECT_NAME = "tpu-pretrain"
# Stack files do not carry a project id (each user sets their own); runs under mocks use
# this one unless the overrides set gcp:project (None there means "unset").
DEFAULT_TEST_PROJECT = "tpu-pretrain-test"


@dataclass(frozen=True)
class Registered:
    type_: str
    name: str
    inputs: dict[str, Any]
    urn: str
    outputs: dict[str, Any] = field(default_factory=dict)
    secret_inputs: frozenset[str] = frozenset()  # top-level inputs the engine got as secrets
    # Resource options as the engine got them: parent, protect, retainOnDelete,
    # dependencies, replaceOnChanges, ignoreChanges, deleteBeforeReplace, importId.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OfflineRun:
    stack: str
    resources: list[Registered]
    exports: dict[str, Any]
    secret_exports: frozenset[str]


def stack_names() -> list[str]:
    return sorted(
        path.name[len("Pulumi.") : -len(".yaml")] for path in STACKS_DIR.glob("Pulumi.*.yaml")
    )


def parse_overrides(items: list[str]) -> dict[str, object]:
    """`--set namespace:key=value` arguments (make plan, the cost estimate) as overrides."""
    overrides: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or ":" not in key:
            raise ConfigError(
                f"--set {item!r}: use namespace:key=value, e.g. tpu-pretrain:scheduling=spot"
            )
        overrides[key] = value
    return overrides


def stack_config(stack: str, overrides: Mapping[str, object] | None = None) -> dict[str, str]:
    """The config the Pulumi CLI hands the program for `stack`: the stack file's `config:`
    section plus overrides (a None value removes a key), merged with Pulumi.yaml's project
    defaults and typed as the CLI passes them (infra/config/project.py cli_config)."""
    path = STACKS_DIR / f"Pulumi.{stack}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no stack file {path}; stacks: {', '.join(stack_names())}")
    document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    config = dict(document.get("config") or {})
    config.setdefault("gcp:project", DEFAULT_TEST_PROJECT)
    for key, value in (overrides or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return cli_config(stack, config)


def _is_secret(value: object) -> bool:
    return (
        isinstance(value, dict)
        and value.get(pulumi_rpc._special_sig_key) == pulumi_rpc._special_secret_sig
    )


def _unwrap_secrets(value: Any) -> Any:
    """Secret inputs arrive wrapped ({sig: secret, value: …}); tests want the value."""
    if _is_secret(value):
        return _unwrap_secrets(value["value"])
    if isinstance(value, dict):
        return {key: _unwrap_secrets(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unwrap_secrets(item) for item in value]
    return value


GET_BUCKETS = "gcp:storage/getBuckets:getBuckets"  # the invoke kept_bucket_exists() calls


_MONITORING_COLLECTIONS = {
    "gcp:monitoring/notificationChannel:NotificationChannel": "notificationChannels",
    "gcp:monitoring/alertPolicy:AlertPolicy": "alertPolicies",
}


def _fake_ip(seed: str, prefix: str) -> str:
    digest = hashlib.sha256(seed.encode()).digest()
    return f"{prefix}.{digest[0] % 250 + 2}"


class _RecordingMonitor(pulumi_mocks.MockMonitor):
    """The mock monitor, also keeping each registration's resource options."""

    def __init__(self, mocks: pulumi_mocks.Mocks) -> None:
        super().__init__(mocks)
        self.options: dict[str, dict[str, Any]] = {}

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        response = super().RegisterResource(request)
        self.options[response.urn] = {
            "parent": request.parent,
            "protect": request.protect if request.HasField("protect") else None,
            "retainOnDelete": (
                request.retainOnDelete if request.HasField("retainOnDelete") else None
            ),
            "dependencies": sorted(request.dependencies),
            "replaceOnChanges": list(request.replaceOnChanges),
            "ignoreChanges": list(request.ignoreChanges),
            "deleteBeforeReplace": request.deleteBeforeReplace,
            "importId": request.importId or None,
        }
        return response


class _GcpMocks:
    """pulumi.runtime.Mocks: resource outputs as GCP would compute them."""

    def __init__(self, project: str, existing_buckets: frozenset[str] = frozenset()) -> None:
        self.project = project
        self.existing_buckets = existing_buckets  # buckets the project already has
        self.resources: list[Registered] = []

    def new_resource(self, args: Any) -> tuple[str, dict[str, Any]]:
        secret_inputs = frozenset(key for key, value in args.inputs.items() if _is_secret(value))
        inputs = _unwrap_secrets(dict(args.inputs))
        state = dict(inputs)
        name = inputs.get("name", args.name)
        kind = args.typ
        if kind == "gcp:serviceaccount/account:Account":
            email = f"{inputs['accountId']}@{self.project}.iam.gserviceaccount.com"
            state |= {
                "email": email,
                "member": f"serviceAccount:{email}",
                "name": f"projects/{self.project}/serviceAccounts/{email}",
            }
        elif kind == "gcp:storage/bucket:Bucket":
            state |= {"url": f"gs://{name}", "selfLink": f"https://storage/{name}"}
        elif kind == "gcp:storage/bucketObject:BucketObject":
            state |= {"mediaLink": f"https://storage/{inputs['bucket']}/{name}"}
        elif kind == "gcp:compute/address:Address":
            state |= {"address": _fake_ip(name, "203.0.113")}
        elif kind == "gcp:compute/instance:Instance":
            nics = [dict(nic) for nic in inputs.get("networkInterfaces", [])]
            for nic in nics:
                nic.setdefault("networkIp", _fake_ip(name, "10.10.0"))
            state |= {"networkInterfaces": nics}
        elif kind == "gcp:tpu/v2Vm:V2Vm":
            # One endpoint per host: a slice (infra/catalogs/tpu.yaml) has several, worker 0 first.
            shape = load_catalog().slice_of(inputs.get("acceleratorType", ""))
            seeds = [name] + [f"{name}-worker-{i}" for i in range(1, shape.hosts if shape else 1)]
            state |= {
                "networkEndpoints": [
                    {"ipAddress": _fake_ip(seed, "10.10.1"), "port": 8470} for seed in seeds
                ]
            }
        elif kind == "random:index/randomBytes:RandomBytes":
            raw = hashlib.sha256(f"mock-random:{args.name}".encode()).digest()
            state |= {"base64": base64.b64encode(raw).decode(), "hex": raw.hex()}
        elif kind == "gcp:projects/iAMCustomRole:IAMCustomRole":
            state |= {"name": f"projects/{self.project}/roles/{inputs['roleId']}"}
        elif kind in _MONITORING_COLLECTIONS:
            # Cloud Monitoring names a channel or policy by an id it assigns (REST
            # projects.notificationChannels / projects.alertPolicies `name`).
            assigned = hashlib.sha256(f"{kind}:{args.name}".encode()).hexdigest()[:16]
            collection = _MONITORING_COLLECTIONS[kind]
            state |= {"name": f"projects/{self.project}/{collection}/{assigned}"}
        resource_id = (
            f"{name}-id"
            if kind != "gcp:compute/network:Network"
            else (f"projects/{self.project}/global/networks/{name}")
        )
        if kind == "gcp:compute/subnetwork:Subnetwork":
            resource_id = f"projects/{self.project}/regions/{inputs['region']}/subnetworks/{name}"
        self.resources.append(
            Registered(
                type_=kind,
                name=args.name,
                inputs=inputs,
                urn="",
                outputs=state,
                secret_inputs=secret_inputs,
            )
        )
        return resource_id, state

    def call(self, args: Any) -> dict[str, Any]:
        if args.token == GET_BUCKETS:
            prefix = str(args.args.get("prefix") or "")
            names = sorted(n for n in self.existing_buckets if n.startswith(prefix))
            buckets = [{"name": n, "location": "", "labels": {}, "selfLink": ""} for n in names]
            return {"buckets": buckets, "id": self.project, "project": self.project}
        return {}


def _run_in_fresh_context(
    stack: str,
    config: Mapping[str, str],
    build_dir: Path | None,
    entry: Callable[[], None] | None,
    existing_buckets: frozenset[str] = frozenset(),
) -> OfflineRun:
    project = str(config.get("gcp:project") or "")

    class Mocks(pulumi_mocks.Mocks):
        def __init__(self) -> None:
            self.inner = _GcpMocks(project or DEFAULT_TEST_PROJECT, existing_buckets)

        def new_resource(self, args: pulumi_mocks.MockResourceArgs):
            return self.inner.new_resource(args)

        def call(self, args: pulumi_mocks.MockCallArgs):
            return self.inner.call(args)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        set_all_config(dict(config), [])
        mocks = Mocks()
        monitor = _RecordingMonitor(mocks)
        pulumi.runtime.set_mocks(
            mocks, project=PROJECT_NAME, stack=stack, preview=False, monitor=monitor
        )

        def program() -> None:
            if entry is not None:
                entry()
            else:
                define(read_stack_config(), build_dir=build_dir or BUILD_DIR)

        _sync_await(run_pulumi_func(program))
        root = pulumi_settings.get_root_resource()
        raw_exports = dict(getattr(root, "outputs", {}) or {})
        exports: dict[str, Any] = {}
        secrets: set[str] = set()
        for key, value in raw_exports.items():
            output = pulumi.Output.from_input(value)
            exports[key] = _sync_await(output.future())
            if _sync_await(output.is_secret()):
                secrets.add(key)
        # The mock monitor registers resources from worker threads: match by (type, name),
        # which Pulumi keeps unique, not by order.
        urns: dict[tuple[str, str], str] = {}
        for urn in monitor.resources:
            qualified_type, name = urn.split("::", 3)[2:]
            urns[(qualified_type.rsplit("$", 1)[-1], name)] = urn
        resources = [
            Registered(
                type_=item.type_,
                name=item.name,
                inputs=item.inputs,
                urn=urns[(item.type_, item.name)],
                outputs=item.outputs,
                secret_inputs=item.secret_inputs,
                options=monitor.options.get(urns[(item.type_, item.name)], {}),
            )
            for item in mocks.inner.resources
        ]
        return OfflineRun(
            stack=stack, resources=resources, exports=exports, secret_exports=frozenset(secrets)
        )
    finally:
        # Outputs nobody awaited (e.g. of unused resource properties) are still pending:
        # cancel them so no task is destroyed pending when this loop is collected.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)


def run_offline(
    stack: str,
    overrides: Mapping[str, object] | None = None,
    *,
    build_dir: Path | None = None,
    entry: Callable[[], None] | None = None,
    stack_name: str | None = None,
    existing_buckets: frozenset[str] = frozenset(),
) -> OfflineRun:
    """Run the program for `stack` under mocks; raises ConfigError for a bad setting.

    `entry` replaces the default `define(read_stack_config())`, e.g. to run infra/__main__.py
    the way the Pulumi CLI does. `stack_name` runs the stack file's settings under another
    Pulumi stack name (names derive from it). `existing_buckets`: bucket names the mocked
    project already has (e.g. one kept by an earlier `pulumi destroy`)."""
    config = stack_config(stack, overrides)
    context = contextvars.Context()
    return context.run(
        _run_in_fresh_context, stack_name or stack, config, build_dir, entry, existing_buckets
    )
