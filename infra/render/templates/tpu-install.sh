# ---- templates/tpu-install.sh: the TPU VM's Python environment, one definition ---------
# Sourced by two callers, never copied: the TPU VM's startup script embeds this file
# (infra/render/render.py), and `make venv-tpu` sources it to build .venv-tpu, the environment the
# CI parity test trains in (tests/infra/test_tpu_parity.py). Inputs are files of the payload
# source tree: requirements/payload.lock and the VM's overlay, VM_REQUIREMENTS: the TPU VM's
# requirements/tpu-vm.txt (the default, TensorFlow's TPU build), requirements/tpu-vm-jax.txt
# (Keras 3 on JAX: `make venv-tpu-jax`) or the GPU VM's requirements/gpu-vm.txt. An overlay's
# `# tpu-<key>: <value>` lines (tpu_overlay_setting) say what else differs: tpu-backend (jax:
# no tf_keras), tpu-python (the environment's Python, when not the image's python3) and
# tpu-uv (the pinned uv that installs that Python on the VM).

tpu_install_say() {
  if declare -F log >/dev/null; then log "$*"; else echo "tpu-install: $*" >&2; fi
}

tpu_python_version() {
  python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'
}

# One `# tpu-KEY: value` line of the overlay (VM_REQUIREMENTS) in SRC; "" when it has none.
tpu_overlay_setting() {
  local src="$1" key="$2" overlay="${VM_REQUIREMENTS:-requirements/tpu-vm.txt}"
  sed -n -E "s/^# tpu-${key}: *([^ ]+) *\$/\1/p" "${src}/${overlay}" | head -n 1
}

# The Python (MAJOR.MINOR) the environment runs on: the overlay's tpu-python, else python3's.
tpu_env_python_version() {
  local version
  version="$(tpu_overlay_setting "$1" python)"
  if [ -n "${version}" ]; then echo "${version}"; else tpu_python_version; fi
}

