"""The trainer's builder (payload/backends/jax/program.py), the HLO reading (hlo.py) and
`tpu-payload compile`'s command line (aot.py) on this machine's CPU.

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

from payload.backends.jax import hlo_summary as hlo

HERE = Path(__file__).parent

# ---- hlo.py on recorded HLO text ---------------------------------------------------------

# A step loop (no trip count) holding a scan of 4 (known trip count) that holds a dot, a
# fused convolution (the TPU's form of a dot), an all-gather per scan step and a Mosaic
# kernel; a dot outside the loop (once per call).
HLO = """HloModule jit_train_chunk, entry_computation_layout={()->()}

%fused_computation.1 (param_0: bf16[2,256,64], param_1: bf16[64,32,1]) -> bf16[2,256,32] {
  %param_0 = bf16[2,256,64]{2,1,0} parameter(0)
  %param_1 = bf16[64,32,1]{2,1,0} parameter(1)
  ROOT %convolution.7 = bf16[2,256,32]{1,2,0:T(8,128)(2,1)} convolution(%param_0, %param_1), window={size=1}, dim_labels=0bf_io0->0bf
}

%scan_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} constant({...})
  %dot.3 = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %all-gather.9 = bf16[64,32]{1,0} all-gather(%w), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %a = bf16[2,256,64]{2,1,0} parameter(1)
  %fusion.2 = bf16[2,256,32]{2,1,0} fusion(%a, %all-gather.9), kind=kOutput, calls=%fused_computation.1
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %dot.3)
}

%scan_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%step_body (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %while.2 = (s32[], f32[8,16]{1,0}) while(%q), condition=%scan_cond, body=%scan_body, backend_config={"known_trip_count":{"n":"4"}}
  %k = bf16[2,4,256,16]{3,2,1,0} parameter(1)
  %splash_mha_fwd_residuals.1 = (f32[2,256,128]{2,1,0}) custom-call(%k), custom_call_target="tpu_custom_call", backend_config="..."
  %all-reduce.4 = f32[512]{0} all-reduce(%k), channel_id=2, to_apply=%add
  ROOT %r = (s32[], f32[8,16]{1,0}) tuple(%while.2)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main.5_spmd (arg: f32[8,16]) -> (s32[], f32[8,16]) {
  %arg = f32[8,16]{1,0} parameter(0)
  %v = f32[16,4]{1,0} constant({...})
  %dot.1 = f32[8,4]{1,0} dot(%arg, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %init = (s32[], f32[8,16]{1,0}) tuple(%arg)
  ROOT %while.9 = (s32[], f32[8,16]{1,0}) while(%init), condition=%scan_cond, body=%step_body
}
"""  # noqa: E501


def test_hlo_counts_matmuls_collectives_and_kernels_with_trip_counts() -> None:
    summary = hlo.summarize(HLO)
    dot = 2 * 8 * 16 * 16  # [8,16] x [16,16]
    convolution = 2 * (2 * 256 * 32) * 64  # out elements x the kernel's input features
    assert summary.step_loop
    assert summary.flops_per_step == 4 * (dot + convolution)
    assert summary.flops_per_call == 2 * 8 * 4 * 16
    assert summary.collectives_per_step == {
        "all-gather": [4, 4 * 64 * 32 * 2],
        "all-reduce": [1, 512 * 4],
    }
    assert summary.collectives_per_call == {}
    assert summary.kernels == {"splash_mha_fwd_residuals": [1, 1]}
    # Without the step loop's body, nothing is per step (an evaluation step has none).
    assert hlo.multiplicities(hlo.parse(HLO))["scan_body"] == (0, 4)


def test_the_compilers_out_of_memory_message_is_one_line() -> None:
    from payload.backends.jax import aot

    error = RuntimeError(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
        "space hbm. Used 20.84G of 15.75G hbm. Exceeded hbm capacity by 5.09G.\n\n"
        "Total hbm usage >= 21.09G:\n    reserved 263.00M\n    program 20.84G\n"
    )
    line = aot.out_of_memory(error)
    assert line is not None and "\n" not in line
    assert "Used 20.84G of 15.75G hbm" in line
    assert aot.out_of_memory(ValueError("q_block_size=512 should divide q_seq_len=640")) is None


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
    from payload import plan
    from payload.backends.jax import aot

    topology = aot.topology_of(plan.accelerator(accelerator))
    assert (topology.name, topology.chips_per_host_bounds, topology.hosts) == (name, bounds, hosts)


# ---- the builder: abstract, repeatable ---------------------------------------------------

BUILD_TWICE = """
import json
from payload.backends.jax import use_jax
use_jax()
import jax
from payload.backends.jax import aot, runtime
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
print(json.dumps({
    "prints": [first.fingerprints(), second.fingerprints()],
    "valued": [v.path for v in variables if v._value is not None],
    "iterations": str(first.state.optimizer[0]),
    "batches": {k: [list(v.shape), str(v.dtype)] for k, v in first.train_batches.items()},
}))
"""


def test_the_builder_creates_no_values_and_builds_the_same_program_twice() -> None:
    """No weight, slot or seed state of the builder's model gets a value (Keras initialises
    pending variables when a stateless call ends: a second build in a process, as the
    trainer's after its real model, once captured them as constants), and two builds lower
    to the same text. GPT-2 has dropout: its seed states are state, never constants."""
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
