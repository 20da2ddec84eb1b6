"""The GPU VM's environment for the Keras 3 / JAX backend (requirements/gpu-vm-jax.txt).

`make venv-gpu-jax` builds .venv-gpu-jax with the shell function the GPU VM's startup script
runs (infra/render/templates/tpu-install.sh tpu_install_env,
VM_REQUIREMENTS=requirements/gpu-vm-jax.txt) on the overlay's Python (3.12). Here: the overlay
resolves for that Python only; the
built environment has jax with its CUDA 12 plugin, keras on JAX and TensorFlow's CPU build and
nothing of TensorFlow's CUDA build or of the TPU; the real CLI trains a tiny Llama in it on the
CPU (JAX_PLATFORMS=cpu); a Llama job (train.backend auto or jax) on a GPU stack renders a
startup script that installs that environment and a trainer unit that must find the GPUs,
while a BERT job keeps the TensorFlow one. What only a GPU VM shows (docs/gpus.md): the CUDA
plugin initialising the GPUs under the image's driver.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from harness import run_offline, startup_script, uv_resolver
from script_sandbox import publish_payload, short_sha, unit_environment

from infra.render import render

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-gpu-jax"
OVERLAY = render.GPU_JAX_REQUIREMENTS_FILE
K = "tpu-pretrain:"
GPU_STACK = "t4-usc1"  # its own job: stacks/jobs/bert-small-mlm-gpu.yaml (TF)


def _install(
    check: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", ". infra/render/templates/tpu-install.sh; " + check, *args],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "VM_REQUIREMENTS": OVERLAY, **(env or {})},
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def llama_job(directory: Path, backend: str | None = None) -> str:
    """A Llama job template for a stack's `job` setting: stacks/jobs/gpt2-small-clm.yaml with
    model.family llama (tiny preset), train.backend left out (auto) unless given."""
    template = yaml.safe_load((ROOT / "stacks/jobs/gpt2-small-clm.yaml").read_text())
    template["name"] = "llama-tiny-clm"
    template["model"] = {"family": "llama", "size": "tiny"}
    template["train"].pop("backend", None)
    # 256 sequences of 256 tokens would not fit the T4 stack's one 16 GB GPU: infra runs the
    # payload's plan and refuses the stack (tests/infra/test_jobfit.py); 32 fit.
    template["train"]["global_batch_size"] = 32
    if backend is not None:
        template["train"]["backend"] = backend
    path = directory / f"llama-{backend or 'auto'}.yaml"
    path.write_text(yaml.safe_dump(template))
    return str(path)


# ---- (1) the overlay resolves, for its own Python ------------------------------------------


def test_the_overlay_names_its_backend_python_and_uv():
    assert render.overlay_setting(OVERLAY, "backend") == "jax"
    assert render.overlay_setting(OVERLAY, "python") == "3.12"
    assert render.overlay_setting(OVERLAY, "uv") == render.overlay_setting(
        render.TPU_JAX_REQUIREMENTS_FILE, "uv"
    )
    assert render.gpu_requirements_for("jax") == OVERLAY
    assert render.gpu_requirements_for("tf") == render.GPU_REQUIREMENTS_FILE


def test_the_gpu_jax_requirements_resolve_for_their_python_only():
    """What the controller's wheelhouse build and the GPU VM's install resolve (binary wheels
    for CPython 3.12 on x86-64 Linux; needs the package index): uv resolves it, as pip's dry
    run would after downloading every CUDA wheel (harness.uv_resolver)."""
    pip = str(Path(sys.executable).with_name("pip"))
    done = _install('tpu_check_resolves "$0" . "$1"', pip, "3.12", env=uv_resolver())
    assert done.returncode == 0, done.stderr[-2000:]
    refused = _install('tpu_check_resolves "$0" . "$1"', pip, "3.10", env=uv_resolver())
    assert refused.returncode == 1
    assert "runs on Python 3.12 (tpu-python), not 3.10" in refused.stderr


def test_the_requirements_are_jax_cuda12_and_grain_without_tensorflow(tmp_path):
    out = tmp_path / "reqs.txt"
    done = _install('tpu_requirements . "$0"; echo "tf_keras=[$(tpu_tf_keras_pin .)]"', str(out))
    assert done.returncode == 0, done.stderr
    assert "tf_keras=[]" in done.stdout  # no tf_keras --no-deps step
    reqs = [line for line in out.read_text().splitlines() if "==" in line]
    names = {re.split(r"[\[=]", line)[0].lower().replace("_", "-") for line in reqs}
    wanted = {"jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cudnn-cu12"}
    assert wanted | {"grain", "gcsfs", "keras", "transformers", "orbax-checkpoint"} <= names
    assert not names & {*render.TENSORFLOW_DISTRIBUTIONS, "libtpu"}
    assert "jax[cuda12]==0.12.0.1" in reqs and "keras==3.15.1" in reqs
    assert len(reqs) == len(names), "a package is pinned twice"


@pytest.mark.parametrize(
    ("old", "new", "refusal"),
    [
        (
            "jax-cuda12-pjrt==0.12.0.1",
            "jax-cuda12-pjrt==0.9.0",
            r"jax-cuda12-pjrt==0\.9\.0 \(not the tested jax 0\.12\.0\.1\)",
        ),
        ("grain==0.2.18", "grain==0.2.17", r"grain==0\.2\.17 \(.* tests 0\.2\.18\)"),
        (
            "scipy==1.17.1",
            "scipy==1.17.1\ntensorflow-cpu==2.20.0",
            r"tensorflow-cpu==2\.20\.0 \(the JAX backend needs no TensorFlow\)",
        ),
    ],
)
def test_render_refuses_a_gpu_jax_overlay_off_the_tested_pins(
    tmp_path, monkeypatch, old: str, new: str, refusal: str
):
    (tmp_path / "requirements").mkdir()
    for name in (render.LOCK_FILE, render.PAYLOAD_DEV_FILE, OVERLAY):
        (tmp_path / name).write_text((render.REPO_ROOT / name).read_text())
    overlay = tmp_path / OVERLAY
    assert old in overlay.read_text()
    overlay.write_text(overlay.read_text().replace(old, new))
    monkeypatch.setattr(render, "REPO_ROOT", tmp_path)
    host = render.GpuHost(
        "n1-standard-8", "nvidia-tesla-t4", "T4", 1, "dlvm", "3.10", "mixed_float16",
        requirements=OVERLAY, backend="jax",
    )  # fmt: skip
    workload = render.Workload("b", "j", "payload/p.tar.gz", "0" * 64, host)
    with pytest.raises(ValueError, match=refusal):
        render.render_gpu_script(workload)


# ---- (2) which environment a GPU stack installs ---------------------------------------------


def _constants(run, name: str) -> dict[str, str]:
    return dict(re.findall(r"^readonly ([A-Z_]+)=(\S*)$", startup_script(run, name), re.MULTILINE))


def test_a_llama_job_installs_the_jax_environment_a_bert_job_the_tensorflow_one(tmp_path):
    cases = {
        None: "tf",  # the stack's own job: BERT, train.backend auto
        llama_job(tmp_path): "jax",  # auto: llama is a family only the JAX backend has
        llama_job(tmp_path, "jax"): "jax",
    }
    for job, backend in cases.items():
        run = run_offline(GPU_STACK, {K + "job": job} if job else None)
        gpu, controller = _constants(run, "gpu-vm"), _constants(run, "controller-vm")
        overlay = render.gpu_requirements_for(backend)
        assert gpu["PAYLOAD_BACKEND"] == backend, job
        assert gpu["VM_REQUIREMENTS"] == controller["VM_REQUIREMENTS"] == overlay, job
        # The controller's wheelhouse is built for the environment's Python.
        assert controller["TPU_PYTHON_VERSION"] == ("3.12" if backend == "jax" else "3.10")
        assert gpu["EXPECT_PYTHON"] == "3.10"  # the image's python3 (host check)


def test_auto_is_jax_for_a_llama_job_on_a_tpu_stack_whose_image_tf_ci_covers(tmp_path):
    """v5e's image is in Google's TF CI (auto is tf for its GPT-2 job), but the payload trains
    llama on JAX only: the stack installs the JAX environment for it."""
    for job, backend in ((None, "tf"), (llama_job(tmp_path), "jax")):
        run = run_offline("v5e-euw4", {K + "job": job} if job else None)
        tpu = _constants(run, "tpu-vm")
        assert tpu["PAYLOAD_BACKEND"] == backend, job
        assert tpu["VM_REQUIREMENTS"] == render.requirements_for(backend), job


@pytest.fixture
def gpu_box(box):
    """The GPU script sandbox (stub nvidia-smi, a venv python that names the ptxas folder),
    whose uv-installed Python makes the same venvs as the image's python3."""
    python3 = (box.bin / "python3").read_text()
    (box.bin / "uv-python").write_text(python3.replace('echo "python3 $*"', 'echo "uv-python $*"'))
    (box.bin / "uv-python").chmod((box.bin / "uv-python").stat().st_mode | stat.S_IXUSR)
    return box


