"""What a job needs on an accelerator, before anything is created: `tpu-payload plan`.

    tpu-payload plan --job JOB --accelerator TYPE [--mfu F] [--json]
    python -m payload.plan --job JOB --accelerator TYPE ...   (what infra runs)

Framework-free (stdlib, PyYAML and the payload's pure modules): it runs on a laptop and in
the Pulumi program's environment, which has no TensorFlow, JAX or transformers. The
accelerator's figures come from payload/plan/accelerators.yaml (Google's and NVIDIA's pages).

The training state, as the JAX backend lays it out (payload/backends/jax/mesh.py):
- weights fp32 (the master copy; bf16 is for compute only), gradients fp32, AdamW's two fp32
  slots: 16 bytes per parameter, plus a second fp32 gradient buffer (the accumulator)
  when train.grad_accum_steps > 1;
- under data parallelism every chip holds all of it; under FSDP each weight whose
  partition rule splits it (mesh.partition_spec: Llama's weights on their hidden-size
  axis, other families' matrices on their largest dimension the chip count divides) is
  divided over the chips, and so are its gradient and slots; vectors stay replicated;
- under FSDP, XLA all-gathers a weight before it is used and reduce-scatters its whole
  gradient: the plan counts the largest unit (one decoder layer's matrices, or the
  embedding / LM head) whole in the compute dtype plus its fp32 gradient ("gathered"; our
  assumption of a compiler that gathers one layer at a time);
- `train.sharding: auto` is data parallelism while the state takes at most half of a chip's
  memory (sharding.DATA_PARALLEL_STATE_SHARE), else FSDP, exactly as mesh.plan decides it.

Activations (per chip, for the per-chip micro-batch b = global batch / chips /
train.grad_accum_steps and sequence length S), in the compute dtype: bf16 (a = 2 bytes) on
TPU and bf16/fp16 GPUs, fp32 (a = 4) on fp32 GPUs and CPU. What one decoder layer keeps for
the backward pass, per token (H hidden size, I intermediate size, A query heads, K
key/value heads, D head size):
    a x (7H + 3KD + 4I)   the block input, normed inputs, q/k/v (and q/k after RoPE), the
                          attention output, the residual, the MLP's gate, up, act(gate) and
                          product, the down projection
  + 8H                    the two RMSNorms' float32 copies of their input
  + 4 x A (x 128)         with a fused attention kernel (payload/model/kernels.py's table, as the
                          trainer: cuDNN on NVIDIA GPUs of compute capability 8.0+ in bf16,
                          splash on TPUs): its float32 softmax statistics (one log-sum-exp
                          per query and head; splash writes each across its 128 lanes);
                          the [S, S] scores never exist
  or (4 + a) x A x S      with the reference attention (the table's other cases, e.g. CPU,
                          attention dropout, older or AMD GPUs): the scores (float32 for
                          the softmax) and probabilities, materialised and kept
With a train.remat policy (jax.checkpoint around each layer of the scan over layers, saving
only what the policy names: sharding.REMAT_SAVES) a layer keeps its input (a x H per token)
plus the activations the policy names (saved_width: `full` none, `minimal` q, k, v, the
attention's output projection and the MLP's gate and up), and one layer's activations above
exist at a time while its backward pass recomputes the rest.
The LM head: the loss computes the logits a chunk of positions at a time
(backends/jax/steps.py chunked_loss_terms; the chunk: payload/model/configs.py loss_chunk_length,
float32 logits under loss_chunk_budget(the chip's memory): 1/64 of it, 256 MiB to 2 GiB),
so a sequence keeps 2a x H per predicted token (the head's input and its chunked copy; for
MLM only the masked positions), and the chip holds one chunk's logits once, whatever the
batch (loss_bytes_per_logit: the float32 logits and, off a TPU, their softmax's gradient in
the compute dtype), beside the head's kernel whole in the compute dtype and its float32
gradient's share.
The step's peak is the larger of two phases never alive together (the TPU compiler's
buffer assignment): the loss (the head's input, the chunk, the head's kernel and gradient)
and the layers' backward pass (the gradients, one gathered unit, one layer's recomputed
activations). On a TPU the compiler's program (GENERATED_CODE_BYTES) and what its memory
analysis reports beyond the live buffers (COMPILER_SCRATCH_BYTES, COMPILER_SLACK) count.
Other families use the same per-layer figure with K = A. A job fits when the state plus the
activations take at most FIT_SHARE of a chip's memory (the rest: XLA's buffers and the
compiled program). tests/payload/test_plan_memory.py compares these figures with XLA's
memory analysis of the real compiled train step.

FLOPs per token are MaxText's (AI-Hypercomputer/maxtext src/maxtext/utils/maxtext_utils.py
calculate_tflops_training_per_device, commit e591f30c): 3 x (forward matmul FLOPs of the
weights: per layer the MLP 2 x 3 x H x I for SwiGLU, q/k/v 2 x H x (A + 2K) x D, the output
projection 2 x H x A x D, and the unembedding 2 x H x V once) plus 3 x the causal attention
2 x S x A x D per layer (its 4 x S x A x D halved for the causal mask). That is 6N over the
matmul weights (the embedding lookup counted once, as the LM head) plus the attention term.
Hours = train.steps x global batch x seq_length x FLOPs per token / (chips x peak x MFU); the
ETA from now, against the job's grant_ends: eta.py. The compiled step executes more (the remat
policy's and the loss's recomputation, the attention kernel's backward: step_flops_per_token),
as the TPU compiler's program confirms for 1B (hlo.py); its code (GENERATED_CODE_BYTES) too."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

from payload.core.errors import TRANSIENT_EXIT, SpecError, TransientError, UserError
from payload.model import kernels

# The JAX backend's rules, from the one copy both read (payload/model/sharding.py).
from payload.model.sharding import (
    DATA_PARALLEL_STATE_SHARE,
    GRADIENT_BYTES,
    REMAT_ALIASES,
    REMAT_FAMILIES,
    SLOT_BYTES,
    STATE_BYTES_PER_PARAMETER,
    WEIGHT_BYTES,
)
from payload.plan import eta

# The accelerator catalog (payload/plan/accelerators.yaml), re-exported: plan.accelerator(...).
from payload.plan.accelerators import (  # noqa: F401
    Accelerator,
    AcceleratorError,
    accelerator,
    catalog,
    known_accelerators,
)

# What a step keeps and executes (payload/plan/step_costs.py), re-exported.
from payload.plan.step_costs import (  # noqa: F401
    TPU_LOSS_BYTES_PER_LOGIT,
    activation_bytes_per_sequence,
    attention_flops_per_token,
    flops_per_token,
    loss_bytes_per_logit,
    loss_chunk_bytes,
    sequence_parts,
    stat_lanes_of,
    step_flops_per_token,
)

# A layout fits when state + activations take at most this share of a chip's memory: the
# rest is for XLA's temporaries, the program and fragmentation (our margin, not a measured
# constant).
FIT_SHARE = 0.9
# The compiled training step's own code on a TPU chip, which the chip holds beside the state
# and the activations: memory_analysis().generated_code_size_in_bytes of the TPU compiler's
# program (bench/bench_tpu_compile.py, v5litepod-16, 2026-11-28): 39.3 MiB for 1B with
# train.remat full, 36.4 MiB minimal; 4.2 MiB for `tiny`. One layer body whatever the
# depth (the scan), so a figure for the presets, not a function of L.
GENERATED_CODE_BYTES = 40 * 2**20
# What the TPU compiler's memory analysis counts among the temporaries beyond the live
# buffers: the on-chip memory its memory-space assignment fills (VMEM on v5e, CMEM on v4:
# 112 and 128 MiB of preallocated temporaries in the buffer assignments of 125m on
# v5litepod-8 and v4-8 with libtpu 0.0.42.1), once the temporaries outgrow it, and the
# heap's fragmentation, a share of the temporaries (fitted, not derived). libtpu 0.0.42.1
# needed a share of 0.23-0.24 to put all 20 Llama preset x accelerator cases of
# docs/performance.md within 10 % (a54e750); libtpu 0.0.52 (the VMs' compiler since jax
# 0.12.0.1) leaves no such share: with it the plan is 1.09-1.34x the compiler at 0.235, and
# at 0 it is 0.957-1.176x on the cases compiled (docs/performance.md, 2026-12-02), any
# positive share only raising the high end. The scratch stays: without it 125m on
# v5litepod-16 falls to 0.78.
COMPILER_SCRATCH_BYTES = 128 * 2**20
COMPILER_SLACK = 0.0
# The MFU the hours assume unless --mfu says otherwise: our assumption for 125M-3B models on
# one slice (MaxText publishes ~50-60% for 8B and larger; small models reach less), not a
# measurement.
DEFAULT_MFU = 0.35
# (sharding, remat) layouts the plan compares: each sharding with no remat, MaxText's
# `minimal` and `full` (the job's own train.remat is added when it is another); a family
# outside sharding.REMAT_FAMILIES gets the remat: none ones.
REMAT_LAYOUTS = ("none", "minimal", "full")
LAYOUTS = tuple((sharding, remat) for sharding in ("data", "fsdp") for remat in REMAT_LAYOUTS)


# ------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: its weights' shapes and the activations' dimensions."""

    family: str
    parameters: int
    matrices: tuple[tuple[int, ...], ...]  # rank >= 2 weights, with their split axis first
    vectors: int  # parameters in rank-1 weights (never split)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_size: int
    vocab: int
    causal: bool
    layer_matrices: int  # parameters in one layer's matrices (what FSDP gathers for it)


