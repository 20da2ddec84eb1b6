"""Each stack's resources, asserted on the inputs the engine would receive."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pulumi
import pytest
import yaml
from harness import by_name, depends_on, of_type, one, run_offline, startup_script, tpu_stack_names

from infra import jobspec, wgkeys
from infra.catalogs import tpu as tpu_catalog
from infra.catalogs.vpn_hop import default_hop_zones
from infra.components.recovery import RECOVERY_ROLE_ID
from infra.render import render

ROOT = Path(__file__).resolve().parents[2]
IAP = "35.235.240.0/20"
V2VM = "gcp:tpu/v2Vm:V2Vm"
INSTANCE = "gcp:compute/instance:Instance"
BUCKET = "gcp:storage/bucket:Bucket"
FIREWALL = "gcp:compute/firewall:Firewall"
EXPECTED = {
    # stack: zone, accelerator, runtime, (preemptible, spot), shielded boot, job
    "v3-euw4": ("europe-west4-a", "v3-8", "v2-alpha-tpuv5", (False, False), False),
    "v2-usc1": ("us-central1-f", "v2-8", "v2-alpha-tpuv5", (True, False), False),
    "v4-usc2": ("us-central2-b", "v4-8", "v2-alpha-tpuv5", (False, False), True),
    "v4-32-usc2": ("us-central2-b", "v4-32", "tpu-ubuntu2204-base", (False, True), True),
    "v5e-euw4": ("europe-west4-b", "v5litepod-8", "v2-alpha-tpuv5-lite", (False, True), True),
    "v5e-16-euw4": ("europe-west4-b", "v5litepod-16", "v2-alpha-tpuv5-lite", (False, True), True),
    "v6e-euw4": ("europe-west4-a", "v6e-8", "v2-alpha-tpuv6e", (False, True), True),
}

# The pod slices: hosts per stack (every other stack is one host).
SLICE_HOSTS = {"v4-32-usc2": 4, "v5e-16-euw4": 4}

# tpuAutoRecover defaults to on for spot/preemptible stacks, off for on-demand ones.
AUTO_RECOVER = {stack: any(flags) for stack, (_, _, _, flags, _) in EXPECTED.items()}
CUSTOM_ROLE = "gcp:projects/iAMCustomRole:IAMCustomRole"
SA_IAM_MEMBER = "gcp:serviceaccount/iAMMember:IAMMember"


def stack_file(stack: str) -> dict:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def run(request):
    return run_offline(request.param)


def workload_email(run) -> str:
    return f"tp-{run.stack}-workload@tpu-pretrain-test.iam.gserviceaccount.com"


def controller_email(run) -> str:
    return f"tp-{run.stack}-controller@tpu-pretrain-test.iam.gserviceaccount.com"


def hop_email(run) -> str:
    return f"tp-{run.stack}-vpn-hop@tpu-pretrain-test.iam.gserviceaccount.com"


def test_the_expected_stacks_exist():
    assert tpu_stack_names() == sorted(EXPECTED)


def test_tpu_vm(run):
    zone, accelerator, runtime, (preemptible, spot), shielded = EXPECTED[run.stack]
    vm = one(run.resources, V2VM)
    assert vm.inputs["zone"] == zone
    assert vm.inputs["acceleratorType"] == accelerator
    assert vm.inputs["runtimeVersion"] == runtime
    assert vm.inputs["schedulingConfig"] == {"preemptible": preemptible, "spot": spot}
    assert vm.inputs["networkConfig"]["enableExternalIps"] is False
    assert vm.inputs["networkConfig"]["canIpForward"] is False
    assert vm.inputs["serviceAccount"] == {
        "email": workload_email(run),
        "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
    }
    assert ("shieldedInstanceConfig" in vm.inputs) is shielded
    if shielded:
        assert vm.inputs["shieldedInstanceConfig"] == {"enableSecureBoot": True}
    assert vm.inputs["metadata"]["enable-oslogin"] == "TRUE"
    assert vm.inputs["metadata"]["block-project-ssh-keys"] == "TRUE"
    assert vm.inputs["metadata"]["serial-port-enable"] == "FALSE"  # like the other VMs
    assert set(vm.inputs["metadata"]) == {
        "startup-script",
        "enable-oslogin",
        "block-project-ssh-keys",
        "serial-port-enable",
        "enable-guest-attributes",  # where the loader leaves its boot state for the watchdog
    }
    assert vm.inputs["metadata"]["enable-guest-attributes"] == "TRUE"
    assert vm.inputs["labels"]["stack"] == run.stack
    assert vm.inputs["labels"]["accelerator"] == accelerator
    assert vm.inputs["tags"] == ["tpu-pretrain-tpu"]


def test_tpu_vm_subnet_name_is_in_the_tpu_region(run):
    zone = EXPECTED[run.stack][0]
    subnet = by_name(run, "network-tpu-subnet")
    assert subnet.inputs["region"] == zone[:-2]
    vm = one(run.resources, V2VM)
    assert vm.inputs["networkConfig"]["subnetwork"] == (
        f"projects/tpu-pretrain-test/regions/{zone[:-2]}/subnetworks/{subnet.inputs['name']}"
    )


def test_controller_vm(run):
    vm = by_name(run, "controller-vm")
    assert vm.inputs["zone"] == EXPECTED[run.stack][0]
    assert vm.inputs["machineType"] == "e2-standard-4"
    (nic,) = vm.inputs["networkInterfaces"]
    assert "accessConfigs" not in nic or nic["accessConfigs"] == []
    metadata = vm.inputs["metadata"]
    assert metadata["enable-oslogin"] == "TRUE"
    assert metadata["block-project-ssh-keys"] == "TRUE"
    assert metadata["serial-port-enable"] == "FALSE"
    assert vm.inputs["shieldedInstanceConfig"] == {
        "enableSecureBoot": True,
        "enableVtpm": True,
        "enableIntegrityMonitoring": True,
    }
    # Its own account: the watchdog's recovery rights never reach the TPU VM's training code.
    assert vm.inputs["serviceAccount"]["email"] == controller_email(run)
    assert vm.inputs.get("canIpForward") in (None, False)


def test_vpn_hop(run):
    vm = by_name(run, "vpn-hop-vm")
    address = by_name(run, "vpn-hop-address")
    # No stack sets tpu-pretrain:vpnZone: the hop stands in the zone the catalog names for the
    # accelerator's region (infra/catalogs/vpn_hop.yaml), never in that region.
    region = EXPECTED[run.stack][0][:-2]
    zone = default_hop_zones()[region]
    assert vm.inputs["zone"] == zone and not zone.startswith(region)
    assert address.inputs["region"] == zone[:-2]
    assert vm.inputs["canIpForward"] is True
    (nic,) = vm.inputs["networkInterfaces"]
    assert nic["accessConfigs"] == [{"natIp": address.outputs["address"], "networkTier": "PREMIUM"}]
    assert nic["subnetwork"].endswith(by_name(run, "network-hop-subnet").inputs["name"])
    assert vm.inputs["serviceAccount"]["email"] == hop_email(run)
    assert vm.inputs["metadata"]["enable-oslogin"] == "TRUE"
    assert vm.inputs["metadata"]["block-project-ssh-keys"] == "TRUE"
    # where the hop publishes the public key it makes at its first boot
    assert vm.inputs["metadata"]["enable-guest-attributes"] == "TRUE"


def test_only_the_hop_has_an_external_ip(run):
    with_external = [
        r.name
        for r in of_type(run.resources, INSTANCE)
        if any(nic.get("accessConfigs") for nic in r.inputs["networkInterfaces"])
    ]
    assert with_external == ["vpn-hop-vm"]
    assert one(run.resources, V2VM).inputs["networkConfig"]["enableExternalIps"] is False


def test_tpu_external_ip_only_when_asked():
    vm = one(run_offline("v3-euw4", {"tpu-pretrain:tpuExternalIp": True}).resources, V2VM)
    assert vm.inputs["networkConfig"]["enableExternalIps"] is True


def test_bucket(run):
    bucket = one(run.resources, BUCKET)
    region = EXPECTED[run.stack][0][:-2]
    assert bucket.inputs["name"] == f"tpu-pretrain-test-{run.stack}-tpu-pretrain"
    assert bucket.inputs["location"] == region.upper()
    assert bucket.inputs["uniformBucketLevelAccess"] is True
    assert bucket.inputs["publicAccessPrevention"] == "enforced"
    assert bucket.inputs["softDeletePolicy"] == {"retentionDurationSeconds": 7 * 86400}
    assert bucket.inputs["forceDestroy"] is False
    assert bucket.options["retainOnDelete"] is True
    assert bucket.options["protect"] in (None, False)  # `pulumi destroy` must still succeed


def test_bucket_goes_with_the_stack_only_when_the_stack_says_so():
    bucket = one(
        run_offline("v3-euw4", {"tpu-pretrain:destroyBucketWithStack": True}).resources, BUCKET
    )
    assert bucket.inputs["forceDestroy"] is True
    assert bucket.options["retainOnDelete"] in (None, False)


def test_iam_is_bucket_level_for_the_dedicated_account(run):
    workload = f"serviceAccount:{workload_email(run)}"
    controller = f"serviceAccount:{controller_email(run)}"
    bindings = of_type(run.resources, "gcp:storage/bucketIAMMember:BucketIAMMember")
    bucket_name = one(run.resources, BUCKET).inputs["name"]
    # Read everything, write outside what another identity runs (tests/infra/
    # test_executables.py evaluates the conditions).
    assert sorted(
        (b.inputs["member"], b.inputs["role"], b.inputs["bucket"], "condition" in b.inputs)
        for b in bindings
    ) == [
        (controller, "roles/storage.objectUser", bucket_name, True),
        (controller, "roles/storage.objectViewer", bucket_name, False),
        (workload, "roles/storage.objectUser", bucket_name, True),
        (workload, "roles/storage.objectViewer", bucket_name, False),
    ]
    project_roles = sorted(
        (r.inputs["member"], r.inputs["role"])
        for r in of_type(run.resources, "gcp:projects/iAMMember:IAMMember")
    )
    hop = f"serviceAccount:{hop_email(run)}"
    # The watchdog's recovery role (made by the bootstrap), only where it is on
    # (spot/preemptible stacks), and only for the controller's account.
    recovery = [(controller, f"projects/tpu-pretrain-test/roles/{RECOVERY_ROLE_ID}")]
    assert project_roles == sorted(
        [
            (hop, "roles/logging.logWriter"),
            (hop, "roles/monitoring.metricWriter"),
            (workload, "roles/logging.logWriter"),
            (workload, "roles/monitoring.metricWriter"),
            (controller, "roles/logging.logWriter"),
            (controller, "roles/monitoring.metricWriter"),
        ]
        + (recovery if AUTO_RECOVER[run.stack] else [])
    )
    text = json.dumps([r.inputs for r in run.resources], default=str)
    assert "compute@developer.gserviceaccount.com" not in text
    assert not of_type(run.resources, "gcp:projects/iAMBinding:IAMBinding")


def test_the_stack_keeps_no_secret(run):
    """The hop makes its own key on its disk: no secret, no secret's grant, no Secret Manager
    API; the hop's account holds nothing but log and metric writing (above)."""
    assert [r.name for r in run.resources if r.type_.startswith("gcp:secretmanager/")] == []
    services = of_type(run.resources, "gcp:projects/service:Service")
    assert "secretmanager.googleapis.com" not in {s.inputs["service"] for s in services}
    hop = f"serviceAccount:{hop_email(run)}"
    assert sorted(r.inputs["role"] for r in run.resources if r.inputs.get("member") == hop) == [
        "roles/logging.logWriter",
        "roles/monitoring.metricWriter",
    ]


