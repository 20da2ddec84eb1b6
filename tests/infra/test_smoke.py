"""`make smoke` end to end, offline: infra/commands/smoke.py drives stub `gcloud` and `pulumi`
executables (first on PATH) and a stub export loader (tools/load_export.py itself runs
in .venv-pt in its own test); the bucket is a directory (smoke_world.py). What the VMs
write there comes from the real rendered startup script run in the script sandbox
(templates/facts.sh) and is published step by step by the injected `sleep`: the wait loop
synchronises on those steps, never on time. Every branch of the control flow runs: all good,
a preflight failure (a missing recovery role among them), the APIs gcloud reads being off, an
older gcloud without the GA TPU VM lists, a stack that is already deployed, a failed `pulumi
up`, a host that does not match the catalog, a job that stops, a slice worker or a watchdog
that reports a failure, the last run's files in the kept bucket, a timeout, KEEP=1, an export
that does not load, a GPU stack."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from harness import GITOPS
from smoke_world import LOADS, RUN, gcloud_commands_are_real

from infra.commands import smoke


def test_all_good_up_wait_verdict_destroy_and_a_report(world):
    w = world()
    w.boot("controller")
    w.boot("tpu", {"STUB_PYTHON_VERSION": "3.10"})
    w.write("bootstrap/tpu.json", {"state": "started"})
    w.finish_training()
    code, runner = w.smoke()
    assert code == 0, w.out.getvalue()
    # The order of a first real run, and the stack's settings untouched.
    assert w.verbs("pulumi") == [
        "stack select", "stack output", "up --yes", "stack output", "destroy --yes",
    ]  # fmt: skip
    # This run's job: stacks/jobs/smoke.yaml under the run's own name, with the profile
    # window on this stack's JAX backend.
    up_config = yaml.safe_load((w.state / "up-config.yaml").read_text())["config"]
    assert up_config["tpu-pretrain:job"] == str(w.job)
    job = yaml.safe_load(w.job.read_text())
    assert job["name"] == RUN
    template = yaml.safe_load((smoke.REPO_ROOT / smoke.SMOKE_JOB).read_text())
    template["train"]["profile"] = {"start_step": 150, "steps": 5}
    assert {k: v for k, v in job.items() if k != "name"} == {
        k: v for k, v in template.items() if k != "name"
    }
    assert yaml.safe_load(w.stack_file.read_text())["config"]["tpu-pretrain:job"] == (
        "stacks/jobs/gpt2-small-clm.yaml"
    )
    # The bundled corpus went where the smoke job reads it.
    corpus = w.box.gcs / w.bucket / "corpus" / "smoke"
    assert sorted(p.name for p in corpus.iterdir()) == ["mixed.txt", "notes.txt"]
    rows = w.rows(runner)
    assert rows["tpu: python"] == ("3.10", "3.10", "ok")
    assert rows["tpu: accelerator_type"][2] == "unknown"  # the sandbox has no metadata value
    assert rows["controller: secure_boot"] == ("enabled", "unknown", "unknown")
    assert rows["devices the trainer saw"] == ("tpu", "tpu x 4 replicas", "ok")
    assert rows["training backend"] == ("(recorded)", "jax", "ok")
    assert rows["steps/s"] == ("(measured)", "7.5", "ok")
    # Beside the plan's rate (its own figures for this job on v6e-8), and the trace.
    fit = runner.fit
    assert fit.steps == 300 and fit.hours > 0 and 0 < fit.mfu <= 1
    planned, seen, verdict = rows["steps/s and MFU vs the plan"]
    assert planned == f"{300 / (fit.hours * 3600):.2f} steps/s at {fit.mfu:.0%} MFU (plan)"
    mfu = fit.mfu * 7.5 / (300 / (fit.hours * 3600))
    assert seen.startswith(f"7.50 steps/s at {mfu:.1%} MFU (") and verdict == "ok"
    assert rows["profile (train.profile, JAX profiler)"] == (
        "steps 151-155 in profile/",
        "profile/plugins/profile/2026_11_26_00_30_00/t1v-n-0-w-0.xplane.pb",
        "ok",
    )
    assert rows[LOADS] == (
        "loads", "BertForMaskedLM: logits [1, 9, 2000] (transformers 5.0.0)", "ok",
    )  # fmt: skip
    assert rows["pulumi destroy"][2] == "ok"
    # The loader got this run's export, downloaded.
    local = w.report_dir / f"export-{RUN}"
    assert [c for c in w.calls if c[0] == "pt-python"] == [
        ["pt-python", str(smoke.LOAD_EXPORT), str(local)]
    ]
    assert json.loads((w.state / "loaded.json").read_text()) == [
        "config.json", "export_complete.json", "tokenizer.json",
    ]  # fmt: skip
    # The preflight: GA TPU lists, the recovery role this spot stack binds.
    assert rows["recovery role tpuPretrainTpuRecovery"] == ("exists", "yes", "ok")
    assert not [c for c in w.calls if c[:2] == ["gcloud", "alpha"]]
    # Progress lines while waiting, and a report a user can attach.
    log = w.out.getvalue()
    assert "job train complete 100%" in log and "preflight passed" in log
    (report,) = (w.tmp / "report").glob("smoke-v6e-euw4-*.md")
    text = report.read_text()
    assert text.startswith("# tpu-pretrain smoke run: stack v6e-euw4, PASSED")
    assert "| tpu: python | 3.10 | 3.10 | ok |" in text and "$ pulumi up --yes" in text
    gcloud_commands_are_real(w)


def test_a_host_that_does_not_match_the_catalog_fails_the_verdict(world):
    w = world()
    w.boot("tpu", {"STUB_PYTHON_VERSION": "3.12"})
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1
    assert w.rows(runner)["tpu: python"] == ("3.10", "3.12", "MISMATCH")
    assert "destroy --yes" in w.verbs("pulumi")  # destroyed all the same


def test_a_driver_or_nic_that_only_a_real_vm_shows_prints_its_fix_in_one_line(world):
    """Which NVIDIA module and NIC driver a GPU VM booted (templates/facts.sh) is known only
    on a real VM: a mismatch is a verdict row that names its fix."""
    w = world()
    w.boot("tpu")
    w.write(
        "bootstrap/facts-gpu.json",
        {
            "name": "gpu",
            "facts": {"nvidia_modules": "proprietary", "nvidia_branch": "570",
                      "nic_driver": "virtio_net"},
            "expected": {"nvidia_modules": "open", "nvidia_branch": "570", "nic_driver": "gve"},
        },
    )  # fmt: skip
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1
    rows = w.rows(runner)
    assert rows["gpu: nvidia_branch"] == ("570", "570", "ok")
    assert rows["gpu: nvidia_modules"] == (
        "open", f"proprietary; fix: {smoke.FACT_FIXES['nvidia_modules']}", "MISMATCH",
    )  # fmt: skip
    assert rows["gpu: nic_driver"] == (
        "gve", f"virtio_net; fix: {smoke.FACT_FIXES['nic_driver']}", "MISMATCH",
    )  # fmt: skip
    assert all("\n" not in fix for fix in smoke.FACT_FIXES.values())


@pytest.mark.parametrize(
    ("scenario", "check", "seen"),
    [
        ({"adc": False}, "credentials (application default, as Pulumi uses them)", "run `gcloud"),
        ({"billing": "False"}, "billing", "False"),
        ({"project_state": "DELETE_REQUESTED"}, "project tpu-pretrain-test", "DELETE_REQUESTED"),
        ({"tpu_types": ["v5litepod-8"]}, "accelerator type v6e-8 in europe-west4-a", "offered"),
        ({"versions": ["tpu-ubuntu2204-base"]}, "runtime version v2-alpha-tpuv6e in", "offered"),
        ({"roles": []}, "recovery role tpuPretrainTpuRecovery", "missing: create it once"),
        (
            {"deleted_roles": ["tpuPretrainTpuRecovery"]},
            "recovery role tpuPretrainTpuRecovery",
            "deleted (undelete it",
        ),
    ],
)
def test_a_preflight_failure_stops_before_anything_is_created(world, scenario, check, seen):
    w = world(**scenario)
    code, runner = w.smoke()
    assert code == 2
    assert w.verbs("pulumi") == []  # nothing created, nothing to destroy
    failed = [r for r in runner.report.rows if r.verdict == "FAILED"]
    assert failed[0].check.startswith(check) and failed[0].seen.startswith(seen)
    assert f"error: preflight: {failed[0].check}: " in w.out.getvalue()


def test_an_older_gcloud_reads_the_tpu_lists_on_the_alpha_track(world):
    w = world(old_gcloud=True)
    w.boot("tpu")
    w.finish_training()
    code, runner = w.smoke()
    assert code == 0, w.out.getvalue()
    assert w.rows(runner)["accelerator type v6e-8 in europe-west4-a"] == ("v6e-8", "yes", "ok")
    lists = [c[1:5] for c in w.calls if "tpu-vm" in c]
    assert lists == [
        ["compute", "tpus", "tpu-vm", "accelerator-types"],
        ["alpha", "compute", "tpus", "tpu-vm"],
        ["compute", "tpus", "tpu-vm", "versions"],
        ["alpha", "compute", "tpus", "tpu-vm"],
    ]
    gcloud_commands_are_real(w)


def test_a_billing_api_that_is_off_is_unknown_not_a_failure(world):
    w = world(billing_api_off=True)
    w.boot("tpu")
    w.finish_training()
    code, runner = w.smoke()
    assert code == 0, w.out.getvalue()
    assert w.rows(runner)["billing"] == (
        "True", "not readable: the Cloud Billing API is not enabled", "unknown",
    )  # fmt: skip


def test_a_disabled_tpu_api_is_unknown_not_a_failure(world):
    w = world(tpu_api_off=True)
    w.boot("tpu")
    w.finish_training()
    code, runner = w.smoke()
    assert code == 0, w.out.getvalue()
    assert w.rows(runner)["accelerator type v6e-8 in europe-west4-a"][1:] == (
        "API not enabled yet (pulumi up enables it)",
        "unknown",
    )


def test_a_deployed_stack_is_never_smoke_tested(world):
    w = world(already_deployed=True)
    code, _ = w.smoke()
    assert code == 2
    assert w.verbs("pulumi") == ["stack select", "stack output"]  # no up, no destroy
    assert "only on a stack with nothing deployed" in w.out.getvalue()


def test_a_failed_up_is_destroyed_and_reported(world):
    w = world(up_fails=True)
    code, runner = w.smoke()
    assert code == 1
    assert w.verbs("pulumi")[-2:] == ["up --yes", "destroy --yes"]
    assert w.rows(runner)["run"][1].startswith("pulumi up failed: error: googleapi: Error 403")


def test_a_job_that_stops_ends_the_wait_at_once(world):
    w = world()
    w.write("bootstrap/tpu.json", {"state": "stopped", "message": "trainer stopped with exit 2"})
    w.steps.append(lambda: pytest.fail("waited after the job stopped"))
    code, runner = w.smoke()
    assert code == 1
    assert w.rows(runner)["run"][1] == "the job stopped: tpu: trainer stopped with exit 2"
    assert "destroy --yes" in w.verbs("pulumi")


@pytest.mark.parametrize(
    ("stack", "status", "doc", "line"),
    [
        (
            "v4-32-usc2",
            "bootstrap/tpu-worker-2.json",
            {"role": "tpu", "state": "failed", "message": "jax.distributed.initialize timed out"},
            "tpu-worker-2: jax.distributed.initialize timed out",
        ),
        (
            "v6e-euw4",
            "bootstrap/tpu-watch.json",
            {"action": "queued", "message": "waiting in q (WAITING_FOR_RESOURCES) for t"},
            "tpu-watch: queued: waiting in q (WAITING_FOR_RESOURCES) for t",
        ),
        (
            "v6e-euw4",
            "bootstrap/tpu-watch.json",
            {"action": "create-failed", "message": "Error 403: tpu.nodes.create denied"},
            "tpu-watch: create-failed: Error 403: tpu.nodes.create denied",
        ),
        (
            "l4x2-use1",
            "bootstrap/gpu-watch.json",
            {"action": "start-failed", "message": "ZONE_RESOURCE_POOL_EXHAUSTED"},
            "gpu-watch: start-failed: ZONE_RESOURCE_POOL_EXHAUSTED",
        ),
        # The watchdog deleted (stopped) a VM whose loader gave up (tests/infra/
        # test_first_boot.py): the wait ends with its reason.
        (
            "v6e-euw4",
            "bootstrap/tpu-watch.json",
            {"action": "boot-failed", "message": "the boot of t failed (worker 0: no pointer)"},
            "tpu-watch: boot-failed: the boot of t failed (worker 0: no pointer)",
        ),
    ],
)
def test_a_worker_or_watchdog_failure_ends_the_wait_with_its_line(world, stack, status, doc, line):
    quotas = {"quotas": [{"metric": "PREEMPTIBLE_NVIDIA_L4_GPUS", "limit": 8.0, "usage": 0.0}]}
    w = world(stack, tpu_types=["v4-32", "v6e-8"], **quotas)
    w.write("bootstrap/tpu-worker-1.json", {"role": "tpu", "state": "started"})
    w.write("bootstrap/tpu-watch.json", {"action": "none", "message": "nothing to do"})
    w.write(status, doc)
    w.steps.append(lambda: pytest.fail("waited after the first failure"))
    code, runner = w.smoke()
    assert code == 1, w.out.getvalue()
    assert w.rows(runner)["run"][1] == f"the job stopped: {line}"
    assert "destroy --yes" in w.verbs("pulumi")


@pytest.mark.parametrize(
    ("stack", "files"),
    [
        ("v4-32-usc2", ["controller", "tpu", "tpu-worker-1", "tpu-worker-2", "tpu-worker-3",
                        "tpu-watch"]),
        ("l4x2-use1", ["controller", "gpu", "gpu-watch"]),
        ("v6e-euw4", ["controller", "tpu", "tpu-watch"]),
    ],
)  # fmt: skip
def test_the_wait_reads_every_status_file_of_the_stack(world, stack, files):
    w = world(stack)
    cfg, _ = smoke.Smoke(stack, stacks_dir=w.stacks, report_dir=w.report_dir, name=RUN).load()
    assert smoke.status_files(cfg) == files
    off = smoke.status_files(replace(cfg, accelerator=replace(cfg.accelerator, auto_recover=False)))
    assert off == files[:-1]  # no watchdog without auto-recovery


def test_the_wait_is_bounded_and_keep_leaves_the_stack_up(world):
    w = world()
    code, runner = w.smoke(timeout_s=300, keep=True)
    assert code == 1
    assert w.clock == 300  # five polls of 60 s, then it gives up
    assert w.rows(runner)["run"][1].startswith("no complete export after 5 min")
    assert "destroy --yes" not in w.verbs("pulumi")
    assert "KEEP=1: stack v6e-euw4 stays up" in w.out.getvalue()


def test_a_timeout_names_a_vm_whose_boot_failed(world):
    """Without a status in the bucket (the controller never booted, no watchdog), the VMs'
    boot states say why (templates/loader.sh: a guest attribute each)."""
    failed = "failed 1700000000 cannot read the job pointer gs://b/jobs/current.json after 615s"
    attributes = {"tp-v6e-euw4-controller": f"boot\t{failed}\n", "tp-v6e-euw4-tpu": "0\tboot\tok\n"}
    w = world(guest_attributes=attributes)
    code, runner = w.smoke(timeout_s=120)
    assert code == 1
    assert w.rows(runner)["run"][1].endswith(
        "; boot failed on controller: cannot read the job pointer gs://b/jobs/current.json after "
        "615s"
    )
    gcloud_commands_are_real(w)


def test_a_broken_export_fails_the_verdict(world):
    w = world(export_broken=True)
    w.boot("tpu")
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1
    assert w.rows(runner)[LOADS] == (
        "loads",
        'BertForMaskedLM.from_pretrained: {"missing_keys": "{cls.predictions.bias}"}',
        "FAILED",
    )


def test_the_last_runs_files_in_the_kept_bucket_are_never_judged(world):
    """destroy keeps the bucket: a second run must not find the first one's export marker
    and status (the old fixed name `smoke`, or an earlier run's name)."""
    w = world()
    for old in ("smoke", "smoke-20261125-230000"):
        root = w.box.gcs / w.bucket / "runs" / old
        (root / "export").mkdir(parents=True)
        (root / "export" / "export_complete.json").write_text("{}")
        (root / "export" / "config.json").write_text("{}")
        (root / "status.json").write_text(json.dumps({"stage": "train", "state": "complete"}))
    code, runner = w.smoke(timeout_s=180)
    assert code == 1
    assert w.rows(runner)["run"][1].startswith("no complete export after 3 min")
    assert LOADS not in w.rows(runner)
    assert not [c for c in w.calls if c[0] == "pt-python"]


def test_each_run_has_a_fresh_name():
    first = smoke.run_name(datetime(2026, 11, 26, 0, 15, 0, tzinfo=timezone.utc))
    second = smoke.run_name(datetime(2026, 11, 26, 0, 15, 1, tzinfo=timezone.utc))
    assert (first, second) == ("smoke-20261126-001500", "smoke-20261126-001501")
    default = smoke.Smoke("v6e-euw4").name
    assert default.startswith("smoke-") and default != "smoke"


def test_a_gpu_stack_checks_machine_type_gpu_quotas_and_its_role(world):
    """GPUS_ALL_REGIONS is the project's quota (`project-info describe`); a region's
    `regions describe` never lists it. The GPU's own quota is the region's."""
    w = world(
        "l4x2-use1",
        project_quotas=[{"metric": "GPUS_ALL_REGIONS", "limit": 4.0, "usage": 3.0}],
        quotas=[
            {"metric": "PREEMPTIBLE_NVIDIA_L4_GPUS", "limit": 8.0, "usage": 0.0},
            {"metric": "GPUS_ALL_REGIONS", "limit": 99.0, "usage": 0.0},  # never read here
        ],
        roles=["tpuPretrainTpuRecovery"],
    )
    code, runner = w.smoke()
    assert code == 2
    rows = w.rows(runner)
    assert rows["machine type g2-standard-24 in us-east1-d"][2] == "ok"
    assert rows["GPU nvidia-l4 in us-east1-d"][2] == "ok"
    assert rows["quota GPUS_ALL_REGIONS in the project"] == (
        ">= 2 free", "1 free (request more: IAM & Admin > Quotas)", "FAILED",
    )  # fmt: skip
    assert rows["quota PREEMPTIBLE_NVIDIA_L4_GPUS in us-east1"] == (">= 2 free", "8 free", "ok")
    assert rows["recovery role tpuPretrainGpuRecovery"][2] == "FAILED"
    assert "error: preflight: quota GPUS_ALL_REGIONS in the project: 1 free" in w.out.getvalue()
    gcloud_commands_are_real(w)


def test_a_quota_gcloud_does_not_list_is_unknown(world):
    w = world("l4x2-use1", quotas=[{"metric": "PREEMPTIBLE_NVIDIA_L4_GPUS", "limit": 8.0}])
    code, runner = w.smoke(timeout_s=60)
    assert w.rows(runner)["quota GPUS_ALL_REGIONS in the project"] == (
        ">= 2 free", "not listed for the project", "unknown",
    )  # fmt: skip
    assert "up --yes" in w.verbs("pulumi")  # unknown does not stop the run
    assert code == 1  # (nothing ran on the stub VMs: the wait times out)


def test_a_stack_without_a_project_is_one_line(world):
    w = world()
    document = yaml.safe_load(w.stack_file.read_text())
    del document["config"]["gcp:project"]
    w.stack_file.write_text(yaml.safe_dump(document))
    code, _ = w.smoke()
    assert code == 2
    assert "error: gcp:project is not set for stack v6e-euw4: run `pulumi config set" in (
        w.out.getvalue()
    )
    assert w.calls == []


# tools/load_export.py itself, in the PyTorch environment the smoke run uses: a real tiny
# BERT export loads and runs; the same export with one weight missing (transformers would
# fill it with random values and only print a report), one whose config.json names code to
# run (auto_map), one whose weights are only a pickle (pytorch_model.bin) and a directory
# that is no export fail with one line.
BUILD_EXPORTS = r"""
import json, sys
from pathlib import Path
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
out = Path(sys.argv[1])
vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "run"])}
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
    sep_token="[SEP]", mask_token="[MASK]")
config = transformers.BertConfig(
    vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=16, max_position_embeddings=32)
for name, drop in (("good", None), ("missing", "bert.encoder.layer.0.output.dense.weight")):
    transformers.BertForMaskedLM(config).save_pretrained(out / name)
    fast.save_pretrained(out / name)
    if drop:
        state = load_file(out / name / "model.safetensors")
        del state[drop]
        save_file(state, out / name / "model.safetensors", metadata={"format": "pt"})
# "remote": importing modeling_evil.py (transformers would, with trust_remote_code) writes RAN.
remote = out / "remote"
transformers.BertForMaskedLM(config).save_pretrained(remote)
fast.save_pretrained(remote)
doc = json.loads((remote / "config.json").read_text())
doc.update(model_type="evil-bert", auto_map={"AutoConfig": "modeling_evil.EvilConfig"})
(remote / "config.json").write_text(json.dumps(doc))
(remote / "modeling_evil.py").write_text(
    f"from pathlib import Path\nPath({str(out / 'RAN')!r}).write_text('ran')\n"
    "from transformers import BertConfig\n"
    "class EvilConfig(BertConfig):\n    model_type = 'evil-bert'\n")
# "pickle": the weights only as pytorch_model.bin, which transformers would unpickle.
pickled = out / "pickle"
model = transformers.BertForMaskedLM(config)
model.save_pretrained(pickled)
fast.save_pretrained(pickled)
torch.save(model.state_dict(), pickled / "pytorch_model.bin")
(pickled / "model.safetensors").unlink()
"""


@pytest.mark.slow
def test_the_export_loader_loads_a_real_export_and_refuses_random_weights(tmp_path):
    python = Path(os.environ.get("PAYLOAD_PT_PYTHON") or smoke.PT_PYTHON)
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must run this check: build .venv-pt with `make venv-pt`")
        pytest.skip("no PyTorch environment: `make venv-pt` builds .venv-pt")
    built = subprocess.run(
        [str(python), "-c", BUILD_EXPORTS, str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr

    def load(name: str) -> subprocess.CompletedProcess[str]:
        # "y" on stdin: what a user would answer transformers' "run the custom code?" prompt.
        return subprocess.run(
            [str(python), str(smoke.LOAD_EXPORT), str(tmp_path / name)],
            check=False,
            capture_output=True,
            text=True,
            input="y\n",
            timeout=300,
            env={**os.environ, "HF_HOME": str(tmp_path / "hf-home")},
        )

    good = load("good")
    assert good.returncode == 0, good.stderr
    doc = json.loads(good.stdout)
    assert doc["class"] == "BertForMaskedLM" and doc["logits_shape"] == [1, doc["tokens"], 7]
    missing = load("missing")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == (
        "BertForMaskedLM.from_pretrained: "
        '{"missing_keys": "{\'bert.encoder.layer.0.output.dense.weight\'}"}'
    )
    remote = load("remote")
    assert remote.returncode == 1 and not (tmp_path / "RAN").exists(), remote.stderr
    assert "contains custom code which must be executed" in remote.stderr.strip().splitlines()[-1]
    pickled = load("pickle")
    assert pickled.returncode == 1, pickled.stdout
    assert (
        pickled.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"Error no file named model.safetensors found in directory {tmp_path / 'pickle'}."
        )
    )
    nothing = load("nothing")
    assert nothing.returncode == 1
    assert nothing.stderr.strip().endswith("nothing: no config.json (not an export directory)")


DEPLOY = "serviceAccount:tpu-pretrain-deploy@tpu-pretrain-test.iam.gserviceaccount.com"
GRANT = {
    "role": "projects/tpu-pretrain-test/roles/tpuPretrainStackAccountUser",
    "members": [DEPLOY],
}
# The bootstrap's other grant on the TPU VM's account: the controller's actAs (this spot
# stack's watchdog recreates the VM as that account).
CONTROLLER_GRANT = {
    "role": "roles/iam.serviceAccountUser",
    "members": ["serviceAccount:tp-v6e-euw4-controller@tpu-pretrain-test.iam.gserviceaccount.com"],
}
ADOPTS = GITOPS


def _gitops(expression: str) -> list[dict]:
    return [
        {"role": "projects/tpu-pretrain-test/roles/tpuPretrainDeployer", "members": [DEPLOY]},
        {
            "role": "projects/tpu-pretrain-test/roles/tpuPretrainStackBuckets",
            "members": [DEPLOY],
            "condition": {"title": "stack-buckets-only", "expression": expression},
        },
    ]


GOOD = "resource.type == 'storage.googleapis.com/Bucket' && resource.name.endsWith('-x')"


@pytest.mark.parametrize(
    ("scenario", "check", "seen"),
    [
        (
            {"project_bindings": _gitops("resource.name.matches('^projects/_/buckets/a$')"),
             "account_bindings": [GRANT, CONTROLLER_GRANT], "stack_config": ADOPTS},
            "GitOps: the bootstrap's IAM conditions",
            "a condition uses matches(): re-run the bootstrap's `pulumi up --refresh`",
        ),
        (
            {"project_bindings": _gitops(GOOD), "account_bindings": [GRANT, CONTROLLER_GRANT]},
            "GitOps: the stack adopts the bootstrap's accounts",
            "set tpu-pretrain:accountsFromBootstrap: true in stacks/Pulumi.v6e-euw4.yaml",
        ),
        (
            {"project_bindings": _gitops(GOOD), "account_bindings": [], "stack_config": ADOPTS},
            "GitOps: deploy account's actAs on tp-v6e-euw4-workload",
            "missing: add stacks/Pulumi.v6e-euw4.yaml, then re-run the bootstrap's "
            "`pulumi up --refresh`",
        ),
        (
            {"project_bindings": _gitops(GOOD), "account_bindings": [GRANT],
             "stack_config": ADOPTS},
            "GitOps: controller's actAs on tp-v6e-euw4-workload",
            "missing: re-run the bootstrap's `pulumi up --refresh`",
        ),
        (
            {"project_bindings": _gitops(GOOD), "account_bindings": [GRANT, CONTROLLER_GRANT],
             "missing_accounts": ["tp-v6e-euw4-vpn-hop"], "stack_config": ADOPTS},
            "GitOps: deploy account's actAs on tp-v6e-euw4-vpn-hop",
            "missing: add stacks/Pulumi.v6e-euw4.yaml",
        ),
    ],
    ids=["matches", "stack-owns-accounts", "no-deploy-grant", "no-controller-grant",
         "no-account"],
)  # fmt: skip
def test_a_gitops_project_without_the_bootstraps_iam_stops_with_the_fix(
    world, scenario, check, seen
):
    w = world(**scenario)
    code, runner = w.smoke()
    assert code == 2
    assert w.verbs("pulumi") == []
    failed = [r for r in runner.report.rows if r.verdict == "FAILED"]
    assert failed[0].check == check and failed[0].seen.startswith(seen), failed


def test_a_gitops_project_with_the_bootstraps_iam_passes_the_preflight(world):
    w = world(
        project_bindings=_gitops(GOOD), account_bindings=[GRANT, CONTROLLER_GRANT],
        stack_config=ADOPTS,
    )  # fmt: skip
    w.boot("controller")
    w.boot("tpu", {"STUB_PYTHON_VERSION": "3.10"})
    w.write("bootstrap/tpu.json", {"state": "started"})
    w.finish_training()
    code, runner = w.smoke()
    assert code == 0, w.out.getvalue()
    rows = {r.check: (r.seen, r.verdict) for r in runner.report.rows}
    assert rows["GitOps: the bootstrap's IAM conditions"] == ("1 conditional bindings", "ok")
    for suffix in ("workload", "controller", "vpn-hop"):
        assert rows[f"GitOps: deploy account's actAs on tp-v6e-euw4-{suffix}"] == ("yes", "ok")
    assert rows["GitOps: the stack adopts the bootstrap's accounts"] == ("yes", "ok")
    assert rows["GitOps: controller's actAs on tp-v6e-euw4-workload"] == ("yes", "ok")


def test_a_project_without_the_deploy_account_is_not_gitops(world):
    w = world()
    code, runner = w.smoke(timeout_s=60)  # a preflight row: one poll of the wait is enough
    assert code == 1  # (nothing ran on the stub VMs: the wait times out)
    rows = {r.check: (r.seen, r.verdict) for r in runner.report.rows}
    assert rows["GitOps: the bootstrap's IAM conditions"] == (
        "no deploy account: not GitOps",
        "unknown",
    )


def _fake_tpu_python(directory: Path, code: int, line: str) -> Path:
    """An interpreter standing in for the TPU environment's: records its argv, prints `line`
    on stderr, exits `code` (the real compile is tests/payload/test_tpu_compile.py's)."""
    python = directory / "tpu-python"
    python.write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > {directory}/compile-argv\n'
        f'echo "error: {line}" >&2\nexit {code}\n'
    )
    python.chmod(0o755)
    return python


@pytest.mark.parametrize(("code", "verdict"), [(0, "ok"), (2, "FAILED")])
def test_the_preflight_compiles_the_job_when_asked(world, code, verdict):
    """`make smoke ... COMPILE=1`: a preflight row for `tpu-payload compile` of the smoke job
    on the stack's TPU type; a job that does not fit stops before anything is created."""
    w = world()
    python = _fake_tpu_python(w.tmp, code, "smoke-run does not fit v6e-8: out of HBM")
    if code == 0:
        w.boot("controller")
        w.boot("tpu", {"STUB_PYTHON_VERSION": "3.10"})
        w.write("bootstrap/tpu.json", {"state": "started"})
        w.finish_training()
    result, runner = w.smoke(compile_python=str(python))
    row = w.rows(runner)["the job compiles for v6e-8 (tpu-payload compile)"]
    assert row[2] == verdict, row
    argv = (w.tmp / "compile-argv").read_text().split()
    assert argv[:4] == ["-m", "payload", "compile", "--job"] and argv[-2:] == [
        "--accelerator",
        "v6e-8",
    ]
    if code:
        assert result == 2 and w.verbs("pulumi") == []
        assert row[1] == "smoke-run does not fit v6e-8: out of HBM"
    else:
        assert result == 0, w.out.getvalue()
