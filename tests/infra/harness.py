"""Run the real Pulumi program under Pulumi's mocks and capture what it registers.

Used by tests/infra and by the policy pack's tests (tests/policy): pytest puts tests/infra on
sys.path for modules in it (`from harness import run_stack`); from another folder insert
`tests/infra` into sys.path first (there is no tests/__init__.py on purpose). Each call runs
the program in a fresh Pulumi context, so it can be called many times in one pytest process.

    run_stack("v6e-euw4")                                  -> list[Captured]
    run_stack("v6e-euw4", {"tpu-pretrain:scheduling": "preemptible"})
    config_error("v3-euw4", {"tpu-pretrain:tpuZone": "mars-north1-a"}) -> one-line message
    stack_names()                                          -> ["a100x4-usc1", ...]
    tpu_stack_names(), gpu_stack_names()                   -> the stacks of one kind

Overrides are stack config keys ("namespace:key") with Python values (lists/dicts become
JSON like the Pulumi CLI passes them); a value of None removes the key. `inputs` are the
resolved inputs as the engine sees them (pulumi-gcp camelCase names, e.g.
"uniformBucketLevelAccess"); component resources (type "tpu-pretrain:index:…") are
included with empty inputs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra import offline
from infra.errors import ConfigError

# Archives built during tests go to a temp dir, not the repository's build/.
_BUILD_DIR = Path(tempfile.mkdtemp(prefix="tpu-pretrain-test-build-"))


@dataclass(frozen=True)
class Captured:
    type_: str
    name: str
    inputs: dict[str, Any]
    urn: str


def stack_names() -> list[str]:
    return offline.stack_names()


def stack_kind(stack: str) -> str:
    """'tpu' or 'gpu': what the stack file's tpu-pretrain:accelerator says (default tpu)."""
    return str(offline.stack_config(stack).get("tpu-pretrain:accelerator", "tpu"))


def tpu_stack_names() -> list[str]:
    return [stack for stack in stack_names() if stack_kind(stack) == "tpu"]


def gpu_stack_names() -> list[str]:
    return [stack for stack in stack_names() if stack_kind(stack) == "gpu"]


def run_offline(
    stack: str,
    overrides: Mapping[str, object] | None = None,
    *,
    entry: Callable[[], None] | None = None,
    stack_name: str | None = None,
    existing_buckets: frozenset[str] = frozenset(),
) -> offline.OfflineRun:
    """The full result: resources (with mock outputs and resource options), stack exports
    and which are secret. `entry` replaces the default program (see infra.offline);
    `stack_name` runs the stack file under another Pulumi stack name."""
    return offline.run_offline(
        stack,
        overrides,
        build_dir=_BUILD_DIR,
        entry=entry,
        stack_name=stack_name,
        existing_buckets=existing_buckets,
    )


def run_stack(stack: str, overrides: Mapping[str, object] | None = None) -> list[Captured]:
    return [
        Captured(type_=r.type_, name=r.name, inputs=r.inputs, urn=r.urn)
        for r in run_offline(stack, overrides).resources
    ]


def config_error(stack: str, overrides: Mapping[str, object] | None = None) -> str:
    """The one-line message of the ConfigError the stack raises (AssertionError if none)."""
    try:
        run_offline(stack, overrides)
    except ConfigError as error:
        message = str(error)
        assert "\n" not in message, f"config error is not one line: {message!r}"
        return message
    raise AssertionError(f"stack {stack} with {overrides} raised no config error")


def of_type(resources: list[Captured], type_: str) -> list[Captured]:
    return [r for r in resources if r.type_ == type_]


def one(resources: list[Captured], type_: str) -> Captured:
    found = of_type(resources, type_)
    assert len(found) == 1, f"expected one {type_}, found {[r.name for r in found]}"
    return found[0]


# The VM a role's loader runs on (infra/render.py LOADER_ROLES).
_ROLE_OF_VM = {"tpu-vm": "tpu", "gpu-vm": "gpu", "controller-vm": "controller"}


def startup_script(run: Any, vm_name: str) -> str:
    """The startup script a VM runs: its metadata's own (the VPN hop), or, behind the loader
    in its metadata, the rendered script the job pointer names for its role (the bucket
    object startup/<role>-<sha>.sh of infra/components/delivery.py StartupDelivery)."""
    role = _ROLE_OF_VM.get(vm_name)
    if role is None:
        (vm,) = [r for r in run.resources if r.name == vm_name]
        return str(vm.inputs["metadata"]["startup-script"])
    (obj,) = [r for r in run.resources if r.name == f"startup-{role}-script"]
    return str(obj.inputs["content"])
