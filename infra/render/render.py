"""Pure rendering of everything the VMs run: the payload archive, startup scripts and the
WireGuard client configuration. No Pulumi import: `python -m infra.commands.plan` and the tests call
these functions directly, and the sandbox tests execute their output.

Startup scripts are a header of shell-quoted constants followed by templates/common.sh and
the role's template. They are idempotent: run on every boot (and again by hand), they only
install what is missing, rewrite files whose content changed and restart what depends on them.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import ipaddress
import json
import re
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infra import jobspec

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).with_name("templates")
LOCK_FILE = "requirements/payload.lock"
# What the payload distribution needs to be pip-installed (pyproject's readme included).
TPU_REQUIREMENTS_FILE = "requirements/tpu-vm.txt"
# A GPU VM installs the same lock with the CUDA build of the same TensorFlow instead.
GPU_REQUIREMENTS_FILE = "requirements/gpu-vm.txt"
# The TPU VM's environment for the Keras 3 / JAX backend (train.backend: jax).
TPU_JAX_REQUIREMENTS_FILE = "requirements/tpu-vm-jax.txt"
# The GPU VM's environment for the same backend: jax[cuda12] instead of jax[tpu].
GPU_JAX_REQUIREMENTS_FILE = "requirements/gpu-vm-jax.txt"
# The payload's CPU test environment: the JAX the JAX backend is tested with.
PAYLOAD_DEV_FILE = "requirements/payload-dev.txt"
# The Beam environment and the Dataflow workers' image built on it (docs/deploy-gcp.md,
# "Dataflow"): in the archive, so the image is built from the very source the stack uploads.
BEAM_REQUIREMENTS_FILE = "requirements/beam.txt"
BEAM_DOCKERFILE = "requirements/beam.Dockerfile"
ARCHIVE_FILES = (
    "pyproject.toml",
    "README.md",
    LOCK_FILE,
    TPU_REQUIREMENTS_FILE,
    GPU_REQUIREMENTS_FILE,
    TPU_JAX_REQUIREMENTS_FILE,
    GPU_JAX_REQUIREMENTS_FILE,
    BEAM_REQUIREMENTS_FILE,
    BEAM_DOCKERFILE,
)
ARCHIVE_DIRS = ("payload",)
ARCHIVE_PREFIX = "tpu-pretrain-payload"

TENSORBOARD_PORT = 6006
OWN_CLIENT_KEY_PLACEHOLDER = "<the private key of the public key you set in vpnClientPublicKey>"
# The VPN hop makes its own key pair at its first boot (templates/vpn-hop.sh) and publishes
# only the public key, as this guest attribute (namespace/key) of the hop's VM. Until then
# nobody knows it: the client configuration the stack outputs carries SERVER_KEY_PLACEHOLDER,
# which `make vpn-config` (infra/commands/vpn_config.py) replaces with the published key.
WG_PUBLIC_KEY_ATTRIBUTE = "tpu-pretrain/wireguard-public-key"
SERVER_KEY_PLACEHOLDER = "<the hop's public key: make vpn-config STACK=<stack> fills it in>"
# The accelerator watchdogs (TPU and GPU) run on the controller every WATCH_INTERVAL. A
# preempted TPU VM is recreated at most once per TPU_RECREATE_MIN_SECONDS (a VM that is
# preempted again at once waits instead of looping).
WATCH_INTERVAL = "2min"
TPU_RECREATE_MIN_SECONDS = 900
# Without capacity the watchdog waits in a queued resource (spot, on-demand) instead of
# failing every tick; gcloud's GA `queued-resources create` has no --preemptible, so a
# preemptible VM is created directly, retried at these growing intervals (seconds).
TPU_CAPACITY_BACKOFF = (240, 3600)  # first wait, longest wait
# How long a request for the accelerator may wait for capacity before the watchdog reports it
# (a capacity-wait event): the stack's tpu-pretrain:capacityWaitMinutes, this by default.
CAPACITY_WAIT_MINUTES = 60
# pulumi-gcp >= 8 puts this label on every resource it creates (effectiveLabels); a recreated
# VM carries it too, so `pulumi refresh` sees the VM Pulumi created.
PULUMI_ATTRIBUTION_LABEL = ("goog-pulumi-provisioned", "true")


@dataclass(frozen=True)
class PayloadArchive:
    name: str  # tpu-pretrain-payload-<sha256[:16]>.tar.gz
    sha256: str
    data: bytes

    @property
    def object_name(self) -> str:
        return f"payload/{self.name}"


@dataclass(frozen=True)
class Pins:
    """Versions the VMs install, read from the pinned files (the startup scripts install
    from the same files, shipped in the payload archive)."""

    tensorflow: str  # the lock's (CPU) TensorFlow
    tf_keras: str  # the lock's, for the CPU TensorFlow
    tensorflow_tpu: str  # requirements/tpu-vm.txt
    libtpu: str
    tpu_tf_keras: str  # what the TPU VM installs: tpu-vm.txt's tf_keras, else the lock's


def _read_pinned(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def read_pins(root: Path = REPO_ROOT) -> Pins:
    lock = _read_pinned(root / LOCK_FILE)
    tpu = _read_pinned(root / TPU_REQUIREMENTS_FILE)
    missing = [f"{LOCK_FILE}: {n}" for n in ("tensorflow", "tf-keras") if n not in lock]
    missing += [
        f"{TPU_REQUIREMENTS_FILE}: {n}" for n in ("tensorflow-tpu", "libtpu") if n not in tpu
    ]
    if missing:
        raise ValueError(f"no pin for {', '.join(missing)}")
    return Pins(
        tensorflow=lock["tensorflow"],
        tf_keras=lock["tf-keras"],
        tensorflow_tpu=tpu["tensorflow-tpu"],
        libtpu=tpu["libtpu"],
        tpu_tf_keras=tpu.get("tf-keras", lock["tf-keras"]),
    )


def overlay_setting(requirements: str, key: str, root: Path = REPO_ROOT) -> str:
    """An overlay's `# tpu-KEY: value` line, as tpu-install.sh tpu_overlay_setting reads it
    ("" when the overlay has none)."""
    text = (root / requirements).read_text(encoding="utf-8")
    match = re.search(rf"^# tpu-{re.escape(key)}: *(\S+) *$", text, re.MULTILINE)
    return match.group(1) if match else ""


def requirements_for(backend: str) -> str:
    """The TPU VM's overlay for a training backend ("tf" | "jax")."""
    return TPU_JAX_REQUIREMENTS_FILE if backend == "jax" else TPU_REQUIREMENTS_FILE


