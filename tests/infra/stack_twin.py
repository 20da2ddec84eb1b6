"""The stack twin: a stack's whole life run from what the program deploys, nothing else.

The program runs under Pulumi's mocks (harness.run_offline); the twin takes from its
registered resources everything a VM finds:
- the bucket: every gcp.storage.BucketObject the program registers (the payload archive, the
  job spec, each role's startup script, the job pointer, the watchdog's lease), written to the
  storage emulator (storage_emulator.py, fake-gcs-server on 127.0.0.1) the way `pulumi up`
  writes them: a changed or dropped object is deleted unless its resource options say
  retainOnDelete, as the engine does on an update; `destroy()` deletes every object the
  state holds that is not retained;
- each VM's metadata: the VM resource's own `metadata` input (the loader and its keys) for
  the VMs `pulumi up` creates, and the watchdog's own create request (its --metadata and
  --metadata-from-file) for a TPU VM the watchdog recreates.
The VMs' `gcloud storage` and `gsutil` read and write the emulator; the TPU, queued-resource
and Compute calls are the sandbox's gcloud stub (sandbox_stubs.py), whose state the twin
moves on as the cloud would: a queued resource that gets capacity becomes ACTIVE with a READY
node (`provision`), a preemption (`preempt`), a spot GPU VM stopped by Compute Engine
(`terminate`). The guest agent's `google_metadata_script_runner startup` runs the VM's
metadata startup-script for real.

    twin = StackTwin(run, tmp_path, emulator_url)
    twin.boot_controller()                   -> the controller's first boot (loader, script)
    vm = twin.boot_accelerator()             -> a TPU or GPU VM's boot (an Accelerator)
    twin.tick()                              -> one watchdog tick on the controller
    twin.events                              -> the run events the watchdog wrote
    twin.deploy(other_run)                   -> `pulumi up` of another program run
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from graphlib import TopologicalSorter
from pathlib import Path

import storage_emulator
from gpu_stubs import install_gpu_stubs
from harness import by_name
from script_sandbox import Sandbox, flag_pairs, logged_events, new_sandbox, split_flags
from storage_emulator import Store, install_stub

from infra.render import render

OBJECT_TYPE = "gcp:storage/bucketObject:BucketObject"
TPU_TYPE = "gcp:tpu/v2Vm:V2Vm"
INSTANCE_TYPE = "gcp:compute/instance:Instance"
UNIT_DIR = "etc/systemd/system"

# The guest agent's runner (google_guest_agent's google_metadata_script_runner): `startup`
# runs the instance's startup-script metadata, here the sandbox's metadata server's.
RUNNER = r"""
echo "google_metadata_script_runner $*" >>"$CALLS"
[ "$1" = startup ] || { echo "unexpected: google_metadata_script_runner $*" >&2; exit 3; }
bash "$STATE/metadata"
"""


def object_content(obj) -> bytes:
    """A BucketObject's bytes as the provider uploads them: `content`, or the file `source`."""
    if "content" in obj.inputs:
        return str(obj.inputs["content"]).encode()
    return Path(obj.inputs["source"].path).read_bytes()


