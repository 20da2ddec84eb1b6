"""Each GPU stack, planned offline under Pulumi's mocks: the GPU VM's inputs as the engine
would receive them, the shared components beside it, and the stack outputs."""

from __future__ import annotations

import pytest
from gcloud_flags import problems
from harness import (
    gpu_stack_names,
    of_type,
    one,
    run_offline,
    startup_script,
    tpu_stack_names,
)

from infra.components.tpu import CLOUD_PLATFORM
from infra.render import render

INSTANCE = "gcp:compute/instance:Instance"
DLVM = (
    "projects/deeplearning-platform-release/global/images/family/"
    "common-cu128-ubuntu-2204-nvidia-570"
)
UBUNTU = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts"
NVIDIA_REPO = (
    "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/"
    "cuda-keyring_1.1-1_all.deb"
)
# stack: boot image, kernel-module flavour, driver packages the startup script installs
# (infra/catalogs/gpu.yaml images: G2 cannot boot the Deep Learning VM image, so the L4 stack
# boots Ubuntu and installs NVIDIA's open modules; T4 and A100 keep the DLVM's driver).
IMAGES = {
    "t4-usc1": (DLVM, "unknown", ""),
    "l4x2-use1": (UBUNTU, "open", "nvidia-open-570 nvidia-utils-570"),
    "a100x4-usc1": (DLVM, "unknown", ""),
}
# stack: zone, machine type, guest accelerators (N1 only), spot, GPUs, precision
EXPECTED = {
    "t4-usc1": (
        "us-central1-a",
        "n1-standard-8",
        [{"type": "nvidia-tesla-t4", "count": 1}],
        True,
        1,
        "mixed_float16",
    ),
    "l4x2-use1": ("us-east1-d", "g2-standard-24", None, True, 2, "mixed_bfloat16"),
    "a100x4-usc1": ("us-central1-a", "a2-highgpu-4g", None, False, 4, "mixed_bfloat16"),
}
SPOT = {
    "onHostMaintenance": "TERMINATE",
    "provisioningModel": "SPOT",
    "preemptible": True,
    "automaticRestart": False,
    "instanceTerminationAction": "STOP",
}
ON_DEMAND = {
    "onHostMaintenance": "TERMINATE",
    "provisioningModel": "STANDARD",
    "preemptible": False,
    "automaticRestart": True,
}


def test_the_gpu_stacks_are_the_expected_ones():
    assert gpu_stack_names() == sorted(EXPECTED)
    assert not set(EXPECTED) & set(tpu_stack_names())


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def run(request):
    return run_offline(request.param)


def gpu_vm(run):
    (vm,) = [r for r in of_type(run.resources, INSTANCE) if r.name == "gpu-vm"]
    return vm


def test_gpu_vm_inputs(run):
    zone, machine_type, accelerators, spot, _, _ = EXPECTED[run.stack]
    vm = gpu_vm(run)
    inputs = vm.inputs
    assert inputs["name"] == f"tp-{run.stack}-gpu"
    assert inputs["zone"] == zone
    assert inputs["machineType"] == machine_type
    assert inputs.get("guestAccelerators") == accelerators
    assert inputs["scheduling"] == (SPOT if spot else ON_DEMAND)
    assert inputs["bootDisk"]["initializeParams"]["image"] == IMAGES[run.stack][0]
    assert inputs["bootDisk"]["initializeParams"]["size"] >= 100
    # No external IP: no access config on any interface.
    assert [nic.get("accessConfigs") for nic in inputs["networkInterfaces"]] == [None]
    assert inputs["serviceAccount"] == {
        "email": f"tp-{run.stack}-workload@tpu-pretrain-test.iam.gserviceaccount.com",
        "scopes": [CLOUD_PLATFORM],
    }
    # Secure boot off: the image's NVIDIA kernel module is not signed for it (see
    # infra/catalogs/gpu.yaml); vTPM and integrity monitoring stay on.
    assert inputs["shieldedInstanceConfig"] == {
        "enableSecureBoot": False,
        "enableVtpm": True,
        "enableIntegrityMonitoring": True,
    }
    metadata = inputs["metadata"]
    assert metadata["enable-oslogin"] == "TRUE"
    assert metadata["block-project-ssh-keys"] == "TRUE"
    assert metadata["serial-port-enable"] == "FALSE"
    assert inputs["tags"] == ["tpu-pretrain-tpu"]
    assert inputs["labels"]["accelerator"] in ("nvidia-tesla-t4", "nvidia-l4", "nvidia-tesla-a100")
    # The VM boots after payload, job, bucket access and NAT exist.
    deps = set(vm.options.get("dependencies") or [])
    for needed in (
        "payload-job-spec",
        "training-bucket-bucket",
        "workload-identity-sa",
        "network-nat",
    ):
        assert any(urn.endswith(f"::{needed}") for urn in deps), (needed, deps)