# transformers' config defaults the presets leave out (BertConfig type_vocab_size 2,
# GPT2Config n_inner None = 4 x n_embd).
_CONFIG_DEFAULTS = {"type_vocab_size": 2, "n_inner": None, "tie_word_embeddings": True}


def model_shape(family: str, size: str, overrides: Mapping[str, Any], vocab: int) -> Shape:
    """The model's shape from the presets (payload/model/configs.py), without transformers."""
    from payload.model import configs as model  # noqa: PLC0415  (pure: presets and parameter_count)

    settings = {**_CONFIG_DEFAULTS, **model.resolved_settings(family, size, overrides)}
    config = SimpleNamespace(vocab_size=vocab, **settings)
    parameters = model.parameter_count(family, config)
    if family == "llama":
        h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        a, k = config.num_attention_heads, config.num_key_value_heads
        if a <= 0 or h % a or k <= 0 or a % k:
            raise SpecError(
                f"model.config: hidden_size={h}, num_attention_heads={a}, "
                f"num_key_value_heads={k}: heads must divide hidden_size and key/value heads "
                "the heads"
            )
        d = h // a
        # Every matrix is split on its hidden-size axis (sharding.FAMILY_RULES["llama"]): listed
        # as (H, other).
        per_layer = [(h, a * d), (h, k * d), (h, k * d), (h, a * d), (h, i), (h, i), (h, i)]
        mats = [(h, vocab)] + per_layer * layers
        if not config.tie_word_embeddings:
            mats.append((h, vocab))
        return Shape(
            family, parameters, tuple(mats), h * (2 * layers + 1), layers, h, i, a, k, d,
            vocab, True, sum(math.prod(m) for m in per_layer),
        )  # fmt: skip
    if family == "gpt2":
        h, layers, a = config.n_embd, config.n_layer, config.n_head
        i = config.n_inner or 4 * h
        mats = [(vocab, h), (config.n_positions, h)]
        mats += [(h, 3 * h), (h, h), (h, i), (i, h)] * layers
        vectors = parameters - sum(math.prod(m) for m in mats)
        return Shape(family, parameters, tuple(mats), vectors, layers, h, i, a, a, h // a,
                     vocab, True, 4 * h * h + 2 * h * i)  # fmt: skip
    h, layers, a = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    i = config.intermediate_size
    if family == "electra":
        mats = model.electra_matrices(config, vocab)
    else:
        mats = [(vocab, h), (config.max_position_embeddings, h), (config.type_vocab_size, h)]
        mats += [(h, h)] * (4 * layers) + [(h, i), (i, h)] * layers + [(h, h)]
    vectors = parameters - sum(math.prod(m) for m in mats)
    return Shape(family, parameters, tuple(mats), vectors, layers, h, i, a, a, h // a, vocab,
                 False, 4 * h * h + 2 * h * i)  # fmt: skip