def test_the_llama_gpu_script_installs_jax_cuda_on_uvs_python(tmp_path, gpu_box):
    run = run_offline(GPU_STACK, {K + "job": llama_job(tmp_path)})
    bucket, _ = publish_payload(run, gpu_box)
    script = startup_script(run, "gpu-vm")
    short = short_sha(script)
    app = f"{gpu_box.root}/opt/tpu-pretrain"
    first = gpu_box.run(script, SMI_GPUS="1")
    assert first.returncode == 0, first.stderr
    calls = gpu_box.calls
    assert "nvidia-smi -L" in calls
    assert "uv python install --quiet --no-bin 3.12" in calls
    assert f"uv-python -m venv {app}/venv-{short}" in calls
    assert f"python3 -m venv {app}/venv-{short}" not in calls
    pip_calls = [c for c in calls if c.startswith("pip ") and "uv==" not in c]
    assert len(pip_calls) == 2  # the requirements and the payload: no tf_keras --no-deps
    (requirements,) = gpu_box.state.glob("requirements-*.txt")
    lock = requirements.read_text()
    assert "jax[cuda12]==0.12.0.1" in lock and "grain==0.2.18" in lock
    assert "jax-cuda12-plugin==0.12.0.1" in lock and "nvidia-cudnn-cu12==" in lock
    assert not re.search(r"^(tensorflow\S*|tf[-_]keras|libtpu)==", lock, re.M)
    unit = (gpu_box.root / "etc/systemd/system/tpu-pretrain-train.service").read_text()
    env = unit_environment(unit)
    assert env["KERAS_BACKEND"] == "jax" and env["TPU_PAYLOAD_BACKEND"] == "jax"
    assert "JAX_PLATFORMS" not in env  # the payload refuses a CPU-only JAX itself (below)
    assert env["TPU_PRETRAIN_GPU"] == "T4" and env["TPU_PRETRAIN_GPU_COUNT"] == "1"
    assert env["PATH"].startswith("/opt/tpu-pretrain/venv/lib/python3.10/site-packages/nvidia/")
    assert not {"TF_USE_LEGACY_KERAS", "FORCE_TF_AVAILABLE"} & set(env)
    assert f"tpu-payload train --job gs://{bucket}/jobs/llama-tiny-clm.json\n" in unit


