"""What one training step of a planned model executes and keeps beyond its weights, by
train.remat policy: the activations a decoder layer keeps for its backward pass and the
matmul FLOPs the compiled step executes (payload/plan.py uses both;
bench/bench_tpu_compile.py and tests/payload/test_plan_memory.py compare them with compiled
programs). Framework-free, as the plan."""

from __future__ import annotations

from typing import Protocol

from payload.sharding import REMAT_SAVES


class Shape(Protocol):
    """What these costs read of a model's shape (payload/plan.py's Shape has it; this
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