def _split(shape: Shape, matrix: tuple[int, ...], fsdp: int) -> bool:
    """Whether mesh.partition_spec splits this matrix over `fsdp` devices: Llama's table
    (the hidden-size axis, listed first), else the generic rule (any dimension it divides)."""
    if fsdp <= 1:
        return False
    if shape.family == "llama" and matrix[0] % fsdp == 0:
        return True
    return any(d % fsdp == 0 for d in matrix)


def sharded_parameters(shape: Shape, fsdp: int) -> tuple[int, int]:
    """(parameters split over the fsdp axis, parameters every chip holds whole)."""
    split = sum(math.prod(m) for m in shape.matrices if _split(shape, m, fsdp))
    return split, shape.parameters - split


def attention_case(
    acc: Accelerator, family: str, size: str, overrides: Mapping[str, Any], *,
    precision: str, seq_length: int, documents: bool,
) -> kernels.Case:  # fmt: skip
    """The kernels table's case of a model (the preset and model.config's head sizes and
    attention dropout) on `acc`, computing in train.precision's dtype on its chip."""
    from payload.model import configs as model  # noqa: PLC0415  (pure: presets)

    settings = model.resolved_settings(family, size, overrides)
    return kernels.Case(
        chip=acc.chip,
        dtype=kernels.compute_dtype(precision, acc.chip),
        head_sizes=model.attention_head_sizes(family, settings),
        dropout=model.attention_dropout(family, settings),
        seq_length=int(seq_length),
        documents=bool(documents),
    )