def test_firewall(run):
    """Every rule, every input: what reaches each VM, from where. The controller and the
    accelerator VM never reach each other (they meet in the bucket); only a slice's hosts
    reach one another; TensorBoard is the controller's alone."""
    rules = {r.name: r.inputs for r in of_type(run.resources, FIREWALL)}
    tpus = of_type(run.resources, V2VM)
    slice_hosts = (
        bool(tpus)
        and tpu_catalog.load_catalog().slice_of(tpus[0].inputs["acceleratorType"]) is not None
    )  # a multi-host slice (catalogs/tpu.yaml `slices:`)
    vpc = one(run.resources, "gcp:compute/network:Network").inputs["name"]
    logged = {"logConfig": {"metadata": "INCLUDE_ALL_METADATA"}}
    common = {"project": "tpu-pretrain-test", "direction": "INGRESS"}
    expected = {
        "network-allow-ssh": {
            **common, **logged,
            "name": f"{vpc}-allow-ssh-iap-vpn",
            "allows": [{"protocol": "tcp", "ports": ["22"]}],
            "sourceRanges": [IAP, "10.250.0.0/24"],
            "targetTags": ["tpu-pretrain-tpu", "tpu-pretrain-controller", "tpu-pretrain-vpn-hop"],
        },
        "network-allow-wireguard": {
            **common, **logged,
            "name": f"{vpc}-allow-wireguard",
            "allows": [{"protocol": "udp", "ports": ["51820"]}],
            "sourceRanges": stack_file(run.stack)["tpu-pretrain:vpnAllowedCidrs"],
            "targetTags": ["tpu-pretrain-vpn-hop"],
        },
        # The hop (and the VPN clients it masquerades): SSH and ping to both VMs...
        "network-allow-from-hop": {
            **common, **logged,
            "name": f"{vpc}-allow-from-hop",
            "allows": [{"protocol": "tcp", "ports": ["22"]}, {"protocol": "icmp"}],
            "sourceTags": ["tpu-pretrain-vpn-hop"],
            "targetTags": ["tpu-pretrain-tpu", "tpu-pretrain-controller"],
        },
        # ...and TensorBoard, which only the controller serves.
        "network-allow-tensorboard": {
            **common, **logged,
            "name": f"{vpc}-allow-tensorboard-from-hop",
            "allows": [{"protocol": "tcp", "ports": ["6006"]}],
            "sourceTags": ["tpu-pretrain-vpn-hop"],
            "targetTags": ["tpu-pretrain-controller"],
        },
    }  # fmt: skip
    if slice_hosts:  # JAX's coordination service on worker 0, the hosts' own traffic
        expected["network-allow-slice"] = {
            **common,
            "name": f"{vpc}-allow-slice",
            "allows": [{"protocol": "tcp"}, {"protocol": "udp"}, {"protocol": "icmp"}],
            "sourceTags": ["tpu-pretrain-tpu"],
            "targetTags": ["tpu-pretrain-tpu"],
        }
    networks = {rule.pop("network") for rule in rules.values()}
    assert rules == expected
    assert networks == {f"projects/tpu-pretrain-test/global/networks/{vpc}"}
    # The rules select VMs by these tags, one role each.
    assert one(run.resources, V2VM).inputs["tags"] == ["tpu-pretrain-tpu"]
    assert by_name(run, "controller-vm").inputs["tags"] == ["tpu-pretrain-controller"]