def gpu_requirements_for(backend: str) -> str:
    """The GPU VM's overlay for a training backend ("tf" | "jax")."""
    return GPU_JAX_REQUIREMENTS_FILE if backend == "jax" else GPU_REQUIREMENTS_FILE


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _archive_members(root: Path) -> list[Path]:
    files = [root / name for name in ARCHIVE_FILES]
    for directory in ARCHIVE_DIRS:
        files += [
            path
            for path in (root / directory).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
        ]
    missing = [str(path.relative_to(root)) for path in files if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"payload archive: missing {', '.join(missing)} in {root}")
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def build_payload_archive(root: Path = REPO_ROOT) -> PayloadArchive:
    """A deterministic tar.gz of the payload source: same files, same bytes, same name."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _archive_members(root):
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0, filename="") as gz:
        gz.write(buffer.getvalue())
    data = compressed.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    return PayloadArchive(name=f"{ARCHIVE_PREFIX}-{digest[:16]}.tar.gz", sha256=digest, data=data)


def write_archive(archive: PayloadArchive, directory: Path) -> Path:
    """Write the archive once (content-addressed); an existing file is already right."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / archive.name
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != archive.sha256:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(archive.data)
        tmp.replace(path)
    return path


# --- startup scripts -------------------------------------------------------------------


@dataclass(frozen=True)
class TpuHost:
    """The TPU VM as the catalog describes it: what it is and what its image ships."""

    accelerator_type: str
    runtime_version: str  # the base image
    python_version: str  # the image's python3 ("3.10"): the wheelhouse is built for it
    hosts: int = 1  # > 1: a multi-host JAX slice, one startup script for every host
    # Secure boot asked of the node (shielded_instance_config); False: not asked, so the
    # host check has no expectation (the image's default is not known here).
    secure_boot: bool = False

    requirements: str = TPU_REQUIREMENTS_FILE  # what replaces parts of the lock (tpu-install.sh)
    backend: str = "tf"  # the training backend the environment is for (TPU_PAYLOAD_BACKEND)

    @property
    def env_python_version(self) -> str:
        """The Python of the payload's environment: the overlay's tpu-python (the JAX
        overlay's own), else the image's python3. The wheelhouse is built for it."""
        return overlay_setting(self.requirements, "python") or self.python_version