# ---- (3) the built environment, and the real CLI in it ----------------------------------------

_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
import jax, keras, grain
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2],
    "jax": jax.__version__,
    "devices": [d.platform for d in jax.devices()],
    "keras_backend": keras.backend.backend(),
    "tensorflow": u.find_spec("tensorflow") is not None,
    "grain": int(sum(grain.MapDataset.range(3).to_iter_dataset())),
    "tf_keras": u.find_spec("tf_keras") is not None,
    "dists": {d.metadata["Name"].lower().replace("_", "-"): d.version for d in m.distributions()},
}))
"""


@pytest.fixture(scope="module")
def jax_venv(tmp_path_factory) -> Path:
    if not (VENV / ".installed").is_file():
        pytest.fail(f"{VENV} is missing: `make venv-gpu-jax` builds it (`make test` does)")
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


def _python(venv: Path, code: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin/python"), "-c", code],
        env=_venv_env(home, KERAS_BACKEND="jax", **env),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_environment_has_jax_cuda12_keras_on_jax_and_grain_without_tensorflow(
    jax_venv, tmp_path
):
    done = _python(jax_venv, _PROBE, tmp_path, JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["python"] == "3.12" and seen["jax"] == "0.12.0.1" and seen["devices"] == ["cpu"]
    assert seen["keras_backend"] == "jax" and not seen["tf_keras"]
    assert not seen["tensorflow"] and seen["grain"] == 3
    dists = seen["dists"]
    assert dists["jax-cuda12-plugin"] == dists["jax-cuda12-pjrt"] == "0.12.0.1"
    assert dists["grain"] == "0.2.18" and dists["gcsfs"] == "2026.10.1"
    assert not {*render.TENSORFLOW_DISTRIBUTIONS, "libtpu"} & set(dists)


def test_without_a_gpu_the_trainer_units_environment_stops_with_gpu_not_found(jax_venv, tmp_path):
    """The GPU VM's trainer unit names its GPUs (TPU_PRETRAIN_GPU*, gpu.sh trainer_host_env)
    and sets no JAX_PLATFORMS. On a host whose CUDA plugin cannot initialise (this one: no
    GPU) JAX falls back to the CPU, and the payload's JAX runtime refuses it with a one-line
    user error (exit 2 from the CLI, not restarted) instead of training on the CPU; with
    JAX_PLATFORMS=cuda jax itself would end in a bare AssertionError."""
    probe = (
        "from payload.core import hosts\n"
        "from payload.backends.jax import runtime\n"
        "hosts.expect_gpu(hosts.GpuHost('T4', 1, 'mixed_float16', 'dlvm-cu128'))\n"
        "runtime.runtime('auto')\n"
    )
    done = _python(jax_venv, probe, tmp_path)
    assert done.returncode != 0
    assert "Jax plugin configuration error" in done.stderr  # the CUDA plugin was tried
    assert (
        "payload.core.hosts.GpuNotFoundError: GPU not found: this VM should have 1 × T4 (image "
        "dlvm-cu128) but JAX 0.12.0.1 sees only cpu (cpu)"
    ) in done.stderr
    cuda = _python(jax_venv, "import jax; jax.devices()", tmp_path, JAX_PLATFORMS="cuda")
    assert cuda.returncode != 0 and "AssertionError" in cuda.stderr


@pytest.mark.slow
def test_the_gpu_jax_environment_trains_and_exports_a_tiny_llama_on_cpu(jax_venv, tmp_path):
    """`tpu-payload run` for a tiny Llama (train.backend auto) in .venv-gpu-jax on the CPU:
    tokenizer, encode, a few JAX steps and the LlamaForCausalLM export."""
    spec = yaml.safe_load((ROOT / "examples/tiny-clm.yaml").read_text())
    spec["output"] = str(tmp_path / "run")
    spec["corpus"]["paths"] = [str(ROOT / "examples/corpus/*.txt")]
    spec["data"]["seq_length"] = 64
    spec["model"] = {"family": "llama", "size": "tiny"}
    spec["train"].update(
        global_batch_size=8, steps=4, warmup_steps=1, checkpoint_every=2, log_every=2
    )
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        [str(jax_venv / "bin/tpu-payload"), "run", "--job", str(job)],
        env=_venv_env(tmp_path, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax"),
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    export = tmp_path / "run/export"
    assert (export / "export_complete.json").is_file()
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
