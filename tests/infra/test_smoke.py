"""`make smoke` end to end, offline: infra/smoke.py drives stub `gcloud` and `pulumi`
executables (first on PATH) and a stub payload CLI; the bucket is a directory. What the VMs
write there comes from the real rendered startup script run in the script sandbox
(templates/facts.sh) and is published step by step by the injected `sleep`: the wait loop
synchronises on those steps, never on time. Every branch of the control flow runs: all good,
a preflight failure, a stack that is already deployed, a failed `pulumi up`, a host that does
not match the catalog, a job that stops, a timeout, KEEP=1, a GPU stack."""

from __future__ import annotations

import io
import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from gcloud_flags import problems
from harness import run_offline
from test_infra_scripts import (  # the sandbox and its helpers, shared with the TPU tests
    Sandbox,
    _publish_payload,
    _script,
    sandbox,  # noqa: F401  (a fixture)
)

from infra import smoke

PROJECT = "tpu-pretrain-test"
SMOKE = {"tpu-pretrain:job": smoke.SMOKE_JOB}

# The stub CLIs: Python scripts that answer from $SMOKE_STATE/scenario.json and log argv.
GCLOUD = r"""
import fnmatch, json, os, shutil, sys
from pathlib import Path
state = Path(os.environ["SMOKE_STATE"])
scenario = json.loads((state / "scenario.json").read_text())
bucket = Path(os.environ["SMOKE_GCS"])
argv = sys.argv[1:]
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["gcloud", *argv]) + "\n")
words = [a for a in argv if not a.startswith("-")]
def local(uri):
    return bucket / uri.removeprefix("gs://")
def fail(message, code=1):
    print(f"ERROR: {message}", file=sys.stderr)
    sys.exit(code)
if words[:3] == ["auth", "application-default", "print-access-token"]:
    if not scenario.get("adc", True):
        fail("(gcloud.auth.application-default.print-access-token) File ... was not found.")
    print("ya29.token")
elif words[:2] == ["projects", "describe"]:
    print(scenario.get("project_state", "ACTIVE"))
elif words[:3] == ["billing", "projects", "describe"]:
    print(scenario.get("billing", "True"))
elif words[:5] == ["alpha", "compute", "tpus", "tpu-vm", "accelerator-types"]:
    if scenario.get("tpu_api_off"):
        fail("Cloud TPU API has not been used in project 1 before or it is disabled.")
    print("\n".join(scenario.get("tpu_types", ["v6e-8", "v6e-16"])))
elif words[:5] == ["alpha", "compute", "tpus", "tpu-vm", "versions"]:
    if scenario.get("tpu_api_off"):
        fail("Cloud TPU API has not been used in project 1 before or it is disabled.")
    print("\n".join(scenario.get("versions", ["v2-alpha-tpuv6e", "tpu-ubuntu2204-base"])))
elif words[:3] == ["compute", "machine-types", "describe"]:
    print(words[3])
elif words[:3] == ["compute", "accelerator-types", "list"]:
    print("\n".join(scenario.get("gpu_types", ["nvidia-l4", "nvidia-tesla-t4"])))
elif words[:3] == ["compute", "regions", "describe"]:
    print(json.dumps({"quotas": scenario.get("quotas", [])}))
elif words[:2] == ["storage", "cp"]:
    *sources, target = words[2:]
    for source in sources:
        dest = local(target) / Path(source).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)
elif words[:2] == ["storage", "cat"]:
    path = local(words[2])
    if not path.is_file():
        fail(f"(gcloud.storage.cat) The following URLs matched no objects or files: {words[2]}")
    sys.stdout.write(path.read_text())
elif words[:2] == ["storage", "ls"]:
    pattern = words[2]
    found = sorted(
        "gs://" + str(p.relative_to(bucket))
        for p in bucket.rglob("*") if p.is_file()
        and fnmatch.fnmatch("gs://" + str(p.relative_to(bucket)), pattern)
    )
    if not found:
        fail("(gcloud.storage.ls) One or more URLs matched no objects.")
    print("\n".join(found))
else:
    fail(f"unexpected: gcloud {' '.join(argv)}", 3)
"""
PULUMI = r"""
import json, os, sys
from pathlib import Path
state = Path(os.environ["SMOKE_STATE"])
scenario = json.loads((state / "scenario.json").read_text())
argv = sys.argv[1:]
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["pulumi", *argv]) + "\n")
up = state / "deployed"
if argv[:2] == ["stack", "select"]:
    pass
elif argv[:2] == ["stack", "output"]:
    deployed = up.exists() or scenario.get("already_deployed")
    print(json.dumps(json.loads((state / "outputs.json").read_text()) if deployed else {}))
elif argv[0] == "up":
    config = argv[argv.index("--config-file") + 1]
    (state / "up-config.yaml").write_text(Path(config).read_text())
    if scenario.get("up_fails"):
        print("error: googleapi: Error 403: Permission denied on resource", file=sys.stderr)
        sys.exit(255)
    up.touch()
elif argv[0] == "destroy":
    up.unlink(missing_ok=True)
else:
    print(f"unexpected: pulumi {argv}", file=sys.stderr)
    sys.exit(3)
"""
PAYLOAD = r"""
import json, os, sys
from pathlib import Path
state = Path(os.environ["SMOKE_STATE"])
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["tpu-payload", *sys.argv[1:]]) + "\n")
if json.loads((state / "scenario.json").read_text()).get("export_broken"):
    print("error: export: pytorch_model.safetensors is missing", file=sys.stderr)
    sys.exit(2)
"""