@dataclass
class Accelerator:
    """One boot of the accelerator VM: its sandbox (its own disk) and the boot's result."""

    box: Sandbox
    result: subprocess.CompletedProcess[str]
    twin_env: dict[str, str]  # the emulator and where the VM's guest attributes go

    @property
    def unit(self) -> str:
        """The trainer unit the boot installed."""
        return (self.box.root / UNIT_DIR / "tpu-pretrain-train.service").read_text()

    @property
    def job_uri(self) -> str:
        return re.search(r"^ExecStart=\S+ \S+ --job (\S+)$", self.unit, re.MULTILINE).group(1)

    @property
    def started_trainer(self) -> bool:
        return any(
            re.fullmatch(r"systemctl (re)?start --no-block tpu-pretrain-train\.service", c)
            for c in self.box.calls
        )

    def helper(self, command: str, **env: str) -> subprocess.CompletedProcess[str]:
        """The trainer unit's helper, as systemd runs it (ExecStartPre, ExecStopPost)."""
        return subprocess.run(
            ["bash", str(self.box.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"), command],
            check=False,
            env=self.box.env(**self.twin_env, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )


class StackTwin:
    def __init__(self, run, root: Path, emulator_url: str) -> None:
        self.run, self.root, self.url = run, root, emulator_url
        objects = [r for r in run.resources if r.type_ == OBJECT_TYPE]
        (self.bucket,) = {str(o.inputs["bucket"]) for o in objects}
        self.store = Store(emulator_url, self.bucket)
        self.store.create()
        # One emulator serves a test process: the bucket starts empty, as a new stack's.
        for name in self.store.names():
            self.store.delete(name)
        self.controller = self._box("controller")
        # The TPU/Compute API's state is the controller's sandbox's: its gcloud stub reads it.
        self.cloud = self.controller.state
        self.state: dict[str, str] = {}  # urn -> object name, as Pulumi's state holds it
        self.retained: dict[str, bool] = {}
        self.boots = self.plans = 0
        self.deploy(run)
        tpus = [r for r in run.resources if r.type_ == TPU_TYPE]
        self.kind = "tpu" if tpus else "gpu"
        self.vm = tpus[0] if tpus else by_name(run, "gpu-vm")
        if self.kind == "tpu":
            self._set("tpu-state", "READY")  # `pulumi up` created it
        else:
            self._set("vm-state", "RUNNING")

    # --- the sandboxes -------------------------------------------------------------------
    def _box(self, name: str, *, gpu: bool = False) -> Sandbox:
        box = new_sandbox(self.root / name)
        if gpu:
            install_gpu_stubs(box)
        install_stub(box.bin)
        runner = box.bin / "google_metadata_script_runner"
        runner.write_text("#!/bin/bash\nset -u\n" + RUNNER)
        return box

    def _set(self, name: str, value: str | None) -> None:
        path = self.cloud / name
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(value + "\n")

    def cloud_state(self, name: str) -> str | None:
        path = self.cloud / name
        return path.read_text().strip() if path.exists() else None

    # --- what `pulumi up` and `pulumi destroy` do to the bucket --------------------------
    def plan(self, run) -> dict:
        """What `pulumi up` of `run` does to the bucket after the state this twin holds:
        every object written in dependency order (a pointer after the scripts it names),
        then what was replaced under another name or dropped deleted, unless retained. The
        bytes go to files beside the plan; the state is the new run's from now on."""
        self.plans += 1
        folder = self.root / f"plan-{self.plans}"
        folder.mkdir()
        objects = {r.urn: r for r in run.resources if r.type_ == OBJECT_TYPE}
        graph = {
            urn: [d for d in r.options.get("dependencies", []) if d in objects]
            for urn, r in objects.items()
        }
        put = []
        for i, urn in enumerate(TopologicalSorter(graph).static_order()):
            path = folder / f"{i}.bytes"
            path.write_bytes(object_content(objects[urn]))
            put.append((str(objects[urn].inputs["name"]), str(path)))
        delete = [
            name
            for urn, name in self.state.items()
            if (urn not in objects or str(objects[urn].inputs["name"]) != name)
            and not self.retained[urn]
        ]
        self.state = {urn: str(r.inputs["name"]) for urn, r in objects.items()}
        self.retained = {urn: bool(r.options.get("retainOnDelete")) for urn, r in objects.items()}
        self.run = run
        plan = {"bucket": self.bucket, "put": put, "delete": delete}
        (folder / "plan.json").write_text(json.dumps(plan))
        return plan

    def deploy(self, run) -> None:
        """`pulumi up` of `run`, now."""
        plan = self.plan(run)
        for name, path in plan["put"]:
            self.store.put(name, Path(path).read_bytes())
        for name in plan["delete"]:
            self.store.delete(name)

    def deploy_hook(self, run) -> Path:
        """`pulumi up` of `run` as a program a VM's stub runs at an unlucky moment
        (storage_emulator.py TWIN_HOOK)."""
        self.plan(run)
        folder = self.root / f"plan-{self.plans}"
        hook = folder / "deploy"
        apply = f"{sys.executable} {storage_emulator.__file__} apply {folder / 'plan.json'}"
        hook.write_text(f"#!/bin/sh\nexec {apply}\n")
        hook.chmod(0o755)
        return hook

    def destroy_objects(self) -> list[str]:
        """`pulumi destroy`'s deletes in the bucket: every object in the state not retained."""
        deleted = [name for urn, name in self.state.items() if not self.retained[urn]]
        for name in deleted:
            self.store.delete(name)
        self.state, self.retained = {}, {}
        return deleted

    def read_json(self, name: str) -> dict:
        return json.loads(self.store.get(name))

    @property
    def run_root(self) -> str:
        """runs/<job> of the job the pointer names (the object prefix)."""
        pointer = self.read_json(render.POINTER_OBJECT)
        return str(pointer["run_root"]).removeprefix(f"gs://{self.bucket}/")

    def watch_status(self) -> dict:
        return self.read_json(f"{self.run_root}/bootstrap/{self.kind}-watch.json")

    # --- the VMs ---------------------------------------------------------------------------
    def boot_controller(self, **extra: str) -> subprocess.CompletedProcess[str]:
        """The controller boots: the guest agent runs its metadata's startup-script."""
        vm = by_name(self.run, "controller-vm")
        self._metadata(self.controller, vm.inputs["metadata"])
        return self._run(self.controller, ["google_metadata_script_runner", "startup"], **extra)

    def boot_accelerator(self, metadata: dict[str, str] | None = None, **extra: str) -> Accelerator:
        """A boot of the accelerator VM on a fresh disk (a VM the watchdog recreated is a new
        VM): its metadata is the program's VM input, or `metadata` (a recreated node's)."""
        self.boots += 1
        box = self._box(f"{self.kind}-vm-{self.boots}", gpu=self.kind == "gpu")
        self._metadata(box, metadata if metadata is not None else self.vm.inputs["metadata"])
        result = self._run(box, ["google_metadata_script_runner", "startup"], **extra)
        return Accelerator(box, result, self._twin_env(box))

    def reboot(self, vm: Accelerator, **extra: str) -> Accelerator:
        """The same VM boots again (its disk kept): a restarted GPU VM, a reboot."""
        result = self._run(vm.box, ["google_metadata_script_runner", "startup"], **extra)
        return Accelerator(vm.box, result, self._twin_env(vm.box))

    def _metadata(self, box: Sandbox, metadata: dict[str, str]) -> None:
        (box.state / "metadata").write_text(metadata["startup-script"])
        md = box.state / "md"
        md.mkdir(exist_ok=True)
        for key, value in metadata.items():
            if key != "startup-script":
                (md / key).write_text(str(value))

    def _twin_env(self, box: Sandbox) -> dict[str, str]:
        # The accelerator's guest attributes are the API's (the controller's gcloud reads
        # them); the controller's own go elsewhere.
        own = box is self.controller
        attributes = self.cloud / ("own-guest-attributes" if own else "guest-attributes")
        return {"STORAGE_EMULATOR_HOST": self.url, "GUEST_ATTRIBUTES_DIR": str(attributes)}

    def _run(self, box: Sandbox, argv: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
        box.calls_file.write_text("")
        env = box.env(**self._twin_env(box), **extra)
        return subprocess.run(
            ["bash", "-c", '"$@"', "boot", *argv],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def tick(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """One tick of the controller's watchdog (its timer's service runs the script)."""
        script = self.controller.root / f"opt/tpu-pretrain/{self.kind}-watch/{self.kind}-watch.sh"
        return self._run(self.controller, ["bash", str(script), *args], **extra)

    @property
    def events(self) -> list[dict]:
        """The run events the controller's watchdog wrote to Cloud Logging (the gcloud stub's
        `logging write`s, oldest first: script_sandbox.logged_events)."""
        return logged_events(self.cloud)

    @property
    def api_calls(self) -> list[str]:
        """The controller's TPU and Compute calls of its last run, as verbs."""
        calls = []
        for call in self.controller.calls:
            words = call.split()
            if words[:3] == ["gcloud", "compute", "tpus"]:
                calls.append(("qr-" if words[3] == "queued-resources" else "") + words[4])
            elif words[:3] == ["gcloud", "compute", "instances"]:
                calls.append(words[3])
        return calls

    # --- the cloud's side ---------------------------------------------------------------
    def preempt(self) -> None:
        self._set("tpu-state", "PREEMPTED")

    def set_vm_state(self, state: str) -> None:
        """A GPU VM's status as Compute Engine moves it (STAGING -> RUNNING after a start)."""
        self._set("vm-state", state)

    def terminate(self) -> None:
        """Compute Engine stops a spot GPU VM (instanceTerminationAction STOP)."""
        self._set("vm-state", "TERMINATED")

    def provision(self) -> dict[str, str]:
        """Capacity for the queued resource: it turns ACTIVE and creates the node READY,
        with the metadata the watchdog's create request gave it; the old VM's guest
        attributes went with it."""
        assert self.cloud_state("qr-state") == "WAITING_FOR_RESOURCES"
        creates = sorted(self.cloud.glob("qr-create-*.args"), key=lambda p: int(p.stem[10:]))
        _, values, _ = split_flags(creates[-1].read_text().splitlines())
        metadata = flag_pairs(values["--metadata"])
        key, _, path = values["--metadata-from-file"].partition("=")
        metadata[key] = Path(path).read_text()
        self._set("qr-state", "ACTIVE")
        self._set("tpu-state", "READY")
        shutil.rmtree(self.cloud / "guest-attributes", ignore_errors=True)
        return metadata