@dataclass(frozen=True)
class GpuHost:
    """The GPU VM as the GPU catalog describes it."""

    machine_type: str
    gpu_type: str  # nvidia-tesla-t4
    gpu_name: str  # T4
    count: int
    image: str
    python_version: str  # the image's python3: the wheelhouse is built for it
    precision: str  # Keras mixed-precision policy for this GPU
    # The image's NVIDIA kernel-module flavour and, when it has no driver, what installs one
    # (catalogs/gpu.yaml images; gpu.sh install_driver).
    kernel_modules: str = "unknown"
    driver_repo: str = ""
    driver_packages: tuple[str, ...] = ()
    hosts: int = 1
    requirements: str = GPU_REQUIREMENTS_FILE
    secure_boot: bool = False  # shielded_instance_config.enable_secure_boot, set either way
    backend: str = "tf"
    nic_type: str = ""  # the network interface's nic_type (GVNIC on A3/A4; "": the default)

    @property
    def driver_branch(self) -> str:
        """The NVIDIA branch the startup script installs (nvidia-open-570: "570"); "" when
        the image brings its driver."""
        for package in self.driver_packages:
            match = re.search(r"-(\d+)$", package)
            if match:
                return match.group(1)
        return ""

    @property
    def env_python_version(self) -> str:
        return overlay_setting(self.requirements, "python") or self.python_version


@dataclass(frozen=True)
class Workload:
    """What a TPU VM or controller needs to know to fetch and run its stage."""

    bucket: str
    job_name: str
    payload_object: str
    payload_sha256: str
    host: TpuHost | GpuHost  # the accelerator VM

    @property
    def wheelhouse_root(self) -> str:
        """gs://<bucket>/wheelhouse/<key>/: the TPU VM's wheels, built by the controller."""
        return f"gs://{self.bucket}/wheelhouse"

    @property
    def values(self) -> dict[str, str]:
        return {
            "JOB_NAME": self.job_name,
            "JOB_URI": jobspec.job_uri(self.bucket, self.job_name),
            "RUN_ROOT": jobspec.run_root(self.bucket, self.job_name),
            "PAYLOAD_URI": f"gs://{self.bucket}/{self.payload_object}",
            "PAYLOAD_SHA256": self.payload_sha256,
        }


# Google's VPC MTU is 1460 by default; WireGuard's own overhead over IPv4/IPv6 is at most 80
# bytes, so the tunnel's MTU is 1460 - 80 (wg-quick would otherwise take 1500 - 80 from the
# uplink and larger packets would be fragmented or dropped). Both ends set it.
WIREGUARD_MTU = 1460 - 80


@dataclass(frozen=True)
class WireGuardServer:
    port: int
    client_cidr: str

    @property
    def server_address(self) -> str:
        network = ipaddress.IPv4Network(self.client_cidr)
        return f"{network.network_address + 1}/{network.prefixlen}"

    @property
    def client_address(self) -> str:
        return f"{ipaddress.IPv4Network(self.client_cidr).network_address + 2}/32"


# The Linux driver of Google's gVNIC (Google's "Using Google Virtual NIC" page: the gve
# driver; in the kernel as drivers/net/ethernet/google/gve): the host fact of a VM whose
# interface is nic_type GVNIC.
GVNIC_DRIVER = "gve"

# The controller VM's shielded settings (infra/components/controller.py SHIELDED_VM): secure
# boot on; its host check expects it.
CONTROLLER_SECURE_BOOT = True


def host_expectations(
    *,
    python: str = "",
    accelerator: str = "",
    machine: str = "",
    libtpu: str = "",
    gpus: int | None = None,
    secure_boot: bool | None = None,
    nvidia_modules: str = "",
    nvidia_branch: str = "",
    nic_driver: str = "",
) -> dict[str, str]:
    """What templates/facts.sh compares the VM with: "" is no expectation."""
    return {
        "EXPECT_NVIDIA_MODULES": nvidia_modules,
        "EXPECT_NVIDIA_BRANCH": nvidia_branch,
        "EXPECT_NIC_DRIVER": nic_driver,
        "EXPECT_PYTHON": python,
        "EXPECT_ACCELERATOR": accelerator,
        "EXPECT_MACHINE": machine,
        "EXPECT_LIBTPU": libtpu,
        "EXPECT_GPUS": "" if gpus is None else str(gpus),
        "EXPECT_SECURE_BOOT": "" if secure_boot is None else str(secure_boot).lower(),
    }


STARTUP_SCRIPT_HEADER = (
    "startup script, rendered by infra/render/render.py; runs on every",
    "# boot and is safe to run again by hand: sudo google_metadata_script_runner startup",
)


