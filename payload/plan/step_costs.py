"""What one training step of a planned model executes and keeps beyond its weights, by
train.remat policy: the activations a decoder layer keeps for its backward pass and the
matmul FLOPs the compiled step executes (payload/plan/estimate.py uses both;
bench/bench_tpu_compile.py and tests/payload/test_plan_memory.py compare them with compiled
programs), and the bytes of activations and of the chunked loss a planned step holds
(payload/plan/estimate.py's docstring says what each figure counts). Framework-free, as the plan."""

from __future__ import annotations

from typing import Protocol

from payload.model import kernels
from payload.model.sharding import REMAT_SAVES
from payload.plan.accelerators import Accelerator

# What the chunked loss holds per logit of its one chunk on a TPU: the float32 logits; their
# softmax and its gradient are fused into the matmuls that read them (the TPU compiler's
# buffer assignment: 125m on v4-8 holds one f32[2, 2048, 32000], 500 MiB, at the loss's
# peak). Elsewhere the gradient is materialised too (loss_bytes_per_logit).
TPU_LOSS_BYTES_PER_LOGIT = 4


class Shape(Protocol):
    """What these costs read of a model's shape (payload/plan/estimate.py's Shape has it; this
    module stands below the plan)."""

    @property
    def family(self) -> str: ...
    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def causal(self) -> bool: ...


def saved_width(shape: Shape, remat: str) -> int:
    """Values per token one decoder layer keeps for its backward pass under `remat`, beside
    its input (which the scan over layers keeps whatever the policy): the widths of the
    activations the policy names (sharding.REMAT_SAVES). The MLP's down projection (mlpwo)
    is named by `minimal` but read by no backward computation, so nothing keeps it."""
    widths = {
        "query_proj": shape.heads * shape.head_size,
        "key_proj": shape.kv_heads * shape.head_size,
        "value_proj": shape.kv_heads * shape.head_size,
        "out_proj": shape.hidden,
        "mlpwi_0": shape.intermediate,
        "mlpwi_1": shape.intermediate,
        "mlpwo": 0,
    }
    return sum(widths[name] for name in REMAT_SAVES[remat] or ())


def flops_per_token(shape: Shape, seq_length: int) -> float:
    """MaxText's training FLOPs per token (payload/plan/estimate.py's docstring), for this model."""
    h, i, layers, d = shape.hidden, shape.intermediate, shape.layers, shape.head_size
    mlp = 2 * h * i * (3 if shape.family == "llama" else 2)  # SwiGLU: gate, up, down
    qkv = 2 * h * (shape.heads + 2 * shape.kv_heads) * d
    projection = 2 * h * shape.heads * d
    weights = layers * (mlp + qkv + projection) + 2 * h * shape.vocab
    return 3.0 * weights + attention_flops_per_token(shape, seq_length)


def attention_flops_per_token(shape: Shape, seq_length: int) -> float:
    """flops_per_token's attention term: 3 x the QK^T and PV matmuls over the sequence
    (halved when causal). What a fused kernel computes (`tpu-payload compile` adds it for
    the Pallas kernels, whose FLOPs the compiled HLO does not show)."""
    attention = 4.0 * seq_length * shape.heads * shape.head_size * shape.layers
    if shape.causal:
        attention /= 2
    return 3.0 * attention


def step_flops_per_token(
    shape: Shape, seq_length: int, predictions: int, remat: str, *, fused: bool
) -> float:
    """The matmul FLOPs one token costs in the compiled training step, what the TPU executes
    (not MaxText's model FLOPs, flops_per_token): the weights' matmuls forward and twice
    backward (6 per weight per token), the LM head's at the predicted positions plus its
    recomputation (the chunked loss recomputes each chunk's logits: 8 per head weight), the
    attention's as the kernel computes them (units of one [S, S] matmul per head, halved
    for a causal fused kernel, which skips the masked blocks, whole for the reference,
    which masks a full square: forward QK^T and PV 2, backward 4 with the reference;
    splash's dq kernel recomputes QK^T, dkv recomputes QK^T and dP: 9), and what
    train.remat recomputes per layer: the
    attention's forward, and every projection whose output the policy does not keep (the
    down projection's never: nothing reads it). hlo.py counts the compiled program the same
    way; bench/bench_tpu_compile.py compares the two."""
    h, i, d, layers = shape.hidden, shape.intermediate, shape.head_size, shape.layers
    a, k = shape.heads, shape.kv_heads
    gated = shape.family == "llama"
    qkv, out = 2 * h * (a + 2 * k) * d, 2 * h * a * d
    mlp_in = 2 * h * i * (2 if gated else 1)
    dense = layers * (qkv + out + mlp_in + 2 * h * i)
    # A fused kernel skips the causal mask's blocks; the reference computes the whole square.
    unit = 2.0 * seq_length * a * d / (2 if shape.causal and fused else 1)
    head = 2.0 * h * shape.vocab * predictions / seq_length
    total = 3 * dense + 4 * head + layers * unit * (9 if fused else 6)
    saved = REMAT_SAVES[remat]
    if saved is not None:
        recompute = 2 * unit
        if not {"query_proj", "key_proj", "value_proj"} <= set(saved):
            recompute += qkv
        if "out_proj" not in saved:
            recompute += out
        if not {"mlpwi_0", "mlpwi_1"} <= set(saved):
            recompute += mlp_in
        total += layers * recompute
    return total


