"""Environment parity: the TPU VM's Python environment, built and exercised on CPU.

`make venv-tpu` builds .venv-tpu with the very shell function the TPU VM's startup script
runs (infra/render/templates/tpu-install.sh `tpu_install_env`: the lock minus tensorflow/tf_keras,
tensorflow-tpu + libtpu from requirements/tpu-vm.txt, tf_keras --no-deps, the payload).
This test installs the current payload source into it the same way, renders the TPU VM's
startup script for a stack, runs it in the script sandbox (script_sandbox.py, with the
venv's real interpreter, so libtpu's own path ends up in the unit), reads the trainer
unit's Environment= lines and runs the real `tpu-payload` CLI with exactly them through
tokenizer -> encode -> train (+ export) on CPU.

What differs from the TPU VM, on purpose and asserted here (nothing else may):
- TF_PLUGGABLE_DEVICE_LIBRARY_PATH is dropped and TPU_LOAD_LIBRARY=0 is added. tensorflow-tpu
  loads libtpu at import whenever it is installed; off a TPU VM libtpu then asks the GCE
  metadata server for tpu-env, accelerator-type and worker endpoints (30 tries each) and
  `import tensorflow` does not return for minutes (measured: > 5 min, killed). The test
  checks instead that the unit's path, moved from /opt/tpu-pretrain/venv to .venv-tpu, is
  the file libtpu.get_library_path() reports.
- TPU_PRETRAIN_ACCELERATOR_TYPE/RUNTIME_VERSION (this host is a TPU VM) are kept for one
  run, which must fail with the one-line "TPU not found" error in status.json and exit 2,
  and dropped for the CPU training run.
Only a real TPU shows that libtpu initialises the chips and TPUStrategy trains on them.
The environment is the TF backend's TPU pin, infra/catalogs/tpu.yaml `tensorflow_tpu` (the pair
with public evidence of running on a TPU; test_tf_tpu_pin.py): checked installed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from harness import run_offline, startup_script
from script_sandbox import Sandbox, publish_payload, unit_environment

from infra.catalogs.tpu import load_catalog
from infra.render import render

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-tpu"
STACK = "v5e-euw4"
APP_VENV = "/opt/tpu-pretrain/venv"
# The only differences between the unit's environment and the parity run's (see above).
DROPPED = {"TF_PLUGGABLE_DEVICE_LIBRARY_PATH"}
ADDED = {"TPU_LOAD_LIBRARY": "0"}
TPU_HOST = {"TPU_PRETRAIN_ACCELERATOR_TYPE", "TPU_PRETRAIN_RUNTIME_VERSION"}


@pytest.fixture(scope="module")
def tpu_venv(tmp_path_factory) -> Path:
    if not (VENV / ".installed").is_file():
        pytest.fail(f"{VENV} is missing: `make venv-tpu` builds it (`make test` does)")
    # The current payload source, installed as the startup script installs it: from the
    # content-addressed archive, with tpu_install_payload.
    archive = render.build_payload_archive()
    src = tmp_path_factory.mktemp("payload-src")
    path = src / archive.name
    path.write_bytes(archive.data)
    with tarfile.open(path) as tar:
        tar.extractall(src / "tree", filter="data")
    install = '. infra/render/templates/tpu-install.sh; tpu_install_payload "$0" "$1"'
    subprocess.run(
        ["bash", "-c", install, str(VENV), str(src / "tree")],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    return VENV


def test_the_parity_environment_holds_the_catalogs_tpu_pin(tpu_venv):
    """.venv-tpu is the catalog's evidenced pair (and tf_keras of its minor), as installed."""
    pin = load_catalog().tensorflow_tpu
    probe = (
        "from importlib.metadata import version as v\n"
        "print(v('tensorflow-tpu'), v('libtpu'), v('tf_keras'))"
    )
    installed = subprocess.run(
        [str(tpu_venv / "bin/python"), "-c", probe],
        env={"PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert installed == [pin.tensorflow_tpu, pin.libtpu, pin.tf_keras]


def _rendered_unit(box: Sandbox, python: Path | None = None) -> str:
    """The trainer unit the startup script writes; with `python`, the venv's interpreter is
    that real one (libtpu's path in the unit is then computed by it)."""
    run = run_offline(STACK)
    publish_payload(run, box)
    extra = {"STUB_VENV_PYTHON": str(python)} if python else {}
    result = box.run(startup_script(run, "tpu-vm"), **extra)
    assert result.returncode == 0, result.stderr
    return (box.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()


def parity_environment(unit_env: dict[str, str], home: Path) -> dict[str, str]:
    env = {key: value for key, value in unit_env.items() if key not in DROPPED}
    env.update(ADDED)
    # systemd's own: a minimal PATH, HOME; nothing from this test process leaks in.
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=str(home), LANG="C.UTF-8")
    return env


def test_the_unit_environment_is_the_parity_environment_plus_the_documented_changes(
    tmp_path, sandbox
):
    """Fails if the trainer unit's environment and the parity run's drift apart."""
    unit_env = unit_environment(_rendered_unit(sandbox))
    env = parity_environment(unit_env, tmp_path)
    systemd = {"PATH", "HOME", "LANG"}
    assert set(env) - systemd == (set(unit_env) - DROPPED) | set(ADDED)
    assert {k: v for k, v in env.items() if k in unit_env} == {
        k: v for k, v in unit_env.items() if k not in DROPPED
    }
    # What TensorFlow needs for the TPU (Google's TF TPU CI set) and transformers needs.
    for key, value in {
        "TF_USE_LEGACY_KERAS": "1",
        "FORCE_TF_AVAILABLE": "1",
        "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
        "TPU_NAME": "local",
    }.items():
        assert unit_env[key] == value
    assert unit_env["TPU_PRETRAIN_ACCELERATOR_TYPE"] == "v5litepod-8"
    assert unit_env["TPU_PRETRAIN_RUNTIME_VERSION"] == "v2-alpha-tpuv5-lite"


def test_the_tpu_vm_requirements_resolve_for_the_images_python():
    """The parity venv runs this machine's Python; the TPU images ship another (3.10). The
    TPU VM's exact requirements must resolve for it with binary wheels only, as the
    controller's wheelhouse build and the TPU VM's install will ask (metadata only, no
    install; needs the package index, like `make test`)."""
    pythons = {image.python for image in load_catalog().images.values() if image.python_ok}
    assert pythons == {"3.10"}
    pip = str(Path(sys.executable).with_name("pip"))
    for python_version in sorted(pythons):
        check = '. infra/render/templates/tpu-install.sh; tpu_check_resolves "$0" . "$1"'
        result = subprocess.run(
            ["bash", "-c", check, pip, python_version],
            cwd=ROOT,
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]


def _job(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    spec["output"] = str(tmp_path / "run")
    spec["corpus"]["paths"] = [str(ROOT / "examples/corpus/*.txt")]
    spec["data"]["seq_length"] = 64
    spec["train"].update(
        global_batch_size=8, steps=4, warmup_steps=1, checkpoint_every=2, log_every=2
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _cli(
    venv: Path, command: str, job: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin/tpu-payload"), command, "--job", str(job)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=job.parent,
    )


@pytest.mark.slow
def test_the_tpu_vm_environment_trains_on_cpu_with_the_units_variables(tpu_venv, sandbox, tmp_path):
    unit_env = unit_environment(_rendered_unit(sandbox, tpu_venv / "bin/python"))
    # The unit's libtpu path is libtpu's own, inside the venv the unit runs.
    libtpu = unit_env["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"]
    assert libtpu.startswith(APP_VENV + "/lib/python")
    here = Path(str(tpu_venv) + libtpu.removeprefix(APP_VENV))
    reported = subprocess.run(
        [str(tpu_venv / "bin/python"), "-c", "import libtpu; print(libtpu.get_library_path())"],
        env={"PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert here.is_file() and str(here) == reported

    env = parity_environment(unit_env, tmp_path)
    job = _job(tmp_path)
    for stage in ("tokenizer", "encode"):
        done = _cli(tpu_venv, stage, job, env)
        assert done.returncode == 0, done.stderr[-3000:]

    # This host declared a TPU VM (as the unit does) but has no TPU: one line, exit 2, and
    # the same line in status.json; no training on the CPU.
    refused = _cli(tpu_venv, "train", job, env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = (
        "TPU not found: runtime v2-alpha-tpuv5-lite on accelerator v5litepod-8: no TPU "
        "device files (/dev/accel*, /dev/vfio/*); not training on the host CPU"
    )
    assert f"error: {line}" in refused.stderr
    status = json.loads((tmp_path / "run/status.json").read_text())
    assert status["state"] == "failed" and line in status["last_error"]["error"]
    assert not (tmp_path / "run/checkpoints").exists()

    cpu_env = {key: value for key, value in env.items() if key not in TPU_HOST}
    trained = _cli(tpu_venv, "train", job, cpu_env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    # tensorflow-tpu has no XLA CPU backend: the strategy turns jit off and says so.
    tf_version = load_catalog().tensorflow_tpu.tensorflow_tpu  # the pin, as imported
    assert f"jit_compile off: this TensorFlow build ({tf_version})" in trained.stderr
    assert '"jit_compile": false' in trained.stderr
    status = json.loads((tmp_path / "run/status.json").read_text())
    assert status["stage"] == "train" and status["state"] == "complete", status
    assert (tmp_path / "run/export/export_complete.json").is_file()
    # transformers sees tensorflow-tpu only through FORCE_TF_AVAILABLE (it is not in its list
    # of TensorFlow distributions): without it, and without the payload (which sets it, see
    # test_the_payload_alone_makes_transformers_see_tensorflow_tpu), no model can be built.
    probe = (
        "from transformers import TFBertForMaskedLM, BertConfig; TFBertForMaskedLM(BertConfig())"
    )
    without = {k: v for k, v in cpu_env.items() if k != "FORCE_TF_AVAILABLE"}
    failed = subprocess.run(
        [str(tpu_venv / "bin/python"), "-c", probe],
        env=without,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0
    assert "requires the TensorFlow library but it was not found" in failed.stderr


# What a user's shell over SSH has: no unit environment (no FORCE_TF_AVAILABLE, no
# TF_USE_LEGACY_KERAS); TPU_LOAD_LIBRARY=0 only because this host is no TPU VM (see above).
_BY_HAND = (
    "import os, payload.cli\n"  # what the `tpu-payload` console script imports first
    "from transformers.utils import is_tf_available\n"
    "print('FORCE_TF_AVAILABLE=' + os.environ.get('FORCE_TF_AVAILABLE', '<unset>'))\n"
    "print('is_tf_available=' + str(is_tf_available()))\n"
    "if is_tf_available():\n"
    "    from transformers import BertConfig, TFBertForMaskedLM\n"
    "    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,\n"
    "                        num_attention_heads=2, intermediate_size=32)\n"
    "    import tensorflow as tf\n"
    "    logits = TFBertForMaskedLM(config)(tf.constant([[1, 2, 3, 4, 5]])).logits\n"
    "    print('logits=' + str(tuple(logits.shape)))\n"
)


def _by_hand(venv: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(TPU_LOAD_LIBRARY="0", **extra)
    done = subprocess.run(
        [str(venv / "bin/python"), "-c", _BY_HAND],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=home,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_the_payload_alone_makes_transformers_see_tensorflow_tpu(tpu_venv, tmp_path):
    """`/opt/tpu-pretrain/venv/bin/tpu-payload ...` run by hand has none of the unit's
    Environment= lines: importing the payload declares tensorflow-tpu to transformers, and a
    TF model builds. A value the user set is theirs, and TensorFlow switched off stays off."""
    seen = _by_hand(tpu_venv, tmp_path)
    assert seen["FORCE_TF_AVAILABLE"] == "1" and seen["is_tf_available"] == "True", seen
    assert seen["logits"] == "(1, 5, 64)", seen  # one sequence, 5 tokens, the vocabulary

    assert _by_hand(tpu_venv, tmp_path, FORCE_TF_AVAILABLE="0") == {
        "FORCE_TF_AVAILABLE": "0",
        "is_tf_available": "False",
    }
    assert _by_hand(tpu_venv, tmp_path, USE_TF="0") == {
        "FORCE_TF_AVAILABLE": "<unset>",
        "is_tf_available": "False",
    }