def _script(
    role: str,
    values: Mapping[str, str],
    *templates: str,
    about: tuple[str, str] = STARTUP_SCRIPT_HEADER,
) -> str:
    header = [
        "#!/bin/bash",
        f"# tpu-pretrain {role} {about[0]}",
        about[1],
        "set -Eeuo pipefail  # -E: the ERR trap (failed status) also fires inside functions",
        f"readonly ROLE={shlex.quote(role)}",
    ]
    for key in sorted(values):
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ValueError(f"bad script constant name {key!r}")
        header.append(f"readonly {key}={shlex.quote(str(values[key]))}")
    body = (TEMPLATES / "common.sh").read_text(encoding="utf-8")
    for template in templates:
        body += "\n" + (TEMPLATES / template).read_text(encoding="utf-8")
    return "\n".join(header) + "\n\n" + body


def render_tpu_script(workload: Workload) -> str:
    """The TPU VM: common.sh + tpu-install.sh (the one install definition, shared with
    `make venv-tpu`) + tpu.sh (functions) + tpu-main.sh."""
    host = workload.host
    if not isinstance(host, TpuHost):
        raise TypeError("render_tpu_script needs a TpuHost workload")
    pins = read_pins()
    # The TPU VM's TensorFlow is tpu-vm.txt's (the pair with evidence of running on a TPU,
    # infra/catalogs/tpu.yaml tensorflow_tpu), not the lock's CPU one; tf_keras must follow it.
    if _minor(pins.tpu_tf_keras) != _minor(pins.tensorflow_tpu):
        raise ValueError(
            f"{TPU_REQUIREMENTS_FILE} pins tensorflow-tpu=={pins.tensorflow_tpu} but the TPU VM "
            f"would install tf_keras=={pins.tpu_tf_keras}: tf_keras must match the TensorFlow "
            "minor (pin it in the same file)"
        )
    libtpu = pins.libtpu
    if host.backend == "jax":
        libtpu = _check_jax_pins(host.requirements)
    values = (
        workload.values
        | {
            "MANIFEST_URI": jobspec.manifest_uri(workload.bucket, workload.job_name),
            "STATUS_URI": f"{jobspec.run_root(workload.bucket, workload.job_name)}/status.json",
            "ACCELERATOR_TYPE": host.accelerator_type,
            "RUNTIME_VERSION": host.runtime_version,
            "WHEELHOUSE_ROOT": workload.wheelhouse_root,
            "TRAINER_ATTRIBUTE": TRAINER_ATTRIBUTE,
            "TPU_HOSTS": str(host.hosts),
            "VM_REQUIREMENTS": host.requirements,
            "PAYLOAD_BACKEND": host.backend,
        }
        | host_expectations(
            python=host.python_version,
            accelerator=host.accelerator_type,
            libtpu=libtpu,
            secure_boot=True if host.secure_boot else None,
        )
    )
    return _script("tpu", values, "tpu-install.sh", "tpu.sh", "facts.sh", "tpu-main.sh")


def render_gpu_script(workload: Workload) -> str:
    """The GPU VM: the TPU VM's pieces (common.sh, the install definition tpu-install.sh with
    requirements/gpu-vm.txt, tpu.sh's trainer unit and helper) + gpu.sh instead of
    tpu-main.sh: the driver check, the CUDA environment and a trainer that must see GPUs."""
    host = workload.host
    if not isinstance(host, GpuHost):
        raise TypeError("render_gpu_script needs a GpuHost workload")
    pins = read_pins()
    if host.backend == "jax":
        _check_jax_pins(host.requirements, accelerator="gpu")
    else:
        gpu_tf = _read_pinned_extra(REPO_ROOT / host.requirements).get("tensorflow")
        if gpu_tf != pins.tensorflow:
            raise ValueError(
                f"{host.requirements} pins tensorflow[and-cuda]=={gpu_tf} but {LOCK_FILE} "
                f"tests tensorflow=={pins.tensorflow}: they must be the same version"
            )
    values = (
        workload.values
        | {
            "MANIFEST_URI": jobspec.manifest_uri(workload.bucket, workload.job_name),
            "STATUS_URI": f"{jobspec.run_root(workload.bucket, workload.job_name)}/status.json",
            "ACCELERATOR_TYPE": f"{host.count}x {host.gpu_name} on {host.machine_type}",
            "RUNTIME_VERSION": host.image.rsplit("/", 1)[-1],
            "WHEELHOUSE_ROOT": workload.wheelhouse_root,
            "TRAINER_ATTRIBUTE": TRAINER_ATTRIBUTE,
            "TPU_HOSTS": "1",
            "VM_REQUIREMENTS": host.requirements,
            "PAYLOAD_BACKEND": host.backend,
            "GPU_TYPE": host.gpu_type,
            "GPU_NAME": host.gpu_name,
            "GPU_COUNT": str(host.count),
            "GPU_PRECISION": host.precision,
            "DRIVER_MODULES": host.kernel_modules,
            "DRIVER_REPO": host.driver_repo,
            "DRIVER_PACKAGES": " ".join(host.driver_packages),
        }
        | host_expectations(
            python=host.python_version,
            machine=host.machine_type,
            gpus=host.count,
            secure_boot=host.secure_boot,
            # Which driver must load: the flavour and branch the catalog installs (an image
            # that brings its own driver: no expectation); gVNIC shows as Google's gve driver.
            nvidia_modules=host.kernel_modules if host.driver_packages else "",
            nvidia_branch=host.driver_branch,
            nic_driver=GVNIC_DRIVER if host.nic_type == "GVNIC" else "",
        )
    )
    return _script("gpu", values, "tpu-install.sh", "tpu.sh", "facts.sh", "gpu.sh")