def attention(job: Any, acc: Accelerator) -> kernels.Choice:
    """The attention the JAX trainer picks for the job on `acc`: the table it reads
    (payload/model/kernels.py) for the same case (backends/jax/attention.choose). A `fused` job
    the table refuses is the trainer's one-line error, here too."""
    model, data, precision = job.model, job.data, job.train.precision
    case = attention_case(acc, model.family, model.size, model.config, precision=precision,
                          seq_length=data.seq_length, documents=data.document_mask)  # fmt: skip
    return kernels.select(job.train.attention, case)


# ------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Layout:
    """Bytes per chip of one (sharding, remat) layout of the job on the accelerator."""

    sharding: str
    remat: str
    weights: int
    slots: int
    gradients: int
    # FSDP: one layer's whole weights and gradient at a time; mixed precision: the scanned
    # layers' weights cast to the compute dtype
    gathered: int
    activations: int
    per_chip_batch: int
    max_per_chip_batch: int  # the largest micro-batch per chip that fits (0: none)
    code: int = 0  # the compiled program itself (TPU: GENERATED_CODE_BYTES)
    # TPU: what the compiler reserves beyond the live buffers (COMPILER_SCRATCH_BYTES,
    # COMPILER_SLACK)
    reserve: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.slots
            + self.gradients
            + self.gathered
            + self.activations
            + self.code
            + self.reserve
        )


@dataclass(frozen=True)
class Plan:
    job: str
    accelerator: Accelerator
    family: str
    size: str
    parameters: int
    seq_length: int
    global_batch_size: int
    grad_accum_steps: int
    steps: int
    flops_per_token: float
    step_flops: float  # matmul FLOPs the compiled step executes (step_flops_per_token)
    mfu: float
    hours: float
    budget_bytes: int  # FIT_SHARE of a chip's memory
    sharding: str  # what the trainer picks for train.sharding (auto resolved)
    sharding_reason: str
    attention: str  # what the trainer picks for train.attention (payload/model/kernels.py)
    attention_reason: str
    remat: str
    layouts: tuple[Layout, ...]
    fits: bool
    refusal: str | None

    def layout(self, sharding: str, remat: str) -> Layout:
        remat = REMAT_ALIASES.get(remat, remat)
        return next(x for x in self.layouts if (x.sharding, x.remat) == (sharding, remat))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for row, layout in zip(out["layouts"], self.layouts, strict=True):
            row["total"] = layout.total
        return out


def resolve_sharding(setting: str, parameters: int, chips: int, memory: int) -> tuple[str, str]:
    """(data | fsdp, why): mesh.plan's decision for a chip of known memory."""
    need = parameters * STATE_BYTES_PER_PARAMETER
    if setting != "auto":
        return setting if chips > 1 else "data", f"train.sharding: {setting}"
    if need <= DATA_PARALLEL_STATE_SHARE * memory or chips == 1:
        why = "fits" if need <= DATA_PARALLEL_STATE_SHARE * memory else "exceeds (one chip)"
        return "data", f"auto: state {_gib(need)} {why} half a chip's {_gib(memory)}"
    return "fsdp", f"auto: state {_gib(need)} exceeds half a chip's {_gib(memory)}"


