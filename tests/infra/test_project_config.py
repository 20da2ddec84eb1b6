"""The config the Pulumi CLI hands the program (infra/config/project.py, after pulumi/pulumi's
sdk/go/common/workspace): Pulumi.yaml loads under the CLI's rules, every stack gets every
project default it does not set, and every stack plans with them, as `pulumi up` runs it."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import yaml
from harness import config_error, gpu_stack_names, run_offline, stack_names

from infra.commands import offline
from infra.config.config import parse_config
from infra.config.keys import KEYS
from infra.config.project import cli_config, cli_text, load_project, valid_for_type
from infra.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "infra" / "__main__.py"
K = "tpu-pretrain:"


def _stack_file(stack: str) -> dict[str, object]:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]


def _run_main() -> None:
    runpy.run_path(str(MAIN), run_name="__main__")


def test_pulumi_yaml_loads_under_the_clis_rules():
    """Project.Validate: a typed key's default must be of its type, else no stack loads."""
    project, declared = load_project()
    assert project == "tpu-pretrain"
    assert set(declared) == {key.name for key in KEYS}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"type": "boolean", "default": ""},
            "The default value specified for configuration key 'k' is not of the expected "
            "type 'boolean'",
        ),
        (
            {"type": "integer", "default": ""},
            "The default value specified for configuration key 'k' is not of the expected "
            "type 'integer'",
        ),
        (
            {"type": "array", "items": {"type": "string"}, "default": [1]},
            "The default value specified for configuration key 'k' is not of the expected "
            "type 'array<string>'",
        ),
        (
            {"type": "array", "default": []},
            "The configuration key 'k' declares an array but does not specify the underlying "
            "type via the 'items' attribute",
        ),
    ],
)
def test_a_project_the_cli_refuses_to_load_is_refused(tmp_path, spec, message):
    path = tmp_path / "Pulumi.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "runtime": "python", "config": {"k": spec}}))
    with pytest.raises(ConfigError) as caught:
        load_project(path)
    assert str(caught.value) == f"could not unmarshal '{path}': {message}"


@pytest.mark.parametrize(
    ("type_name", "value", "valid"),
    [
        ("boolean", "true", True),
        ("boolean", False, True),
        ("boolean", "", False),
        ("boolean", "yes", False),
        ("integer", 7, True),
        ("integer", "-3", True),
        ("integer", "", False),
        ("integer", "1.5", False),
        ("integer", True, False),
        ("string", "", True),
        ("string", 7, False),
    ],
)
def test_value_types_follow_validate_config_value(type_name, value, valid):
    assert valid_for_type(type_name, None, value) is valid


def test_defaults_reach_the_program_as_the_cli_passes_them():
    given = offline.stack_config("t4-usc1")
    # Not set in the GPU stack's file, set by the CLI from Pulumi.yaml.
    assert "tpu-pretrain:tpuArchitecture" not in _stack_file("t4-usc1")
    assert given[K + "tpuArchitecture"] == "vm"
    assert given[K + "tpuExternalIp"] == "false"  # fmt "%v" of a YAML boolean
    assert given[K + "vpnPort"] == "51820"
    assert given[K + "tpuZone"] == ""
    assert given[K + "vpnAllowedCidrs"] == '["203.0.113.0/24"]'  # a list arrives as JSON
    assert all(isinstance(value, str) for value in given.values())


@pytest.mark.parametrize("stack", stack_names())
def test_every_stack_plans_with_every_project_default(stack):
    """What `pulumi up` gives the program: each declared key is present, and the plan holds.
    A stack that plans only from its file alone (without the defaults) fails here."""
    given = offline.stack_config(stack)
    assert {key.name for key in KEYS} <= {k.removeprefix(K) for k in given}
    assert set(given) > set(_stack_file(stack)) | {"gcp:project"}
    run = run_offline(stack, entry=_run_main)  # infra/__main__.py, as the CLI runs it
    assert run.resources


@pytest.mark.parametrize("stack", gpu_stack_names())
def test_a_gpu_stack_plans_with_the_tpu_defaults_and_refuses_a_tpu_setting(stack):
    # The defaults tpuArchitecture vm, tpuExternalIp false, ... are not "TPU settings".
    vms = [r for r in run_offline(stack).resources if r.type_ == "gcp:compute/instance:Instance"]
    assert "gpu-vm" in {vm.name for vm in vms}
    assert config_error(stack, {K + "tpuExternalIp": True}) == (
        "tpu-pretrain:tpuExternalIp: a TPU setting in a GPU stack (tpu-pretrain:accelerator: "
        "gpu); remove it"
    )


def test_a_tpu_stack_refuses_a_gpu_setting_but_not_the_gpu_defaults():
    assert config_error("v3-euw4", {K + "gpuZone": "us-central1-a"}).startswith(
        "tpu-pretrain:gpuZone: a GPU setting in a TPU stack"
    )
    config = parse_config(
        project="tpu-pretrain-test",
        stack="v3-euw4",
        values={
            key.removeprefix(K): value
            for key, value in offline.stack_config("v3-euw4").items()
            if key.startswith(K)
        },
    )
    assert config.accelerator.kind == "tpu"


def test_the_clis_own_refusals_come_first():
    assert config_error("v3-euw4", {K + "vpnAllowedCidrs": None, K + "job": None}) == (
        "Stack 'v3-euw4' is missing configuration values 'job' and 'vpnAllowedCidrs'"
    )
    assert config_error("v3-euw4", {K + "tpuExternalIp": "maybe"}) == (
        "Stack 'v3-euw4' with configuration key 'tpuExternalIp' must be of type 'boolean'"
    )
    assert config_error("v3-euw4", {K + "vpnPort": "51820x"}) == (
        "Stack 'v3-euw4' with configuration key 'vpnPort' must be of type 'integer'"
    )


def test_cli_config_keeps_the_stack_value_over_the_default():
    stack = {K + "tpuArchitecture": "node", K + "job": "j", K + "vpnAllowedCidrs": ["a"]}
    config = cli_config("s", stack)
    assert config[K + "tpuArchitecture"] == "node"
    assert cli_text(True) == "true" and cli_text(7) == "7" and cli_text(["a", "b"]) == '["a","b"]'