# TensorFlow's distributions: none belongs in a JAX overlay (the JAX backend imports no
# TensorFlow: its input is Grain's, its gs:// gcsfs').
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "tf-keras")
# What a JAX overlay pins as requirements/payload-dev.txt does (the CPU tests' versions).
JAX_TESTED_PINS = ("jax", "jaxlib", "orbax-checkpoint", "grain", "gcsfs")


def _check_jax_pins(requirements: str, accelerator: str = "tpu") -> str:
    """A JAX overlay against what the payload is tested with: no TensorFlow, jax/jaxlib,
    Orbax, Grain and gcsfs as requirements/payload-dev.txt pins them (the CPU tests'), and
    it names its own Python and, for a TPU VM, libtpu, for a GPU VM the CUDA plugin and PJRT
    of the same JAX. Returns its libtpu pin (the TPU host check's expectation; "" for a
    GPU). The lock's tensorflow and tf_keras are dropped on the VM (tpu-install.sh)."""
    overlay = _read_pinned_extra(REPO_ROOT / requirements)
    dev = _read_pinned(REPO_ROOT / PAYLOAD_DEV_FILE)
    problems = [
        f"{name}=={overlay[name]} (the JAX backend needs no TensorFlow)"
        for name in TENSORFLOW_DISTRIBUTIONS
        if name in overlay
    ]
    for name in JAX_TESTED_PINS:
        if overlay.get(name) != dev.get(name):
            problems.append(
                f"{name}=={overlay.get(name)} ({PAYLOAD_DEV_FILE} tests {dev.get(name)})"
            )
    if accelerator == "gpu":
        for name in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
            if overlay.get(name) != dev.get("jax"):
                problems.append(
                    f"{name}=={overlay.get(name)} (not the tested jax {dev.get('jax')})"
                )
    elif "libtpu" not in overlay:
        problems.append("no libtpu pin")
    for key in ("python", "uv"):
        if not overlay_setting(requirements, key):
            problems.append(f"no `# tpu-{key}:` line")
    if problems:
        raise ValueError(f"{requirements}: " + "; ".join(problems))
    return overlay.get("libtpu", "")


def _read_pinned_extra(path: Path) -> dict[str, str]:
    """name==version pins of a requirements file, extras dropped (tensorflow[and-cuda])."""
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;#]+)", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(3)
    return pins


def queued_resource_name(tpu_name: str) -> str:
    """The one queued resource the TPU watchdog waits in (the TPU VM's zone and project)."""
    return f"{tpu_name}-watch"


