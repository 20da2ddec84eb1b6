"""Ours vs a plain transformers PyTorch loop on one GPU, in one command (issue 33, item 5).

    python bench/bench_gpu.py                       # 125m, 1b, bert on the GPU (< 5 min)
    python bench/bench_gpu.py --tiny                # tiny shapes, eager PyTorch (CPU, ~1 min)
    python bench/bench_gpu.py --models 125m --shards RUN/data   # batches from a job's shards
    python bench/bench_gpu.py --precision-check     # our bf16 vs fp32 loss over 200 steps

What runs where: this process only prepares batches (numpy) and reports; each side runs in
a child process of its own (`--side jax|torch`), one after the other, so that JAX and
PyTorch never share the GPU's memory and each side's peak memory is its own.

- Ours: the trainer's own programs for the bench's job (job_document: the model, batch,
  AdamW hyper-parameters, precision and train.remat; the rest the trainer's defaults), built
  by the trainer's own calls (trainer_programs: runtime.runtime, program.with_attention,
  program.build_model, program.build, as train.py does): the attention `train.attention:
  auto` picks on this chip (cuDNN flash attention on an NVIDIA GPU of compute capability
  8.0+, the reference on a CPU), the dtype policy, the mesh and the state's shardings, the
  donated state, the remat policy, 8 steps per compiled call, the chunked loss sized from the
  device's memory, Keras AdamW with global-norm clipping 1.0 and the trainer's weight-decay
  exclusions; the held-out loss by the trainer's evaluation step. Each row says what ran
  (the trainer's runtime line, the attention and why, policy, remat, donated state arrays,
  steps per call, the loss's chunk, the programs' fingerprints: the trainer logs the same
  ones for the same job) and what the compiled chunk holds (hlo_facts: its cuDNN attention
  custom calls, expected layers x (forward + backward), and any [.., S, S] buffer: the
  reference's float32 scores; a kernel has none).
- PyTorch: transformers' LlamaForCausalLM / BertForMaskedLM from the same config and the
  same initial weights (ours, through hf_weights.hf_state_dict), fp32 weights under bf16
  autocast, `attn_implementation="sdpa"`, `torch.compile(model)` (`--torch-eager`: without),
  torch.optim.AdamW(fused=True on CUDA), clip_grad_norm_ 1.0, the same token-weighted cross
  entropy. Keras' Adam adds epsilon to sqrt(v) before the bias correction, PyTorch after: the
  loop sets PyTorch's epsilon to eps / sqrt(1 - beta2^t) (bench_llama_torch.py explains it).
- Batches: `--shards DATA_DIR` (a job's encoded data directory, clm models only) reads the
  training and held-out shards with payload/core/records.py (that needs google-crc32c);
  otherwise token batches drawn with a fixed seed from a first-order Markov chain over the
  vocabulary (8 likely successors per token: learnable, so the held-out loss moves), BERT's
  with 15% of positions masked. Both sides train on the same batches in the same order and
  are evaluated on the same held-out batches.
- Figures: tokens/s over the timed steps, after one real optimizer step on each side
  (compiles and warms up: batch 0, the schedule's step 0); MFU = tokens/s x MaxText's FLOPs
  per token (payload/plan/estimate.py flops_per_token) over (a) the measured peak (the best of 5
  bf16 8192^3 matmuls, each framework its own; the higher is used) and (b) the datasheet's
  dense bf16 peak (H100 SXM and H200: 989.5 TFLOP/s); peak memory (JAX: the device's
  peak_bytes_in_use; PyTorch: max_memory_allocated; on CPU, where neither exists, XLA's
  memory analysis of the compiled chunk and the PyTorch process's peak RSS, labelled so);
  the held-out loss after the timed steps.

Runs on a GPU machine's preinstalled stack without TensorFlow (jax[cuda], torch,
transformers 4 or 5 with its tokenizers and tqdm, plus keras, namex, optree and
google-crc32c, which the trainer's evaluation step imports through payload/core/records.py):
nothing this script or its children
import pulls in TensorFlow (tests/payload/test_bench_gpu.py checks it). Nothing is asserted
but --precision-check's 1% (reported, exit 0 either way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_CALL = 8
# Dense bf16 TFLOP/s from NVIDIA's datasheets (H100 SXM5 and H200 SXM: 989.5 without
# sparsity; the datasheets print 1,979 with sparsity), by a word of the device's name.
DATASHEET_TFLOPS = {"H100": 989.5, "H200": 989.5}
# name -> the job's model and batch: family, preset, vocabulary (the preset models': SmolLM2's
# 49,152, Llama 3.2's 128,256, BERT's 30,522), sequence, batch, masked slots (MLM).
MODELS: dict[str, dict[str, Any]] = {
    "125m": {"family": "llama", "size": "125m", "vocab": 49152, "seq": 2048, "batch": 8},
    "1b": {"family": "llama", "size": "1b", "vocab": 128256, "seq": 2048, "batch": 4},
    # The issue's "3b on one 141 GB GPU" (an H200): 16 B/parameter of state is 51 GB.
    "3b": {"family": "llama", "size": "3b", "vocab": 128256, "seq": 2048, "batch": 4},
    "bert": {
        "family": "bert",
        "size": "base",
        "vocab": 30522,
        "seq": 512,
        "batch": 32,
    },
}
TINY: dict[str, dict[str, Any]] = {
    "125m": {"family": "llama", "size": "tiny", "vocab": 512, "seq": 128, "batch": 4},
    "bert": {
        "family": "bert",
        "size": "tiny",
        "vocab": 512,
        "seq": 128,
        "batch": 8,
    },
}
SPECIAL = {"llama": {"pad": 1, "bos": 0, "eos": 2}, "bert": {"pad": 0, "cls": 2, "sep": 3}}
MASK_ID = 4
HPARAMS = {
    "learning_rate": 3e-4,
    "warmup": 20,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "epsilon": 1e-8,
    "clip_norm": 1.0,
}


def lr_at(step: int) -> float:
    """Linear warm-up over HPARAMS["warmup"] steps, then constant: PyTorch's rate at
    optimizer step `step` (0-based), what ours gets from the job (job_document: train.decay
    constant; backends/jax/schedule.py WarmupDecay)."""
    return HPARAMS["learning_rate"] * min(1.0, (step + 1) / HPARAMS["warmup"])


# ---- batches (this process: numpy only) ---------------------------------------------------


def markov_tokens(rng: np.random.Generator, rows: int, seq: int, vocab: int) -> np.ndarray:
    """[rows, seq] tokens of a fixed first-order Markov chain (seed 0): each token is
    followed by one of 8 successors, the first half of the time by the first."""
    table = np.random.default_rng(0).integers(5, vocab, size=(vocab, 8))
    out = np.empty((rows, seq), np.int64)
    out[:, 0] = rng.integers(5, vocab, size=rows)
    for i in range(1, seq):
        pick = np.where(rng.random(rows) < 0.5, 0, rng.integers(1, 8, size=rows))
        out[:, i] = table[out[:, i - 1], pick]
    return out


def causal_batch(ids: np.ndarray, pad_id: int | None) -> dict[str, np.ndarray]:
    """payload/backends/tf/masking.py causal_labels in numpy (bench_llama_torch.py's)."""
    labels = np.concatenate([ids[..., 1:], np.zeros_like(ids[..., :1])], axis=-1)
    weights = np.ones(ids.shape, np.float32)
    weights[..., -1] = 0.0
    mask = np.ones_like(ids)
    if pad_id is not None:
        mask = (ids != pad_id).astype(ids.dtype)
        weights *= (labels != pad_id) & (ids != pad_id)
    return {
        "input_ids": ids.astype(np.int32),
        "attention_mask": mask.astype(np.int32),
        "labels": labels.astype(np.int32),
        "label_weights": weights,
    }


def masked_batch(rng: np.random.Generator, ids: np.ndarray, slots: int) -> dict[str, np.ndarray]:
    """BERT's MLM inputs: 15% of the positions (at most `slots`, never 0) become [MASK]."""
    rows, seq = ids.shape
    count = min(slots, max(1, round(0.15 * seq)))
    positions = np.zeros((rows, slots), np.int32)
    weights = np.zeros((rows, slots), np.float32)
    for r in range(rows):
        positions[r, :count] = np.sort(rng.choice(np.arange(1, seq), count, replace=False))
    weights[:, :count] = 1.0
    labels = np.take_along_axis(ids, positions, axis=1) * (weights > 0)
    masked = ids.copy()
    np.put_along_axis(masked, positions[:, :count], MASK_ID, axis=1)
    return {
        "input_ids": masked.astype(np.int32),
        "attention_mask": np.ones_like(masked, np.int32),
        "masked_lm_positions": positions,
        "masked_lm_ids": labels.astype(np.int32),
        "masked_lm_weights": weights,
    }


def read_split(data_dir: str, split: str) -> tuple[np.ndarray, int | None]:
    """Every record of a split's shards (payload/core/records.py's pure reader) and the pad id."""
    from payload.core import records
    from payload.schema.manifest import load_manifest, shard_paths, special_ids_of

    manifest = load_manifest(data_dir)
    rows = []
    for path in shard_paths(data_dir, manifest, split=split):
        with Path(path).open("rb") as file:
            rows += [
                records.decode_record(r, manifest.token_dtype) for r in records.iter_records(file)
            ]
    return np.stack(rows).astype(np.int64), special_ids_of(manifest).get("pad")


def masked_slots(seq: int) -> int:
    """The masked slots of an MLM row: the job's data.max_predictions (payload/schema/job.py)."""
    from payload.schema.job import DataSpec

    return DataSpec(objective="mlm", seq_length=seq).max_predictions


def make_batches(spec: dict[str, Any], steps: int, eval_batches: int, shards: str | None) -> dict:
    """{"train": {name: [steps, B, ...]}, "eval": {name: [E, B, ...]}}: `steps` batches,
    the warm-up step's and the timed steps'."""
    rows, seq = spec["batch"], spec["seq"]
    rng = np.random.default_rng(1)
    if shards:
        train_ids, pad = read_split(shards, "train")
        eval_ids, _ = read_split(shards, "eval")
        if train_ids.shape[1] != seq:
            raise SystemExit(f"--shards: records of {train_ids.shape[1]} tokens, not {seq}")
        order = np.concatenate(
            [rng.permutation(len(train_ids)) for _ in range(-(-steps * rows // len(train_ids)))]
        )
        train = train_ids[order[: steps * rows]]
        held = eval_ids[: eval_batches * rows]
        eval_batches = len(held) // rows
        held = held[: eval_batches * rows]
    else:
        pad = None
        train = markov_tokens(rng, steps * rows, seq, spec["vocab"])
        held = markov_tokens(np.random.default_rng(2), eval_batches * rows, seq, spec["vocab"])

    def batches(ids: np.ndarray, count: int) -> dict[str, np.ndarray]:
        if spec["family"] == "bert":
            out = masked_batch(rng, ids, masked_slots(seq))
        else:
            out = causal_batch(ids, pad)
        return {k: v.reshape(count, rows, *v.shape[1:]) for k, v in out.items()}

    return {"train": batches(train, steps), "eval": batches(held, eval_batches)}


def flops_per_token(spec: dict[str, Any]) -> float:
    from payload.plan import estimate

    shape = estimate.model_shape(
        spec["family"], spec["size"], spec.get("config", {}), spec["vocab"]
    )
    return estimate.flops_per_token(shape, spec["seq"])


# ---- the sides (child processes) ----------------------------------------------------------


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def datasheet(name: str) -> float | None:
    return next((t * 1e12 for k, t in DATASHEET_TFLOPS.items() if k in name), None)


def load_batches(work: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(training batches [steps, B, ...], held-out batches [E, B, ...]) of batches.npz."""
    data = np.load(work / "batches.npz")
    train = {k[6:]: data[k] for k in data.files if k.startswith("train_")}
    held = {k[5:]: data[k] for k in data.files if k.startswith("eval_")}
    return train, held


def job_document(spec: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The job our side trains, as a job file would say it: the bench's model and batch, the
    bench's AdamW hyper-parameters and schedule (HPARAMS: warm-up, then constant), its
    precision and train.remat; everything else the trainer's defaults (train.attention
    auto, train.sharding auto). Recorded in every row of ours."""
    masked = spec["family"] == "bert"
    return {
        "name": "bench-gpu",
        "output": str(work / "run"),
        "corpus": {"paths": [str(work / "unused.txt")]},  # never read: batches.npz is
        "tokenizer": {"kind": "wordpiece" if masked else "bpe", "vocab_size": spec["vocab"]},
        "data": {"objective": "mlm" if masked else "clm", "seq_length": spec["seq"]},
        "model": {"family": spec["family"], "size": spec["size"], "config": spec.get("config", {})},
        "train": {
            "backend": "jax",
            # The warm-up step and the timed ones (at least the warm-up's length, which the
            # spec requires; with a constant rate the length changes nothing else).
            "steps": max(args.steps + 1, HPARAMS["warmup"]),
            "global_batch_size": spec["batch"],
            "learning_rate": HPARAMS["learning_rate"],
            "warmup_steps": HPARAMS["warmup"],
            "decay": "constant",
            "weight_decay": HPARAMS["weight_decay"],
            "adam_beta1": HPARAMS["beta1"],
            "adam_beta2": HPARAMS["beta2"],
            "adam_epsilon": HPARAMS["epsilon"],
            "clip_norm": HPARAMS["clip_norm"],
            "precision": args.precision,
            "remat": args.remat,
        },
    }


def trainer_programs(
    work: Path, spec: dict[str, Any], args: argparse.Namespace, held_rows: int
) -> dict[str, Any]:
    """What the trainer builds for the bench's job, by the trainer's own calls (train.py
    _train, _build, _programs): the runtime of this process's devices
    (runtime.runtime: the precision policy, the mesh, the device memory that sizes the
    loss's chunks), the attention (program.with_attention: attention.choose on the chip),
    the model and AdamW with values (program.build_model) and the lowered programs
    (program.build: the training chunk with the trainer's state shardings and donation, and
    the evaluation step of `held_rows` held-out rows, as a manifest of that many would give).
    Returns them by name, with the job and its config."""
    from payload.backends.jax import program, runtime
    from payload.model import configs
    from payload.spec import parse_job
    from payload.training import heldout

    job = parse_job(job_document(spec, args, work), source=str(work / "job.yaml"))
    family, seq = spec["family"], int(spec["seq"])
    config = configs.build_config(
        family,
        spec["size"],
        spec.get("config", {}),
        vocab_size=spec["vocab"],
        special_ids=SPECIAL[family],
    )
    parameters = configs.parameter_count(family, config)
    rt = runtime.runtime(job.train.precision, job.train.sharding, parameters)
    rt = program.with_attention(job, config, seq, rt)
    model, optimizer = program.build_model(job, config, seq, rt)
    eval_batch = heldout.eval_batch_size(held_rows, job.train.global_batch_size, rt.num_replicas)
    programs = program.build(job, config, rt, seq_length=seq, eval_batch=eval_batch or None)
    return {"job": job, "config": config, "rt": rt, "model": model, "optimizer": optimizer,
            "programs": programs}  # fmt: skip


def donated_inputs(lowered_text: str) -> int:
    """The inputs a lowered program gives its outputs' buffers (StableHLO's
    `tf.aliasing_output` / `jax.buffer_donor` argument attributes): the donated state."""
    return len(re.findall(r"tf\.aliasing_output|jax\.buffer_donor", lowered_text))


def loss_chunk(job: Any, config: Any, rt: Any) -> dict[str, int]:
    """The positions of one chunk of the chunked loss and its budget, as steps.py sizes them
    (model.loss_chunk_length of the rows one device holds, under model.loss_chunk_budget of
    the runtime's device memory)."""
    from payload.model import configs

    rows = max(1, job.train.global_batch_size // rt.num_replicas)
    length = job.data.max_predictions if job.data.objective == "mlm" else job.data.seq_length
    budget = configs.loss_chunk_budget(rt.facts.device_memory)
    positions = configs.loss_chunk_length(rows, length, int(config.vocab_size), budget)
    return {"positions": positions, "of": length, "budget_bytes": budget}


def hlo_facts(text: str, seq: int) -> dict[str, Any]:
    """What a compiled program's HLO text holds: its cuDNN attention custom calls by target
    (`__cudnn$fmha...`: jax 0.10.2 fused_attention_stablehlo.py _custom_name_maps; the
    forward and the backward call of each layer) and the shapes of its arrays whose last
    two dimensions are the sequence (the reference attention's [.., S, S] scores and
    probabilities; `square_f32`: those in float32)."""
    targets: dict[str, int] = {}
    for name in re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text):
        targets[name] = targets.get(name, 0) + 1
    square = sorted(
        {
            f"{dtype}[{dims}]"
            for dtype, dims in re.findall(r"\b(\w+)\[([\d,]+)\]", text)
            if dims.endswith(f",{seq},{seq}") and dims.count(",") >= 2
        }
    )
    return {
        "cudnn_calls": sum(targets.values()),
        "cudnn_targets": targets,
        "square": square,
        "square_f32": [shape for shape in square if shape.startswith("f32[")],
    }


def jax_memory(compiled: Any) -> tuple[int, str]:
    """The device's peak bytes in use, or (CPU) XLA's memory analysis of the chunk."""
    import jax

    memory = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in memory:
        return int(memory["peak_bytes_in_use"]), "device peak"
    analysis = compiled.memory_analysis()
    total = (
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    return int(total), "XLA memory analysis"


def jax_matmul_flops(size: int) -> float:
    """The best of 5 bf16 size^3 matmuls (float32 accumulation), FLOP/s."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    matmul = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    jax.block_until_ready(matmul(a))
    return 2 * size**3 / min(_timed(lambda: jax.block_until_ready(matmul(a))) for _ in range(5))


def jax_side(work: Path, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Ours: the trainer's own programs (trainer_programs) on the bench's batches: one real
    optimizer step first (compiles and warms up; batch 0), then the timed steps, then the
    trainer's evaluation step on the held-out batches."""
    from payload.backends.jax import use_jax

    use_jax()
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from payload.backends.jax import hf_weights, steps

    train, held = load_batches(work)
    held_rows = int(np.prod(next(iter(held.values())).shape[:2]))  # [E, B, ...]
    built = trainer_programs(work, spec, args, held_rows)
    job, rt, model, programs = built["job"], built["programs"].rt, built["model"], built["programs"]
    if args.write_init:
        from safetensors.numpy import save_file

        save_file(hf_weights.hf_state_dict(model), str(work / "init.safetensors"))
        (work / "config.json").write_text(built["config"].to_json_string())
    state = jax.device_put(steps.TrainState.of(model, built["optimizer"]), programs.state_shardings)
    per_call = rt.steps_per_execution
    assert per_call == STEPS_PER_CALL, (per_call, STEPS_PER_CALL)
    total = next(iter(train.values())).shape[0]  # 1 + the timed steps

    def on_devices(arrays: dict[str, np.ndarray], specs: dict[str, Any]) -> dict[str, Any]:
        return {k: jax.device_put(v, specs[k].sharding) for k, v in arrays.items()}

    chunks = [
        on_devices({k: v[start : start + per_call] for k, v in train.items()},
                   programs.train_batches)
        for start in [0, *range(1, total, per_call)]
    ]  # fmt: skip
    started = time.perf_counter()
    compiled = programs.train_chunk()
    state, metrics = compiled(state, chunks[0], np.int32(1))  # one real step: batch 0
    warmup_loss = float(np.asarray(metrics["loss"])[0])
    compile_s = time.perf_counter() - started
    per_chunk = []
    started = time.perf_counter()
    for batches in chunks[1:]:
        state, metrics = compiled(state, batches, np.int32(per_call))
        per_chunk.append(metrics["loss"])
    per_chunk = [np.asarray(x) for x in per_chunk]  # waits for the last call
    seconds = time.perf_counter() - started
    peak_memory, memory_kind = jax_memory(compiled)
    totals = np.zeros(3)
    evaluate = programs.eval_sums()
    if evaluate is not None:
        replicated = NamedSharding(rt.mesh, P())
        sums = jax.device_put(np.zeros([3], np.float32), replicated)
        for i in range(next(iter(held.values())).shape[0]):
            batch = on_devices({k: v[i] for k, v in held.items()}, programs.eval_batches)
            sums = evaluate(state.trainable, state.non_trainable, batch, np.int32(i), sums)
        totals = np.asarray(sums, np.float64)
    device = jax.devices()[0]
    lowered = programs.train_lowered.as_text()
    return {
        "side": "jax",
        "device": device.device_kind,
        "platform": device.platform,
        "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "compile_s": compile_s,
        "seconds": seconds,
        "steps": total - 1,
        "warmup_loss": warmup_loss,
        "losses": [float(x) for chunk_losses in per_chunk for x in chunk_losses],
        "held_out": float(totals[0] / max(totals[1], 1.0)),
        "held_out_rows": held_rows,
        "peak_memory": int(peak_memory),
        "memory_kind": memory_kind,
        "matmul_flops": jax_matmul_flops(args.matmul),
        "datasheet_flops": datasheet(device.device_kind),
        # What ran: the trainer's runtime line (policy, chip, mesh, steps per call, the
        # attention and why), its remat policy, the donated state, the loss's chunk and the
        # programs' fingerprints (the trainer logs the same ones for the same job).
        "runtime": rt.describe(),
        "attention": rt.attention.describe() if rt.attention else None,
        "policy": rt.policy,
        "remat": job.train.remat,
        "steps_per_call": per_call,
        "donated": {
            "inputs": donated_inputs(lowered),
            "state_arrays": len(jax.tree.leaves(programs.state)),
        },
        "loss_chunk": loss_chunk(job, built["config"], rt),
        "fingerprints": programs.fingerprints(),
        "job": job_document(spec, args, work),
        "layers": int(built["config"].num_hidden_layers),
        "hlo": hlo_facts(compiled.as_text(), spec["seq"]),
        "versions": {"jax": jax.__version__},
    }


def torch_model(work: Path, family: str, device: Any) -> tuple[Any, Any]:
    """LlamaForCausalLM / BertForMaskedLM from ours' config and initial weights (sdpa),
    and torch.optim.AdamW (fused on CUDA) without decay on norms and biases."""
    import torch
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config_class = transformers.LlamaConfig if family == "llama" else transformers.BertConfig
    config = config_class.from_dict(json.loads((work / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    model_class = (
        transformers.LlamaForCausalLM if family == "llama" else transformers.BertForMaskedLM
    )
    model = model_class(config)
    missing, unexpected = model.load_state_dict(load_file(work / "init.safetensors"), strict=False)
    tied = {"lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"weights: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(device).train()
    named = list(model.named_parameters())
    decays = [p for n, p in named if not any(k in n for k in ("norm", "bias", "LayerNorm"))]
    keeps = [p for n, p in named if any(k in n for k in ("norm", "bias", "LayerNorm"))]
    optimizer = torch.optim.AdamW(
        [
            {"params": decays, "weight_decay": HPARAMS["weight_decay"]},
            {"params": keeps, "weight_decay": 0.0},
        ],
        lr=HPARAMS["learning_rate"],
        betas=(HPARAMS["beta1"], HPARAMS["beta2"]),
        eps=HPARAMS["epsilon"],
        fused=device.type == "cuda",
    )
    return model, optimizer


def torch_matmul_flops(size: int, device: Any, sync: Any) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    torch.matmul(a, a)
    sync()
    return 2 * size**3 / min(_timed(lambda: (torch.matmul(a, a), sync())) for _ in range(5))


def torch_loss_sums(forward: Any, batch: dict[str, Any], family: str, precision: str) -> Any:
    """(sum of weighted token cross entropies, sum of weights) of one batch: the logits under
    bf16 autocast (or float32), the cross entropy on their float32 copy."""
    import torch

    device = batch["input_ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = forward(
            input_ids=batch["input_ids"].long(), attention_mask=batch["attention_mask"].long()
        ).logits
    if family == "bert":
        positions = batch["masked_lm_positions"].long()
        logits = torch.take_along_dim(logits, positions[..., None], dim=1)
        labels, weights = batch["masked_lm_ids"].long(), batch["masked_lm_weights"]
    else:
        labels, weights = batch["labels"].long(), batch["label_weights"]
    per_token = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    )
    return (per_token * weights.reshape(-1)).sum(), weights.sum()


def torch_peak_memory() -> tuple[int, str]:
    import resource

    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def torch_side(work: Path, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A plain transformers loop: torch.compile, bf16 autocast, the same loss and batches."""
    import torch
    import transformers

    family = spec["family"]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, optimizer = torch_model(work, family, device)
    forward = model if args.torch_eager else torch.compile(model)
    train, held = load_batches(work)

    def tensors(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}

    def loss_sums(batch: dict[str, Any]) -> tuple[Any, Any]:
        return torch_loss_sums(forward, batch, family, args.precision)

    def step(index: int, batch: dict[str, Any]) -> Any:
        total, count = loss_sums(batch)
        loss = total / torch.clamp(count, min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HPARAMS["clip_norm"])
        correction = math.sqrt(1.0 - HPARAMS["beta2"] ** (index + 1))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(index)
            group["eps"] = HPARAMS["epsilon"] / correction
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    batches = [tensors({k: v[i] for k, v in train.items()}) for i in range(len(train["input_ids"]))]
    started = time.perf_counter()
    warmup_loss = float(step(0, batches[0]))  # compiles (torch.compile): one real step
    sync()
    compile_s = time.perf_counter() - started
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses = []
    started = time.perf_counter()
    for i in range(1, len(batches)):
        losses.append(step(i, batches[i]))
    sync()
    seconds = time.perf_counter() - started
    sums = [0.0, 0.0]
    with torch.no_grad():
        for i in range(next(iter(held.values())).shape[0]):
            t, c = loss_sums(tensors({k: v[i] for k, v in held.items()}))
            sums = [sums[0] + float(t), sums[1] + float(c)]
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak, kind = torch_peak_memory()
    return {
        "side": "torch.compile" if not args.torch_eager else "torch eager",
        "device": name,
        "compile_s": compile_s,
        "seconds": seconds,
        "steps": len(losses),
        "warmup_loss": warmup_loss,
        "losses": [float(x) for x in losses],
        "held_out": sums[0] / max(sums[1], 1.0),
        "peak_memory": int(peak),
        "memory_kind": kind,
        "matmul_flops": torch_matmul_flops(args.matmul, device, sync),
        "datasheet_flops": datasheet(name),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def run_child(
    work: Path, side: str, spec: dict[str, Any], args: argparse.Namespace, **extra: Any
) -> dict[str, Any]:
    """One side in its own process; its one JSON line."""
    settings = {**vars(args), **extra}
    (work / f"{side}.args.json").write_text(json.dumps({"spec": spec, "args": settings}))
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, __file__, "--child", side, "--work", str(work)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=False,
        timeout=args.child_timeout,
    )
    if result.returncode:
        raise SystemExit(f"the {side} side failed (exit {result.returncode}); its log is above")
    return json.loads(result.stdout.strip().splitlines()[-1])


def child_main(side: str, work: Path) -> None:
    saved = json.loads((work / f"{side}.args.json").read_text())
    args = argparse.Namespace(**saved["args"])
    run = jax_side if side == "jax" else torch_side
    print(json.dumps(run(work, saved["spec"], args)), flush=True)


# ---- the report ---------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def ours_line(ours: dict[str, Any]) -> str:
    """What ran on our side, from its row: the trainer's attention and why, policy, remat,
    donation, steps per call, the loss's chunk, the compiled chunk's cuDNN calls and
    [.., S, S] buffers, the programs' fingerprints."""
    facts, chunk, donated = ours["hlo"], ours["loss_chunk"], ours["donated"]
    attention = ours["attention"] or {"implementation": "reference", "reason": "none chosen"}
    return (
        f"ours (the trainer's programs: program.build): attention {attention['implementation']}"
        f" ({attention['reason']}); policy {ours['policy']}; train.remat {ours['remat']}; "
        f"donated {donated['inputs']} of {donated['state_arrays']} state arrays; "
        f"{ours['steps_per_call']} steps per call; loss chunk {chunk['positions']} of "
        f"{chunk['of']} positions ({_gib(chunk['budget_bytes'])} budget); compiled chunk: "
        f"{facts['cudnn_calls']} cuDNN attention calls "
        f"({', '.join(f'{k} x{v}' for k, v in facts['cudnn_targets'].items()) or 'none'}; "
        f"{ours['layers']} layers x forward + backward = {2 * ours['layers']}), float32 "
        f"[.., S, S] buffers: {', '.join(facts['square_f32']) or 'none'}; fingerprints "
        + ", ".join(f"{k} {v}" for k, v in ours["fingerprints"].items())
    )


def compare(name: str, spec: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    data = make_batches(spec, args.steps + 1, args.eval_batches, args.shards)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        np.savez(
            work / "batches.npz",
            **{f"train_{k}": v for k, v in data["train"].items()},
            **{f"eval_{k}": v for k, v in data["eval"].items()},
        )
        rows = [run_child(work, "jax", spec, args, write_init=True)]
        if not args.ours_only:
            rows.append(run_child(work, "torch", spec, args))
    per_token = flops_per_token(spec)
    tokens = spec["batch"] * spec["seq"]
    peak = max(r["matmul_flops"] for r in rows)
    print(
        f"\n{name}: {spec['family']} {spec['size']}, {rows[0]['parameters']:,} parameters, "
        f"vocab {spec['vocab']}, batch {spec['batch']} x {spec['seq']}, {args.steps} timed "
        f"steps, {args.precision}; {' / '.join(r['device'] for r in rows)}; "
        f"{per_token / 1e9:.3f} GFLOP/token (MaxText); measured bf16 {args.matmul}^3 matmul "
        f"peak: "
        + ", ".join(f"{r['side']} {r['matmul_flops'] / 1e12:.3g}" for r in rows)
        + " TFLOP/s"
    )
    print(
        f"{'side':<15}{'compile s':>10}{'tokens/s':>12}{'MFU meas.':>10}{'MFU sheet':>10}"
        f"{'peak memory':>14}  {'held-out':>9}  first -> last loss"
    )
    for row in rows:
        rate = tokens * row["steps"] / row["seconds"]
        row.update(name=name, tokens_per_s=rate, mfu_measured=rate * per_token / peak)
        sheet = row["datasheet_flops"]
        row["mfu_datasheet"] = rate * per_token / sheet if sheet else None
        print(
            f"{row['side']:<15}{row['compile_s']:>10.1f}{rate:>12.0f}"
            f"{row['mfu_measured']:>10.1%}"
            + (f"{row['mfu_datasheet']:>10.1%}" if sheet else f"{'-':>10}")
            + f"{_gib(row['peak_memory']):>14}  {row['held_out']:>9.4f}  "
            f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}  ({row['memory_kind']})"
        )
    ours = rows[0]
    print(ours_line(ours))
    for other in rows[1:]:
        ratio = rows[0]["tokens_per_s"] / other["tokens_per_s"]
        memory = rows[0]["peak_memory"] / other["peak_memory"]
        print(f"ours / {other['side']}: {ratio:.2f}x tokens/s, {memory:.2f}x peak memory")
    return rows


def precision_check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Our model's loss curve in bf16 (mixed_bfloat16) vs float32 on the same batches."""
    spec = dict((TINY if args.tiny else MODELS)["125m"], **_overrides(args))
    data = make_batches(spec, args.steps + 1, args.eval_batches, args.shards)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        np.savez(
            work / "batches.npz",
            **{f"train_{k}": v for k, v in data["train"].items()},
            **{f"eval_{k}": v for k, v in data["eval"].items()},
        )
        for precision in ("bf16", "fp32"):
            rows.append(run_child(work, "jax", spec, args, precision=precision, write_init=False))
    bf16, fp32 = (np.asarray(r["losses"]) for r in rows)
    gap = np.abs(bf16 - fp32) / fp32
    window = min(10, len(bf16))
    means = [np.mean(x[: len(x) // window * window].reshape(-1, window), 1) for x in (bf16, fp32)]
    window_gap = np.abs(means[0] - means[1]) / means[1]
    print(
        f"\nprecision check: {spec['family']} {spec['size']} {spec.get('config', {})}, batch "
        f"{spec['batch']} x {spec['seq']}, {len(bf16)} steps, same batches and initial "
        f"weights (seed 0); {rows[0]['device']}"
    )
    print(
        f"loss first -> last: bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f}, fp32 {fp32[0]:.4f} -> "
        f"{fp32[-1]:.4f}; held-out bf16 {rows[0]['held_out']:.4f}, fp32 "
        f"{rows[1]['held_out']:.4f}"
    )
    print(
        f"|bf16 - fp32| / fp32 per step: largest {gap.max():.2%} (step {gap.argmax() + 1}), "
        f"mean {gap.mean():.2%}; over {window}-step means: largest {window_gap.max():.2%} -> "
        + ("within 1%" if window_gap.max() <= 0.01 else "NOT within 1%")
    )
    return rows


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("seq", "batch"):
        if getattr(args, key):
            out[key] = getattr(args, key)
    if args.layers:
        out["config"] = {"num_hidden_layers": args.layers}
    return out


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    from payload.schema.job import REMATS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="125m,1b,bert", help="of " + ",".join(MODELS))
    parser.add_argument(
        "--steps",
        type=int,
        help="timed steps, a multiple of 8 (default 32; --precision-check 200; --tiny 8)",
    )
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--shards", help="a job's encoded data directory (clm models)")
    parser.add_argument("--tiny", action="store_true", help="tiny presets and shapes (CPU)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument(
        "--remat", default="none", choices=REMATS, help="our side's train.remat (default none)"
    )
    parser.add_argument(
        "--precision-check",
        action="store_true",
        help="our 125m in bf16 vs fp32 over --steps (200) on the same batches",
    )
    parser.add_argument("--seq", type=int, help="override the sequence length")
    parser.add_argument("--batch", type=int, help="override the batch")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--torch-eager", action="store_true", help="no torch.compile")
    parser.add_argument(
        "--torch-compile", action="store_true", help="torch.compile with --tiny too"
    )
    parser.add_argument(
        "--ours-only", action="store_true", help="our side only (no PyTorch needed)"
    )
    parser.add_argument("--matmul", type=int, help="the peak matmul's size (8192; --tiny 1024)")
    parser.add_argument("--child-timeout", type=int, default=1800)
    parser.add_argument("--json", help="also write every row here")
    parser.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    default_steps = 200 if args.precision_check else (8 if args.tiny else 32)
    args.steps = args.steps or default_steps
    args.matmul = args.matmul or (1024 if args.tiny else 8192)
    # On a CPU inductor compiles for minutes (6 min for the tiny Llama on 2 loaded cores):
    # --tiny proves the script with eager PyTorch unless asked.
    args.torch_eager = args.torch_eager or (args.tiny and not args.torch_compile)
    if args.steps % STEPS_PER_CALL:
        parser.error(f"--steps must be a multiple of {STEPS_PER_CALL}")
    table = TINY if args.tiny else MODELS
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    args.model_names = [m for m in args.models.split(",") if m in table]
    return args


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    if args.child:
        child_main(args.child, args.work)
        return
    started = time.perf_counter()
    if args.precision_check:
        rows = precision_check(args)
    else:
        table = TINY if args.tiny else MODELS
        rows = []
        for name in args.model_names:
            spec = dict(table[name], **_overrides(args))
            if args.shards and spec["family"] != "llama":
                print(f"{name}: --shards serves clm models; generated batches", file=sys.stderr)
                rows += compare(name, spec, argparse.Namespace(**{**vars(args), "shards": None}))
            else:
                rows += compare(name, spec, args)
    print(
        f"\nwall time {time.perf_counter() - started:.0f} s; "
        f"{statistics.median([r['compile_s'] for r in rows]):.0f} s median compile"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