class World:
    """The stubs, the bucket and the VMs' timeline for one smoke run."""

    def __init__(self, tmp_path: Path, box: Sandbox, monkeypatch, stack: str, **scenario):
        self.tmp, self.box, self.stack = tmp_path, box, stack
        self.state = tmp_path / "smoke-state"
        bin_dir = tmp_path / "smoke-bin"
        for directory in (self.state, bin_dir):
            directory.mkdir()
        for name, body in (("gcloud", GCLOUD), ("pulumi", PULUMI), ("tpu-payload", PAYLOAD)):
            path = bin_dir / name
            path.write_text(f"#!{sys.executable}\n{body}")
            path.chmod(0o755)
        self.payload_cli = [str(bin_dir / "tpu-payload")]
        (self.state / "scenario.json").write_text(json.dumps(scenario))
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        monkeypatch.setenv("SMOKE_STATE", str(self.state))
        monkeypatch.setenv("SMOKE_GCS", str(box.gcs))
        # The user's stack file, with their project set (never changed by the smoke run).
        self.stacks = tmp_path / "stacks"
        self.stacks.mkdir()
        source = smoke.STACKS_DIR / f"Pulumi.{stack}.yaml"
        document = yaml.safe_load(source.read_text())
        document["config"]["gcp:project"] = PROJECT
        self.stack_file = self.stacks / f"Pulumi.{stack}.yaml"
        self.stack_file.write_text(yaml.safe_dump(document))
        # What `pulumi up` would create: the program itself, under Pulumi's mocks.
        self.run = run_offline(stack, SMOKE)
        (self.state / "outputs.json").write_text(json.dumps(self.run.exports))
        self.bucket = self.run.exports["bucketUrl"].removeprefix("gs://")
        self.root = box.gcs / self.bucket / "runs" / "smoke"
        self.steps: list = []
        self.clock = 0.0
        self.out = io.StringIO()

    # The VMs, step by step: each sleep of the wait loop publishes the next step.
    def boot(self, role: str, env: dict[str, str] | None = None) -> None:
        def step() -> None:
            archive = next(r for r in self.run.resources if r.name == "payload-archive")
            if not (self.box.gcs / self.bucket / archive.inputs["name"]).exists():
                _publish_payload(self.run, self.box)
            result = self.box.run(_script(self.run, f"{role}-vm"), **(env or {}))
            assert result.returncode == 0, result.stderr

        self.steps.append(step)

    def write(self, relative: str, doc: dict) -> None:
        def step() -> None:
            path = self.root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc))

        self.steps.append(step)

    def finish_training(self, steps_per_second: float = 7.5) -> None:
        accelerator = "gpu" if "gpuName" in self.run.exports else "tpu"
        self.write(
            "status.json",
            {
                "stage": "train", "state": "complete", "progress": 1.0,
                "runtime": {
                    "accelerator": accelerator, "replicas": 4, "hosts": 1, "backend": "jax",
                },
                "stages": {"train": {"metrics": {"steps_per_second": steps_per_second}}},
            },
        )  # fmt: skip
        self.write("export/export_complete.json", {"step": 300})

    def sleep(self, seconds: float) -> None:
        self.clock += seconds
        if self.steps:
            self.steps.pop(0)()

    def smoke(self, **options) -> tuple[int, smoke.Smoke]:
        runner = smoke.Smoke(
            self.stack,
            clock=lambda: self.clock,
            sleep=self.sleep,
            poll_s=60,
            timeout_s=options.pop("timeout_s", 3600),
            report_dir=self.tmp / "report",
            payload_cli=self.payload_cli,
            out=self.out,
            stacks_dir=self.stacks,
            **options,
        )
        return runner.execute(), runner

    @property
    def calls(self) -> list[list[str]]:
        path = self.state / "calls.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def verbs(self, tool: str) -> list[str]:
        return [" ".join(c[1:3]) for c in self.calls if c[0] == tool]

    def rows(self, runner: smoke.Smoke) -> dict[str, tuple[str, str, str]]:
        return {r.check: (r.expected, r.seen, r.verdict) for r in runner.report.rows}


