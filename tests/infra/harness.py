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

A process runs each distinct program once: run_offline keeps the result of every run by
what it is a function of (the stack, its config as the CLI hands it, the stack name, the
buckets that exist) and hands later callers a deep copy. What a test patches makes another
key: the key also holds the environment and every infra module's attributes
(monkeypatch.setattr on render, say); `fresh=True` always runs the program
(test_infra_harness.py: twice in a row, the same result).

Overrides are stack config keys ("namespace:key") with Python values (lists/dicts become
JSON like the Pulumi CLI passes them); a value of None removes the key. `inputs` are the
resolved inputs as the engine sees them (pulumi-gcp camelCase names, e.g.
"uniformBucketLevelAccess"); component resources (type "tpu-pretrain:index:…") are
included with empty inputs.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.commands import offline
from infra.errors import ConfigError

# Archives built during tests go to a temp dir, not the repository's build/.
_BUILD_DIR = Path(tempfile.mkdtemp(prefix="tpu-pretrain-test-build-"))

# What a GitOps stack sets (docs/gitops.md): it adopts the bootstrap's accounts and brings
# its client's own public key (32 bytes no private key belongs to: nobody can connect).
GITOPS = {
    "tpu-pretrain:accountsFromBootstrap": True,
    "tpu-pretrain:vpnClientPublicKey": base64.b64encode(
        hashlib.sha256(b"tpu-pretrain test client").digest()
    ).decode(),
}


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
    fresh: bool = False,
) -> offline.OfflineRun:
    """The full result: resources (with mock outputs and resource options), stack exports
    and which are secret. `entry` replaces the default program (see infra.commands.offline; never
    kept); `stack_name` runs the stack file under another Pulumi stack name; `fresh` runs
    the program even if this process ran it with the same inputs before."""
    key = None
    if entry is None:
        key = _run_key(stack, overrides, stack_name, existing_buckets)
        if not fresh and key in _RUNS:
            return copy.deepcopy(_RUNS[key])
    run = offline.run_offline(
        stack,
        overrides,
        build_dir=_BUILD_DIR,
        entry=entry,
        stack_name=stack_name,
        existing_buckets=existing_buckets,
    )
    if key is not None:
        _RUNS[key] = copy.deepcopy(run)
    return run


# Results of the program by _run_key (230 distinct runs in the infra + policy suite, split
# between its workers; ~0.3 MB each).
_RUNS: dict[tuple[Any, ...], offline.OfflineRun] = {}


def _run_key(
    stack: str,
    overrides: Mapping[str, object] | None,
    stack_name: str | None,
    existing_buckets: frozenset[str],
) -> tuple[Any, ...]:
    """What a run of the default program is a function of: the config the CLI would hand it
    (the stack file as it is now, with the overrides), its names, the project's buckets, plus
    what a test may have patched: the environment and every attribute of every infra module
    (by identity: monkeypatch.setattr changes it, its undo restores it)."""
    config = json.dumps(offline.stack_config(stack, overrides), sort_keys=True, default=repr)
    modules = tuple(
        (name, attr, id(value))
        for name, module in sorted(sys.modules.items())
        if name == "infra" or name.startswith("infra.")
        for attr, value in vars(module).items()
    )
    # pytest's own PYTEST_CURRENT_TEST names the running test: never the program's input.
    environ = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    return (stack, config, stack_name, existing_buckets, environ, modules)


def run_stack(
    stack: str, overrides: Mapping[str, object] | None = None, *, fresh: bool = False
) -> list[Captured]:
    return [
        Captured(type_=r.type_, name=r.name, inputs=r.inputs, urn=r.urn)
        for r in run_offline(stack, overrides, fresh=fresh).resources
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


def uv_resolver() -> dict[str, str]:
    """The environment in which tpu-install.sh's tpu_check_resolves asks CI's uv (`make`'s
    .venv-uv) instead of pip: the GPU locks' checks, whose pip dry runs download every CUDA
    wheel (the TPU checks keep pip's path covered)."""
    uv = Path(__file__).resolve().parents[2] / ".venv-uv" / "bin" / "uv"
    if not uv.exists():
        raise AssertionError(f"{uv} is missing: `make venv-uv` builds it")
    # The system's certificates, which pip gets from pip.conf where the index needs them.
    return {"TPU_INSTALL_UV": str(uv), "UV_NATIVE_TLS": "1"}


def of_type(resources: list[Captured], type_: str) -> list[Captured]:
    return [r for r in resources if r.type_ == type_]


def one(resources: list[Captured], type_: str) -> Captured:
    found = of_type(resources, type_)
    assert len(found) == 1, f"expected one {type_}, found {[r.name for r in found]}"
    return found[0]


# The VM a role's loader runs on (infra/render/render.py LOADER_ROLES).
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


def by_name(run, name: str) -> offline.Registered:
    (found,) = [r for r in run.resources if r.name == name]
    return found


def depends_on(run, dependent: offline.Registered, target: offline.Registered) -> bool:
    """Whether `dependent` waits for `target` (directly, or through resources it depends on,
    their children included): Pulumi then destroys `dependent` before `target`."""
    by_urn = {r.urn: r for r in run.resources}
    children: dict[str, list[str]] = {}
    for r in run.resources:
        children.setdefault(r.options.get("parent", ""), []).append(r.urn)
    seen, todo = set(), list(dependent.options["dependencies"])
    while todo:
        urn = todo.pop()
        if urn in seen:
            continue
        seen.add(urn)
        if urn == target.urn:
            return True
        todo += children.get(urn, [])
        if urn in by_urn:
            todo += by_urn[urn].options.get("dependencies", [])
    return False