def test_gpu_startup_script_is_the_gpu_variant(run):
    _, machine_type, _, _, gpus, precision = EXPECTED[run.stack]
    script = startup_script(run, "gpu-vm")
    assert script.startswith("#!/bin/bash\n# tpu-pretrain gpu startup script")
    assert "readonly VM_REQUIREMENTS=requirements/gpu-vm.txt" in script
    assert f"readonly GPU_COUNT={gpus}" in script
    assert f"readonly GPU_PRECISION={precision}" in script
    assert f"on {machine_type}" in script
    # The GPU main replaces the TPU main; the shared pieces come along.
    assert "templates/gpu.sh" in script
    assert "templates/tpu-main.sh" not in script
    assert "tpu_install_env()" in script


def test_the_driver_install_follows_the_image(run):
    image, modules, packages = IMAGES[run.stack]
    script = startup_script(run, "gpu-vm")
    family = image.rsplit("/", 1)[-1]
    assert f"readonly RUNTIME_VERSION={family}\n" in script
    assert f"readonly DRIVER_MODULES={modules}\n" in script
    if packages:
        assert f"readonly DRIVER_PACKAGES='{packages}'\n" in script
        assert f"readonly DRIVER_REPO={NVIDIA_REPO}\n" in script
    else:
        assert "readonly DRIVER_PACKAGES=''\n" in script
        assert "readonly DRIVER_REPO=''\n" in script
    # install_driver runs before the GPUs are checked.
    assert script.index("\ninstall_driver\n") < script.index("\ncheck_gpus\n")


def test_one_accelerator_and_the_shared_components(run):
    assert not of_type(run.resources, "gcp:tpu/v2Vm:V2Vm")
    names = {r.name for r in of_type(run.resources, INSTANCE)}
    assert names == {"gpu-vm", "controller-vm", "vpn-hop-vm"}
    one(run.resources, "gcp:storage/bucket:Bucket")
    components = {r.type_ for r in run.resources if r.type_.startswith("tpu-pretrain:")}
    assert "tpu-pretrain:index:GpuVm" in components
    assert "tpu-pretrain:index:TpuVm" not in components
    controller = next(r for r in run.resources if r.name == "controller-vm")
    assert controller.inputs["zone"] == EXPECTED[run.stack][0]
    # The controller's wheelhouse is built for the GPU overlay and the image's Python.
    script = startup_script(run, "controller-vm")
    assert "readonly VM_REQUIREMENTS=requirements/gpu-vm.txt" in script
    assert "readonly TPU_PYTHON_VERSION=3.10" in script


def test_the_gpu_vm_is_let_in_only_from_the_hop_and_iap(run):
    """One GPU VM, no peer: no rule lets another accelerator VM (or the controller) in; its
    rules (all inputs: test_infra_resources.py test_firewall) carry the accelerator's tag."""
    rules = {r.name: r.inputs for r in of_type(run.resources, "gcp:compute/firewall:Firewall")}
    assert sorted(rules) == [
        "network-allow-from-hop", "network-allow-ssh", "network-allow-tensorboard",
        "network-allow-wireguard",
    ]  # fmt: skip
    gpu = next(r for r in run.resources if r.name == "gpu-vm")
    (tag,) = gpu.inputs["tags"]
    reaching = sorted(name for name, rule in rules.items() if tag in rule["targetTags"])
    assert reaching == ["network-allow-from-hop", "network-allow-ssh"]
    assert all(rule.get("sourceTags", []) == [] or rule["sourceTags"] == ["tpu-pretrain-vpn-hop"]
               for rule in rules.values())  # fmt: skip


def test_gpu_outputs(run):
    zone, _, _, spot, gpus, _ = EXPECTED[run.stack]
    exports = run.exports
    name = f"tp-{run.stack}-gpu"
    assert exports["gpuName"] == name
    assert exports["gpuZone"] == zone
    assert exports["gpuWorkerIps"] == [exports["gpuInternalIp"]]
    assert not any(key.startswith("tpu") for key in exports)
    ssh = exports["sshCommands"]
    assert ssh["gpu"] == (
        f"gcloud compute ssh {name} --zone {zone} --project tpu-pretrain-test --tunnel-through-iap"
    )
    assert ssh["gpuOverVpn"].endswith("--internal-ip")
    assert exports["rerunStartupCommands"]["gpu"].startswith(ssh["gpu"])
    quota = exports["gpuQuota"]
    region = zone.rsplit("-", 1)[0]
    gpu_metric = {"t4-usc1": "NVIDIA_T4_GPUS", "l4x2-use1": "NVIDIA_L4_GPUS"}.get(
        run.stack, "NVIDIA_A100_GPUS"
    )
    regional = f"PREEMPTIBLE_{gpu_metric}" if spot else gpu_metric
    assert quota["needs"] == (
        f"{gpus} of GPUS_ALL_REGIONS (the project) and {regional} in {region}"
    )
    table = "--flatten quotas --format 'table(quotas.metric,quotas.limit,quotas.usage)'"
    assert quota["check"] == (
        f"gcloud compute regions describe {region} --project tpu-pretrain-test {table}"
    )
    # GPUS_ALL_REGIONS is a project quota: `regions describe` never lists it.
    assert quota["checkProject"] == (
        f"gcloud compute project-info describe --project tpu-pretrain-test {table}"
    )
    assert not problems(quota["checkProject"]) and not problems(quota["check"])
    recovery = exports["gpuRecovery"]
    assert recovery["start"] == (
        f"gcloud compute instances start {name} --zone {zone} --project tpu-pretrain-test"
    )