@dataclass(frozen=True)
class TpuWatch:
    """Everything the controller's watchdog needs to recreate the TPU VM exactly as Pulumi's
    gcp.tpu.V2Vm declares it (same name, so Pulumi state still addresses it)."""

    project: str
    name: str
    zone: str
    accelerator_type: str
    runtime_version: str
    network: str
    subnetwork: str
    external_ip: bool
    preemptible: bool
    spot: bool
    shielded_boot: bool
    service_account_email: str
    scopes: tuple[str, ...]
    description: str
    labels: Mapping[str, str]
    tags: tuple[str, ...]
    metadata: Mapping[str, str]  # everything but the startup script (passed as a file)
    startup_script: str
    release_when_done: bool = False  # delete the TPU VM once the job's export is complete
    hosts: int = 1  # a slice: one node of several hosts, deleted and recreated as one
    capacity_wait_minutes: int = CAPACITY_WAIT_MINUTES  # then a capacity-wait event
    kind = "tpu"

    @property
    def queued_resource(self) -> str:
        return queued_resource_name(self.name)

    @property
    def scheduling(self) -> str:
        return "spot" if self.spot else "preemptible" if self.preemptible else "on-demand"

    def values(self, workload: Workload) -> dict[str, str]:
        def pairs(items: Mapping[str, str]) -> str:
            for key, value in items.items():
                if not re.fullmatch(r"[a-z0-9_.-]+", key) or "," in value or "=" in value:
                    raise ValueError(f"cannot pass {key}={value!r} to gcloud as KEY=VALUE")
            return ",".join(f"{key}={value}" for key, value in sorted(items.items()))

        labels = dict(self.labels) | dict([PULUMI_ATTRIBUTION_LABEL])
        return {
            "JOB_NAME": workload.job_name,
            "RUN_ROOT": jobspec.run_root(workload.bucket, workload.job_name),
            "PROJECT": self.project,
            "TPU_NAME": self.name,
            "TPU_ZONE": self.zone,
            "ACCELERATOR_TYPE": self.accelerator_type,
            "RUNTIME_VERSION": self.runtime_version,
            "TPU_NETWORK": self.network,
            "TPU_SUBNETWORK": self.subnetwork,
            "EXTERNAL_IPS": "true" if self.external_ip else "false",
            "SCHEDULING": self.scheduling,
            "SECURE_BOOT": "true" if self.shielded_boot else "false",
            "SERVICE_ACCOUNT": self.service_account_email,
            "SCOPES": ",".join(self.scopes),
            "DESCRIPTION": self.description,
            "LABELS": pairs(labels),
            "TAGS": ",".join(self.tags),
            "METADATA": pairs(self.metadata),
            "TPU_STARTUP_SHA256": hashlib.sha256(self.startup_script.encode()).hexdigest(),
            "MIN_RECREATE_SECONDS": str(TPU_RECREATE_MIN_SECONDS),
            "CAPACITY_BACKOFF_FIRST": str(TPU_CAPACITY_BACKOFF[0]),
            "CAPACITY_BACKOFF_MAX": str(TPU_CAPACITY_BACKOFF[1]),
            "QUEUED_RESOURCE": self.queued_resource,
            "LEASE_URI": f"gs://{workload.bucket}/"
            + jobspec.watch_lease_object_name(workload.job_name),
            "EXPORT_MARKER_URI": jobspec.export_marker_uri(workload.bucket, workload.job_name),
            "POINTER_URI": pointer_uri(workload.bucket),
            "RELEASE_WHEN_DONE": "true" if self.release_when_done else "false",
            "TPU_HOSTS": str(self.hosts),
            "CAPACITY_WAIT_SECONDS": str(self.capacity_wait_minutes * 60),
            "BOOT_ATTRIBUTE": BOOT_ATTRIBUTE,
            "TRAINER_ATTRIBUTE": TRAINER_ATTRIBUTE,
        }

    def script(self, workload: Workload) -> str:
        return _watch_script(self.kind, self.values(workload), "tpu-watch.sh")


def render_tpu_watch_script(workload: Workload, watch: TpuWatch) -> str:
    """The TPU watchdog the controller runs from a systemd timer (templates/tpu-watch.sh)."""
    return watch.script(workload)


def _watch_script(kind: str, values: Mapping[str, str], template: str) -> str:
    about = (
        "watchdog, rendered by infra/render/render.py and installed by the",
        f"# controller's startup script; tpu-pretrain-{kind}-watch.timer runs it every "
        + WATCH_INTERVAL,
    )
    return _script(f"{kind}-watch", values, "watch-common.sh", template, about=about)


