#!/usr/bin/env bash
# Install time of the TPU VM's environment: from a wheelhouse (pip install --no-index
# --find-links, what a recreated TPU VM does) vs from the package index (a first boot).
# Uses the startup script's own functions (infra/render/templates/tpu-install.sh) for this
# machine's python3; pip's cache is off for both, so each install really fetches or reads
# every wheel. Prints figures; asserts nothing. Usage: bash bench/bench_tpu_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
. infra/render/templates/tpu-install.sh
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
out="${BENCH_OUT:-bench/out/tpu-install}"
rm -rf "${out}"
mkdir -p "${out}"
python_version="$(tpu_python_version)"

seconds() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }

start="$(seconds)"
python3 -m venv "${out}/builder"
tpu_build_wheelhouse "${out}/builder/bin/pip" . "${python_version}" "${out}/wheelhouse"
built="$(elapsed "${start}" "$(seconds)")"
size="$(du -sh "${out}/wheelhouse" | cut -f1)"
count="$(find "${out}/wheelhouse" -name '*.whl' | wc -l)"

start="$(seconds)"
python3 -m venv "${out}/index"
tpu_install_env "${out}/index" . ""
index="$(elapsed "${start}" "$(seconds)")"

start="$(seconds)"
python3 -m venv "${out}/wheels"
tpu_install_env "${out}/wheels" . "${out}/wheelhouse"
wheels="$(elapsed "${start}" "$(seconds)")"

echo "TPU VM environment, Python ${python_version}, ${count} wheels (${size}):"
echo "  wheelhouse build (pip download, once per lock, on the controller): ${built}s"
echo "  install from the package index (first boot):                      ${index}s"
echo "  install from the wheelhouse (--no-index --find-links):             ${wheels}s"
rm -rf "${out}"