def _layout(
    shape: Shape,
    acc: Accelerator,
    sharding: str,
    remat: str,
    *,
    seq_length: int,
    predictions: int,
    per_chip_batch: int,
    accumulate: bool,
    budget: int,
    fused: bool,
) -> Layout:
    fsdp = acc.chips if sharding == "fsdp" else 1
    split, whole = sharded_parameters(shape, fsdp)
    held = whole + math.ceil(split / fsdp)
    gradients = held * GRADIENT_BYTES * (2 if accumulate else 1)
    # Under FSDP a layer's weights are all-gathered in the compute dtype before it runs and
    # its gradient is reduce-scattered in the compute dtype (the layers cast their float32
    # weights before the gather; the TPU compiler fuses both collectives into the matmuls):
    # at least the largest such unit (a decoder layer, or the embedding / LM head) is whole
    # on every chip at once, weights and gradient.
    largest_unit = max([shape.layer_matrices, *(math.prod(m) for m in shape.matrices)])
    unit = largest_unit * 2 * acc.activation_bytes if fsdp > 1 else 0
    gathered = unit
    # Under mixed precision the compiler casts the chip's share of the scanned decoder's
    # stacked weights to the compute dtype once per step, outside the scan's loops (seen in
    # the TPU compiler's program: bf16 [L, ...] stacks enter both loops).
    if shape.family in REMAT_FAMILIES and acc.activation_bytes < WEIGHT_BYTES:
        split_layers = _split(shape, (shape.hidden, 1), fsdp)
        gathered += (
            shape.layers * shape.layer_matrices // (fsdp if split_layers else 1)
        ) * acc.activation_bytes
    code = GENERATED_CODE_BYTES if acc.kind == "tpu" else 0
    kept, layer, head = sequence_parts(
        shape, seq_length, predictions, remat, acc.activation_bytes, fused=fused,
        stat_lanes=stat_lanes_of(acc),
    )  # fmt: skip
    # The step's two phases, never alive together: the loss (the head's input, one chunk's
    # logits and their gradient, the head's kernel whole in the compute dtype and its
    # float32 gradient's share) and the layers' backward pass (the gradients, one gathered
    # unit, one layer's recomputed activations). An accumulator of gradients lives in both.
    vocab_matrix = shape.hidden * shape.vocab
    chunk = loss_chunk_bytes(
        shape, per_chip_batch, predictions, acc.memory_bytes, loss_bytes_per_logit(acc)
    )
    carried = held * GRADIENT_BYTES if accumulate else 0
    loss = (
        chunk
        + carried
        + vocab_matrix * acc.activation_bytes
        + vocab_matrix * GRADIENT_BYTES // fsdp
    )
    layers = gradients + unit
    peak = max(loss + head * per_chip_batch, layers + layer * per_chip_batch)
    activations = kept * per_chip_batch + peak - gradients - unit
    reserve = _reserve(acc, gradients + gathered + activations)
    # The largest micro-batch whose temporaries, with the compiler's reserve, fit the budget
    # beside the state and the program.
    fixed = held * (WEIGHT_BYTES + SLOT_BYTES) + code
    tpu = acc.kind == "tpu"
    allowed = (budget - fixed - COMPILER_SCRATCH_BYTES * tpu) / (1 + COMPILER_SLACK * tpu)
    stacks = gathered - unit
    largest = min(
        int(allowed - stacks - loss) // (kept + head) if kept + head else 0,
        int(allowed - stacks - layers) // (kept + layer) if kept + layer else 0,
    )
    return Layout(
        sharding=sharding,
        remat=remat,
        weights=held * WEIGHT_BYTES,
        slots=held * SLOT_BYTES,
        gradients=gradients,
        gathered=gathered,
        # what the peak holds beyond the columns before it
        activations=activations,
        per_chip_batch=per_chip_batch,
        max_per_chip_batch=int(max(0, largest)),
        code=code,
        reserve=reserve,
    )


def _reserve(acc: Accelerator, temporaries: int) -> int:
    """What the TPU compiler adds to `temporaries` (COMPILER_SCRATCH_BYTES, COMPILER_SLACK);
    nothing elsewhere. The on-chip copies count once the temporaries outgrow the on-chip
    memory: a program whose temporaries fit there keeps them there, not twice (the tiny
    Llama of tests/payload/test_tpu_compile.py: 5.6 MB of temporaries in all)."""
    if acc.kind != "tpu":
        return 0
    copies = min(COMPILER_SCRATCH_BYTES, max(0, temporaries - COMPILER_SCRATCH_BYTES))
    return copies + int(COMPILER_SLACK * temporaries)


