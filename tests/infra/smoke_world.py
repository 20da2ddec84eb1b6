"""The offline world of `make smoke` (tests/infra/test_smoke.py, test_untrusted.py): stub
`gcloud` and `pulumi` executables first on PATH and a stub export loader, a bucket that is a
directory, and the VMs' timeline: what the VMs write comes from the real rendered startup
scripts run in the script sandbox and is published step by step by the injected `sleep`, so
the wait loop synchronises on those steps, never on time.

    World(tmp_path, sandbox, monkeypatch, stack, **scenario)   (conftest.py's `world` fixture)
    w.boot(role), w.write(relative, doc), w.finish_training(export=EXPORT)
    w.smoke(**options) -> (exit code, smoke.Smoke); w.rows(runner), w.calls, w.verbs(tool)
    gcloud_commands_are_real(w)
"""

from __future__ import annotations

import io
import json
import shlex
import sys
from pathlib import Path

import yaml
from gcloud_flags import problems
from harness import run_offline, startup_script
from script_sandbox import Sandbox, publish_payload

from infra import jobspec
from infra.commands import smoke

PROJECT = "tpu-pretrain-test"
RUN = "smoke-20261126-001500"  # the run's name, injected (by default from the UTC time)
LOADS = "export loads (from_pretrained + one forward pass, PyTorch CPU)"
# What the exporter writes into export/ (payload/training/export.py set_pytorch_config, the
# tokenizer's save_pretrained), as much as the stub loader needs.
BERT_CONFIG = {
    "architectures": ["BertForMaskedLM"],
    "model_type": "bert",
    "transformers_weights": "pytorch_model.safetensors",
}
EXPORT: dict[str, dict | str] = {
    "config.json": BERT_CONFIG,
    "tokenizer.json": {"version": "1.0", "model": {"type": "WordPiece"}},
}

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
tpu = words[1:] if words[:1] == ["alpha"] else words  # the TPU VM lists: GA, or alpha
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
    if scenario.get("billing_api_off"):
        fail("Cloud Billing API has not been used in project 7 before or it is disabled. "
             "Enable it by visiting https://console.developers.google.com/apis/api/"
             "cloudbilling.googleapis.com/overview?project=7")
    print(scenario.get("billing", "True"))
elif words[:4] in (["compute", "tpus", "tpu-vm", "accelerator-types"],
                   ["compute", "tpus", "tpu-vm", "versions"]) and scenario.get("old_gcloud"):
    fail(f"(gcloud.compute.tpus.tpu-vm) Invalid choice: '{words[3]}'.", 2)
elif words[:1] == ["alpha"] and not scenario.get("old_gcloud"):
    fail("unexpected: alpha although the GA command works", 3)
elif tpu[:4] == ["compute", "tpus", "tpu-vm", "accelerator-types"]:
    if scenario.get("tpu_api_off"):
        fail("Cloud TPU API has not been used in project 1 before or it is disabled.")
    print("\n".join(scenario.get("tpu_types", ["v6e-8", "v6e-16", "v4-32"])))
elif tpu[:4] == ["compute", "tpus", "tpu-vm", "versions"]:
    if scenario.get("tpu_api_off"):
        fail("Cloud TPU API has not been used in project 1 before or it is disabled.")
    print("\n".join(scenario.get("versions", ["v2-alpha-tpuv6e", "tpu-ubuntu2204-base"])))
elif words[:3] == ["iam", "roles", "describe"]:
    if words[3] not in scenario.get("roles", ["tpuPretrainTpuRecovery", "tpuPretrainGpuRecovery"]):
        fail(f"NOT_FOUND: The role named projects/p/roles/{words[3]} was not found.")
    print(json.dumps({"name": f"projects/p/roles/{words[3]}",
                      "deleted": words[3] in scenario.get("deleted_roles", [])}))
elif words[:2] == ["projects", "get-iam-policy"]:
    print(json.dumps({"bindings": scenario.get("project_bindings", [])}))
elif words[:3] == ["iam", "service-accounts", "get-iam-policy"]:
    if words[3].split("@")[0] in scenario.get("missing_accounts", []):
        fail(f"NOT_FOUND: Service account projects/-/serviceAccounts/{words[3]} does not exist.")
    print(json.dumps({"bindings": scenario.get("account_bindings", [])}))
elif words[:3] == ["compute", "project-info", "describe"]:
    print(json.dumps({"quotas": scenario.get("project_quotas", [])}))
elif words[:3] == ["compute", "machine-types", "describe"]:
    print(words[3])
elif words[:3] == ["compute", "accelerator-types", "list"]:
    print("\n".join(scenario.get("gpu_types", ["nvidia-l4", "nvidia-tesla-t4"])))
elif words[:3] == ["compute", "regions", "describe"]:
    print(json.dumps({"quotas": scenario.get("quotas", [])}))
elif words[:2] == ["storage", "cp"] and words[2].startswith("gs://"):  # a download
    *sources, target = words[2:]
    assert target.endswith("/") and Path(target).is_dir(), argv  # into a folder, by name
    for source in sources:
        assert "*" not in source, argv
        if not local(source).is_file():
            fail(f"The following URLs matched no objects or files: {source}")
        shutil.copy(local(source), Path(target) / local(source).name)
        if scenario.get("download_fails"):  # after the first object: a half-done download
            fail("HTTPError 503: Backend Error")
