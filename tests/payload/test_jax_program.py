"""The trainer's builder (payload/backends/jax/program.py) and `tpu-payload compile`'s command
line (aot.py) on this machine's CPU. The HLO reading (hlo.py), on recorded HLO: test_hlo.py.

What a TPU compile shows is in test_tpu_compile.py (the TPU environment); that the real
trainer compiles exactly what the compile path builds is in test_jax_sharding.py (the
fingerprints of an FSDP and a data-parallel run on 8 devices).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import assert_user_error, run_cli

HERE = Path(__file__).parent

# ---- `tpu-payload compile`'s pieces -----------------------------------------------------


@pytest.mark.parametrize(
    ("accelerator", "name", "bounds", "hosts"),
    [
        ("v5litepod-4", "v5e:2x2", (2, 2, 1), 1),
        ("v5litepod-8", "v5e:2x4", (2, 4, 1), 1),  # one TPU VM of 8 chips
        ("v5litepod-16", "v5e:4x4", (2, 2, 1), 4),
        ("v6e-8", "v6e:2x4", (2, 4, 1), 1),
        ("v4-8", "v4:2x2x1", (2, 2, 1), 1),  # v4-8: 8 TensorCores, 4 chips
        ("v5p-32", "v5:2x2x4", (2, 2, 1), 4),
    ],
)
def test_a_tpu_type_names_its_topology(
    accelerator: str, name: str, bounds: tuple[int, int, int], hosts: int
) -> None:
    from payload.plan import accelerators  # the table alone: no JAX in this test's process

    topology = accelerators.topology_of(accelerators.accelerator(accelerator))
    assert (topology.name, topology.chips_per_host_bounds, topology.hosts) == (name, bounds, hosts)


# ---- the builder: abstract, repeatable ---------------------------------------------------

BUILD_TWICE = """
import json, os, tempfile, warnings
from payload.backends.jax import use_jax
use_jax()
import jax
cache = tempfile.mkdtemp(prefix="program-test-cache-")
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from payload.backends.jax import aot, program, runtime
from payload.spec import parse_job
job = parse_job({
    "name": "program", "output": "/tmp/unused-program-test", "corpus": {"paths": ["/x.txt"]},
    "tokenizer": {"kind": "bpe", "vocab_size": 512},
    "data": {"objective": "clm", "seq_length": 32, "eval_fraction": 0.1},
    "model": {"family": "gpt2", "size": "tiny"},
    "train": {"backend": "jax", "steps": 4, "global_batch_size": 4},
}, source="/tmp/program.yaml")
facts = runtime.Facts(platform="cpu", device_kind="cpu", local_devices=1, device_memory=None)
first = aot.build_for(job, facts, jax.devices())
second = aot.build_for(job, facts, jax.devices())
variables = first.model.variables + first.optimizer.variables[1:]
def chunks():
    return sorted(n for n in os.listdir(cache) if n.startswith("jit_train_chunk"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    onednn = first.train_chunk().as_text()
    after_onednn = chunks()
    os.environ[program.CPU_ONEDNN_ENV] = "0"
    plain = second.train_chunk().as_text()
os.environ[program.CPU_ONEDNN_ENV] = "yes"
try:
    program.train_compiler_options("cpu")
    refused = None
except Exception as exc:
    refused = f"{type(exc).__name__}: {exc}"
print(json.dumps({
    "refused": refused,
    "onednn": ["__onednn$matmul" in onednn, "__onednn$matmul" in plain],
    "cached": [after_onednn, chunks()],
    "options": [first.train_options, second.train_options],  # the trainer's cache line
    "warnings": [str(w.message) for w in caught],
    "prints": [first.fingerprints(), second.fingerprints()],
    "valued": [v.path for v in variables if v._value is not None],
    "iterations": str(first.state.optimizer[0]),
    "batches": {k: [list(v.shape), str(v.dtype)] for k, v in first.train_batches.items()},
}))
"""


def test_the_builder_creates_no_values_and_builds_the_same_program_twice() -> None:
    """The CPU's training chunk compiles with oneDNN and is not cached; no weight, slot or
    seed state of the builder's model gets a value (Keras initialises pending variables when
    a stateless call ends: a second build in a process, as the trainer's after its real
    model, once captured them as constants), and two builds lower to the same text. GPT-2
    has dropout: its seed states are state, never constants."""
    done = subprocess.run(
        [sys.executable, "-c", BUILD_TWICE],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["prints"][0] == seen["prints"][1], seen["prints"]
    assert set(seen["prints"][0]) == {"train_chunk", "eval_step"}
    assert seen["valued"] == [], seen["valued"]
    assert "int32" in seen["iterations"] and "shape=()" in seen["iterations"]
    # On the CPU the training chunk's weight gradients are oneDNN matmuls (program.py
    # CPU_TRAIN_OPTIONS); XLA cannot serialize that executable, so it is not written to the
    # persistent cache, and nothing warns. With CPU_ONEDNN_ENV=0: no oneDNN, and cached.
    assert seen["onednn"] == [True, False], seen
    assert seen["cached"][0] == [] and len(seen["cached"][1]) == 1, seen["cached"]
    assert seen["options"] == [{"xla_cpu_experimental_onednn_custom_call": True}, None]
    assert seen["warnings"] == [], seen["warnings"]
    assert seen["refused"] == (
        "SpecError: TPU_PAYLOAD_CPU_ONEDNN: 'yes' must be 0 (off) or 1 (on, the default)"
    )
    # steps_per_execution 8 on CPU, the global batch, the sequence: the pipeline's features.
    assert seen["batches"] == {
        "input_ids": [[8, 4, 32], "int32"],
        "attention_mask": [[8, 4, 32], "int32"],
        "labels": [[8, 4, 32], "int32"],
        "label_weights": [[8, 4, 32], "float32"],
    }


# ---- the command line's refusals ---------------------------------------------------------


def _job(tmp_path: Path, family: str = "llama", **train: object) -> Path:
    import yaml

    document = {
        "name": "compile-cli",
        "output": str(tmp_path / "out"),
        "corpus": {"paths": [str(tmp_path / "corpus.txt")]},
        "tokenizer": {"kind": "bpe", "vocab_size": 512},
        "data": {"objective": "clm", "seq_length": 128},
        "model": {"family": family, "size": "tiny"},
        "train": {"backend": "jax", "steps": 4, "global_batch_size": 8, **train},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.parametrize(
    ("accelerator", "pattern"),
    [
        ("nvidia-l4", r"^error: --accelerator nvidia-l4: the GPU compiler .* needs a GPU"),
        ("v3-8", r"^error: --accelerator v3-8: no topology for v3 \(compile knows v4, v5e, "),
        (
            "v5litepod-2",
            r"^error: --accelerator v5litepod-2: no topology of 2 chips; v5litepod-1, ",
        ),
        ("tpu-9", r"^error: --accelerator 'tpu-9': unknown accelerator type"),
    ],
)
def test_compile_refuses_what_it_cannot_compile_here_in_one_line(
    tmp_path: Path, accelerator: str, pattern: str
) -> None:
    job = _job(tmp_path)
    result = run_cli("compile", "--job", str(job), "--accelerator", accelerator, timeout=300)
    assert_user_error(result, pattern)


def test_compile_needs_libtpu_and_says_where_it_is(tmp_path: Path) -> None:
    """This environment (.venv) has JAX without libtpu: one line naming the TPU environment."""
    job = _job(tmp_path)
    result = run_cli("compile", "--job", str(job), "--accelerator", "v5litepod-4", timeout=300)
    assert_user_error(result, r"compile needs the TPU compiler \(the libtpu wheel\).*venv-tpu-jax")


def test_compile_refuses_a_tf_job(tmp_path: Path) -> None:
    job = _job(tmp_path, "gpt2", backend="tf")
    result = run_cli("compile", "--job", str(job), "--accelerator", "v5litepod-4", timeout=300)
    assert_user_error(result, r"train.backend: tf: compile builds the JAX trainer's programs")