def plan_job(job: Any, acc: Accelerator, *, mfu: float = DEFAULT_MFU) -> Plan:
    """The plan of a validated job spec (payload.spec.JobSpec) on `acc`."""
    if not 0 < mfu <= 1:
        raise SpecError(f"--mfu: {mfu} must be in (0, 1]")
    train, data = job.train, job.data
    shape = model_shape(
        job.model.family, job.model.size, job.model.config, job.tokenizer.vocab_size
    )
    predictions = data.max_predictions if data.objective == "mlm" else data.seq_length
    split = acc.chips * train.grad_accum_steps
    if train.global_batch_size % split:
        # What the JAX trainer refuses (backends/jax/runtime.py check_global_batch).
        raise SpecError(
            f"train.global_batch_size: {train.global_batch_size} does not split into "
            f"train.grad_accum_steps: {train.grad_accum_steps} micro-batches over the "
            f"{acc.chips} chips of {acc.name}; use a multiple of {split}"
        )
    micro = train.global_batch_size // split
    budget = int(FIT_SHARE * acc.memory_bytes)
    chosen_attention = attention(job, acc)
    fused = chosen_attention.implementation != "reference"
    remat = REMAT_ALIASES.get(train.remat, train.remat)
    candidates = [*LAYOUTS]
    if remat not in REMAT_LAYOUTS:
        candidates += [(sharding, remat) for sharding in ("data", "fsdp")]
    layouts = tuple(
        _layout(
            shape,
            acc,
            sharding,
            remat,
            seq_length=data.seq_length,
            predictions=predictions,
            per_chip_batch=micro,
            accumulate=train.grad_accum_steps > 1,
            budget=budget,
            fused=fused,
        )
        for sharding, remat in candidates
        if remat == "none" or job.model.family in REMAT_FAMILIES
    )
    sharding, reason = resolve_sharding(
        train.sharding, shape.parameters, acc.chips, acc.memory_bytes
    )
    per_token = flops_per_token(shape, data.seq_length)
    executed = step_flops_per_token(shape, data.seq_length, predictions, remat, fused=fused)
    tokens = train.steps * train.global_batch_size * data.seq_length
    hours = tokens * per_token / (acc.chips * acc.peak_flops * mfu) / 3600
    draft = Plan(
        job=job.name,
        accelerator=acc,
        family=job.model.family,
        size=job.model.size,
        parameters=shape.parameters,
        seq_length=data.seq_length,
        global_batch_size=train.global_batch_size,
        grad_accum_steps=train.grad_accum_steps,
        steps=train.steps,
        flops_per_token=per_token,
        step_flops=executed * train.global_batch_size * data.seq_length,
        mfu=mfu,
        hours=hours,
        budget_bytes=budget,
        sharding=sharding,
        sharding_reason=reason,
        attention=chosen_attention.implementation,
        attention_reason=chosen_attention.reason,
        remat=remat,
        layouts=layouts,
        fits=True,
        refusal=None,
    )
    chosen = draft.layout(sharding, remat)
    if chosen.total <= budget:
        return draft
    return replace(draft, fits=False, refusal=_refusal(draft, chosen, job))


def _refusal(plan: Plan, chosen: Layout, job: Any) -> str:
    """One line: what does not fit, and what would."""
    acc = plan.accelerator
    options = []
    micro = chosen.per_chip_batch
    for layout in plan.layouts:
        settings = []
        if layout.sharding != plan.sharding and acc.chips == 1:
            continue  # FSDP over one chip is data parallelism
        if layout.sharding != plan.sharding:
            settings.append(f"train.sharding: {layout.sharding}")
        if layout.remat != plan.remat:
            settings.append(f"train.remat: {layout.remat}")
        if layout.max_per_chip_batch <= 0:
            continue
        if layout.max_per_chip_batch >= micro:
            if settings:
                options.append(f"{', '.join(settings)} ({_gib(layout.total)})")
            continue
        # A smaller micro-batch through gradient accumulation (same global batch).
        accum = _accum_for(plan, acc.chips, layout.max_per_chip_batch)
        if accum is not None:
            settings.append(f"train.grad_accum_steps: {accum}")
            per_chip = plan.global_batch_size // (acc.chips * accum)
            options.append(f"{', '.join(settings)} (micro-batch {per_chip} per chip)")
    larger = _larger_accelerator(plan, job)
    if larger:
        options.append(f"a larger accelerator: {larger}")
    would = "; would fit: " + "; or ".join(options) if options else "; nothing listed fits"
    return (
        f"plan: {plan.family} {plan.size} ({plan.parameters / 1e9:.2f}B parameters) does not fit "
        f"{acc.name} with train.sharding: {plan.sharding}, train.remat: {plan.remat}, "
        f"{micro} sequence(s) of {plan.seq_length} per chip: {_gib(chosen.total)} per chip > "
        f"{_gib(plan.budget_bytes)} ({FIT_SHARE:.0%} of {_gib(acc.memory_bytes)}){would}"
    )


def _accum_for(plan: Plan, chips: int, largest: int) -> int | None:
    """The smallest train.grad_accum_steps whose micro-batch per chip is <= `largest`
    and splits the global batch evenly."""
    for accum in range(plan.grad_accum_steps + 1, plan.global_batch_size + 1):
        if plan.global_batch_size % (chips * accum) == 0 and (
            plan.global_batch_size // (chips * accum) <= largest
        ):
            return accum
    return None