def sequence_parts(
    shape: Shape,
    seq_length: int,
    predictions: int,
    remat: str,
    dtype_bytes: int,
    *,
    fused: bool,
    stat_lanes: int = 1,
) -> tuple[int, int, int]:
    """Per sequence: (what its layers keep through the backward pass, the one layer's
    activations its backward pass recomputes at a time, the head's input) (docstring).
    `stat_lanes`: how many float32 copies of each softmax statistic a fused kernel keeps
    (splash: its 128 lanes, stat_lanes_of)."""
    a, h, s = dtype_bytes, shape.hidden, seq_length
    scores = 4 * stat_lanes * shape.heads if fused else (4 + a) * shape.heads * s
    per_token_layer = (
        a * (7 * h + 3 * shape.kv_heads * shape.head_size + 4 * shape.intermediate) + 8 * h + scores
    )
    layer = per_token_layer * s
    head = 2 * a * h * predictions
    if REMAT_SAVES[remat] is None:
        return shape.layers * layer, 0, head
    return shape.layers * a * (h + saved_width(shape, remat)) * s, layer, head


def activation_bytes_per_sequence(
    shape: Shape,
    seq_length: int,
    predictions: int,
    remat: str,
    dtype_bytes: int,
    *,
    fused: bool = False,
    stat_lanes: int = 1,
) -> int:
    """Activation bytes one sequence needs at the peak of its backward pass (docstring),
    without the loss's one chunk of logits (loss_chunk_bytes)."""
    parts = sequence_parts(
        shape, seq_length, predictions, remat, dtype_bytes, fused=fused, stat_lanes=stat_lanes
    )
    return sum(parts)


def stat_lanes_of(acc: Accelerator) -> int:
    """Float32 copies per softmax statistic that the chip's fused attention kernel keeps for
    its backward pass: splash (TPU) writes each query's log-sum-exp across its 128 lanes
    (jax 0.10.2 splash_attention_kernel.py: `logsumexp_ref.shape == (bq, NUM_LANES)`; the
    TPU compiler's program keeps f32[rows, heads, S, 128]); cuDNN one."""
    return kernels.SPLASH_LANES if acc.kind == "tpu" else 1


def loss_chunk_bytes(
    shape: Shape,
    per_chip_batch: int,
    predictions: int,
    memory_bytes: int | None = None,
    per_logit: int = TPU_LOSS_BYTES_PER_LOGIT,
) -> int:
    """What the chunked loss holds at once on a chip of `memory_bytes`, besides the head's
    input: one chunk's float32 logits and what its backward pass computes from them,
    `per_logit` bytes each (loss_bytes_per_logit; module docstring)."""
    from payload.model import configs  # noqa: PLC0415  (pure)

    if per_chip_batch <= 0:
        return 0
    budget = configs.loss_chunk_budget(memory_bytes)
    positions = configs.loss_chunk_length(per_chip_batch, predictions, shape.vocab, budget)
    return per_logit * shape.vocab * per_chip_batch * positions


def loss_bytes_per_logit(acc: Accelerator) -> int:
    """Bytes per logit of the loss's chunk: the float32 logits, and off a TPU their
    softmax's gradient in the compute dtype, which the backward pass's two matmuls read
    (the TPU compiler fuses it into them: TPU_LOSS_BYTES_PER_LOGIT)."""
    if acc.kind == "tpu":
        return TPU_LOSS_BYTES_PER_LOGIT
    return TPU_LOSS_BYTES_PER_LOGIT + acc.activation_bytes
