"""The TPU VM's environment for the Keras 3 / JAX backend (requirements/tpu-vm-jax.txt).

`make venv-tpu-jax` builds .venv-tpu-jax with the shell function the TPU VM's startup script
runs (infra/render/templates/tpu-install.sh tpu_install_env,
VM_REQUIREMENTS=requirements/tpu-vm-jax.txt) on the overlay's Python (3.12). Here: the overlay
resolves for that Python only; the
built environment has jax, keras on JAX and TensorFlow's CPU build and nothing of TF's TPU
line; a job with train.backend: jax (or a v6e stack, auto) renders a startup script that
installs that environment, and the script runs in the script sandbox (script_sandbox.py).
What only a TPU VM shows (docs/jax-on-tpu-vm.md): uv's CPython download, the devices JAX
sees, libtpu 0.0.52 initialising v6e/v5e chips.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from harness import config_error, run_offline, startup_script
from script_sandbox import (
    bootstrap_status,
    job_with_backend,
    publish_payload,
    short_sha,
    unit_environment,
)

from infra.render import render

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-tpu-jax"
OVERLAY = render.TPU_JAX_REQUIREMENTS_FILE
K = "tpu-pretrain:"


def _install(check: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", ". infra/render/templates/tpu-install.sh; " + check, *args],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "VM_REQUIREMENTS": OVERLAY},
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---- (1) the overlay resolves, for its own Python ------------------------------------------


def test_the_overlay_names_its_python_and_uv():
    assert render.overlay_setting(OVERLAY, "backend") == "jax"
    assert render.overlay_setting(OVERLAY, "python") == "3.12"
    assert render.overlay_setting(OVERLAY, "uv") == "uv==0.13.9"
    # The TF overlays run on the image's python3 and name none.
    for other in (render.TPU_REQUIREMENTS_FILE, render.GPU_REQUIREMENTS_FILE):
        assert render.overlay_setting(other, "python") == ""


def test_the_jax_requirements_resolve_for_their_python_only():
    """What the controller's wheelhouse build and the TPU VM's install resolve (metadata only,
    binary wheels for CPython 3.12 on x86-64 Linux; needs the package index)."""
    pip = str(Path(sys.executable).with_name("pip"))
    done = _install('tpu_check_resolves "$0" . "$1"', pip, "3.12")
    assert done.returncode == 0, done.stderr[-2000:]
    # jaxlib 0.12.0.1 has no cp310 wheel: the image's Python is refused before pip is asked.
    refused = _install('tpu_check_resolves "$0" . "$1"', pip, "3.10")
    assert refused.returncode == 1
    assert "runs on Python 3.12 (tpu-python), not 3.10" in refused.stderr


def test_the_jax_requirements_drop_tensorflow_and_tf_keras_and_add_grain(tmp_path):
    out = tmp_path / "reqs.txt"
    done = _install('tpu_requirements . "$0"; echo "tf_keras=[$(tpu_tf_keras_pin .)]"', str(out))
    assert done.returncode == 0, done.stderr
    assert "tf_keras=[]" in done.stdout  # no tf_keras --no-deps step
    reqs = [line for line in out.read_text().splitlines() if "==" in line]
    names = {re.split(r"[\[=]", line)[0].lower().replace("_", "-") for line in reqs}
    assert {"jax", "jaxlib", "libtpu", "grain", "gcsfs", "keras", "transformers"} <= names
    assert not names & set(render.TENSORFLOW_DISTRIBUTIONS)
    assert "jax==0.12.0.1" in reqs and "libtpu==0.0.52" in reqs and "keras==3.15.1" in reqs
    assert len(reqs) == len(names), "a package is pinned twice"


# ---- (2) the built environment ----------------------------------------------------------

_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
import jax, keras, grain
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2],
    "jax": jax.__version__,
    "devices": [d.platform for d in jax.devices()],
    "keras": keras.__version__,
    "keras_backend": keras.backend.backend(),
    "tensorflow": u.find_spec("tensorflow") is not None,
    "grain": int(sum(grain.MapDataset.range(3).to_iter_dataset())),
    "tf_keras": u.find_spec("tf_keras") is not None,
    "dists": sorted(d.metadata["Name"].lower().replace("_", "-") for d in m.distributions()),
    "libtpu": m.version("libtpu"),
}))
"""


@pytest.fixture(scope="module")
def jax_venv(tmp_path_factory) -> Path:
    if not (VENV / ".installed").is_file():
        pytest.fail(f"{VENV} is missing: `make venv-tpu-jax` builds it (`make test` does)")
    # The current payload source, installed as the startup script installs it.
    archive = render.build_payload_archive()
    src = tmp_path_factory.mktemp("payload-src")
    (src / archive.name).write_bytes(archive.data)
    with tarfile.open(src / archive.name) as tar:
        tar.extractall(src / "tree", filter="data")
    done = _install('tpu_install_payload "$0" "$1"', str(VENV), str(src / "tree"))
    assert done.returncode == 0, done.stderr
    return VENV


