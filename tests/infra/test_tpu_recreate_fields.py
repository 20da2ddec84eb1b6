"""A TPU node the watchdog recreates must read back as the V2Vm Pulumi declared, or the next
`pulumi preview --refresh` plans a replacement of the training TPU.

The provider's schema (pulumi-gcp bridges the Terraform resource `google_tpu_v2_vm`,
generated from GoogleCloudPlatform/magic-modules mmv1/products/tpuv2/Vm.yaml, read at commit
068cc45653d9a6962a00fd7d324d8bd542e76801) marks these inputs `immutable` (ForceNew: a
difference replaces the node): zone, name, runtimeVersion, acceleratorType, cidrBlock,
networkConfig (network, subnetwork, enableExternalIps, canIpForward, queueCount),
networkConfigs, serviceAccount (email, scope), schedulingConfig (preemptible, reserved,
spot), shieldedInstanceConfig, acceleratorConfig. description, labels, metadata, tags and
dataDisks are updated in place by the provider; this program replaces the node on those too
(infra/components/tpu.py IN_PLACE_FIELDS: the deploy account holds no tpu.nodes.update,
test_every_change_replaces_the_tpu_vm below). cidrBlock, networkConfig, serviceAccount and
acceleratorConfig are `default_from_api` (an API value the program did not set is no diff).

Closed world: every input the program gives the V2Vm must be one the watchdog reproduces
(a gcloud flag with the same value, checked on the real watchdog in the sandbox), or a
field listed here as needing nothing; a new V2Vm input fails this test until it is
reproduced or its case is made here."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_offline
from script_sandbox import Watch, flag_pairs, split_flags

IMMUTABLE = {
    "zone", "name", "runtimeVersion", "acceleratorType", "cidrBlock", "networkConfig",
    "networkConfigs", "serviceAccount", "schedulingConfig", "shieldedInstanceConfig",
    "acceleratorConfig",
}  # fmt: skip
MUTABLE = {"description", "labels", "metadata", "tags", "dataDisks"}
# The V2Vm input -> how a recreated node gets the same value.
NEEDS_NOTHING = {"project": "the same project (--project); not a node field"}


def _reproduced(vm: dict, flags: dict, switches: set, startup: str) -> dict[str, bool]:
    """Per V2Vm input: does the watchdog's create carry the same value?"""
    net, account = vm["networkConfig"], vm["serviceAccount"]
    scheduling = vm.get("schedulingConfig", {})
    metadata = dict(vm["metadata"])
    return {
        "zone": flags["--zone"] == vm["zone"],
        "name": flags.get("--node-id", flags.get("name")) == vm["name"],
        "runtimeVersion": flags.get("--runtime-version", flags.get("--version"))
        == vm["runtimeVersion"],
        "acceleratorType": flags["--accelerator-type"] == vm["acceleratorType"],
        "networkConfig": flags["--network"] == net["network"]
        and flags["--subnetwork"] == net["subnetwork"]
        and ("--internal-ips" in switches) == (not net["enableExternalIps"])
        and net.get("canIpForward") is False  # gcloud's default; no flag is passed
        and "queueCount" not in net,
        "serviceAccount": flags["--service-account"] == account["email"]
        and flags["--scopes"] == ",".join(account["scopes"]),
        "schedulingConfig": ("--spot" in switches) == bool(scheduling.get("spot"))
        and ("--preemptible" in switches) == bool(scheduling.get("preemptible"))
        and not scheduling.get("reserved"),
        "shieldedInstanceConfig": ("--shielded-secure-boot" in switches)
        == bool(vm.get("shieldedInstanceConfig", {}).get("enableSecureBoot")),
        "description": flags["--description"] == vm["description"],
        "labels": flag_pairs(flags["--labels"])
        == vm["labels"] | {"goog-pulumi-provisioned": "true"},
        "tags": flags["--tags"] == ",".join(vm["tags"]),
        "metadata": startup == metadata.pop("startup-script")
        and flag_pairs(flags["--metadata"]) == metadata,
    }


@pytest.mark.parametrize(
    ("stack", "state", "create"),
    [
        ("v6e-euw4", "PREEMPTED", "qr-create"),  # spot: through a queued resource
        ("v3-euw4", "TERMINATED", "qr-create"),  # on-demand with the watchdog on
        ("v2-usc1", "PREEMPTED", "create"),  # preemptible: tpu-vm create
        ("v4-32-usc2", "PREEMPTED", "qr-create"),  # a slice, secure boot
    ],
)
def test_the_recreated_node_has_every_immutable_field_of_the_v2vm(
    stack,
    state,
    create,
    sandbox,
):
    overrides = {"tpu-pretrain:tpuAutoRecover": True} if stack == "v3-euw4" else None
    watch = Watch(run_offline(stack, overrides), sandbox)
    watch.set_state(state)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    (argv,) = watch.creates(create)
    positional, flags, switches = split_flags(argv)
    if create == "create":
        flags["name"] = positional[-1]
    startup_path = flags["--metadata-from-file"].split("=", 1)[1]
    startup = Path(startup_path).read_text(encoding="utf-8")
    vm = watch.vm.inputs
    reproduced = _reproduced(vm, flags, switches, startup)
    for key in vm:
        assert key in reproduced or key in NEEDS_NOTHING, (
            f"V2Vm input {key!r} is not reproduced by the watchdog: a recreated node would "
            "differ (add its gcloud flag to tpu-watch.sh node_flags, or its case here)"
        )
        assert key in IMMUTABLE | MUTABLE | set(NEEDS_NOTHING), key
    assert {k: ok for k, ok in reproduced.items() if not ok} == {}
    # What the program leaves to the API (default_from_api): never an input of ours.
    assert not {"cidrBlock", "acceleratorConfig", "networkConfigs", "dataDisks"} & set(vm)


@pytest.mark.parametrize("stack", ["v6e-euw4", "v4-32-usc2"])
def test_every_change_replaces_the_tpu_vm(stack):
    """No in-place update of a node (its metadata is a startup script that runs as its
    account): the provider's mutable fields replace it, the old node deleted first (its name
    is fixed), so the deploy account needs no tpu.nodes.update."""
    [vm] = [r for r in run_offline(stack).resources if r.type_ == "gcp:tpu/v2Vm:V2Vm"]
    assert sorted(vm.options["replaceOnChanges"]) == sorted(MUTABLE)
    assert vm.options["deleteBeforeReplace"] is True
    assert set(vm.inputs) - set(NEEDS_NOTHING) <= MUTABLE | IMMUTABLE
