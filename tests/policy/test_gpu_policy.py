"""The policy pack over the GPU stacks: each passes with zero violations, and a GPU VM with an
external IP, the default compute account, or without vTPM/integrity monitoring is refused by
the intended rule. Secure boot off is accepted on a VM with GPUs only (its NVIDIA kernel
module is not signed for secure boot, infra/catalogs/gpu.yaml), never on another VM."""

from __future__ import annotations

import copy
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from policy_harness import run_pack

from policy import identities, vms
from policy.resources import BUCKET, HOP_MARK, INSTANCE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
from harness import gpu_stack_names, run_stack

GPU_STACKS = gpu_stack_names()
DEFAULT_SA = "123456789012-compute@developer.gserviceaccount.com"


@cache
def _captured(stack: str) -> tuple[tuple[str, str, dict[str, Any], str], ...]:
    return tuple((r.type_, r.name, r.inputs, r.urn) for r in run_stack(stack))


def resources(stack: str) -> list[tuple[str, str, dict[str, Any], str]]:
    return [(t, n, copy.deepcopy(i), u) for t, n, i, u in _captured(stack)]


def _gpu_vm(stack_resources) -> dict[str, Any]:
    (inputs,) = [i for t, n, i, _ in stack_resources if t == INSTANCE and n == "gpu-vm"]
    return inputs


def _violations(stack_resources) -> list[tuple[str, str]]:
    return [(v.policy, v.message) for v in run_pack(stack_resources)]


def test_there_are_gpu_stacks():
    assert len(GPU_STACKS) >= 3


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_gpu_stack_has_zero_violations(stack):
    stack_resources = resources(stack)
    vm = _gpu_vm(stack_resources)
    # The pack sees a VM with GPUs whose secure boot is off: the GPU exception is exercised.
    assert vms.has_gpus(vm)
    assert vm["shieldedInstanceConfig"]["enableSecureBoot"] is False
    assert _violations(stack_resources) == []


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_a_gpu_vm_with_an_external_ip_is_refused(stack):
    stack_resources = resources(stack)
    _gpu_vm(stack_resources)["networkInterfaces"][0]["accessConfigs"] = [{}]
    assert _violations(stack_resources) == [
        (
            "no-external-ip-except-vpn-hop",
            f"{vms.MSG_EXTERNAL_IP}: networkInterfaces[0] has an access config; only the VM "
            f"with {HOP_MARK} may have one",
        )
    ]


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_a_gpu_vm_on_the_default_compute_account_is_refused(stack):
    stack_resources = resources(stack)
    _gpu_vm(stack_resources)["serviceAccount"]["email"] = DEFAULT_SA
    violations = _violations(stack_resources)
    # The default account, and (the allowlist) an account that is not the stack's own.
    assert {policy for policy, _ in violations} == {
        "no-default-compute-service-account",
        "vm-accounts-are-stack-accounts",
    }
    assert ("no-default-compute-service-account", f"{identities.MSG_DEFAULT_SA}: {DEFAULT_SA}") in (
        violations
    )


@pytest.mark.parametrize("key", ["enableVtpm", "enableIntegrityMonitoring"])
def test_a_gpu_vm_keeps_vtpm_and_integrity_monitoring(key):
    stack_resources = resources("t4-usc1")
    _gpu_vm(stack_resources)["shieldedInstanceConfig"][key] = False
    assert _violations(stack_resources) == [
        ("shielded-vm", f"{vms.MSG_SHIELDED}: GPU VM: shieldedInstanceConfig.{key} is not true")
    ]


def test_the_gpu_exception_does_not_cover_a_vm_without_gpus():
    stack_resources = resources("t4-usc1")
    gpu = _gpu_vm(stack_resources)
    gpu.pop("guestAccelerators")  # an n1-standard-8 without GPUs: an ordinary VM
    assert _violations(stack_resources) == [
        (
            "shielded-vm",
            f"{vms.MSG_SHIELDED}: shieldedInstanceConfig.enableSecureBoot is not true",
        )
    ]


@pytest.mark.parametrize(
    ("props", "has_gpus"),
    [
        ({"machineType": "n1-standard-8", "guestAccelerators": [{"count": 1}]}, True),
        ({"machineType": "n1-standard-8", "guestAccelerators": [{"count": 0}]}, False),
        ({"machineType": "n1-standard-8"}, False),
        ({"machineType": "zones/us-central1-a/machineTypes/a2-highgpu-4g"}, True),
        ({"machineType": "g2-standard-24"}, True),
        ({"machineType": "a3-highgpu-8g"}, True),
        ({"machineType": "a4-highgpu-8g"}, True),
        ({"machineType": "e2-standard-4"}, False),
    ],
)
def test_what_counts_as_a_gpu_vm(props, has_gpus):
    assert vms.has_gpus(props) is has_gpus


@pytest.mark.parametrize("stack", GPU_STACKS)
@pytest.mark.parametrize("location", ["US", "EU", "europe-west1", "us-west4"])
def test_a_gpu_stacks_bucket_outside_the_gpu_region_is_refused(stack, location):
    stack_resources = resources(stack)
    region = _gpu_vm(stack_resources)["zone"].rsplit("-", 1)[0]
    (bucket,) = [i for t, _, i, _ in stack_resources if t == BUCKET]
    assert bucket["location"].lower() == region  # the stack as the program writes it
    bucket["location"] = location
    violations = _violations(stack_resources)
    assert [policy for policy, _ in violations] == ["accelerator-and-bucket-same-region"]
    [(_, message)] = violations
    assert message.startswith(f"{vms.MSG_REGION}: GPU VM gpu-vm is in {region} (")
    assert message.endswith(f"is in {location.lower()}")
