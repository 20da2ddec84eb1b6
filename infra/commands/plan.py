"""Offline plan: what a stack would create, without a cloud account or the Pulumi CLI.

    python -m infra.commands.plan --stack v6e-euw4 [--set tpu-pretrain:scheduling=spot ...]
                         [--compile .venv-tpu-jax/bin/python]

Runs the real program under Pulumi's mocks (infra.commands.offline) and prints a table of every
resource with its key settings, then the rendered startup scripts and job spec, then what
the grant does not pay (infra/commands/costs.py: the daily cost of the controller, the hop,
the bucket's storage, egress and Dataflow; TPU time marked as paid by the grant). Secret
values (a generated client key, the client configuration) are never printed. `--compile PYTHON`
(`make plan COMPILE=1`) then compiles the stack's job for its TPU type with the payload's
`tpu-payload compile` in the TPU environment (infra/jobfit.py compile_job; minutes), and
exits 2 with its one line when the job does not fit."""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from typing import Any

from infra import jobfit, jobspec
from infra.commands import costs, offline
from infra.config.config import GpuConfig, parse_config
from infra.errors import ConfigError
from infra.render import render

# Per resource type, the inputs worth a glance (engine names).
KEY_SETTINGS: dict[str, tuple[str, ...]] = {
    "gcp:projects/service:Service": ("service", "disableOnDestroy"),
    "gcp:compute/network:Network": ("name", "autoCreateSubnetworks"),
    "gcp:compute/subnetwork:Subnetwork": ("region", "ipCidrRange", "privateIpGoogleAccess"),
    "gcp:compute/router:Router": ("region",),
    "gcp:compute/routerNat:RouterNat": ("region", "sourceSubnetworkIpRangesToNat"),
    "gcp:compute/firewall:Firewall": ("allows", "sourceRanges", "sourceTags", "targetTags"),
    "gcp:serviceaccount/account:Account": ("accountId",),
    "gcp:projects/iAMMember:IAMMember": ("role", "member"),
    "gcp:projects/iAMCustomRole:IAMCustomRole": ("roleId", "permissions"),
    "gcp:serviceaccount/iAMMember:IAMMember": ("serviceAccountId", "role", "member"),
    "gcp:artifactregistry/repository:Repository": (
        "repositoryId",
        "location",
        "format",
        "mode",
        "dockerConfig",
    ),
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": (
        "repository",
        "location",
        "role",
        "member",
    ),
    "gcp:storage/bucket:Bucket": (
        "name",
        "location",
        "uniformBucketLevelAccess",
        "publicAccessPrevention",
        "softDeletePolicy",
        "forceDestroy",
    ),
    "gcp:storage/bucketIAMMember:BucketIAMMember": ("bucket", "role", "member"),
    "gcp:storage/bucketObject:BucketObject": ("bucket", "name"),
    "gcp:tpu/v2Vm:V2Vm": (
        "name",
        "zone",
        "acceleratorType",
        "runtimeVersion",
        "schedulingConfig",
        "networkConfig",
        "shieldedInstanceConfig",
    ),
    "gcp:compute/instance:Instance": (
        "name",
        "zone",
        "machineType",
        "canIpForward",
        "guestAccelerators",
        "scheduling",
    ),
    "gcp:compute/address:Address": ("region", "addressType"),
    "random:index/randomBytes:RandomBytes": ("length",),
}
HIDDEN = "[secret]"