def test_render_refuses_a_gpu_overlay_with_another_tensorflow(tmp_path, monkeypatch):
    (tmp_path / "requirements").mkdir()
    for name in (render.LOCK_FILE, render.TPU_REQUIREMENTS_FILE):
        (tmp_path / name).write_text((render.REPO_ROOT / name).read_text())
    (tmp_path / render.GPU_REQUIREMENTS_FILE).write_text("tensorflow[and-cuda]==2.19.0\n")
    monkeypatch.setattr(render, "REPO_ROOT", tmp_path)
    host = render.GpuHost(
        "n1-standard-8", "nvidia-tesla-t4", "T4", 1, DLVM, "3.10", "mixed_float16"
    )
    workload = render.Workload("b", "j", "payload/p.tar.gz", "0" * 64, host)
    with pytest.raises(
        ValueError, match=r"tensorflow\[and-cuda\]==2\.19\.0 but .*tensorflow==2\.20\.0"
    ):
        render.render_gpu_script(workload)


def test_an_a4_vm_boots_from_hyperdisk_balanced():
    """A4 takes no Persistent Disk (Google's accelerator-optimized machines page); the GPU VM's
    boot disk type comes from infra/catalogs/gpu.yaml."""
    overrides = {
        "tpu-pretrain:gpuMachineType": "a4-highgpu-8g",
        "tpu-pretrain:gpuZone": "us-central1-b",
        "tpu-pretrain:scheduling": "spot",
    }

    def boot_disk_type(run) -> str:
        (vm,) = [r for r in run.resources if r.name == "gpu-vm"]
        return vm.inputs["bootDisk"]["initializeParams"]["type"]

    assert boot_disk_type(run_offline("a100x4-usc1", overrides)) == "hyperdisk-balanced"
    assert boot_disk_type(run_offline("a100x4-usc1")) == "pd-balanced"


def test_an_a4_vm_boots_ubuntu_and_installs_the_open_modules():
    """B200 runs only the open kernel modules here (NVIDIA; Google's A4 blueprint boots
    ubuntu-2204-lts and installs nvidia-open-570): the image and the install come from the
    catalog, under the same mocks as the shipped stacks."""
    overrides = {
        "tpu-pretrain:gpuMachineType": "a4-highgpu-8g",
        "tpu-pretrain:gpuZone": "us-central1-b",
        "tpu-pretrain:scheduling": "spot",
    }
    run = run_offline("a100x4-usc1", overrides)
    (vm,) = [r for r in run.resources if r.name == "gpu-vm"]
    assert vm.inputs["bootDisk"]["initializeParams"]["image"] == UBUNTU
    script = startup_script(run, "gpu-vm")
    assert "readonly DRIVER_PACKAGES='nvidia-open-570 nvidia-utils-570'\n" in script
    assert "readonly DRIVER_MODULES=open\n" in script


@pytest.mark.parametrize(
    ("machine_type", "nic"),
    [("a3-highgpu-8g", "GVNIC"), ("a4-highgpu-8g", "GVNIC"), ("a2-highgpu-4g", None)],
)
def test_a3_and_a4_vms_get_the_gvnic_interface_their_family_needs(machine_type, nic):
    """A3 and A4 need gVNIC (infra/catalogs/gpu.yaml families `nic`, with its source); the
    other families keep Compute Engine's default interface (no nic_type at all)."""
    overrides = {
        "tpu-pretrain:gpuMachineType": machine_type,
        "tpu-pretrain:gpuZone": "us-central1-b",
        "tpu-pretrain:scheduling": "spot",
    }
    (vm,) = [r for r in run_offline("a100x4-usc1", overrides).resources if r.name == "gpu-vm"]
    (interface,) = vm.inputs["networkInterfaces"]
    assert interface.get("nicType") == nic
