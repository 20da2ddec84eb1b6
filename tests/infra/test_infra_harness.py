"""The harness itself: every stack runs, repeatedly, in one process, without leaking state."""

from __future__ import annotations

import harness
import pulumi
from harness import (
    config_error,
    gpu_stack_names,
    one,
    run_offline,
    run_stack,
    stack_names,
    tpu_stack_names,
)

from infra.commands import offline
from infra.render import render


def comparable(resources):
    def plain(value):
        if isinstance(value, pulumi.FileAsset):
            return ("FileAsset", value.path)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return sorted((r.type_, r.name, repr(plain(r.inputs))) for r in resources)


def test_stack_names_come_from_the_stacks_folder():
    assert stack_names() == [
        "a100x4-usc1",
        "l4x2-use1",
        "t4-usc1",
        "v2-usc1",
        "v3-euw4",
        "v4-32-usc2",
        "v4-usc2",
        "v5e-16-euw4",
        "v5e-euw4",
        "v6e-euw4",
    ]
    assert gpu_stack_names() == ["a100x4-usc1", "l4x2-use1", "t4-usc1"]
    assert tpu_stack_names() == [s for s in stack_names() if s not in gpu_stack_names()]


def test_every_stack_runs_twice_with_the_same_result():
    for stack in stack_names():
        first = run_stack(stack, fresh=True)
        second = run_stack(stack, fresh=True)
        assert comparable(first) == comparable(second)
        assert all(r.urn.startswith(f"urn:pulumi:{stack}::tpu-pretrain::") for r in first)


def test_overrides_do_not_leak_into_the_next_run():
    spot = one(run_stack("v3-euw4", {"tpu-pretrain:scheduling": "spot"}), "gcp:tpu/v2Vm:V2Vm")
    assert spot.inputs["schedulingConfig"] == {"preemptible": False, "spot": True}
    again = one(run_stack("v3-euw4", fresh=True), "gcp:tpu/v2Vm:V2Vm")
    assert again.inputs["schedulingConfig"] == {"preemptible": False, "spot": False}


def test_a_config_error_does_not_poison_the_next_run():
    message = config_error("v3-euw4", {"tpu-pretrain:tpuZone": "mars-north1-a"})
    assert message.startswith("tpu-pretrain:tpuZone: unknown zone 'mars-north1-a'")
    assert len(run_stack("v3-euw4", fresh=True)) > 30


def test_a_kept_run_is_a_copy_and_a_patch_runs_the_program_again(monkeypatch):
    """run_offline hands out copies of the runs it keeps, to every test of the process; a
    patched infra module or a changed environment is another run, and the undone patch finds
    the kept one again."""
    ran = []
    real_run = offline.run_offline

    def counted_run(*args, **kwargs):
        ran.append(args)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(offline, "run_offline", counted_run)
    first = run_offline("v3-euw4")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # what pytest sets
    assert run_offline("v3-euw4") is not first
    assert len(ran) == 1, "the next test of the process runs the program again"
    monkeypatch.undo()
    one(first.resources, "gcp:storage/bucket:Bucket").inputs["location"] = "MARS"
    again = run_offline("v3-euw4")
    assert one(again.resources, "gcp:storage/bucket:Bucket").inputs["location"] != "MARS"
    assert comparable(again.resources) == comparable(run_offline("v3-euw4", fresh=True).resources)

    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    real = render.read_pins
    monkeypatch.setattr(render, "read_pins", counted)
    run_offline("v3-euw4")
    assert calls, "a patched infra module must run the program again"
    monkeypatch.undo()
    kept = len(harness._RUNS)
    run_offline("v3-euw4")
    assert len(harness._RUNS) == kept  # the unpatched key again: nothing new ran
    monkeypatch.setenv("TPU_PRETRAIN_HARNESS_TEST", "1")
    run_offline("v3-euw4")
    assert len(harness._RUNS) == kept + 1


def test_inputs_use_engine_names_and_resolved_values():
    bucket = one(run_stack("v6e-euw4"), "gcp:storage/bucket:Bucket")
    assert bucket.inputs["uniformBucketLevelAccess"] is True
    assert bucket.inputs["publicAccessPrevention"] == "enforced"


def test_exports_and_secrets_are_reported():
    run = run_offline("v6e-euw4")
    assert "vpnClientConfig" in run.secret_exports
    assert "tpuName" in run.exports and "tpuName" not in run.secret_exports