# The interpreter that creates the environment's venv, for SRC's overlay: python3, or for an
# overlay with tpu-python a CPython installed by the overlay's pinned uv (tpu-uv) under DIR
# (DIR/uv: uv's own venv, made by python3; DIR/python: its Pythons). Needs the internet the
# first time (uv's download of the CPython build); an installed one is reused.
tpu_env_python() {
  local src="$1" dir="$2" version uv
  version="$(tpu_overlay_setting "${src}" python)"
  if [ -z "${version}" ]; then
    echo python3
    return 0
  fi
  uv="$(tpu_overlay_setting "${src}" uv)"
  if [ -z "${uv}" ]; then
    tpu_install_say "${VM_REQUIREMENTS}: tpu-python ${version} without a tpu-uv pin"
    return 1
  fi
  if [ ! -x "${dir}/uv/bin/uv" ] || [ "$("${dir}/uv/bin/uv" --version | cut -d' ' -f2)" != "${uv#uv==}" ]; then
    rm -rf "${dir}/uv"
    python3 -m venv "${dir}/uv" >&2
    "${dir}/uv/bin/pip" install --quiet "${uv}" >&2
  fi
  UV_PYTHON_INSTALL_DIR="${dir}/python" UV_CACHE_DIR="${dir}/uv-cache" \
    "${dir}/uv/bin/uv" python install --quiet --no-bin "${version}" >&2
  UV_PYTHON_INSTALL_DIR="${dir}/python" "${dir}/uv/bin/uv" python find --managed-python \
    --no-python-downloads "${version}"
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

# Resolve (no install) the TPU VM's requirements for PYTHON_VERSION: what the wheelhouse
# build and the TPU VM's install would find, checked from any machine. An overlay with its own
# Python (tpu-python) is checked for that Python only. PIP's `install --dry-run`, or where
# TPU_INSTALL_UV names a uv, `uv pip compile` for the same target (x86-64 manylinux up to
# 2.31, binary wheels only): uv reads each wheel's metadata alone (by range requests where
# the index serves none), pip's dry run downloads every wheel (the GPU lock's: >2 GB).
tpu_check_resolves() {
  local pip="$1" src="$2" python_version="$3" reqs target dir rc=0 wanted
  wanted="$(tpu_overlay_setting "${src}" python)"
  if [ -n "${wanted}" ] && [ "${wanted}" != "${python_version}" ]; then
    tpu_install_say "${VM_REQUIREMENTS}: its environment runs on Python ${wanted} (tpu-python), not ${python_version}"
    return 1
  fi
  reqs="$(mktemp)"
  tpu_requirements "${src}" "${reqs}"
  if [ -n "${TPU_INSTALL_UV:-}" ]; then
    "${TPU_INSTALL_UV}" pip compile --quiet --no-header --output-file /dev/null \
      --python-version "${python_version}" --python-platform x86_64-manylinux_2_31 \
      --only-binary :all: "${reqs}" || rc=$?
  else
    dir="$(mktemp -d)"
    mapfile -t target < <(tpu_wheel_target "${python_version}")
    "${pip}" install --dry-run --ignore-installed --quiet --target "${dir}" "${target[@]}" \
      -r "${reqs}" || rc=$?
    rm -rf "${dir}"
  fi
  rm -f "${reqs}"
  return "${rc}"
}

# tf_keras as the overlay (VM_REQUIREMENTS) pins it, else as the lock does: it must match
# the VM's TensorFlow minor (tpu-vm.txt: tensorflow-tpu 2.19.1 -> tf_keras 2.19.0, while the
# lock's CPU TensorFlow is 2.20). Installed with --no-deps (it requires `tensorflow`). None
# for the JAX backend's overlay (tpu-backend: jax): Keras 3 only.
tpu_tf_keras_pin() {
  local overlay="${VM_REQUIREMENTS:-requirements/tpu-vm.txt}" file
  if [ "$(tpu_overlay_setting "$1" backend)" = jax ]; then
    return 0
  fi
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

# `pip install ARGS` into VENV: VENV's own pip (the VMs), or uv's `uv pip install` where
# TPU_INSTALL_UV names a uv (`make venv-tpu*` builds CI's copies of these environments so,
# from the same files: same pins, same payload; uv installs them 7x faster than pip; it
# writes no .pyc, which the tests' first import of each module writes instead).
tpu_pip_install() {
  local venv="$1"
  shift
  if [ -n "${TPU_INSTALL_UV:-}" ]; then
    "${TPU_INSTALL_UV}" pip install --python "${venv}/bin/python" "$@"
  else
    "${venv}/bin/pip" install "$@"
  fi
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
    if tpu_pip_install "${venv}" --quiet --no-index --find-links "${wheelhouse}" -r "${reqs}" \
      && { [ -z "${keras}" ] || tpu_pip_install "${venv}" --quiet --no-index \
        --find-links "${wheelhouse}" --no-deps "${keras}"; }; then
      tpu_install_say "installed from the wheelhouse"
    else
      tpu_install_say "wheelhouse incomplete; installing from the package index"
      wheelhouse=""
    fi
  fi
  if [ -z "${wheelhouse}" ] || [ ! -d "${wheelhouse}" ]; then
    tpu_pip_install "${venv}" --quiet -r "${reqs}"
    if [ -n "${keras}" ]; then
      tpu_pip_install "${venv}" --quiet --no-deps "${keras}"
    fi
  fi
  rm -f "${reqs}"
  tpu_install_payload "${venv}" "${src}"
}

# The payload itself (its requirements are all pinned above).
tpu_install_payload() {
  tpu_pip_install "$1" --quiet --no-deps "$2"
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
  if [ -n "${keras}" ]; then
    "${pip}" download --quiet --dest "${dir}" "${target[@]}" --no-deps "${keras}"
  fi
  rm -f "${reqs}"
}