def test_network(run):
    vpc = one(run.resources, "gcp:compute/network:Network")
    assert vpc.inputs["autoCreateSubnetworks"] is False
    subnets = {
        r.name: r.inputs for r in of_type(run.resources, "gcp:compute/subnetwork:Subnetwork")
    }
    assert subnets["network-tpu-subnet"]["region"] == EXPECTED[run.stack][0][:-2]
    assert (
        subnets["network-hop-subnet"]["region"]
        == default_hop_zones()[EXPECTED[run.stack][0][:-2]][:-2]
    )
    for subnet in subnets.values():
        assert subnet["privateIpGoogleAccess"] is True
        assert subnet["logConfig"]["flowSampling"] > 0
    nat = one(run.resources, "gcp:compute/routerNat:RouterNat")
    assert nat.inputs["region"] == EXPECTED[run.stack][0][:-2]
    assert nat.inputs["subnetworks"][0]["name"].endswith(subnets["network-tpu-subnet"]["name"])


def test_apis_stay_enabled_on_destroy(run):
    services = of_type(run.resources, "gcp:projects/service:Service")
    names = {s.inputs["service"] for s in services}
    assert {"tpu.googleapis.com", "compute.googleapis.com"} <= names
    assert {"cloudresourcemanager.googleapis.com", "serviceusage.googleapis.com"} <= names
    assert all(s.inputs["disableOnDestroy"] is False for s in services)


