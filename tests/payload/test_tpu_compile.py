"""The trainer's programs compiled for real TPU targets, on this CPU-only machine: `tpu-payload
compile`'s path (payload/backends/jax/aot.py, through the trainer's builder program.py) in
the TPU environment (.venv-tpu-jax: jax 0.12.0.1 + libtpu 0.0.52, whose compiler targets any TPU
topology without a TPU; PAYLOAD_TPU_PYTHON names another interpreter).

Why here and not in tests/infra (test_tpu_jax_env.py also drives .venv-tpu-jax): what is
tested is the payload's programs, not the VM's environment; the driver imports this working
copy's payload (PYTHONPATH), as test_encode_beam.py runs .venv-beam, instead of installing
the payload into the environment first.

Cases (one driver process; ~105 s of CPU alone, ~21 s a case): the tiny Llama (with its
evaluation step) for v5e:2x2 (v5litepod-4) and v6e:2x2 (v6e-4), and a tiny BERT MLM job
(attention dropout 0, so that splash applies) for v5e:2x2, FSDP over the 4 chips, splash
chosen by `train.attention: auto`; and a sequence length at which splash's block must adapt
(768: a 384-token block, the one that is not a power of two; one-layer Llama) on v5e:2x2;
and the tiny Llama 144 wide on v5e:2x2, whose shards are narrow enough that the layer stacks'
default layout puts the layer axis inside (as 125m's and 350m's on v5e:4x4).
Every family's tiny preset also compiles through `tpu-payload compile --json` on v5litepod-4,
one process each (~33 s of CPU a family). Each chip and each family compiles here; the
other pairs are bench/bench_tpu_compile.py's (BERT on v6e: `--family bert --size tiny
--remat none --accelerator v6e-4 --seq 256 --config '{"attention_probs_dropout_prob": 0.0}'`:
the same three kernels, bf16 gathers).
The other lengths' blocks (640 -> 128, 1280 -> 256) are chosen by the same rule
(test_jax_attention.py: splash_block, and the kernel built on them in interpret mode); one
TPU compile each took ~11-13 s of CPU. Asserted:
- splash is the attention and its Mosaic kernels are in the compiled training chunk: per
  layer and step one forward, one dq and one dkv kernel run (Llama's: one instance each in
  the scanned layer body; BERT's: one per layer; the evaluation step: forward only), and
  the FSDP all-gathers are mostly bf16 (hlo.py reads them off the TPU's program);
- the step loop carries the state in the layouts of the program's arguments (hlo.py
  relaid_state: no weight or AdamW slot copied into another layout for the loop);
- the plan (payload/plan/estimate.py) agrees with the compiler: its per-chip total (weights + slots
+
  gradients + activations + the compiler's reserve + the chunk's batches) is at most
  PLAN_OVER times and at least 1 / PLAN_FACTOR of the compiler's arguments + outputs -
  aliased + temporaries (generated code apart: the plan's is one constant for the presets).
  Compiler / plan, measured 2026-12-01 with libtpu 0.0.42.1: 0.76 and 0.68 (Llama on
  v5e:2x2, v6e:2x2), 1.12 (BERT), 0.63 (the 144-wide Llama); 2026-12-02 with libtpu 0.0.52
  and the refitted plan (COMPILER_SLACK 0): 0.51 and 0.46 for the two Llamas (their
  temporaries 2.7 and 2.2 MB where the plan counts 6.5 MB: the new compiler keeps more of a
  program this small on the chip, below what the plan resolves), the other two within
  1 / PLAN_FACTOR..PLAN_FACTOR. On models this small TPU tiling pads every small array (a
  [64] vector takes a (128) tile) and XLA's fixed buffers weigh most (the presets: 0.96-1.18
  on the cases of docs/performance.md);
- the FLOPs per step (HLO matmuls with trip counts + the kernels' attention term) within
  FLOPS_FACTOR of the plan's model FLOPs (measured 2026-11-28 on v5e:2x2: 1.07 Llama: the
  embedding's one-hot matmul and the chunked loss's recomputed logits; 0.92 BERT: MLM's
  head runs at the masked positions only, the plan counts every position);
- a sequence length that is a multiple of 128 but not of 512 compiles with splash on a
  block that divides it (payload/model/kernels.py splash_block); never an error.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).parent / "drivers" / "tpu_compile_driver.py"
PLAN_FACTOR = 1.6
PLAN_OVER = 2.5
FLOPS_FACTOR = 1.5
# A sequence length that is a multiple of splash's 128-token lanes but not of its default
# 512-token block (payload/model/kernels.py SPLASH_BLOCK): its block, 384, is no power of two.
ODD_LENGTHS = (768,)


def _job(
    family: str,
    *,
    seq: int = 256,
    layers: int | None = None,
    held_out: bool = False,
    hidden: int | None = None,
):
    config: dict[str, Any] = {}
    if hidden:
        config["hidden_size"] = hidden
    if family == "llama":
        config["max_position_embeddings"] = max(512, seq)
        kind, objective = "bpe", "clm"
    else:
        config["attention_probs_dropout_prob"] = 0.0  # splash holds no probabilities
        kind, objective = "wordpiece", "mlm"
    if layers:
        config["num_hidden_layers"] = layers
    return {
        "name": f"compile-{family}",
        "corpus": {"paths": ["/nonexistent/corpus.txt"]},
        "tokenizer": {"kind": kind, "vocab_size": 512},
        "data": {
            "objective": objective,
            "seq_length": seq,
            "eval_fraction": 0.1 if held_out else 0,
        },
        "model": {"family": family, "size": "tiny", "config": config},
        "train": {"backend": "jax", "steps": 10, "global_batch_size": 8, "sharding": "fsdp"},
    }


TARGETS = [
    ("llama-v5e", "v5litepod-4", _job("llama", held_out=True)),
    ("llama-v6e", "v6e-4", _job("llama")),
    ("bert-v5e", "v5litepod-4", _job("bert")),
]
LENGTHS = [(f"seq-{n}", "v5litepod-4", _job("llama", seq=n, layers=1)) for n in ODD_LENGTHS]
# Shards narrow enough that the chip's default layout of a stack over the layers puts the
# layer axis inside: the tiny Llama 144 wide, split 4 ways ([2, 36, 176] lays out
# major-to-minor (1, 0, 2); 125m and 350m split 16 ways on v5e:4x4 do the same).
NARROW = [("llama-narrow", "v5litepod-4", _job("llama", hidden=144))]


def _tpu_python() -> Path:
    configured = os.environ.get("PAYLOAD_TPU_PYTHON")
    python = Path(configured) if configured else REPO / ".venv-tpu-jax" / "bin" / "python"
    if not python.exists():
        pytest.fail("the TPU compile checks need .venv-tpu-jax: `make venv-tpu-jax` builds it")
    return python


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, Any]]:
    every = TARGETS + LENGTHS + NARROW
    cases = [{"name": name, "accelerator": acc, "job": job} for name, acc, job in every]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    done = subprocess.run(
        [str(_tpu_python()), str(DRIVER), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["name"] for row in rows] == [case["name"] for case in cases], done.stderr[-3000:]
    return {row["name"]: row for row in rows}


def _compiler_total(memory: dict[str, int]) -> int:
    return memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]


@pytest.mark.parametrize(("name", "accelerator", "job"), TARGETS, ids=[t[0] for t in TARGETS])
def test_compiles_for_the_tpu_with_splash_as_the_plan_says(
    compiled: dict[str, dict[str, Any]], name: str, accelerator: str, job: dict[str, Any]
) -> None:
    row = compiled[name]
    assert "error" not in row, row
    assert row["fits"] and row["accelerator"] == accelerator
    # The chip as aot.facts_of states it from the topology's devices (what chip_of reads of
    # a real TPU), and splash's block: the sequence (256) itself.
    chip = {"v5litepod-4": "TPU v5 lite", "v6e-4": "TPU v6 lite"}[accelerator]
    assert row["runtime"]["chip"] == chip
    assert row["runtime"]["attention"] == {
        "implementation": "splash",
        "reason": f"train.attention: auto on {chip}",
        "block": 256,
    }
    assert row["runtime"]["mesh"] == {"sharding": "fsdp", "data": 1, "fsdp": 4}
    layers = 2  # the tiny presets
    chunk = row["programs"]["training chunk"]
    kernels = chunk["kernels"]
    assert sorted(kernels) == [
        "splash_mha_dkv_segmented_no_residuals",
        "splash_mha_dq_segmented_no_residuals",
        "splash_mha_fwd_segmented_residuals",
    ], kernels
    # [instances, runs per step, runs per call]: each kernel runs once per layer per
    # optimizer step; Llama's layers are one lax.scan body (one instance of each kernel run
    # L times: the scan's trip count), BERT's are unrolled (one instance per layer).
    instances = 1 if job["model"]["family"] == "llama" else layers
    assert all(count == [instances, layers, 0] for count in kernels.values()), kernels
    assert chunk["step_loop"] and chunk["collectives_per_step"]["all-gather"][0] > 0
    # The step loop carries the state in the arguments' layouts (steps.carried_layouts): no
    # second, relaid copy of any weight or AdamW slot (without it: 6 for the tiny Llama on v5e:4x4).
    assert chunk["relaid_state"] == 0, chunk["relaid_state"]
    # FSDP gathers the weights in bf16 under mixed precision (the CPU's HLO cannot tell), and
    # no weight matrix and no state the step loop carries in float32 (a layout pin that the
    # partitioner met with float32 gathers of the whole state: steps.carried_layouts). The
    # tiny BERT gathers 6 KB of float32 a step beside 2 MB of bf16; the tiny Llama none.
    gathered = chunk["all_gathers_per_step"]
    assert max(gathered, key=gathered.get) == "bf16", gathered
    assert gathered.get("f32", 0) <= gathered["bf16"] / 100, gathered
    if job["data"]["eval_fraction"]:
        forward = row["programs"]["evaluation step"]["kernels"]
        assert forward == {"splash_mha_fwd_segmented_no_residuals": [1, 0, layers]}, forward
    ratio = _compiler_total(chunk["memory"]) / row["plan"]["total"]
    assert 1 / PLAN_OVER <= ratio <= PLAN_FACTOR, (name, ratio, chunk["memory"], row["plan"])
    assert chunk["memory"]["code"] > 0  # generated code: reported, not in the plan
    flops = (chunk["flops_per_step"] + row["kernel_flops_per_step"]) / row["model_flops_per_step"]
    assert 1 / FLOPS_FACTOR <= flops <= FLOPS_FACTOR, (name, flops)
    assert len(row["fingerprints"]["train_chunk"]) == 16


@pytest.mark.parametrize(("name", "accelerator", "job"), LENGTHS, ids=[t[0] for t in LENGTHS])
def test_odd_lengths_compile_with_splash_on_a_block_that_divides_them(
    compiled: dict[str, dict[str, Any]], name: str, accelerator: str, job: dict[str, Any]
) -> None:
    row = compiled[name]
    assert "error" not in row, row["error"]
    attention = row["runtime"]["attention"]
    kernels = row["programs"]["training chunk"]["kernels"]
    # Splash, on the largest multiple of 128 up to 512 that divides the sequence
    # (payload/model/kernels.py splash_block: 768 -> 384).
    seq = job["data"]["seq_length"]
    assert attention["implementation"] == "splash", attention
    assert attention["block"] == {768: 384}[seq], attention
    assert len(kernels) == 3 and all(count == [1, 1, 0] for count in kernels.values()), kernels


@pytest.mark.parametrize(("name", "accelerator", "job"), NARROW, ids=[t[0] for t in NARROW])
def test_narrow_stacks_stay_in_their_own_layout_through_the_step_loop(
    compiled: dict[str, dict[str, Any]], name: str, accelerator: str, job: dict[str, Any]
) -> None:
    """A stack whose shard's default layout puts the layer axis inside is held in that layout
    through the step loop (steps.carried_layouts): without the pin the compiler carries 9 of
    the tiny model's arrays L-major, copied in and out of the loop (125m on v5e:4x4: 21,
    0.12 GiB a chip), and the pin makes no float32 gather."""
    row = compiled[name]
    assert "error" not in row, row["error"]
    chunk = row["programs"]["training chunk"]
    assert chunk["relaid_state"] == 0, chunk["relaid_state"]
    gathered = chunk["all_gathers_per_step"]
    assert gathered.get("f32", 0) <= gathered["bf16"] / 100, gathered


# One objective per family, as a user names it (payload/spec.py FAMILIES_FOR_OBJECTIVE).
FAMILY_OBJECTIVE = {
    "bert": "mlm",
    "roberta": "mlm",
    "gpt2": "clm",
    "llama": "clm",
    "electra": "rtd",
}


@pytest.mark.parametrize(("family", "objective"), sorted(FAMILY_OBJECTIVE.items()))
def test_every_family_compiles_on_the_command_line(
    tmp_path: Path, family: str, objective: str
) -> None:
    """`tpu-payload compile` as a user runs it, for every family's tiny preset on one TPU
    type: exit 0 with the compiler's bytes per chip for each program (ELECTRA's plan and
    compile crashed on a config without to_dict)."""
    from payload import spec

    assert family in spec.FAMILIES_FOR_OBJECTIVE[objective]
    job = {
        "name": f"cli-{family}",
        "output": str(tmp_path / "out"),
        "corpus": {"paths": [str(tmp_path / "corpus.txt")]},
        "tokenizer": {"kind": "bpe" if objective == "clm" else "wordpiece", "vocab_size": 512},
        "data": {"objective": objective, "seq_length": 128},
        "model": {"family": family, "size": "tiny"},
        "train": {"backend": "jax", "steps": 10, "global_batch_size": 8},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    done = subprocess.run(
        [
            *(str(_tpu_python()), "-m", "payload", "compile", "--job", str(path)),
            *("--accelerator", "v5litepod-4", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["fits"] is True and report["accelerator"] == "v5litepod-4"
    assert report["programs"], report
    for name, program in report["programs"].items():
        assert program["memory"]["total"] > 0, (name, program)