def _compact(value: Any, drop: tuple[str, ...] = ("network", "subnetwork")) -> str:
    """One-line JSON; a resource's long network links are dropped (`drop`), never an
    output's (dataflowOptions names its subnetwork)."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in drop}
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _settings(resource: offline.Registered) -> str:
    keys = KEY_SETTINGS.get(resource.type_, ())
    parts = [f"{key}={_compact(resource.inputs[key])}" for key in keys if key in resource.inputs]
    if resource.type_ == "gcp:compute/instance:Instance":
        nics = resource.inputs.get("networkInterfaces", [])
        external = any(nic.get("accessConfigs") for nic in nics)
        parts.append(f"externalIp={_compact(external)}")
    return " ".join(parts)


def format_plan(run: offline.OfflineRun) -> str:
    rows = sorted(
        (r for r in run.resources if not r.type_.startswith("tpu-pretrain:")),
        key=lambda r: (r.urn.split("::")[2], r.name),
    )
    components = sorted(r.name for r in run.resources if r.type_.startswith("tpu-pretrain:"))
    type_width = max(len(r.type_) for r in rows)
    name_width = max(len(r.name) for r in rows)
    lines = [
        f"Stack {run.stack}: {len(rows)} resources in {len(components)} components "
        f"({', '.join(components)})",
        "",
        f"{'TYPE':<{type_width}}  {'NAME':<{name_width}}  KEY SETTINGS",
    ]
    lines += [f"{r.type_:<{type_width}}  {r.name:<{name_width}}  {_settings(r)}" for r in rows]
    lines += ["", "Outputs:"]
    for key in sorted(run.exports):
        value = HIDDEN if key in run.secret_exports else _compact(run.exports[key], drop=())
        lines.append(f"  {key}: {value}")
    for resource in sorted(run.resources, key=lambda r: r.name):
        script = (resource.inputs.get("metadata") or {}).get("startup-script")
        title = f"startup script of {resource.name} ({resource.type_})"
        if resource.inputs.get("contentType") == "text/x-shellscript":
            # What a VM's loader runs (components/delivery.py StartupDelivery).
            script = resource.inputs.get("content")
            title = (
                f"gs://{resource.inputs['bucket']}/{resource.inputs['name']} (run by the loader)"
            )
        if script:
            lines += ["", f"==== {title} ====", script]
            # The controller carries its watchdog base64-encoded; show it readable too.
            match = re.search(
                r"^readonly WATCH_SCRIPT_B64=([A-Za-z0-9+/=]+)$", script, re.MULTILINE
            )
            if match:
                watchdog = base64.b64decode(match.group(1)).decode()
                lines += ["", f"==== watchdog installed by {resource.name} ====", watchdog]
    for resource in run.resources:
        if resource.inputs.get("contentType") == "application/json":
            what = "job pointer" if resource.inputs["name"] == render.POINTER_OBJECT else "job spec"
            lines += [
                "",
                f"==== {what} gs://{resource.inputs['bucket']}/{resource.inputs['name']} ====",
            ]
            lines.append(resource.inputs["content"].rstrip("\n"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.commands.plan", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--stack", required=True, help="one of: " + ", ".join(offline.stack_names())
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--compile",
        metavar="PYTHON",
        help="also compile the stack's job for its TPU type with this interpreter of the TPU "
        f"environment (e.g. {jobfit.TPU_PYTHON}; takes minutes)",
    )
    args = parser.parse_args(argv)
    try:
        if args.stack not in offline.stack_names():
            raise ConfigError(
                f"--stack {args.stack!r}: no stacks/Pulumi.{args.stack}.yaml; stacks: "
                + ", ".join(offline.stack_names())
            )
        overrides = offline.parse_overrides(args.set)
        run = offline.run_offline(args.stack, overrides)
        estimate = costs.stack_estimate(args.stack, overrides, run)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(format_plan(run))
    sys.stdout.write("\n" + costs.format_text(estimate))
    if args.compile:
        sys.stdout.flush()
        return compile_stack_job(args.stack, overrides, args.compile)
    return 0


def compile_stack_job(stack: str, overrides: dict[str, object], python: str) -> int:
    """`tpu-payload compile` of the stack's rendered job for its TPU type (jobfit.compile_job):
    0 when it compiles (or there is nothing to compile here: a GPU stack, the TF backend), 2
    with its one line when it does not."""
    config = offline.stack_config(stack, overrides)
    values = {k.split(":", 1)[1]: v for k, v in config.items() if k.startswith("tpu-pretrain:")}
    cfg = parse_config(project=str(config.get("gcp:project")), stack=stack, values=values)
    if isinstance(cfg.accelerator, GpuConfig):
        print(f"compile: stack {stack} trains on GPUs: the GPU compiler needs a GPU (skipped)")
        return 0
    if cfg.backend != "jax":
        print(
            f"compile: stack {stack}'s job trains on the {cfg.backend} backend; compile builds "
            "the JAX trainer's programs (skipped)"
        )
        return 0
    spec = jobspec.render_job_spec(jobspec.load_template(cfg.job_file), cfg.bucket.name)
    accelerator = cfg.accelerator.accelerator_type
    print(f"compile: {cfg.job_name} for {accelerator} with {python} (tpu-payload compile)")
    sys.stdout.flush()
    code, line = jobfit.compile_job(jobspec.to_json(spec), accelerator, python)
    if code != 0:
        print(f"error: compile: {line or f'exit status {code}'}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