def test_components_own_every_resource(run):
    components = [r for r in run.resources if r.type_.startswith("tpu-pretrain:index:")]
    assert {c.type_.split(":")[-1] for c in components} == {
        "ProjectApis",
        "Network",
        "ServiceIdentity",
        "TrainingBucket",
        "PayloadDelivery",
        "StartupDelivery",
        "ControllerVm",
        "TpuVm",
        "VpnHop",
    } | ({"TpuAutoRecovery"} if AUTO_RECOVER[run.stack] else set())
    component_urns = {c.urn for c in components}
    for resource in run.resources:
        if resource not in components:
            assert resource.options["parent"] in component_urns, resource.name


def _client_key(run) -> dict[str, str]:
    """The client's generated key (a stack without vpnClientPublicKey): seed and private key."""
    (seed,) = of_type(run.resources, "random:index/randomBytes:RandomBytes")
    assert seed.name == "vpn-hop-client-key"
    return {"seed": seed.outputs["base64"], "private": wgkeys.private_key(seed.outputs["base64"])}


def test_the_client_s_generated_key_is_only_in_its_seed_and_the_secret_config(run):
    """The one private key of a stack a person deploys without vpnClientPublicKey is the
    client's: in the random bytes' output and the secret client config, in no resource's
    inputs (no metadata, no script, no object); the hop's key is made on the hop."""
    key = _client_key(run)
    for resource in run.resources:
        text = json.dumps(resource.inputs, default=str)
        for label, value in key.items():
            assert value not in text, f"the client's {label} appears in {resource.name}"
    assert f"PrivateKey = {key['private']}\n" in run.exports["vpnClientConfig"]
    assert "vpnClientConfig" in run.secret_exports
    hop_script = by_name(run, "vpn-hop-vm").inputs["metadata"]["startup-script"]
    assert "wg genkey" in hop_script and "gcloud secrets" not in hop_script
    assert "PrivateKey = ${private_key}" in hop_script


