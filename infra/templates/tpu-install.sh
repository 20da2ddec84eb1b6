# ---- templates/tpu-install.sh: the TPU VM's Python environment, one definition ---------
# Sourced by two callers, never copied: the TPU VM's startup script embeds this file
# (infra/render.py), and `make venv-tpu` sources it to build .venv-tpu, the environment the
# CI parity test trains in (tests/infra/test_tpu_parity.py). Inputs are files of the payload
# source tree: requirements/payload.lock and the VM's overlay, VM_REQUIREMENTS: the TPU VM's
# requirements/tpu-vm.txt (the default) or the GPU VM's requirements/gpu-vm.txt.

tpu_install_say() {
  if declare -F log >/dev/null; then log "$*"; else echo "tpu-install: $*" >&2; fi
}

tpu_python_version() {
  python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'
}

# libtpu.so inside VENV, relative to it (TF_PLUGGABLE_DEVICE_LIBRARY_PATH of the trainer
# unit), as libtpu itself reports it: libtpu.get_library_path().
tpu_libtpu_path() {
  "$1/bin/python" -c 'import os, sys, libtpu
print(os.path.relpath(libtpu.get_library_path(), sys.prefix))'
}

# The requirements pip resolves for the VM: the tested lock without tensorflow/tf_keras
# and without what the overlay (VM_REQUIREMENTS) pins, plus the overlay (without its
# tf_keras, which goes in alone with --no-deps: tpu_tf_keras_pin).
tpu_requirements() {
  local src="$1" out="$2" names overlay="${VM_REQUIREMENTS:-requirements/tpu-vm.txt}"
  names="$(grep -Eo '^[A-Za-z0-9_.-]+(\[[^]]*\])?==' "${src}/${overlay}" \
    | sed -E 's/(\[.*\])?==$//' | tr 'A-Z_' 'a-z-' | paste -sd '|' -)"
  awk -F'==' -v drop="^(tensorflow|tf-keras|${names})\$" '
    /^[A-Za-z0-9_.-]+==/ { name = tolower($1); gsub(/_/, "-", name); if (name ~ drop) next }
    { print }' "${src}/requirements/payload.lock" >"${out}"
  grep -Ev '^[[:space:]]*(#|$)' "${src}/${overlay}" | grep -Eiv '^tf[-_]keras==' >>"${out}"
}

# pip's target flags for the TPU VM's wheels: CPython PYTHON_VERSION, x86-64 Linux, binary
# wheels only (the controller's own Python may differ).
tpu_wheel_target() {
  local python_version="$1"
  printf '%s\n' --only-binary=:all: --python-version "${python_version}" --implementation cp \
    --abi "cp${python_version//./}" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform linux_x86_64
}

# Resolve (no install, metadata only) the TPU VM's requirements for PYTHON_VERSION: what the
# wheelhouse build and the TPU VM's install would find, checked from any machine.
tpu_check_resolves() {
  local pip="$1" src="$2" python_version="$3" reqs target dir rc=0
  reqs="$(mktemp)"
  dir="$(mktemp -d)"
  tpu_requirements "${src}" "${reqs}"
  mapfile -t target < <(tpu_wheel_target "${python_version}")
  "${pip}" install --dry-run --ignore-installed --quiet --target "${dir}" "${target[@]}" \
    -r "${reqs}" || rc=$?
  rm -rf "${reqs}" "${dir}"
  return "${rc}"
}

# tf_keras as the overlay (VM_REQUIREMENTS) pins it, else as the lock does: it must match
# the VM's TensorFlow minor (tpu-vm.txt: tensorflow-tpu 2.19.1 -> tf_keras 2.19.0, while the
# lock's CPU TensorFlow is 2.20). Installed with --no-deps (it requires `tensorflow`).
tpu_tf_keras_pin() {
  local overlay="${VM_REQUIREMENTS:-requirements/tpu-vm.txt}" file
  for file in "$1/${overlay}" "$1/requirements/payload.lock"; do
    if grep -Eiq '^tf[-_]keras==' "${file}"; then
      grep -Ei '^tf[-_]keras==' "${file}" | head -n 1 | sed -E 's/^tf[-_]keras==/tf_keras==/I'
      return 0
    fi
  done
  return 1
}

# Wheelhouse key: same requirements + same target Python = same wheels. The controller
# computes it for the Python of the TPU image (catalog), the TPU VM for its own python3.
tpu_wheelhouse_key() {
  local src="$1" python_version="$2" reqs
  reqs="$(mktemp)"
  tpu_requirements "${src}" "${reqs}"
  tpu_tf_keras_pin "${src}" >>"${reqs}"
  echo "python=${python_version} platform=linux_x86_64" >>"${reqs}"
  sha256sum "${reqs}" | cut -c1-16
  rm -f "${reqs}"
}

# Install the requirements, tf_keras and the payload itself into VENV. With a WHEELHOUSE
# directory the install is offline (--no-index --find-links); if that fails (a wheel is
# missing), it falls back to the package index.
tpu_install_env() {
  local venv="$1" src="$2" wheelhouse="${3:-}" reqs keras
  reqs="$(mktemp)"
  tpu_requirements "${src}" "${reqs}"
  keras="$(tpu_tf_keras_pin "${src}")"
  if [ -n "${wheelhouse}" ] && [ -d "${wheelhouse}" ]; then
    if "${venv}/bin/pip" install --quiet --no-index --find-links "${wheelhouse}" -r "${reqs}" \
      && "${venv}/bin/pip" install --quiet --no-index --find-links "${wheelhouse}" --no-deps \
        "${keras}"; then
      tpu_install_say "installed from the wheelhouse"
    else
      tpu_install_say "wheelhouse incomplete; installing from the package index"
      wheelhouse=""
    fi
  fi
  if [ -z "${wheelhouse}" ] || [ ! -d "${wheelhouse}" ]; then
    "${venv}/bin/pip" install --quiet -r "${reqs}"
    "${venv}/bin/pip" install --quiet --no-deps "${keras}"
  fi
  rm -f "${reqs}"
  tpu_install_payload "${venv}" "${src}"
}

# The payload itself (its requirements are all pinned above).
tpu_install_payload() {
  "$1/bin/pip" install --quiet --no-deps "$2"
}

# Download every wheel a TPU VM with Python PYTHON_VERSION needs into DIR (the controller
# runs this once per lock; its own Python may differ, hence --python-version/--platform).
tpu_build_wheelhouse() {
  local pip="$1" src="$2" python_version="$3" dir="$4" reqs keras
  reqs="$(mktemp)"
  tpu_requirements "${src}" "${reqs}"
  keras="$(tpu_tf_keras_pin "${src}")"
  local target
  mapfile -t target < <(tpu_wheel_target "${python_version}")
  "${pip}" download --quiet --dest "${dir}" "${target[@]}" -r "${reqs}"
  "${pip}" download --quiet --dest "${dir}" "${target[@]}" --no-deps "${keras}"
  rm -f "${reqs}"
}