elif words[:2] == ["storage", "cp"]:
    *sources, target = words[2:]
    for source in sources:
        dest = local(target) / Path(source).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)
elif "get-guest-attributes" in words:  # a VM's boot state: scenario guest_attributes[vm]
    vm = words[words.index("get-guest-attributes") + 1]
    print(scenario.get("guest_attributes", {}).get(vm, ""), end="")
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
LOADER = r"""
import json, os, sys
from pathlib import Path
state = Path(os.environ["SMOKE_STATE"])
with (state / "calls.log").open("a") as log:
    log.write(json.dumps(["pt-python", *sys.argv[1:]]) + "\n")
export = Path(sys.argv[2])
(state / "loaded.json").write_text(json.dumps(sorted(p.name for p in export.iterdir())))
scenario = json.loads((state / "scenario.json").read_text())
if scenario.get("export_broken"):
    print('BertForMaskedLM.from_pretrained: {"missing_keys": "{cls.predictions.bias}"}',
          file=sys.stderr)
    sys.exit(1)
print(json.dumps({"class": scenario.get("loader_class", "BertForMaskedLM"),
                  "transformers": "5.0.0", "tokens": 9, "logits_shape": [1, 9, 2000]}))
"""


class World:
    """The stubs, the bucket and the VMs' timeline for one smoke run."""

    def __init__(self, tmp_path: Path, box: Sandbox, monkeypatch, stack: str, **scenario):
        self.tmp, self.box, self.stack = tmp_path, box, stack
        # Settings the user's stack file adds (the gcloud stub never sees them).
        stack_config = scenario.pop("stack_config", {})
        self.state = tmp_path / "smoke-state"
        bin_dir = tmp_path / "smoke-bin"
        for directory in (self.state, bin_dir):
            directory.mkdir()
        for name, body in (("gcloud", GCLOUD), ("pulumi", PULUMI), ("pt-python", LOADER)):
            path = bin_dir / name
            path.write_text(f"#!{sys.executable}\n{body}")
            path.chmod(0o755)
        self.pt_python = bin_dir / "pt-python"
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
        document["config"].update(stack_config)
        self.stack_file = self.stacks / f"Pulumi.{stack}.yaml"
        self.stack_file.write_text(yaml.safe_dump(document))
        # What `pulumi up` would create: the program itself, under Pulumi's mocks, with the
        # job the smoke run writes for this run (the same function, the same name).
        self.report_dir = tmp_path / "report"
        self.job = smoke.write_run_job(self.report_dir, RUN)
        self.run = run_offline(stack, {"tpu-pretrain:job": str(self.job), **stack_config})
        (self.state / "outputs.json").write_text(json.dumps(self.run.exports))
        self.bucket = self.run.exports["bucketUrl"].removeprefix("gs://")
        self.root = box.gcs / self.bucket / "runs" / RUN
        self.steps: list = []
        self.clock = 0.0
        self.out = io.StringIO()

    # The VMs, step by step: each sleep of the wait loop publishes the next step.
    def boot(self, role: str, env: dict[str, str] | None = None) -> None:
        def step() -> None:
            archive = next(r for r in self.run.resources if r.name == "payload-archive")
            if not (self.box.gcs / self.bucket / archive.inputs["name"]).exists():
                publish_payload(self.run, self.box)
            result = self.box.run(startup_script(self.run, f"{role}-vm"), **(env or {}))
            assert result.returncode == 0, result.stderr

        self.steps.append(step)

    def write(self, relative: str, doc: dict | str) -> None:
        """At the next step, the run's object `relative`: a JSON document, or text as is."""

        def step() -> None:
            path = self.root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(doc if isinstance(doc, str) else json.dumps(doc))

        self.steps.append(step)

    def finish_training(
        self, steps_per_second: float = 7.5, export: dict[str, dict | str] | None = None
    ) -> None:
        """status.json says the training is complete, then the export is written: `export`,
        {path under export/: JSON document or text}, or EXPORT by default."""
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
        # The JAX trainer's train.profile trace (payload/backends/jax/profile.py's layout).
        self.write("profile/plugins/profile/2026_11_26_00_30_00/t1v-n-0-w-0.xplane.pb", "xplane")
        for relative, doc in (EXPORT if export is None else export).items():
            self.write(f"export/{relative}", doc)
        self.write(f"export/{jobspec.EXPORT_MARKER}", {"step": 300})  # last, as the exporter

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
            report_dir=self.report_dir,
            pt_python=self.pt_python,
            out=self.out,
            stacks_dir=self.stacks,
            name=RUN,
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


def gcloud_commands_are_real(w: World) -> None:
    """Every gcloud command the run made exists with its flags (gcloud_flags.py)."""
    commands = [c for c in w.calls if c[0] == "gcloud"]
    assert commands
    assert {shlex.join(c): problems(c) for c in commands if problems(c)} == {}