def _venv_env(home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", **extra}


def test_the_environment_has_jax_keras_on_jax_and_grain_without_tensorflow(jax_venv, tmp_path):
    done = subprocess.run(
        [str(jax_venv / "bin/python"), "-c", _PROBE],
        env=_venv_env(tmp_path, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax"),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["python"] == render.overlay_setting(OVERLAY, "python")
    assert seen["jax"] == "0.12.0.1" and seen["devices"] and set(seen["devices"]) == {"cpu"}
    assert seen["keras"] == "3.15.1" and seen["keras_backend"] == "jax"
    assert not seen["tensorflow"] and seen["grain"] == 3
    assert seen["libtpu"] == "0.0.52"
    assert not seen["tf_keras"]
    assert {"grain", "gcsfs"} <= set(seen["dists"])
    assert not set(render.TENSORFLOW_DISTRIBUTIONS) & set(seen["dists"])


def test_jax_platforms_tpu_without_a_tpu_is_an_error_not_a_cpu_run(jax_venv, tmp_path):
    """The trainer unit's JAX_PLATFORMS=tpu on a host without TPU chips (measured here: the
    error comes within a second; libtpu does not wait for the metadata server)."""
    done = subprocess.run(
        [str(jax_venv / "bin/python"), "-c", "import jax; print(jax.devices())"],
        env=_venv_env(tmp_path, JAX_PLATFORMS="tpu", KERAS_BACKEND="jax"),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "Unable to initialize backend 'tpu'" in done.stderr
    assert "CpuDevice" not in done.stdout


# ---- (3) the rendered startup script ------------------------------------------------------


@pytest.fixture(scope="module")
def jax_run():
    return run_offline("v6e-euw4")  # v6e: train.backend auto -> jax (catalog tf_ci: false)


def test_backend_choice_follows_the_job_then_the_catalog(tmp_path):
    def constants(run, name: str) -> dict[str, str]:
        text = startup_script(run, name)
        return dict(re.findall(r"^readonly ([A-Z_]+)=(\S*)$", text, re.MULTILINE))

    jax_job = job_with_backend(tmp_path, "jax")
    tf_job = job_with_backend(tmp_path, "tf")
    cases = {
        ("v6e-euw4", None): "jax",  # auto: v2-alpha-tpuv6e is not in Google's TF CI
        ("v6e-euw4", tf_job): "tf",
        ("v5e-euw4", None): "tf",  # auto: v2-alpha-tpuv5-lite is
        ("v5e-euw4", jax_job): "jax",
    }
    for (stack, job), backend in cases.items():
        run = run_offline(stack, {K + "job": job} if job else None)
        tpu, controller = constants(run, "tpu-vm"), constants(run, "controller-vm")
        overlay = render.requirements_for(backend)
        assert tpu["PAYLOAD_BACKEND"] == backend, (stack, job)
        assert tpu["VM_REQUIREMENTS"] == controller["VM_REQUIREMENTS"] == overlay
        # The controller's wheelhouse is built for the environment's Python.
        assert controller["TPU_PYTHON_VERSION"] == ("3.12" if backend == "jax" else "3.10")
        assert tpu["EXPECT_PYTHON"] == "3.10"  # the image's python3 (host check)
        assert tpu["EXPECT_LIBTPU"] == ("0.0.52" if backend == "jax" else render.read_pins().libtpu)


def test_a_bad_backend_and_tf_on_a_slice_are_config_errors(tmp_path):
    bad = job_with_backend(tmp_path, "pytorch")
    assert config_error("v6e-euw4", {K + "job": bad}) == (
        f"{K}job: {bad!r}: train.backend 'pytorch' is not one of: tf, jax, auto"
    )
    # A slice runs JAX only: an explicit tf is refused with one line (auto and jax: see
    # test_slice_startup.py).
    tf_job = job_with_backend(tmp_path, "tf", "stacks/jobs/bert-base-mlm.yaml")
    assert config_error("v4-32-usc2", {K + "job": tf_job}) == (
        f"{K}job: {tf_job!r}: train.backend: tf on a v4-32 slice is not supported: Google's TF "
        "CI runs TF slices only through its grpc_tpu_worker container (not built here); use "
        "train.backend: jax"
    )


def test_the_jax_script_installs_the_jax_environment_on_uvs_python(jax_run, sandbox):
    bucket, _ = publish_payload(jax_run, sandbox)
    script = startup_script(jax_run, "tpu-vm")
    short = short_sha(script)
    app = f"{sandbox.root}/opt/tpu-pretrain"
    first = sandbox.run(script)
    assert first.returncode == 0, first.stderr
    calls = sandbox.calls
    # uv (pinned in the overlay) in its own venv of the image's python3, then its CPython.
    assert f"python3 -m venv {app}/uv" in calls
    assert "pip install --quiet uv==0.13.9" in calls
    assert "uv python install --quiet --no-bin 3.12" in calls
    assert "uv python find --managed-python --no-python-downloads 3.12" in calls
    assert f"uv-python -m venv {app}/venv-{short}" in calls
    assert f"python3 -m venv {app}/venv-{short}" not in calls
    pip_calls = [c for c in calls if c.startswith("pip ") and "uv==" not in c]
    src = f"{app}/src-{short}"
    assert len(pip_calls) == 2  # the requirements and the payload: no tf_keras --no-deps
    assert re.fullmatch(r"pip install --quiet -r \S+", pip_calls[0])
    assert pip_calls[1] == f"pip install --quiet --no-deps {src}"
    (requirements,) = sandbox.state.glob("requirements-*.txt")
    lock = requirements.read_text()
    assert "transformers==4.57.6" in lock and "jax==0.12.0.1" in lock
    assert "grain==0.2.18" in lock and "libtpu==0.0.52" in lock
    assert not re.search(r"^(tensorflow\S*|tf[-_]keras)==", lock, re.MULTILINE)
    # No wheelhouse yet: the key the TPU VM looks for is the one for Python 3.12.
    assert "no wheelhouse" in first.stderr and "for Python 3.12 yet" in first.stderr

    unit = (sandbox.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    assert unit_environment(unit) == {
        "PYTHONUNBUFFERED": "1",
        "TPU_PAYLOAD_VERBOSE": "1",
        "KERAS_BACKEND": "jax",
        "TPU_PAYLOAD_BACKEND": "jax",
        "JAX_PLATFORMS": "tpu",
        "TPU_PRETRAIN_ACCELERATOR_TYPE": "v6e-8",
        "TPU_PRETRAIN_RUNTIME_VERSION": "v2-alpha-tpuv6e",
        "TPU_PRETRAIN_HOST_FACTS": "/opt/tpu-pretrain/host-facts.json",
    }
    assert (
        f"ExecStart=/opt/tpu-pretrain/venv/bin/tpu-payload train --job gs://{bucket}/jobs/"
        "gpt2-small-clm.json\n" in unit
    )
    assert bootstrap_status(sandbox, bucket)["state"] == "started"

    second = sandbox.run(script)  # idempotent: nothing installed again, the unit unchanged
    assert second.returncode == 0, second.stderr
    assert not [c for c in sandbox.calls if c.startswith(("pip ", "uv ", "uv-python -m venv"))]
    assert (sandbox.root / "etc/systemd/system/tpu-pretrain-train.service").read_text() == unit


def test_the_controller_builds_the_jax_wheelhouse_for_python_312(jax_run, sandbox):
    bucket, _ = publish_payload(jax_run, sandbox)
    controller = sandbox.run(startup_script(jax_run, "controller-vm"))
    assert controller.returncode == 0, controller.stderr
    downloads = [c for c in sandbox.calls if c.startswith("pip download")]
    assert len(downloads) == 1  # the requirements only: no tf_keras --no-deps download
    assert "--python-version 3.12 --implementation cp --abi cp312" in downloads[0]
    (wheelhouse,) = (sandbox.gcs / bucket / "wheelhouse").iterdir()
    # The TPU VM computes the same key for its environment's Python and installs from it.
    shutil.rmtree(sandbox.root / "opt")
    tpu = sandbox.run(startup_script(jax_run, "tpu-vm"))
    assert tpu.returncode == 0, tpu.stderr
    assert f"wheelhouse {wheelhouse.name}: 1 wheels downloaded" in tpu.stderr, tpu.stderr
    assert "installed from the wheelhouse" in tpu.stderr


# ---- (4) the real CLI in the JAX environment (waits for the payload's JAX trainer) ----------


def _tiny_jax_job(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    spec["output"] = str(tmp_path / "run")
    spec["corpus"]["paths"] = [str(ROOT / "examples/corpus/*.txt")]
    spec["data"]["seq_length"] = 64
    spec["train"].update(
        backend="jax", global_batch_size=8, steps=4, warmup_steps=1, checkpoint_every=2, log_every=2
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_the_jax_environment_runs_a_tiny_jax_job_on_cpu(jax_venv, tmp_path):
    """PENDING THE PAYLOAD SIDE: `tpu-payload run` with train.backend: jax in .venv-tpu-jax on
    the CPU (JAX_PLATFORMS=cpu), through tokenizer, encode, train and export. Skipped while the
    installed payload refuses the train.backend key (the JAX trainer lands separately)."""
    job = _tiny_jax_job(tmp_path)
    env = _venv_env(tmp_path, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax", TPU_PAYLOAD_BACKEND="jax")
    done = subprocess.run(
        [str(jax_venv / "bin/tpu-payload"), "run", "--job", str(job)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tmp_path,
    )
    if done.returncode == 2 and "train.backend" in done.stderr:
        line = [x for x in done.stderr.splitlines() if "train.backend" in x][-1]
        pytest.skip(f"the payload's CLI does not accept train.backend: jax yet: {line.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run/export/export_complete.json").is_file()
