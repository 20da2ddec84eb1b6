"""The script sandbox's stub executables: gcloud, gsutil (over `fakegcs`, the bucket as a
directory), python3 and the venv's recorders, pip, systemctl, systemd-run, apt-get, curl (the
metadata server and guest attributes), sleep, ip, logger and google_metadata_script_runner.
Each records its calls in $CALLS; script_sandbox.py new_sandbox writes them into a sandbox's
bin/. RECORDED: tools that only record."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

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
  # The URI may hold a * wildcard, as gcloud storage ls takes it: each match, as a URI.
  listed=0
  for f in $(local_of "$1"); do
    [ -e "$f" ] || continue
    listed=1
    echo "gs://${f#"$FAKE_GCS"/}"
  done
  [ "$listed" = 0 ] || exit 0
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
elif [ "$1 $2" = "logging write" ]; then
  # Cloud Logging: each entry written, its arguments one a line, in $STATE/logging/<n>.args
  # (script_sandbox.logged_events reads them); LOGGING_WRITE_ERROR refuses the write.
  if [ -n "${LOGGING_WRITE_ERROR:-}" ]; then
    echo "ERROR: (gcloud.logging.write) $LOGGING_WRITE_ERROR" >&2
    exit 1
  fi
  mkdir -p "$STATE/logging"
  n="$(ls "$STATE/logging" | wc -l)"
  printf '%s\n' "$@" >"$STATE/logging/$n.args"
elif [ "$1 $2 $3" = "compute tpus queued-resources" ]; then
  # $STATE/qr-state holds the queued resource's state (no file: there is none).
  verb="$4"
  if [ "$verb" != create ] && [ ! -f "$STATE/qr-state" ]; then
    echo "ERROR: (gcloud.compute.tpus.queued-resources.$verb) NOT_FOUND: '$5' was not found" >&2
    exit 1
  fi
  case "$verb" in
    # With the watchdog's format: state|stateInitiator|failedData.error.message, the last
    # two from $STATE/qr-detail ("SERVICE|", "|Quota … exceeded"; none: empty).
    describe)
      if [[ "$*" == *failedData* ]]; then
        detail="$(cat "$STATE/qr-detail" 2>/dev/null || echo '|')"
        printf '%s|%s\n' "$(cat "$STATE/qr-state")" "$detail"
      else
        cat "$STATE/qr-state"
      fi
      ;;
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
    # With the watchdog's format: state|health|healthDescription, the last two from
    # $STATE/tpu-health ("TIMEOUT|…"; none: HEALTHY for a READY node, else empty).
    describe)
      if [[ "$*" == *healthDescription* ]]; then
        health="$(cat "$STATE/tpu-health" 2>/dev/null || true)"
        if [ -z "$health" ] && [ "$(cat "$STATE/tpu-state")" = READY ]; then health="HEALTHY|"; fi
        printf '%s|%s\n' "$(cat "$STATE/tpu-state")" "${health:-|}"
      else
        cat "$STATE/tpu-state"
      fi
      ;;
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
# A program on stdin (`python3 - ARGS <<'PY'`: the scripts' JSON, common.sh emit_event,
# watch-common.sh put_status) runs on a real interpreter, unrecorded.
if [ "${1:-}" = - ]; then
  exec "$STUB_REAL_PYTHON" "$@"
fi
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
case " $* " in *" wireguard-tools "*) cp "$STUB_DIR/wg.installed" "$STUB_DIR/wg" ;; esac
"""
# wireguard-tools' `wg genkey` (a new private key) and `wg pubkey` (stdin's private key ->
# its public key), with real keys: infra/wgkeys.py (X25519, RFC 7748) in this interpreter.
# Other verbs are only recorded. The key material itself never goes to the call log.
_WG = r"""
echo "wg $*" >>"$CALLS"
case "${1:-}" in
  genkey)
    exec env PYTHONPATH=@REPO@ @PYTHON@ -c 'import base64, os
from infra import wgkeys
print(wgkeys.private_key(base64.b64encode(os.urandom(32)).decode()))' ;;
  pubkey)
    exec env PYTHONPATH=@REPO@ @PYTHON@ -c 'import sys
from infra import wgkeys
print(wgkeys.public_key(sys.stdin.read().strip()))' ;;
esac
"""
STUBS["wg"] = _WG.replace("@REPO@", shlex.quote(str(REPO_ROOT))).replace(
    "@PYTHON@", shlex.quote(sys.executable)
)
STUBS["wg.installed"] = STUBS["wg"]
STUBS["curl"] = r"""
echo "curl $*" >>"$CALLS"
# A guest attribute set from inside the VM (`curl -X PUT --data VALUE .../guest-attributes/
# NAMESPACE/KEY`): $STATE/guest-attributes/NAMESPACE/KEY (or under GUEST_ATTRIBUTES_DIR),
# unless GUEST_ATTRIBUTES_OFF.
if [[ " $* " == *" -X PUT "* ]]; then
  [ -z "${GUEST_ATTRIBUTES_OFF:-}" ] || { echo "curl: (22) 403" >&2; exit 22; }
  args=("$@"); value=""
  for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = --data ] && value="${args[$((i + 1))]}"
  done
  path="${*: -1}"; path="${path#*/guest-attributes/}"
  dir="${GUEST_ATTRIBUTES_DIR:-$STATE/guest-attributes}"  # the stack twin: the API's copy
  mkdir -p "$dir/$(dirname "$path")"
  printf '%s' "$value" >"$dir/$path"
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
RECORDED = ("sysctl",)