@dataclass(frozen=True)
class GpuWatch:
    """What the controller's GPU watchdog needs to start a stopped spot GPU VM again
    (templates/gpu-watch.sh): the VM is stopped by preemption, never deleted, so it is
    started in place (same disk, same metadata, same Pulumi state)."""

    kind = "gpu"
    project: str
    name: str
    zone: str
    capacity_wait_minutes: int = CAPACITY_WAIT_MINUTES  # then a capacity-wait event
    startup_script = ""  # nothing to recreate from: the stopped VM keeps its metadata

    def values(self, workload: Workload) -> dict[str, str]:
        return {
            "JOB_NAME": workload.job_name,
            "RUN_ROOT": jobspec.run_root(workload.bucket, workload.job_name),
            "PROJECT": self.project,
            "VM_NAME": self.name,
            "VM_ZONE": self.zone,
            "LEASE_URI": f"gs://{workload.bucket}/"
            + jobspec.watch_lease_object_name(workload.job_name),
            "EXPORT_MARKER_URI": jobspec.export_marker_uri(workload.bucket, workload.job_name),
            "POINTER_URI": pointer_uri(workload.bucket),
            "BOOT_ATTRIBUTE": BOOT_ATTRIBUTE,
            "TRAINER_ATTRIBUTE": TRAINER_ATTRIBUTE,
            "CAPACITY_WAIT_SECONDS": str(self.capacity_wait_minutes * 60),
        }

    def script(self, workload: Workload) -> str:
        return _watch_script(self.kind, self.values(workload), "gpu-watch.sh")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def render_controller_script(workload: Workload, watch: TpuWatch | GpuWatch | None = None) -> str:
    """With `watch`, the controller also installs that accelerator's watchdog (its script, a
    systemd timer; for a TPU also the TPU VM's startup script it recreates the VM with);
    without, it removes any watchdog."""
    values = (
        workload.values
        | {
            "TENSORBOARD_PORT": str(TENSORBOARD_PORT),
            "AUTO_RECOVER": "true" if watch else "false",
            "WATCH_KIND": watch.kind if watch else "",
            "WATCH_INTERVAL": WATCH_INTERVAL,
            "WATCH_SCRIPT_B64": b64(watch.script(workload)) if watch else "",
            "TPU_STARTUP_SCRIPT_B64": b64(watch.startup_script) if watch else "",
            # The wheelhouse: built once per lock for the TPU image's Python (tpu-install.sh).
            "WHEELHOUSE_ROOT": workload.wheelhouse_root,
            "TPU_PYTHON_VERSION": workload.host.env_python_version,
            "VM_REQUIREMENTS": workload.host.requirements,
            # The data unit's status messages name the payload's status and the manifest.
            "MANIFEST_URI": jobspec.manifest_uri(workload.bucket, workload.job_name),
            "STATUS_URI": f"{jobspec.run_root(workload.bucket, workload.job_name)}/status.json",
        }
        | host_expectations(secure_boot=CONTROLLER_SECURE_BOOT)
    )
    return _script("controller", values, "tpu-install.sh", "facts.sh", "controller.sh")


# --- the stable loader and the job pointer (templates/loader.sh) ------------------------
# A TPU VM's only mutable inputs are description, dataDisks, labels, metadata and tags, and
# this program replaces the node on those too (components/tpu.py IN_PLACE_FIELDS): a startup
# script with the payload's digest in it would replace the TPU VM on every payload or job
# commit. So every VM's metadata holds the loader, which names only its bucket and role; the
# rendered scripts are bucket objects named by their digest, and the pointer names them.
POINTER_OBJECT = "jobs/current.json"
# How long a VM's loader keeps reading the pointer and what it names before its boot counts
# as failed (templates/loader.sh back_off: waits doubling from 5 s to 60 s that add up to at
# least this). Google documents that a new grant "typically" takes about 2 minutes to
# propagate and can take 7 minutes or longer (iam/docs/access-change-propagation); the VMs
# wait for a grant's creation, not its propagation.
LOADER_WAIT_SECONDS = 600
# Where a VM's loader leaves its boot state, read without the bucket by the controller's
# watchdog (templates/watch-common.sh vm_failure) and `make smoke`: a guest attribute
# (namespace/key) of the VM, "loading", "ok" or "failed <epoch> <message>".
BOOT_ATTRIBUTE = "tpu-pretrain/boot"
# Where the trainer unit's helper leaves the trainer's state (templates/tpu.sh
# trainer_stopped): "running", or "stopped <epoch> <message>" once it stopped for good (exit 2,
# or TRAINER_FAILURES_MAX failures in a row). The watchdog then stops the billing as for a
# failed boot. In the boot state's namespace: one read of the namespace gets both.
TRAINER_ATTRIBUTE = "tpu-pretrain/trainer"
# The metadata key that turns guest attributes on (Compute Engine's "Setting and querying
# guest attributes"); every VM that boots the loader carries it.
GUEST_ATTRIBUTES_METADATA = {"enable-guest-attributes": "TRUE"}
STARTUP_OBJECT_PREFIX = "startup"
LOADER_ROLES = ("tpu", "gpu", "controller")  # the roles whose VMs boot the loader
_POINTER_VALUE = re.compile(r"[A-Za-z0-9._/:=+-]+")  # what loader.sh's sed reads back


def pointer_uri(bucket: str) -> str:
    return f"gs://{bucket}/{POINTER_OBJECT}"


def startup_object_name(role: str, script: str) -> str:
    """startup/<role>-<sha256[:16]>.sh: a changed script is a new object."""
    return f"{STARTUP_OBJECT_PREFIX}/{role}-{hashlib.sha256(script.encode()).hexdigest()[:16]}.sh"


