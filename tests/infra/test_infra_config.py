"""Stack configuration: every rule fails with its exact one-line message."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml
from harness import GITOPS, config_error, one, run_stack, stack_names, tpu_stack_names

from infra import wgkeys
from infra.catalogs.tpu import load_catalog
from infra.config.config import parse_config
from infra.config.keys import KEYS

ROOT = Path(__file__).resolve().parents[2]
K = "tpu-pretrain:"
ZONES = (
    "asia-east1-c, europe-west4-a, europe-west4-b, us-central1-a, us-central1-b, "
    "us-central1-c, us-central1-f, us-central2-b, us-east1-d, us-east5-a, us-east5-b, "
    "us-south1-a, us-west1-c, us-west4-a"
)
CLASSIC = "v2-alpha-tpuv5, tpu-ubuntu2204-base"  # usable images for v2/v3/v4

CASES = [
    (
        "v3-euw4",
        {K + "tpuZone": "mars-north1-a"},
        "tpu-pretrain:tpuZone: unknown zone 'mars-north1-a'; infra/catalogs/tpu.yaml lists: "
        f"{ZONES}",
    ),
    (
        "v3-euw4",
        {K + "tpuZone": "europe-west4"},
        "tpu-pretrain:tpuZone: 'europe-west4' is not a zone name like europe-west4-a",
    ),
    (
        "v3-euw4",
        {K + "acceleratorType": "v4-8"},
        "tpu-pretrain:acceleratorType: 'v4-8' is not offered in europe-west4-a; offered there: "
        "v2-8, v3-8, v6e-1, v6e-4, v6e-8",
    ),
    (
        "v3-euw4",
        {K + "runtimeVersion": "tpu-vm-tf-2.16.1-pjrt"},
        "tpu-pretrain:runtimeVersion: 'tpu-vm-tf-2.16.1-pjrt' is a TensorFlow image; TensorFlow "
        "comes from pip (tensorflow-tpu in the payload's venv), so boot the base image for TPU "
        f"v3: {CLASSIC} (recommended: v2-alpha-tpuv5)",
    ),
    (
        "v6e-euw4",
        {K + "runtimeVersion": "v2-alpha-tpuv5"},
        "tpu-pretrain:runtimeVersion: 'v2-alpha-tpuv5' is not a base image for TPU v6e (v6e-8); "
        "use one of: v2-alpha-tpuv6e",
    ),
    (
        "v5e-euw4",
        {K + "runtimeVersion": "tpu-ubuntu2204-base"},
        "tpu-pretrain:runtimeVersion: 'tpu-ubuntu2204-base' is not a base image for TPU v5e "
        "(v5litepod-8); use one of: v2-alpha-tpuv5-lite",
    ),
    (
        # A slice boots the image its evidence boots (catalogs/tpu.yaml slices `image:`), though
        # the generation boots others on a single host.
        "v4-32-usc2",
        {K + "runtimeVersion": "v2-alpha-tpuv5"},
        "tpu-pretrain:runtimeVersion: 'v2-alpha-tpuv5' is not the image the v4-32 slice's "
        "evidence boots; use tpu-ubuntu2204-base (infra/catalogs/tpu.yaml slices, "
        "docs/pod-slices.md)",
    ),
    (
        "v4-usc2",
        {K + "runtimeVersion": "tpu-vm-base"},
        "tpu-pretrain:runtimeVersion: 'tpu-vm-base' ships Python 3.8; the payload needs "
        f"Python >= 3.10; use one of: {CLASSIC}",
    ),
    (
        "v3-euw4",
        {K + "tpuArchitecture": "node"},
        "tpu-pretrain:tpuArchitecture: 'node' asks for a TPU Node, which Google no longer "
        "provisions (new TPU Nodes are refused since 2025-04-15); set "
        "tpu-pretrain:tpuArchitecture to 'vm' (TPU VM, gcp.tpu.V2Vm)",
    ),
    (
        "v3-euw4",
        {K + "runtimeVersion": "2.12.0"},
        "tpu-pretrain:runtimeVersion: '2.12.0' is a TPU Node TensorFlow version; new TPU Nodes "
        f"are refused since 2025-04-15; use a TPU VM base image for TPU v3: {CLASSIC}",
    ),
    (
        "v3-euw4",
        {K + "bucketLocation": "US"},
        "tpu-pretrain:bucketLocation: 'US' is outside the TPU region europe-west4; "
        "set it to europe-west4 (or leave it unset)",
    ),
    (
        "v3-euw4",
        {K + "bucketName": "my-training-data"},
        "tpu-pretrain:bucketName: 'my-training-data' must end with '-tpu-pretrain': the deploy "
        "account may change only buckets named so (docs/guard-rails.md)",
    ),
    (
        "v2-usc1",
        {K + "bucketLocation": "us-east1"},
        "tpu-pretrain:bucketLocation: 'US-EAST1' is outside the TPU region us-central1; "
        "set it to us-central1 (or leave it unset)",
    ),
    (
        "v3-euw4",
        {K + "vpnZone": "europe-west4-b"},
        "tpu-pretrain:vpnZone: 'europe-west4-b' is in the TPU's own region europe-west4; the hop "
        "belongs in a region near you, outside it (the policy pack's "
        "one-vpn-hop-outside-tpu-region; unset, a stack here gets europe-west1-b)",
    ),
    (
        "v3-euw4",
        {K + "vpnAllowedCidrs": ["203.0.113.0/24", "10.0.0.0/33"]},
        "tpu-pretrain:vpnAllowedCidrs[1]: '10.0.0.0/33' is not an IPv4 CIDR like 203.0.113.0/24",
    ),
    (
        "v3-euw4",
        {K + "vpnAllowedCidrs": ["203.0.113.7"]},
        "tpu-pretrain:vpnAllowedCidrs[0]: '203.0.113.7' is not an IPv4 CIDR like 203.0.113.0/24",
    ),
    (
        "v3-euw4",
        {K + "vpnAllowedCidrs": ["203.0.113.1/24"]},
        "tpu-pretrain:vpnAllowedCidrs[0]: '203.0.113.1/24' is not an IPv4 CIDR like 203.0.113.0/24",
    ),
    (
        "v3-euw4",
        {K + "tpuSubnetCidr": "10.10.0.0/200"},
        "tpu-pretrain:tpuSubnetCidr: '10.10.0.0/200' is not an IPv4 CIDR like 203.0.113.0/24",
    ),
    (
        "v3-euw4",
        {K + "vpnClientCidr": "10.10.4.0/24"},
        "tpu-pretrain:vpnClientCidr: 10.10.4.0/24 overlaps tpu-pretrain:tpuSubnetCidr "
        "10.10.0.0/20; use disjoint ranges",
    ),
    (
        "v3-euw4",
        {K + "vpnAllowedCidrs": None},
        # The Pulumi CLI's own refusal (no default in Pulumi.yaml), before the program runs.
        "Stack 'v3-euw4' is missing configuration value 'vpnAllowedCidrs'",
    ),
    (
        "v3-euw4",
        {"gcp:project": None},
        "gcp:project is required: run `pulumi config set gcp:project <your-project-id>`",
    ),
    (
        "v3-euw4",
        {K + "scheduling": "cheap"},
        "tpu-pretrain:scheduling: 'cheap' is not allowed; use one of: on-demand, preemptible, spot",
    ),
    (
        "v6e-euw4",
        {K + "tpuAutoRecover": "sometimes"},
        "tpu-pretrain:tpuAutoRecover: 'sometimes' must be true or false",
    ),
    (
        "v3-euw4",
        {K + "tpuZones": "europe-west4-a"},
        "tpu-pretrain:tpuZones: unknown setting; known: " + ", ".join(sorted(k.name for k in KEYS)),
    ),
    (
        "v3-euw4",
        {K + "vpnClientPublicKey": "not-a-key"},
        "tpu-pretrain:vpnClientPublicKey: 'not-a-key' is not a WireGuard public key "
        "(44 base64 characters, the output of `wg pubkey`)",
    ),
    (
        # A GitOps stack keeps no private key in its state: it brings its client's key.
        "t4-usc1",
        {K + "accountsFromBootstrap": True},
        "tpu-pretrain:vpnClientPublicKey is required with tpu-pretrain:accountsFromBootstrap: "
        "a GitOps stack keeps no private key in its state; set it to your own WireGuard public "
        "key (`wg genkey | tee client.key | wg pubkey`; keep client.key)",
    ),
    (
        "v3-euw4",
        {K + "accountsFromBootstrap": "true", K + "vpnClientPublicKey": ""},
        "tpu-pretrain:vpnClientPublicKey is required with tpu-pretrain:accountsFromBootstrap: "
        "a GitOps stack keeps no private key in its state; set it to your own WireGuard public "
        "key (`wg genkey | tee client.key | wg pubkey`; keep client.key)",
    ),
    (
        "v3-euw4",
        {K + "bucketSoftDeleteDays": 3},
        "tpu-pretrain:bucketSoftDeleteDays: '3' must be an integer from 7 to 90",
    ),
    (
        "v6e-euw4",
        {K + "capacityWaitMinutes": 0},
        "tpu-pretrain:capacityWaitMinutes: '0' must be an integer from 1 to 10080",
    ),
    (
        "v3-euw4",
        {K + "job": "stacks/jobs/missing.yaml"},
        "tpu-pretrain:job: 'stacks/jobs/missing.yaml': cannot read job template: "
        "No such file or directory",
    ),
]


@pytest.mark.parametrize(("stack", "overrides", "message"), CASES, ids=[c[2][:40] for c in CASES])
def test_config_errors_are_one_exact_line(stack, overrides, message):
    assert config_error(stack, overrides) == message


def test_job_template_must_not_set_output(tmp_path):
    template = tmp_path / "job.yaml"
    template.write_text("name: x1\noutput: gs://elsewhere\ncorpus: {paths: [a]}\n")
    message = config_error("v3-euw4", {K + "job": str(template)})
    assert message.endswith("output: set by infra (gs://<bucket>/runs/<name>); remove it")


def test_valid_variations_render():
    vm = one(
        run_stack("v6e-euw4", {K + "scheduling": "preemptible", K + "vpnZone": "us-west1-b"}),
        "gcp:tpu/v2Vm:V2Vm",
    )
    assert vm.inputs["schedulingConfig"] == {"preemptible": True, "spot": False}
    # A GitOps stack with its client's key, and a stack a person deploys without one.
    own = GITOPS[K + "vpnClientPublicKey"]
    gitops = run_stack("v3-euw4", GITOPS)
    [hop] = [r for r in gitops if r.name == "vpn-hop-vm"]
    assert f"readonly WG_CLIENT_PUBLIC_KEY={own}\n" in hop.inputs["metadata"]["startup-script"]
    seeds = "random:index/randomBytes:RandomBytes"
    assert not [r for r in gitops if r.type_ == seeds]
    by_a_person = run_stack("v3-euw4", {K + "accountsFromBootstrap": False})
    assert [r.name for r in by_a_person if r.type_ == seeds] == ["vpn-hop-client-key"]


def test_pulumi_yaml_declares_every_key_with_type_and_description():
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    assert project["name"] == "tpu-pretrain"
    assert project["main"] == "infra/"
    assert project["stackConfigDir"] == "stacks"
    assert project["runtime"]["name"] == "python"
    declared = project["config"]
    assert set(declared) == {key.name for key in KEYS}
    for key in KEYS:
        assert declared[key.name]["type"] == key.type
        assert declared[key.name]["description"] == key.description
        assert declared[key.name].get("default") == key.default


def test_stack_files_use_only_declared_keys():
    declared = {f"tpu-pretrain:{key.name}" for key in KEYS}
    for stack in stack_names():
        config = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
        assert set(config) <= declared, stack
        assert "gcp:project" not in config  # each user sets their own


def test_catalog_is_consistent():
    catalog = load_catalog()
    for zone, types in catalog.zones.items():
        assert types, zone
        for accelerator_type in types:
            generation = catalog.generation_of(accelerator_type)
            # Base images only: TensorFlow comes from pip, never from a tpu-vm-tf-* image.
            assert not [i for i in generation.images if i.startswith("tpu-vm-tf-")]
            # The recommended (first) image runs the payload's Python.
            assert catalog.images[generation.images[0]].python_ok


def test_catalog_images_follow_googles_tf_ci_and_docs():
    """GoogleCloudPlatform/ml-auto-solutions (TF release/nightly DAGs) and
    cloud.google.com/tpu/docs/runtimes, as recorded in catalogs/tpu.yaml."""
    catalog = load_catalog()
    first = {name: generation.images[0] for name, generation in catalog.generations.items()}
    assert first == {
        "v2": "v2-alpha-tpuv5",
        "v3": "v2-alpha-tpuv5",
        "v4": "v2-alpha-tpuv5",
        "v5e": "v2-alpha-tpuv5-lite",
        "v5p": "v2-alpha-tpuv5",
        "v6e": "v2-alpha-tpuv6e",
    }
    covered = {name for name, image in first.items() if catalog.images[image].tf_ci}
    assert covered == {"v2", "v3", "v4", "v5e", "v5p"}  # Google's TF CI has no v6e
    assert not catalog.images["tpu-vm-base"].python_ok  # Ubuntu 20.04, Python 3.8


def test_catalog_refuses_an_unusable_recommended_image(tmp_path):
    text = (ROOT / "infra/catalogs/tpu.yaml").read_text()
    bad = tmp_path / "tpu.yaml"
    bad.write_text(text.replace("images: [v2-alpha-tpuv5-lite]", "images: [tpu-vm-base]"))
    with pytest.raises(ValueError, match="generation v5e needs a usable first image"):
        load_catalog(bad)


def test_every_stack_boots_a_base_image_and_the_current_generation_is_in_googles_tf_ci():
    catalog = load_catalog()
    for stack in tpu_stack_names():
        config = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
        image = config["tpu-pretrain:runtimeVersion"]
        accelerator_type = config["tpu-pretrain:acceleratorType"]
        generation = catalog.generation_of(accelerator_type)
        # A slice boots the image its evidence boots (catalogs/tpu.yaml slices), others the first.
        shape = catalog.slice_of(accelerator_type)
        assert image == ((shape and shape.image) or generation.images[0]), stack
    assert catalog.slice_of("v4-32").image == "tpu-ubuntu2204-base"
    current = yaml.safe_load((ROOT / "stacks/Pulumi.v5e-euw4.yaml").read_text())["config"]
    assert catalog.images[current["tpu-pretrain:runtimeVersion"]].tf_ci


def test_wireguard_keys_match_rfc7748():
    # RFC 7748 section 6.1: Alice's private scalar and public key.
    private = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    public = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    clamped = wgkeys.private_key(base64.b64encode(private).decode())
    assert base64.b64decode(clamped) == wgkeys.clamp(private)
    assert wgkeys.public_key(clamped) == base64.b64encode(public).decode()
    raw = base64.b64decode(wgkeys.private_key(base64.b64encode(b"\xff" * 32).decode()))
    assert raw[0] & 7 == 0 and raw[31] & 0x80 == 0 and raw[31] & 0x40


@pytest.mark.parametrize(
    ("scheduling", "expected"), [("on-demand", False), ("preemptible", True), ("spot", True)]
)
def test_tpu_auto_recover_defaults_to_the_scheduling(scheduling, expected):
    values = yaml.safe_load((ROOT / "stacks" / "Pulumi.v3-euw4.yaml").read_text())["config"]
    values = {key.removeprefix(K): value for key, value in values.items()}
    cfg = parse_config(
        project="tpu-pretrain-test", stack="v3-euw4", values=values | {"scheduling": scheduling}
    )
    assert cfg.tpu.auto_recover is expected
    explicit = parse_config(
        project="tpu-pretrain-test",
        stack="v3-euw4",
        values=values | {"scheduling": scheduling, "tpuAutoRecover": str(not expected).lower()},
    )
    assert explicit.tpu.auto_recover is (not expected)


def test_release_when_done_needs_the_watchdog():
    assert config_error("v3-euw4", {K + "tpuReleaseWhenDone": True}) == (
        "tpu-pretrain:tpuReleaseWhenDone: true needs tpu-pretrain:tpuAutoRecover: true (the "
        "controller's watchdog releases the TPU VM); turn both on or leave it false"
    )
    # A boolean key: the Pulumi CLI itself refuses another value before the program runs.
    assert config_error("v6e-euw4", {K + "tpuReleaseWhenDone": "maybe"}) == (
        "Stack 'v6e-euw4' with configuration key 'tpuReleaseWhenDone' must be of type 'boolean'"
    )


SUPPORTED_SLICES = {
    "v4-16": (2, 4, 8),
    "v4-32": (4, 4, 16),
    "v5litepod-16": (4, 4, 16),
    "v5litepod-32": (8, 4, 32),
    "v5p-32": (4, 4, 16),
}


def test_the_catalog_lists_only_slices_with_evidence_of_jax_on_them():
    """Hosts x chips per host: google/xpk system_characteristics; each slice names the Google
    doc or CI job that runs JAX on exactly that type (catalogs/tpu.yaml, docs/pod-slices.md)."""
    catalog = load_catalog()
    shapes = {
        name: (shape.hosts, shape.chips_per_host, shape.replicas)
        for name, shape in catalog.slices.items()
    }
    assert shapes == SUPPORTED_SLICES
    for name, shape in catalog.slices.items():
        assert shape.source.startswith(("ran: ", "documented: ")), name
        assert catalog.generation_of(name).name in ("v4", "v5e", "v5p")
        assert [zone for zone, types in catalog.zones.items() if name in types], name
    assert catalog.slice_of("v4-8") is None
    assert "v4-32" in catalog.zones["us-central2-b"]
    assert catalog.generation_of("v4-32").images[0] == "v2-alpha-tpuv5"
    assert catalog.generation_of("v5litepod-16").images[0] == "v2-alpha-tpuv5-lite"
    assert catalog.generation_of("v5p-32").images[0] == "v2-alpha-tpuv5"
    # v5p-16: only GKE (xpk) runs found, no Cloud TPU VM doc or CI job: not listed.
    assert "v5p-16" not in catalog.accelerators
    assert catalog.unlisted_slice("v5p-16") and catalog.unlisted_slice("v6e-16")
    assert not catalog.unlisted_slice("v5p-8") and not catalog.unlisted_slice("v4-32")


def test_the_catalog_refuses_a_slice_of_one_host_or_without_a_source(tmp_path):
    text = (ROOT / "infra/catalogs/tpu.yaml").read_text()
    bad = tmp_path / "tpu.yaml"
    bad.write_text(text.replace("  v5p-32:\n    hosts: 4\n", "  v5p-32:\n    hosts: 1\n"))
    with pytest.raises(ValueError, match="slice v5p-32 needs hosts >= 2"):
        load_catalog(bad)
    start = text.index("  v5p-32:\n    hosts: 4\n")
    end = text.index("\nzones:")
    bad.write_text(text[:start] + "  v5p-32: {hosts: 4, chips_per_host: 4}\n" + text[end:])
    with pytest.raises(ValueError, match="slice v5p-32 has no source"):
        load_catalog(bad)


def test_a_slice_stack_knows_its_hosts():
    cfg = parse_config(
        project="my-project-123",
        stack="v4-32-usc2",
        values={
            key.removeprefix(K): value
            for key, value in yaml.safe_load((ROOT / "stacks/Pulumi.v4-32-usc2.yaml").read_text())[
                "config"
            ].items()
        },
    )
    assert (cfg.tpu.accelerator_type, cfg.tpu.hosts, cfg.tpu.chips_per_host) == ("v4-32", 4, 4)
    assert cfg.job_name == "bert-base-mlm"


def _job(tmp_path: Path, batch: int | None) -> str:
    template = yaml.safe_load((ROOT / "stacks/jobs/bert-base-mlm.yaml").read_text())
    if batch is None:
        del template["train"]["global_batch_size"]
    else:
        template["train"]["global_batch_size"] = batch
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(template))
    return str(path)


def test_a_slice_refuses_a_global_batch_that_does_not_split_over_its_replicas(tmp_path):
    job = _job(tmp_path, 100)
    assert config_error("v4-32-usc2", {K + "job": job}) == (
        f"tpu-pretrain:job: {job!r}: train.global_batch_size 100 must be a multiple of the 16 "
        "replicas of v4-32 (4 hosts x 4 chips); e.g. 96 or 112"
    )
    # v4-16 has 2 hosts x 4 chips: 100 is no multiple of 8 either.
    message = config_error("v4-32-usc2", {K + "job": job, K + "acceleratorType": "v4-16"})
    assert message.endswith(
        "must be a multiple of the 8 replicas of v4-16 (2 hosts x 4 chips); e.g. 96 or 104"
    )


def test_a_slice_takes_the_payloads_default_batch_and_single_hosts_are_not_checked(tmp_path):
    # No train.global_batch_size: the payload's default 32 is a multiple of 16.
    run_stack("v4-32-usc2", {K + "job": _job(tmp_path, None)})
    # One host: infra leaves the batch to the payload (it knows the replicas it finds).
    run_stack("v4-usc2", {K + "job": _job(tmp_path, 100)})


def test_a_slice_type_is_refused_where_the_zone_does_not_offer_it():
    assert config_error("v4-32-usc2", {K + "acceleratorType": "v5p-32"}) == (
        "tpu-pretrain:acceleratorType: 'v5p-32' is not offered in us-central2-b; offered "
        "there: v4-8, v4-16, v4-32"
    )


@pytest.mark.parametrize("accelerator_type", ["v5p-16", "v4-64", "v5litepod-64", "v6e-16"])
def test_a_slice_type_without_evidence_is_refused_naming_the_supported_ones(accelerator_type):
    assert config_error("v4-32-usc2", {K + "acceleratorType": accelerator_type}) == (
        f"tpu-pretrain:acceleratorType: {accelerator_type!r} is a multi-host slice that no "
        "Google doc or CI job shows running JAX on Cloud TPU VMs; supported slices: v4-16, "
        "v4-32, v5litepod-16, v5litepod-32, v5p-32 (infra/catalogs/tpu.yaml, docs/pod-slices.md)"
    )


def _hop(resources: list) -> tuple[str, str, str]:
    """(the hop VM's zone, its address's region, its subnet's region)."""
    by = {r.name: r for r in resources}
    return (
        by["vpn-hop-vm"].inputs["zone"],
        by["vpn-hop-address"].inputs["region"],
        by["network-hop-subnet"].inputs["region"],
    )


@pytest.mark.parametrize(
    ("stack", "zone"),
    [("v5e-euw4", "europe-west1-b"), ("v4-usc2", "us-south1-a"), ("l4x2-use1", "us-east4-a")],
)
def test_the_hop_defaults_to_a_zone_beside_the_accelerators_region(stack, zone):
    """No stack file sets vpnZone: the hop gets the catalog's zone for the accelerator's region
    (TPU and GPU stacks alike), outside that region (the policy pack's rule)."""
    assert (
        "tpu-pretrain:vpnZone"
        not in yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    )
    assert _hop(run_stack(stack)) == (zone, zone[:-2], zone[:-2])


def test_vpn_zone_overrides_the_default():
    resources = run_stack("v5e-euw4", {K + "vpnZone": "europe-west2-a"})
    assert _hop(resources) == ("europe-west2-a", "europe-west2", "europe-west2")


def test_every_accelerator_region_has_a_default_hop_zone_outside_it():
    from infra.catalogs.gpu import load_gpu_catalog
    from infra.catalogs.vpn_hop import default_hop_zones

    region = re.compile(r"^([a-z]+-[a-z]+\d+)-[a-z]$")
    regions = {region.match(z).group(1) for z in load_catalog().zones} | {
        region.match(z).group(1) for z in load_gpu_catalog().zones
    }
    zones = default_hop_zones()
    assert regions <= set(zones), sorted(regions - set(zones))
    for accelerator_region, zone in zones.items():
        assert region.match(zone) and region.match(zone).group(1) != accelerator_region, zone


def test_a_region_without_a_default_hop_zone_asks_for_vpn_zone():
    from infra.config import config as stack_config
    from infra.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        stack_config._default_hop_zone("mars-north1", "TPU")
    assert str(raised.value) == (
        "tpu-pretrain:vpnZone is required for a TPU in mars-north1 (infra/catalogs/vpn_hop.yaml "
        "has no default zone for that region): set a zone near you outside mars-north1, e.g. "
        "pulumi config set tpu-pretrain:vpnZone <zone>"
    )