def _larger_accelerator(plan: Plan, job: Any) -> str | None:
    """The first accelerator of the same kind (a list of common sizes) on which the job's
    own settings fit."""
    candidates = (
        ["v5litepod-8", "v4-8", "v6e-8", "v5p-8", "v4-16", "v4-32", "v5litepod-16", "v6e-16"]
        if plan.accelerator.kind == "tpu"
        else ["nvidia-a100-80gb", "nvidia-h100-80gb", "nvidia-h100-80gbx8", "nvidia-b200x8"]
    )
    for name in candidates:
        if name == plan.accelerator.name:
            continue
        other = accelerator(name)
        if (
            other.memory_bytes * other.chips
            <= plan.accelerator.memory_bytes * plan.accelerator.chips
        ):
            continue
        if plan.global_batch_size % other.chips:
            continue
        candidate = plan_job_fits(job, other)
        if candidate:
            return name
    return None


def plan_job_fits(job: Any, acc: Accelerator) -> bool:
    shape = model_shape(
        job.model.family, job.model.size, job.model.config, job.tokenizer.vocab_size
    )
    train, data = job.train, job.data
    predictions = data.max_predictions if data.objective == "mlm" else data.seq_length
    sharding, _ = resolve_sharding(train.sharding, shape.parameters, acc.chips, acc.memory_bytes)
    budget = int(FIT_SHARE * acc.memory_bytes)
    layout = _layout(
        shape,
        acc,
        sharding,
        REMAT_ALIASES.get(train.remat, train.remat),
        seq_length=data.seq_length,
        predictions=predictions,
        per_chip_batch=max(1, train.global_batch_size // (acc.chips * train.grad_accum_steps)),
        accumulate=train.grad_accum_steps > 1,
        budget=budget,
        fused=attention(job, acc).implementation != "reference",
    )
    return layout.total <= budget


# ---------------------------------------------------------------------------- rendering


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_plan(plan: Plan) -> str:
    acc = plan.accelerator
    width = max(len(x.remat) for x in plan.layouts) + 2
    lines = [
        f"job {plan.job}: {plan.family} {plan.size}, {plan.parameters:,} parameters, "
        f"seq_length {plan.seq_length}, global batch {plan.global_batch_size}"
        + (f" in {plan.grad_accum_steps} micro-batches" if plan.grad_accum_steps > 1 else ""),
        f"accelerator {acc.name}: {acc.chips} chip(s) of {_gib(acc.memory_bytes)}, "
        f"{acc.peak_flops / 1e12:.0f} TFLOP/s peak each ({acc.source})",
        f"trainer's layout: train.sharding {plan.sharding} ({plan.sharding_reason}), "
        f"train.remat {plan.remat}; fits when a chip holds at most {_gib(plan.budget_bytes)} "
        f"({FIT_SHARE:.0%})",
        f"attention: {plan.attention} ({plan.attention_reason})",
        "",
        f"{'sharding':<9}{'remat':<{width}}{'weights':>10}{'slots':>10}{'grads':>10}"
        f"{'gathered':>10}{'activ.':>10}{'total':>10}{'max batch/chip':>16}",
    ]
    for x in plan.layouts:
        mark = " <-" if (x.sharding, x.remat) == (plan.sharding, plan.remat) else ""
        lines.append(
            f"{x.sharding:<9}{x.remat:<{width}}{_gib(x.weights):>10}{_gib(x.slots):>10}"
            f"{_gib(x.gradients):>10}{_gib(x.gathered):>10}{_gib(x.activations):>10}"
            f"{_gib(x.total):>10}"
            f"{x.max_per_chip_batch:>16}{mark}"
        )
    lines += [
        "",
        f"micro-batch per chip {plan.layouts[0].per_chip_batch} sequence(s); model FLOPs per "
        f"token {plan.flops_per_token / 1e9:.2f} GFLOP (MaxText's 6N + attention); the "
        f"compiled step executes {plan.step_flops / 1e12:.2f} TFLOP of matmuls (train.remat "
        f"{plan.remat}'s recomputation and the attention kernel's backward included)",
        # backends/jax/evaluate.py: the held-out batches run in micro-batches of at most the
        # training micro-batch's rows per chip, forward only (no gradients, no kept
        # activations for a backward pass): within the training step's memory.
        f"evaluation: at most {plan.layouts[0].per_chip_batch} sequence(s) per chip at once, "
        "forward only (within the training step's memory)",
        f"{plan.steps:,} steps x {plan.global_batch_size} x {plan.seq_length} tokens = "
        f"{plan.steps * plan.global_batch_size * plan.seq_length / 1e9:.2f}B tokens: "
        f"{plan.hours:.1f} hours at {plan.mfu:.0%} MFU",
        "fits" if plan.fits else "does NOT fit",
    ]
    return "\n".join(lines) + "\n"


def markdown(plans: Sequence[Plan]) -> str:
    """A Markdown table of plans (docs/models.md's, generated by `--sizes ... --markdown`):
    per layout the bytes per chip of the job's micro-batch and the largest micro-batch per
    chip that fits; "no" marks a layout where the job's own micro-batch does not fit."""
    head = ["size", "parameters", "accelerator"]
    head += [f"{s}{'' if r == 'none' else ' + ' + r}" for s, r in LAYOUTS]
    head += ["auto picks", "hours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in plans:
        cells = [f"`{p.size}`", f"{p.parameters / 1e6:,.0f}M", f"`{p.accelerator.name}`"]
        for x in p.layouts[: len(LAYOUTS)]:
            fits = "" if x.total <= p.budget_bytes else " (no)"
            cells.append(f"{x.total / 2**30:.1f} GiB{fits}, max {x.max_per_chip_batch}")
        cells += [p.sharding, f"{p.hours:,.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="job spec (YAML/JSON), as for the stages")
    parser.add_argument(
        "--accelerator",
        required=True,
        help="TPU type (v5litepod-8, v4-32, v6e-8, ...) or GPU type[x count] (nvidia-l4x2)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"model FLOPs utilisation the hours assume (default {DEFAULT_MFU})",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--sizes",
        help="plan the job once per model.size preset of this comma-separated list, on each "
        "of a comma-separated --accelerator list, and print one Markdown table (the docs')",
    )
    parser.add_argument(
        "--stop-cost",
        action="store_true",
        help="print what a stop by SIGTERM costs instead, one Markdown row per plan "
        "(docs/preemption.md); not with --json",
    )


def load_job(path: str) -> Any:
    """The job spec, validated as the stages validate it. A job template (stacks/jobs/*.yaml,
    whose `output` infra fills in) is planned too: the plan writes nothing. Where
    transformers is not installed (the Pulumi program's environment) the model-vs-data check
    that builds a transformers config is left to the payload on the VM; the plan's own shape
    checks still run."""
    from importlib.util import find_spec  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from payload import spec  # noqa: PLC0415

    check_model = find_spec("transformers") is not None
    try:
        return spec.load_job(path, check_model=check_model)
    except SpecError as error:
        if str(error) != "output is required":
            raise
        document = spec.parse_document(Path(path).read_text(encoding="utf-8"))
        if not isinstance(document, dict):
            raise
        source = str(Path(path).resolve())
        document = {**document, "output": "plan-writes-nothing"}
        return spec.parse_job(document, source=source, check_model=check_model)


def _table(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    accelerators = [accelerator(name) for name in args.accelerator.split(",")]
    plans = []
    for size in args.sizes.split(","):
        sized = replace(job, model=replace(job.model, size=size))
        plans += [plan_job(sized, acc, mfu=args.mfu) for acc in accelerators]
    if getattr(args, "stop_cost", False):
        from payload.plan import stopping  # noqa: PLC0415

        sys.stdout.write(stopping.markdown(plans))
    else:
        sys.stdout.write(markdown(plans))
    return 0


def run(args: argparse.Namespace) -> int:
    """`tpu-payload plan`: 0 fits, 2 does not fit (or bad input), as one line on stderr."""
    try:
        if getattr(args, "stop_cost", False) and args.json:
            raise UserError("--stop-cost prints a Markdown table: drop --json")
        if args.sizes:
            return _table(args)
        job = load_job(args.job)
        plan = plan_job(job, accelerator(args.accelerator), mfu=args.mfu)
    except (UserError, TransientError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2 if isinstance(exc, UserError) else TRANSIENT_EXIT
    if getattr(args, "stop_cost", False):
        from payload.plan import stopping  # noqa: PLC0415

        sys.stdout.write(stopping.markdown([plan]))
        return 0
    ends = eta.of_plan(plan, job.grant_ends)
    if args.json:
        print(json.dumps({**plan.to_dict(), "eta": ends.to_dict()}, indent=2, sort_keys=True))
    else:
        sys.stdout.write(format_plan(plan) + eta.plan_text(ends))
    if plan.refusal:
        print(f"error: {plan.refusal}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    about = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m payload.plan", description=about)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