def render_loader(role: str, bucket: str) -> str:
    """The startup script in a VM's metadata: the same bytes for every job and payload."""
    if role not in LOADER_ROLES:
        raise ValueError(f"no loader for role {role!r}")
    header = [
        "#!/bin/bash",
        f"# tpu-pretrain {role} startup loader, rendered by infra/render/render.py; runs on "
        "every boot",
        "# and is safe to run again by hand: sudo google_metadata_script_runner startup",
        "set -Eeuo pipefail",
        f"readonly ROLE={shlex.quote(role)}",
        f"readonly BUCKET_URI={shlex.quote(f'gs://{bucket}')}",
        f"readonly POINTER_URI={shlex.quote(pointer_uri(bucket))}",
        f"readonly BOOT_WAIT_SECONDS={LOADER_WAIT_SECONDS}",
        f"readonly BOOT_ATTRIBUTE={BOOT_ATTRIBUTE}",
    ]
    body = (TEMPLATES / "loader.sh").read_text(encoding="utf-8")
    return "\n".join(header) + "\n\n" + _loader_events() + body


# The loader's `stopped` event goes through the scripts' one writer of events, common.sh
# emit_event, and the retries it writes with: those definitions, copied from common.sh.
LOADER_EVENT_FUNCTIONS = ("retry_gcloud", "event_severity", "emit_event")
LOADER_RETRY_ATTEMPTS = 3  # a failed boot waited long already: a short retry of the write


def _loader_events() -> str:
    common = (TEMPLATES / "common.sh").read_text(encoding="utf-8")
    transient = re.search(r"^readonly TRANSIENT_ERRORS=.*$", common, re.MULTILINE)
    if transient is None:
        raise ValueError("templates/common.sh has no TRANSIENT_ERRORS")
    parts = [
        "# ---- from templates/common.sh (render.py render_loader): the event writer ----",
        f"readonly RETRY_ATTEMPTS={LOADER_RETRY_ATTEMPTS}",
        transient.group(0),
    ]
    for name in LOADER_EVENT_FUNCTIONS:
        found = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", common, re.MULTILINE | re.DOTALL)
        if found is None:
            raise ValueError(f"templates/common.sh has no function {name}")
        parts.append(found.group(0))
    return "\n".join(parts) + "# ---- end of the event writer ----\n\n"


def render_pointer(workload: Workload, scripts: Mapping[str, str]) -> str:
    """jobs/current.json: the job, the payload archive and each role's rendered startup
    script, with their sha256. Flat, one "key": "value" per line (loader.sh reads it with
    sed), every value checked against what the loader accepts."""
    fields = {
        "job": workload.job_name,
        "job_uri": jobspec.job_uri(workload.bucket, workload.job_name),
        "run_root": jobspec.run_root(workload.bucket, workload.job_name),
        "payload_object": workload.payload_object,
        "payload_sha256": workload.payload_sha256,
    }
    for role, script in sorted(scripts.items()):
        if role not in LOADER_ROLES:
            raise ValueError(f"no loader for role {role!r}")
        fields[f"script_{role}"] = startup_object_name(role, script)
        fields[f"script_{role}_sha256"] = hashlib.sha256(script.encode()).hexdigest()
    for key, value in fields.items():
        if not _POINTER_VALUE.fullmatch(value):
            raise ValueError(f"{POINTER_OBJECT}: {key} {value!r} has characters the loader refuses")
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"


def render_vpn_hop_script(server: WireGuardServer, *, client_public_key: str) -> str:
    """The hop: its own key pair made at first boot, wg0.conf, forwarding, and its public key
    published as the guest attribute WG_PUBLIC_KEY_ATTRIBUTE."""
    values = {
        "WG_PUBLIC_KEY_ATTRIBUTE": WG_PUBLIC_KEY_ATTRIBUTE,
        "WG_PORT": str(server.port),
        "WG_MTU": str(WIREGUARD_MTU),
        "WG_SERVER_ADDRESS": server.server_address,
        "WG_CLIENT_ADDRESS": server.client_address,
        "WG_CLIENT_PUBLIC_KEY": client_public_key,
        "VPN_CLIENT_CIDR": server.client_cidr,
    }
    return _script("vpn-hop", values, "vpn-hop.sh")


def render_wireguard_client_config(
    *,
    client_private_key: str,
    server_public_key: str,
    endpoint: str,
    client_cidr: str,
    allowed_ips: tuple[str, ...],
) -> str:
    """The client side: only the VPC ranges go through the tunnel (split tunnel)."""
    client = WireGuardServer(port=0, client_cidr=client_cidr)
    return (
        "[Interface]\n"
        f"PrivateKey = {client_private_key}\n"
        f"Address = {client.client_address}\n"
        f"MTU = {WIREGUARD_MTU}\n"
        "\n"
        "[Peer]\n"
        f"PublicKey = {server_public_key}\n"
        f"Endpoint = {endpoint}\n"
        f"AllowedIPs = {', '.join(allowed_ips)}\n"
        "PersistentKeepalive = 25\n"
    )