def test_vpn_client_config_is_a_secret_limited_to_the_vpc(run):
    assert "vpnClientConfig" in run.secret_exports
    config = run.exports["vpnClientConfig"]
    key = _client_key(run)
    assert f"PrivateKey = {key['private']}\n" in config
    # The hop's key is made at its first boot: a placeholder until `make vpn-config`.
    assert f"PublicKey = {render.SERVER_KEY_PLACEHOLDER}\n" in config
    hop = by_name(run, "vpn-hop-vm").inputs
    assert run.exports["vpnServerKey"] == {
        "instance": hop["name"],
        "zone": hop["zone"],
        "project": hop["project"],
        "guestAttribute": render.WG_PUBLIC_KEY_ATTRIBUTE,
        "command": f"gcloud compute instances get-guest-attributes {hop['name']} --zone "
        f"{hop['zone']} --project {hop['project']} "
        f"--query-path={render.WG_PUBLIC_KEY_ATTRIBUTE} --format='value(value)'",
    }
    address = by_name(run, "vpn-hop-address").outputs["address"]
    assert f"Endpoint = {address}:51820\n" in config
    assert "AllowedIPs = 10.10.0.0/20, 10.20.0.0/24\n" in config
    assert "MTU = 1380\n" in config  # Google's VPC MTU 1460 - WireGuard's 80
    hop_script = hop["metadata"]["startup-script"]
    assert "readonly WG_MTU=1380" in hop_script
    client_public = wgkeys.public_key(key["private"])
    assert f"readonly WG_CLIENT_PUBLIC_KEY={client_public}" in hop_script
    assert f"readonly WG_PUBLIC_KEY_ATTRIBUTE={render.WG_PUBLIC_KEY_ATTRIBUTE}" in hop_script


def test_a_user_supplied_client_key_replaces_the_generated_pair():
    own = base64.b64encode(bytes(range(32))).decode()
    run = run_offline("v6e-euw4", {"tpu-pretrain:vpnClientPublicKey": own})
    assert of_type(run.resources, "random:index/randomBytes:RandomBytes") == []
    hop_script = by_name(run, "vpn-hop-vm").inputs["metadata"]["startup-script"]
    assert f"readonly WG_CLIENT_PUBLIC_KEY={own}" in hop_script
    assert f"PrivateKey = {render.OWN_CLIENT_KEY_PLACEHOLDER}\n" in run.exports["vpnClientConfig"]


def test_payload_archive_is_content_addressed_and_uploaded(run):
    archive_object = by_name(run, "payload-archive")
    name = archive_object.inputs["name"]
    match = re.fullmatch(r"payload/tpu-pretrain-payload-([0-9a-f]{16})\.tar\.gz", name)
    assert match
    source = archive_object.inputs["source"]
    assert isinstance(source, pulumi.FileAsset)
    data = Path(source.path).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert digest.startswith(match.group(1))
    for vm in ("tpu-vm", "controller-vm"):
        script = startup_script(run, vm)
        assert f"readonly PAYLOAD_SHA256={digest}\n" in script
        assert f"/{name}\n" in script


