"""The GPU catalog (infra/catalogs/gpu.yaml) and its one check, validate(): every rule with
the message a user sees, and the combinations of Compute Engine's own tables."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from harness import config_error, run_offline

from infra.catalogs.gpu import GPU_CATALOG_PATH, GpuChoiceError, load_gpu_catalog

CATALOG = load_gpu_catalog()
K = "tpu-pretrain:"


def error_of(*args: object, image: str | None = None) -> GpuChoiceError:
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate(*args, image=image)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    return caught.value


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        (
            ("n1-standard-8", "nvidia-tesla-t4", 3, "us-central1-a", "on-demand"),
            "count",
            "3 × T4 is not a valid count: 1, 2 or 4",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-v100", 3, "us-central1-a", "on-demand"),
            "count",
            "3 × V100 is not a valid count: 1, 2, 4 or 8",
        ),
        (
            ("n1-standard-32", "nvidia-tesla-v100", 1, "us-central1-a", "on-demand"),
            "machine_type",
            "n1-standard-32 has more vCPUs than 1 × V100 allows (12)",
        ),
        (
            ("n1-highmem-16", "nvidia-tesla-v100", 1, "us-central1-a", "on-demand"),
            "machine_type",
            "n1-highmem-16 has more vCPUs than 1 × V100 allows (12)",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-t4", 1, "us-central2-b", "on-demand"),
            "zone",
            "us-central2 has no GPUs",
        ),
        (
            ("a4-highgpu-8g", None, None, "europe-west4-b", "on-demand"),
            "provisioning",
            "A4 has no on-demand capacity; use spot (flex-start is not supported here yet)",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-t4", 1, "us-central1-a", "preemptible"),
            "provisioning",
            "'preemptible' is not a GPU provisioning model: use on-demand or spot",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-v100", 1, "us-east1-d", "spot"),
            "zone",
            "us-east1-d does not offer V100; zones with V100: asia-east1-c, europe-west4-a, "
            "europe-west4-b, europe-west4-c, us-central1-a, us-central1-b, us-central1-c, "
            "us-central1-f, us-east1-b, us-east1-c, us-west1-a, us-west1-b",
        ),
        (
            ("a2-highgpu-4g", "nvidia-tesla-t4", None, "us-central1-a", "on-demand"),
            "machine_type",
            "a2-highgpu-4g comes with 4 × A100 40GB and takes no other GPUs (4 × T4 asked); "
            "leave the GPU type and count unset or pick another machine type",
        ),
        (
            ("g2-standard-24", None, 1, "us-east1-d", "spot"),
            "machine_type",
            "g2-standard-24 comes with 2 × L4 and takes no other GPUs (1 × L4 asked); "
            "leave the GPU type and count unset or pick another machine type",
        ),
        (
            ("g2-standard-7", None, None, "us-east1-d", "spot"),
            "machine_type",
            "'g2-standard-7' is not a G2 machine type; use one of: g2-standard-4, g2-standard-8, "
            "g2-standard-12, g2-standard-16, g2-standard-32, g2-standard-24, g2-standard-48, "
            "g2-standard-96",
        ),
        (
            ("n1-standard-8", "nvidia-l4", 1, "us-central1-a", "spot"),
            "gpu",
            "L4 cannot be attached to n1-standard-8; N1 takes T4 (nvidia-tesla-t4), V100 "
            "(nvidia-tesla-v100), P100 (nvidia-tesla-p100), P4 (nvidia-tesla-p4); L4 comes with "
            "its own machine types",
        ),
        (
            ("n1-standard-8", None, None, "us-central1-a", "spot"),
            "gpu",
            "n1-standard-8 needs a GPU type and count: T4 (nvidia-tesla-t4), V100 "
            "(nvidia-tesla-v100), P100 (nvidia-tesla-p100), P4 (nvidia-tesla-p4)",
        ),
        (
            ("e2-standard-8", None, None, "us-central1-a", "spot"),
            "machine_type",
            "'e2-standard-8' has no GPUs: use an N1 type (n1-standard-8, ...) with T4, V100, "
            "P100, P4 or a type of the A2, G2, A3, A4 families",
        ),
        (
            ("n1-standard-12", "nvidia-tesla-t4", 1, "us-central1-a", "spot"),
            "machine_type",
            "'n1-standard-12' is not an N1 machine type: n1-standard-N with N in "
            "1, 2, 4, 8, 16, 32, 64 or 96",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-k80", 1, "us-central1-a", "spot"),
            "gpu",
            "K80 was retired on 2024-05-01; use one of: P4 (nvidia-tesla-p4), P100 "
            "(nvidia-tesla-p100), V100 (nvidia-tesla-v100), T4 (nvidia-tesla-t4), A100 40GB "
            "(nvidia-tesla-a100), A100 80GB (nvidia-a100-80gb), L4 (nvidia-l4), H100 "
            "(nvidia-h100-80gb), B200 (nvidia-b200)",
        ),
        (
            ("n1-standard-8", "nvidia-rtx-9000", 1, "us-central1-a", "spot"),
            "gpu",
            "'nvidia-rtx-9000' is not a GPU type; known: P4 (nvidia-tesla-p4), P100 "
            "(nvidia-tesla-p100), V100 (nvidia-tesla-v100), T4 (nvidia-tesla-t4), A100 40GB "
            "(nvidia-tesla-a100), A100 80GB (nvidia-a100-80gb), L4 (nvidia-l4), H100 "
            "(nvidia-h100-80gb), B200 (nvidia-b200)",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-t4", 1, "us-central1", "spot"),
            "zone",
            "'us-central1' is not a zone name like us-central1-a",
        ),
        (
            ("n1-standard-8", "nvidia-tesla-t4", 1, "mars-north1-a", "spot"),
            "zone",
            "zone 'mars-north1-a' is not in infra/catalogs/gpu.yaml; listed: "
            + ", ".join(sorted(CATALOG.zones)),
        ),
    ],
)
def test_each_rule_names_what_is_allowed(args, field, message):
    error = error_of(*args)
    assert str(error) == message
    assert error.field == field


def test_memory_ceiling_is_its_own_rule():
    """Google's N1 ceilings allow >= 6.5 GB per vCPU, so no real N1 shape breaks the memory
    ceiling alone: the rule is checked against a tightened table."""
    tight = {**CATALOG.n1, "nvidia-tesla-v100": {**CATALOG.n1["nvidia-tesla-v100"], 1: (12, 50)}}
    catalog = dataclasses.replace(CATALOG, n1=tight)
    with pytest.raises(GpuChoiceError) as caught:
        catalog.validate("n1-highmem-8", "nvidia-tesla-v100", 1, "us-central1-a", "spot")
    assert str(caught.value) == "n1-highmem-8 has more memory (52 GB) than 1 × V100 allows (50 GB)"
    assert caught.value.field == "machine_type"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # The N1 tables: the largest shape each count allows, and the smallest.
        (("n1-standard-8", "nvidia-tesla-v100", 1, "us-central1-a", "on-demand"), ("V100", 1)),
        (("n1-highmem-8", "nvidia-tesla-v100", 1, "us-central1-a", "spot"), ("V100", 1)),
        (("n1-standard-96", "nvidia-tesla-v100", 8, "us-central1-a", "on-demand"), ("V100", 8)),
        (("n1-standard-32", "nvidia-tesla-t4", 1, "us-east1-c", "spot"), ("T4", 1)),
        (("n1-highmem-32", "nvidia-tesla-t4", 2, "europe-west4-a", "spot"), ("T4", 2)),
        (("n1-standard-96", "nvidia-tesla-t4", 4, "europe-west4-b", "on-demand"), ("T4", 4)),
        (("n1-standard-16", "nvidia-tesla-p100", 1, "us-central1-c", "on-demand"), ("P100", 1)),
        (("n1-standard-16", "nvidia-tesla-p4", 1, "us-central1-a", "on-demand"), ("P4", 1)),
        # The accelerator-optimized types carry their GPUs.
        (("a2-highgpu-1g", None, None, "us-central1-a", "on-demand"), ("A100 40GB", 1)),
        (("a2-megagpu-16g", None, None, "us-central1-a", "spot"), ("A100 40GB", 16)),
        (("a2-ultragpu-8g", None, None, "europe-west4-a", "on-demand"), ("A100 80GB", 8)),
        (("g2-standard-4", None, None, "us-east1-d", "on-demand"), ("L4", 1)),
        (("g2-standard-48", "nvidia-l4", 4, "europe-west4-c", "spot"), ("L4", 4)),
        (("a3-highgpu-8g", None, None, "us-central1-a", "on-demand"), ("H100", 8)),
        (("a4-highgpu-8g", None, None, "europe-west4-b", "spot"), ("B200", 8)),
    ],
)
def test_valid_combinations_pass(args, expected):
    machine_type, _, _, zone, provisioning = args
    choice = CATALOG.validate(*args)
    assert (choice.gpu.name, choice.count) == expected
    assert choice.attached is machine_type.startswith("n1-")
    assert choice.spot is (provisioning == "spot")
    assert choice.region == zone.rsplit("-", 1)[0]


def test_every_n1_vcpu_ceiling_is_exact():
    """At each GPU count the ceiling's own vCPU count passes when an N1 shape has it, and the
    next N1 shape up is refused with the ceiling in the message."""
    for gpu, counts in CATALOG.n1.items():
        zone = next(z for z, offered in sorted(CATALOG.zones.items()) if gpu in offered)
        name = CATALOG.gpus[gpu].name
        for count, (max_vcpus, _) in counts.items():
            above = (
                min(v for v in (1, 2, 4, 8, 16, 32, 64, 96) if v > max_vcpus)
                if max_vcpus < 96
                else None
            )
            fits = max(v for v in (1, 2, 4, 8, 16, 32, 64, 96) if v <= max_vcpus)
            CATALOG.validate(f"n1-highcpu-{fits}", gpu, count, zone, "spot")
            if above is not None:
                with pytest.raises(GpuChoiceError) as caught:
                    CATALOG.validate(f"n1-highcpu-{above}", gpu, count, zone, "spot")
                assert str(caught.value) == (
                    f"n1-highcpu-{above} has more vCPUs than {count} × {name} allows ({max_vcpus})"
                )


def test_precision_follows_the_gpu_generation():
    """bfloat16 from compute capability 8.0 (Ampere) on, float16 with loss scaling on 7.x
    (Tensor Cores), float32 below."""
    expected = {6: "float32", 7: "mixed_float16"}
    for gpu in CATALOG.gpus.values():
        major = int(gpu.compute_capability.split(".")[0])
        assert gpu.precision == ("mixed_bfloat16" if major >= 8 else expected[major]), gpu


def test_quota_metrics_follow_provisioning():
    on_demand = CATALOG.validate(
        "n1-standard-8", "nvidia-tesla-t4", 2, "us-central1-a", "on-demand"
    )
    spot = CATALOG.validate("g2-standard-24", None, None, "us-east1-d", "spot")
    assert on_demand.quota_metrics == ("GPUS_ALL_REGIONS", "NVIDIA_T4_GPUS")
    assert spot.quota_metrics == ("GPUS_ALL_REGIONS", "PREEMPTIBLE_NVIDIA_L4_GPUS")


DLVM = (
    "projects/deeplearning-platform-release/global/images/family/"
    "common-cu128-ubuntu-2204-nvidia-570"
)
UBUNTU = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts"


def test_catalog_has_sources_a_date_and_its_images():
    assert CATALOG.checked == "2026-11-24"
    assert {name: image.uri for name, image in CATALOG.images.items()} == {
        "dlvm-cu128": DLVM,
        "ubuntu-2204-nvidia-open": UBUNTU,
        "ubuntu-2204-nvidia-proprietary": UBUNTU,
    }
    assert {image.python for image in CATALOG.images.values()} == {"3.10"}
    assert "us-central2" in CATALOG.no_gpu_regions


# Per machine type x GPU generation: the image it boots, the kernel-module flavour and the
# driver packages the startup script installs (none: the image brings its driver).
@pytest.mark.parametrize(
    ("shape", "image", "modules", "packages"),
    [
        (
            ("n1-standard-8", "nvidia-tesla-p4", 1, "us-central1-a"),
            UBUNTU,
            "proprietary",
            ("cuda-drivers-570",),
        ),
        (
            ("n1-standard-8", "nvidia-tesla-p100", 1, "us-central1-c"),
            UBUNTU,
            "proprietary",
            ("cuda-drivers-570",),
        ),
        (
            ("n1-standard-8", "nvidia-tesla-v100", 1, "us-central1-a"),
            UBUNTU,
            "proprietary",
            ("cuda-drivers-570",),
        ),
        (("n1-standard-8", "nvidia-tesla-t4", 1, "us-central1-a"), DLVM, "unknown", ()),
        (("a2-highgpu-4g", None, None, "us-central1-a"), DLVM, "unknown", ()),
        (("a2-ultragpu-1g", None, None, "us-central1-a"), DLVM, "unknown", ()),
        (
            ("g2-standard-24", None, None, "us-east1-d"),
            UBUNTU,
            "open",
            ("nvidia-open-570", "nvidia-utils-570"),
        ),
        (
            ("a3-highgpu-8g", None, None, "us-central1-a"),
            UBUNTU,
            "open",
            ("nvidia-open-570", "nvidia-utils-570"),
        ),
        (
            ("a4-highgpu-8g", None, None, "us-central1-b"),
            UBUNTU,
            "open",
            ("nvidia-open-570", "nvidia-utils-570"),
        ),
    ],
)
def test_the_image_and_driver_come_from_the_catalog(shape, image, modules, packages):
    choice = CATALOG.validate(*shape, "spot")
    assert choice.image.uri == image
    assert choice.image.kernel_modules == modules
    assert choice.image.driver_packages == packages
    assert bool(choice.image.driver_repo) == bool(packages)


# Images and what Google's and NVIDIA's pages say of them (not what the catalog says).
# "G2": "You can't use Deep Learning VM Images as boot disks for instances that use the G2
# machine type" (Google's G2 limitations). "pre-Turing": the open kernel modules "are not
# compatible with" Maxwell, Pascal or Volta (NVIDIA's driver installation guide). "open":
# the open modules are "what you should use" from Turing on and the only ones here for
# Hopper/Blackwell (NVIDIA; Google's A4 blueprint installs nvidia-open-570). "unknown": the
# DLVM image's flavour is not in our sources, so it drives only GPUs that run both.
IMAGE_SHAPES = [
    (("g2-standard-24", None, None, "us-east1-d"), "dlvm-cu128", "image", "G2"),
    (("g2-standard-8", None, None, "us-east1-d"), "ubuntu-2204-nvidia-open", None, "G2"),
    (("g2-standard-8", None, None, "us-east1-d"), "ubuntu-2204-nvidia-proprietary", None, "G2"),
    (
        ("n1-standard-8", "nvidia-tesla-v100", 1, "us-central1-a"),
        "ubuntu-2204-nvidia-open",
        "image",
        "pre-Turing",
    ),
    (
        ("n1-standard-8", "nvidia-tesla-p100", 1, "us-central1-c"),
        "ubuntu-2204-nvidia-open",
        "image",
        "pre-Turing",
    ),
    (("n1-standard-8", "nvidia-tesla-p4", 1, "us-central1-a"), "dlvm-cu128", "image", "unknown"),
    (
        ("n1-standard-8", "nvidia-tesla-t4", 1, "us-central1-a"),
        "ubuntu-2204-nvidia-open",
        None,
        "open",
    ),
    (("n1-standard-8", "nvidia-tesla-t4", 1, "us-central1-a"), "dlvm-cu128", None, "unknown"),
    (
        ("a3-highgpu-8g", None, None, "us-central1-a"),
        "ubuntu-2204-nvidia-proprietary",
        "image",
        "open",
    ),
    (("a3-highgpu-8g", None, None, "us-central1-a"), "dlvm-cu128", "image", "unknown"),
    (
        ("a4-highgpu-8g", None, None, "us-central1-b"),
        "ubuntu-2204-nvidia-proprietary",
        "image",
        "open",
    ),
    (("a4-highgpu-8g", None, None, "us-central1-b"), "ubuntu-2204-nvidia-open", None, "open"),
    (("a2-highgpu-1g", None, None, "us-central1-a"), "no-such-image", "image", "-"),
]


@pytest.mark.parametrize(
    ("shape", "image", "refused", "statement"),
    IMAGE_SHAPES,
    ids=[f"{s[0][1] or s[0][0]}-{s[1]}" for s in IMAGE_SHAPES],
)
def test_an_image_the_gpu_cannot_use_is_refused(shape, image, refused, statement):
    if refused is None:
        assert CATALOG.validate(*shape, "spot", image=image).image.name == image, statement
        return
    error = error_of(*shape, "spot", image=image)
    assert error.field == refused, statement


def test_image_refusals_name_what_the_shape_boots():
    assert str(
        error_of("g2-standard-24", None, None, "us-east1-d", "spot", image="dlvm-cu128")
    ) == (
        "G2 cannot boot Deep Learning VM images (dlvm-cu128); use ubuntu-2204-nvidia-open, "
        "ubuntu-2204-nvidia-proprietary"
    )
    assert str(
        error_of(
            "n1-standard-8",
            "nvidia-tesla-v100",
            1,
            "us-central1-a",
            "spot",
            image="ubuntu-2204-nvidia-open",
        )
    ) == (
        "ubuntu-2204-nvidia-open has the open kernel modules and V100 runs only the "
        "proprietary NVIDIA kernel modules; use ubuntu-2204-nvidia-proprietary"
    )
    assert str(
        error_of("a4-highgpu-8g", None, None, "us-central1-b", "spot", image="dlvm-cu128")
    ) == (
        "dlvm-cu128 has kernel modules of an unknown flavour and B200 runs only the open "
        "NVIDIA kernel modules; use ubuntu-2204-nvidia-open"
    )


def test_the_catalog_refuses_a_gpu_image_it_cannot_drive(tmp_path):
    raw = yaml.safe_load(GPU_CATALOG_PATH.read_text())
    raw["gpus"]["nvidia-tesla-v100"]["image"] = "ubuntu-2204-nvidia-open"
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="nvidia-tesla-v100: image 'ubuntu-2204-nvidia-open'"):
        load_gpu_catalog(path)
    raw["gpus"]["nvidia-tesla-v100"]["image"] = "ubuntu-2204-nvidia-proprietary"
    raw["gpus"]["nvidia-l4"]["image"] = "dlvm-cu128"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"g2: .*nvidia-l4.* boot a Deep Learning VM image"):
        load_gpu_catalog(path)


# The config names the key each catalog message is about (run through the real program).
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {K + "gpuCount": 3},
            "tpu-pretrain:gpuCount: 3 × T4 is not a valid count: 1, 2 or 4",
        ),
        (
            {K + "gpuMachineType": "n1-standard-64"},
            "tpu-pretrain:gpuMachineType: n1-standard-64 has more vCPUs than 1 × T4 allows (48)",
        ),
        (
            {K + "gpuZone": "us-central2-b"},
            "tpu-pretrain:gpuZone: us-central2 has no GPUs",
        ),
        (
            {K + "scheduling": "preemptible"},
            "tpu-pretrain:scheduling: 'preemptible' is not a GPU provisioning model: use "
            "on-demand or spot",
        ),
        (
            {K + "gpuType": "nvidia-tesla-k80"},
            "tpu-pretrain:gpuType: K80 was retired on 2024-05-01; use one of: P4 "
            "(nvidia-tesla-p4), P100 (nvidia-tesla-p100), V100 (nvidia-tesla-v100), T4 "
            "(nvidia-tesla-t4), A100 40GB (nvidia-tesla-a100), A100 80GB (nvidia-a100-80gb), "
            "L4 (nvidia-l4), H100 (nvidia-h100-80gb), B200 (nvidia-b200)",
        ),
        (
            {K + "tpuZone": "europe-west4-a"},
            "tpu-pretrain:tpuZone: a TPU setting in a GPU stack (tpu-pretrain:accelerator: "
            "gpu); remove it",
        ),
        (
            {K + "gpuZone": None},
            "tpu-pretrain:gpuZone is required: GPU stacks: zone of the GPU VM, e.g. "
            "us-central1-a (see infra/catalogs/gpu.yaml).",
        ),
        (
            {K + "accelerator": "fpga"},
            "tpu-pretrain:accelerator: 'fpga' is not allowed; use one of: tpu, gpu",
        ),
    ],
)
def test_gpu_stack_config_errors_name_the_key(overrides, message):
    assert config_error("t4-usc1", overrides) == message


def test_the_stacks_image_setting_is_checked_against_the_gpu():
    assert config_error("l4x2-use1", {K + "gpuImage": "dlvm-cu128"}) == (
        "tpu-pretrain:gpuImage: G2 cannot boot Deep Learning VM images (dlvm-cu128); use "
        "ubuntu-2204-nvidia-open, ubuntu-2204-nvidia-proprietary"
    )
    run = run_offline("t4-usc1", {K + "gpuImage": "ubuntu-2204-nvidia-open"})
    (vm,) = [r for r in run.resources if r.name == "gpu-vm"]
    assert vm.inputs["bootDisk"]["initializeParams"]["image"] == UBUNTU


def test_a_tpu_stack_refuses_gpu_settings():
    assert config_error("v3-euw4", {K + "gpuCount": 2}) == (
        "tpu-pretrain:gpuCount: a GPU setting in a TPU stack (tpu-pretrain:accelerator: tpu); "
        "remove it"
    )


def test_multi_gpu_batch_must_split_over_the_gpus(tmp_path):
    job = tmp_path / "odd-batch.yaml"
    job.write_text(
        "name: odd-batch\ncorpus: {paths: [x/]}\ntokenizer: {kind: bpe, vocab_size: 1000}\n"
        "data: {objective: clm, seq_length: 64}\nmodel: {family: gpt2, size: small}\n"
        "train: {steps: 10, global_batch_size: 6}\n"
    )
    assert config_error("a100x4-usc1", {K + "job": str(job)}) == (
        f"tpu-pretrain:job: {str(job)!r}: train.global_batch_size 6 must be a multiple of the "
        "4 replicas of 4 × A100 40GB (one replica per GPU); e.g. 4 or 8"
    )


@pytest.mark.parametrize(
    ("machine_type", "gpu", "count", "zone", "offered"),
    [
        ("n1-standard-8", "nvidia-tesla-v100", 1, "us-east1-b", True),
        ("n1-standard-8", "nvidia-tesla-p100", 1, "europe-west4-b", False),
        ("n1-standard-8", "nvidia-tesla-p4", 1, "europe-west4-b", True),
        ("g2-standard-8", None, None, "us-central1-f", False),
        ("g2-standard-8", None, None, "us-west1-c", True),
        ("g2-standard-8", None, None, "asia-east1-b", True),
        ("a2-highgpu-1g", None, None, "asia-east1-c", False),
        ("a2-ultragpu-1g", None, None, "us-central1-a", True),
        ("a3-highgpu-8g", None, None, "europe-west4-a", False),
        ("a3-highgpu-8g", None, None, "europe-west4-c", True),
        ("a4-highgpu-8g", None, None, "us-east1-b", True),
    ],
)
def test_zone_facts_from_the_source(machine_type, gpu, count, zone, offered):
    """Zones as SkyPilot's GCP catalog lists them (skypilot-org/skypilot-catalog
    catalogs/v8/gcp/vms.csv at 006059e0f18acb1341e22a27751e9f80df6ba92f, generated from the
    Compute Engine API): V100 in us-east1-b, P4 but no P100 in europe-west4-b, L4 in
    us-west1-c and asia-east1-b but not us-central1-f, no A100 in asia-east1-c, A100 80GB in
    us-central1-a, H100 in europe-west4-c but not -a, B200 (spot) in us-east1-b."""
    provisioning = "spot" if machine_type.startswith("a4") else "on-demand"
    if offered:
        CATALOG.validate(machine_type, gpu, count, zone, provisioning)
    else:
        error = error_of(machine_type, gpu, count, zone, provisioning)
        assert error.field == "zone" and f"{zone} does not offer" in str(error)


# Shapes and what Google's pages say of them, not what the catalog says: each row names its
# statement. (machine type, GPU, count, zone, provisioning) -> None (valid) or the field refused.
# "A3": "For a3-highgpu-1g, a3-highgpu-2g, and a3-highgpu-4g machine types, you must create
# instances by using Spot VMs or Flex-start VMs"; "A4": spot, reservations or flex-start only;
# "N1": n1-highmem and n1-highcpu start at 2 vCPUs, n1-standard at 1 (Compute Engine's
# accelerator-optimized and general-purpose machine family pages, as issue 28 quotes them).
GOOGLE_SHAPES = [
    (("a3-highgpu-1g", None, None, "us-central1-a", "on-demand"), "provisioning", "A3"),
    (("a3-highgpu-2g", None, None, "us-central1-a", "on-demand"), "provisioning", "A3"),
    (("a3-highgpu-4g", None, None, "us-central1-a", "on-demand"), "provisioning", "A3"),
    (("a3-highgpu-1g", None, None, "us-central1-a", "spot"), None, "A3"),
    (("a3-highgpu-8g", None, None, "us-central1-a", "on-demand"), None, "A3"),
    (("a4-highgpu-8g", None, None, "us-central1-b", "on-demand"), "provisioning", "A4"),
    (("a4-highgpu-8g", None, None, "us-central1-b", "spot"), None, "A4"),
    (("n1-highmem-1", "nvidia-tesla-t4", 1, "us-central1-a", "spot"), "machine_type", "N1"),
    (("n1-highcpu-1", "nvidia-tesla-t4", 1, "us-central1-a", "spot"), "machine_type", "N1"),
    (("n1-standard-1", "nvidia-tesla-t4", 1, "us-central1-a", "spot"), None, "N1"),
    (("n1-highmem-2", "nvidia-tesla-t4", 1, "us-central1-a", "spot"), None, "N1"),
    (("n1-highcpu-2", "nvidia-tesla-t4", 1, "us-central1-a", "spot"), None, "N1"),
]


@pytest.mark.parametrize(
    ("shape", "refused", "statement"),
    GOOGLE_SHAPES,
    ids=[f"{s[0][0]}-{s[0][4]}" for s in GOOGLE_SHAPES],
)
def test_the_validator_agrees_with_googles_pages(shape, refused, statement):
    if refused is None:
        assert CATALOG.validate(*shape).machine_type == shape[0], statement
        return
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate(*shape)
    assert caught.value.field == refused, statement


def test_a3_high_small_types_name_spot_and_flex_start():
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate("a3-highgpu-2g", None, None, "us-central1-a", "on-demand")
    assert str(caught.value) == (
        "a3-highgpu-2g has no on-demand capacity; use spot (flex-start is not supported here yet)"
    )
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate("n1-highmem-1", "nvidia-tesla-t4", 1, "us-central1-a", "spot")
    assert str(caught.value) == (
        "'n1-highmem-1' is not an N1 machine type: n1-highmem-N with N in 2, 4, 8, 16, 32, 64 or 96"
    )


@pytest.mark.parametrize(
    ("machine_type", "zone", "disk"),
    [
        # "Hyperdisk Balanced (hyperdisk-balanced): this is the only disk type that is
        # supported for the boot disk" (A4, Google's accelerator-optimized machines page).
        ("a4-highgpu-8g", "us-central1-b", "hyperdisk-balanced"),
        ("a3-highgpu-8g", "us-central1-a", "pd-balanced"),
        ("g2-standard-8", "us-central1-a", "pd-balanced"),
    ],
)
def test_the_boot_disk_comes_from_the_catalog(machine_type, zone, disk):
    assert CATALOG.validate(machine_type, None, None, zone, "spot").boot_disk == disk


# Shapes from SkyPilot's data (not the catalog's own lists): its GCP catalog vms.csv at
# 006059e0 lists a2-megagpu-16g in fewer zones than A100 40GB, and its gcp_catalog.py
# (005261080a) lowers 4 × P100 to 64 vCPUs / 208 GB in us-east1-c.
SKYPILOT_SHAPES = [
    (("a2-megagpu-16g", None, None, "us-east1-b", "spot"), "zone"),
    (("a2-megagpu-16g", None, None, "us-west1-b", "spot"), "zone"),
    (("a2-megagpu-16g", None, None, "us-central1-f", "spot"), None),
    (("a2-highgpu-8g", None, None, "us-east1-b", "spot"), None),
    (("n1-standard-96", "nvidia-tesla-p100", 4, "us-east1-c", "spot"), "machine_type"),
    (("n1-standard-64", "nvidia-tesla-p100", 4, "us-east1-c", "spot"), "machine_type"),
    (("n1-highmem-64", "nvidia-tesla-p100", 4, "us-east1-c", "spot"), "machine_type"),
    (("n1-standard-32", "nvidia-tesla-p100", 4, "us-east1-c", "spot"), None),
    (("n1-highcpu-64", "nvidia-tesla-p100", 4, "us-east1-c", "spot"), None),
    (("n1-standard-96", "nvidia-tesla-p100", 4, "us-central1-c", "spot"), None),
]


@pytest.mark.parametrize(
    ("shape", "refused"), SKYPILOT_SHAPES, ids=[f"{s[0][0]}-{s[0][3]}" for s in SKYPILOT_SHAPES]
)
def test_machine_type_zones_and_zone_ceilings(shape, refused):
    if refused is None:
        assert CATALOG.validate(*shape).machine_type == shape[0]
        return
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate(*shape)
    assert caught.value.field == refused


def test_a_machine_type_zone_refusal_names_where_it_is_offered():
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate("a2-megagpu-16g", None, None, "us-east1-b", "spot")
    assert str(caught.value) == (
        "us-east1-b offers A100 40GB but not the machine type a2-megagpu-16g; zones with "
        "a2-megagpu-16g: europe-west4-a, europe-west4-b, us-central1-a, us-central1-b, "
        "us-central1-c, us-central1-f"
    )
    with pytest.raises(GpuChoiceError) as caught:
        CATALOG.validate("n1-standard-96", "nvidia-tesla-p100", 4, "us-east1-c", "spot")
    assert str(caught.value) == (
        "n1-standard-96 has more vCPUs than 4 × P100 allows in us-east1-c (64)"
    )


def test_machine_zones_must_lie_within_the_gpus_zones(tmp_path):
    raw = yaml.safe_load(GPU_CATALOG_PATH.read_text())
    raw["machine_zones"]["a2-megagpu-16g"].append("us-east1-d")  # no A100 there
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"a2-megagpu-16g: \['us-east1-d'\] do not offer"):
        load_gpu_catalog(path)


def test_the_catalog_records_the_nic_each_family_needs_with_its_source(tmp_path):
    catalog = load_gpu_catalog()
    assert {name: f.nic_type for name, f in catalog.families.items()} == {
        "a2": "", "g2": "", "a3": "GVNIC", "a4": "GVNIC",
    }  # fmt: skip
    assert catalog.validate("a3-highgpu-8g", None, None, "us-central1-b", "spot").nic_type == (
        "GVNIC"
    )
    text = GPU_CATALOG_PATH.read_text()
    for broken, message in (
        (text.replace("    nic: GVNIC\n", "    nic: gvnic\n", 1), "nic 'gvnic' is not one of"),
        (text.replace("    nic_source: >-\n", "    nic_source_: >-\n", 1), "has no nic_source"),
    ):
        path = tmp_path / "gpu.yaml"
        path.write_text(broken)
        with pytest.raises(ValueError, match=message):
            load_gpu_catalog(path)