@pytest.fixture
def world(tmp_path, sandbox, monkeypatch):  # noqa: F811
    return lambda stack="v6e-euw4", **scenario: World(
        tmp_path, sandbox, monkeypatch, stack, **scenario
    )


def _gcloud_commands_are_real(w: World) -> None:
    commands = [c for c in w.calls if c[0] == "gcloud"]
    assert commands
    assert {shlex.join(c): problems(c) for c in commands if problems(c)} == {}


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
    up_config = yaml.safe_load((w.state / "up-config.yaml").read_text())["config"]
    assert up_config["tpu-pretrain:job"] == "stacks/jobs/smoke.yaml"
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
    assert rows["export loads (tpu-payload export)"][2] == "ok"
    assert rows["pulumi destroy"][2] == "ok"
    assert [c for c in w.calls if c[0] == "tpu-payload"] == [
        ["tpu-payload", "export", "--job", f"gs://{w.bucket}/jobs/smoke.json"]
    ]
    # Progress lines while waiting, and a report a user can attach.
    log = w.out.getvalue()
    assert "job train complete 100%" in log and "preflight passed" in log
    (report,) = (w.tmp / "report").glob("smoke-v6e-euw4-*.md")
    text = report.read_text()
    assert text.startswith("# tpu-pretrain smoke run: stack v6e-euw4, PASSED")
    assert "| tpu: python | 3.10 | 3.10 | ok |" in text and "$ pulumi up --yes" in text
    _gcloud_commands_are_real(w)


def test_a_host_that_does_not_match_the_catalog_fails_the_verdict(world):
    w = world()
    w.boot("tpu", {"STUB_PYTHON_VERSION": "3.12"})
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1
    assert w.rows(runner)["tpu: python"] == ("3.10", "3.12", "MISMATCH")
    assert "destroy --yes" in w.verbs("pulumi")  # destroyed all the same


@pytest.mark.parametrize(
    ("scenario", "check", "seen"),
    [
        ({"adc": False}, "credentials (application default, as Pulumi uses them)", "run `gcloud"),
        ({"billing": "False"}, "billing", "False"),
        ({"project_state": "DELETE_REQUESTED"}, "project tpu-pretrain-test", "DELETE_REQUESTED"),
        ({"tpu_types": ["v5litepod-8"]}, "accelerator type v6e-8 in europe-west4-a", "offered"),
        ({"versions": ["tpu-ubuntu2204-base"]}, "runtime version v2-alpha-tpuv6e in", "offered"),
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


def test_the_wait_is_bounded_and_keep_leaves_the_stack_up(world):
    w = world()
    code, runner = w.smoke(timeout_s=300, keep=True)
    assert code == 1
    assert w.clock == 300  # five polls of 60 s, then it gives up
    assert w.rows(runner)["run"][1].startswith("no complete export after 5 min")
    assert "destroy --yes" not in w.verbs("pulumi")
    assert "KEEP=1: stack v6e-euw4 stays up" in w.out.getvalue()


def test_a_broken_export_fails_the_verdict(world):
    w = world(export_broken=True)
    w.boot("tpu")
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1
    assert w.rows(runner)["export loads (tpu-payload export)"] == (
        "exit 0",
        "error: export: pytorch_model.safetensors is missing",
        "FAILED",
    )


def test_a_gpu_stack_checks_machine_type_gpu_and_quota(world):
    quotas = [
        {"metric": "GPUS_ALL_REGIONS", "limit": 4.0, "usage": 0.0},
        {"metric": "PREEMPTIBLE_NVIDIA_L4_GPUS", "limit": 1.0, "usage": 0.0},
    ]
    w = world("l4x2-use1", quotas=quotas)
    code, runner = w.smoke()
    assert code == 2
    rows = w.rows(runner)
    assert rows["machine type g2-standard-24 in us-east1-d"][2] == "ok"
    assert rows["GPU nvidia-l4 in us-east1-d"][2] == "ok"
    assert rows["quota GPUS_ALL_REGIONS in us-east1"] == (">= 2 free", "4 free", "ok")
    assert rows["quota PREEMPTIBLE_NVIDIA_L4_GPUS in us-east1"][1:] == (
        "1 free (request more: IAM & Admin > Quotas)",
        "FAILED",
    )
    _gcloud_commands_are_real(w)


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