def test_payload_archive_is_deterministic_and_complete():
    first, second = render.build_payload_archive(), render.build_payload_archive()
    assert first.data == second.data and first.name == second.name
    with tarfile.open(fileobj=io.BytesIO(first.data)) as tar:
        names = tar.getnames()
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    assert {"pyproject.toml", "README.md", "requirements/payload.lock", "payload/spec.py"} <= set(
        names
    )
    assert names == sorted(names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_job_spec_is_rendered_into_the_bucket_layout(run):
    job_object = by_name(run, "payload-job-spec")
    bucket = one(run.resources, BUCKET).inputs["name"]
    template_path = ROOT / stack_file(run.stack)["tpu-pretrain:job"]
    template = jobspec.load_template(template_path)
    spec = json.loads(job_object.inputs["content"])
    assert job_object.inputs["name"] == f"jobs/{template['name']}.json"
    assert spec == jobspec.render_job_spec(template, bucket)
    assert spec["output"] == f"gs://{bucket}/runs/{template['name']}"
    assert all(p.startswith(f"gs://{bucket}/corpus/") for p in spec["corpus"]["paths"])


def test_stack_outputs(run):
    exports = run.exports
    zone = EXPECTED[run.stack][0]
    assert exports["tpuName"] == f"tp-{run.stack}-tpu"
    assert exports["tpuZone"] == zone
    assert exports["tpuInternalIp"].startswith("10.10.")
    assert exports["controllerInternalIp"].startswith("10.10.")
    assert exports["bucketUrl"] == f"gs://tpu-pretrain-test-{run.stack}-tpu-pretrain"
    assert exports["tensorboardUrl"].startswith(f"http://{exports['controllerInternalIp']}:6006")
    # IAP tunneling to a TPU VM is in gcloud's alpha track only; GA reaches it over the VPN.
    assert exports["sshCommands"]["tpu"] == (
        f"gcloud alpha compute tpus tpu-vm ssh tp-{run.stack}-tpu --zone {zone} "
        "--project tpu-pretrain-test --tunnel-through-iap"
    )
    assert exports["sshCommands"]["tpuOverVpn"] == (
        f"gcloud compute tpus tpu-vm ssh tp-{run.stack}-tpu --zone {zone} "
        "--project tpu-pretrain-test --internal-ip"
    )
    assert "--tunnel-through-iap" in exports["sshCommands"]["controller"]
    assert exports["vpnEndpoint"].endswith(":51820")
    if run.stack not in SLICE_HOSTS:
        assert exports["rerunStartupCommands"]["tpu"] == (
            exports["sshCommands"]["tpu"]
            + " --command 'sudo google_metadata_script_runner startup'"
        )
    vm = one(run.resources, V2VM)
    assert exports["tpuRecovery"]["replace"] == f"pulumi up --replace '{vm.urn}'"
    watchdog = exports["tpuRecovery"]["watchdog"]
    if AUTO_RECOVER[run.stack]:
        assert watchdog.startswith("on: the controller checks the TPU VM every 2min")
        bucket = exports["bucketUrl"]
        assert re.search(rf"status {bucket}/runs/[a-z0-9-]+/bootstrap/tpu-watch\.json,", watchdog)
        assert "journalctl -u tpu-pretrain-tpu-watch.service" in watchdog
    else:
        assert watchdog.startswith("off (tpu-pretrain:tpuAutoRecover=false)")
    assert exports["tpuRecovery"]["check"].startswith(
        f"gcloud compute tpus tpu-vm describe tp-{run.stack}-tpu --zone {zone} "
    )
    assert run.secret_exports == {"vpnClientConfig"}
    # Every host's IP, worker 0 (the internal IP above) first.
    hosts = SLICE_HOSTS.get(run.stack, 1)
    assert len(exports["tpuWorkerIps"]) == len(set(exports["tpuWorkerIps"])) == hosts
    assert exports["tpuWorkerIps"][0] == exports["tpuInternalIp"]
    if hosts > 1:
        # Worker 0 by default; --worker=all for the startup script that every host runs.
        assert exports["sshCommands"]["tpuAllWorkers"] == (
            exports["sshCommands"]["tpu"] + " --worker=all"
        )
        assert exports["rerunStartupCommands"]["tpu"] == (
            exports["sshCommands"]["tpu"]
            + " --worker=all --command 'sudo google_metadata_script_runner startup'"
        )
    else:
        assert "tpuAllWorkers" not in exports["sshCommands"]


def test_tpu_recovery_least_privilege(run):
    """The watchdog runs as the controller's account: the bootstrap's recovery role bound to
    it at project level and actAs on the TPU VM's account only, when tpuAutoRecover is on
    (the default for spot/preemptible). The program creates no role, and the TPU VM's own
    account gets none of it."""
    assert of_type(run.resources, CUSTOM_ROLE) == []
    sa_grants = of_type(run.resources, SA_IAM_MEMBER)
    role = f"projects/tpu-pretrain-test/roles/{RECOVERY_ROLE_ID}"
    grants = [
        r
        for r in of_type(run.resources, "gcp:projects/iAMMember:IAMMember")
        if r.inputs["role"] == role
    ]
    if not AUTO_RECOVER[run.stack]:
        assert grants == [] and sa_grants == []
        return
    controller = f"serviceAccount:{controller_email(run)}"
    (grant,) = grants
    assert grant.inputs["member"] == controller
    (act_as,) = sa_grants
    assert act_as.inputs == {
        "serviceAccountId": f"projects/tpu-pretrain-test/serviceAccounts/{workload_email(run)}",
        "role": "roles/iam.serviceAccountUser",
        "member": controller,
    }
    workload = f"serviceAccount:{workload_email(run)}"
    workload_grants = [
        r.inputs["role"] for r in run.resources if r.inputs.get("member") == workload
    ]
    assert sorted(workload_grants) == [
        "roles/logging.logWriter",
        "roles/monitoring.metricWriter",
        "roles/storage.objectUser",
        "roles/storage.objectViewer",
    ]
    # The controller boots after its grants exist.
    dependencies = by_name(run, "controller-vm").options["dependencies"]
    assert {grant.urn, act_as.urn} <= set(dependencies)


@pytest.mark.parametrize(
    ("stack", "value", "on"),
    [("v3-euw4", True, True), ("v6e-euw4", False, False), ("v2-usc1", "false", False)],
)
def test_tpu_auto_recover_can_be_set_either_way(stack, value, on):
    run = run_offline(stack, {"tpu-pretrain:tpuAutoRecover": value})
    assert of_type(run.resources, CUSTOM_ROLE) == []
    assert len(of_type(run.resources, SA_IAM_MEMBER)) == int(on)
    script = startup_script(run, "controller-vm")
    assert f"readonly AUTO_RECOVER={'true' if on else 'false'}\n" in script
    assert ("readonly WATCH_SCRIPT_B64=''\n" in script) is not on
    assert run.exports["tpuRecovery"]["watchdog"].startswith("on:" if on else "off")


def test_destroy_order_leaves_no_tpu_behind(run):
    """With the watchdog on, `pulumi destroy` deletes the lease first, then the controller
    (whose shutdown hook cancels the watchdog's queue), and the TPU VM last: nothing can
    recreate the TPU VM after Pulumi deleted it."""
    leases = [r for r in run.resources if r.name == "controller-tpu-watch-lease"]
    controller, tpu = by_name(run, "controller-vm"), by_name(run, "tpu-vm")
    if not AUTO_RECOVER[run.stack]:
        assert leases == []
        return
    (lease,) = leases
    assert depends_on(run, controller, tpu)
    assert depends_on(run, lease, controller)
    assert not depends_on(run, tpu, controller) and not depends_on(run, controller, lease)
    bucket = run.exports["bucketUrl"].removeprefix("gs://")
    assert lease.inputs["bucket"] == bucket
    # The watchdog looks for exactly this object.
    script = startup_script(run, "controller-vm")
    encoded = re.search(r"^readonly WATCH_SCRIPT_B64=(\S+)$", script, re.MULTILINE)
    watchdog = base64.b64decode(encoded.group(1)).decode()
    assert f"readonly LEASE_URI=gs://{bucket}/{lease.inputs['name']}\n" in watchdog
    job = json.loads(by_name(run, "payload-job-spec").inputs["content"])
    assert f"readonly EXPORT_MARKER_URI={job['output']}/export/export_complete.json\n" in (watchdog)
    assert "readonly RELEASE_WHEN_DONE=false\n" in watchdog
    assert f"readonly QUEUED_RESOURCE={tpu.inputs['name']}-watch\n" in watchdog


def test_the_destroy_order_check_can_fail():
    """Without the watchdog the controller does not wait for the TPU VM (created in
    parallel, as before): the helper above reports that."""
    run = run_offline("v3-euw4")
    assert not depends_on(run, by_name(run, "controller-vm"), by_name(run, "tpu-vm"))
