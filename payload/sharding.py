"""How the training state is laid over the chips, as data: the one copy of the rules.

Read by the JAX backend, which applies them all (payload/backends/jax/mesh.py: the mesh, each
weight's PartitionSpec, the `auto` choice), by the plan, which sizes a job before anything
exists with the bytes per parameter, the `auto` share and REMAT_FAMILIES (payload/plan.py),
and by the job's vocabularies (payload/job.py: SHARDINGS, REMAT_FAMILIES). Framework-free,
standard library only: the plan runs in the Pulumi program's environment, which has no JAX
(tests/infra/test_jobfit.py checks its import closure).

- The mesh has two axes, `data` x `fsdp` (MaxText's names); a batch is split over both.
- The training state is fp32 weights, fp32 gradients and AdamW's two fp32 slots: 16 bytes
  per parameter (docs/backends.md "The mesh").
- `train.sharding: auto` keeps data parallelism while that state takes at most
  DATA_PARALLEL_STATE_SHARE of a chip's memory, else FSDP.
- A family's FSDP table (FAMILY_RULES) names, by a variable's path, the axis of each weight
  split over `fsdp`; mesh.py's module docstring gives the generic rule for everything else
  and why Llama's table follows MaxText's logical axis rules.
"""

from __future__ import annotations

import re

# train.sharding: how the JAX backend lays the training state over the devices; `auto`: data
# parallelism while the state fits a chip, else FSDP. The TF backend: data only.
SHARDINGS = ("auto", "data", "fsdp")
AXES = ("data", "fsdp")
BATCH = ("data", "fsdp")  # the batch dimension is split over both axes

WEIGHT_BYTES = 4  # the fp32 master copy (bf16 is for compute only)
GRADIENT_BYTES = 4
SLOT_BYTES = 8  # AdamW: momentum and velocity, fp32
STATE_BYTES_PER_PARAMETER = WEIGHT_BYTES + GRADIENT_BYTES + SLOT_BYTES
# `auto` keeps data parallelism while the replicated state takes at most this share of a
# chip's memory; the rest is for activations, the compiled program and XLA's buffers.
DATA_PARALLEL_STATE_SHARE = 0.5

# train.remat (jax.checkpoint around each decoder block) applies to these families' decoder
# blocks only: the spec refuses it for the others and the plan offers no remat layouts.
REMAT_FAMILIES = ("llama",)

# family -> ((a regular expression searched in the variable's path, the axis split over
# fsdp), ...): the first match decides. `[/_]` matches a weight's path (llama/layers_0/
# self_attn/q_proj/kernel) and its optimizer slots' (adamw/llama_layers_0_self_attn_q_proj_
# kernel_momentum). Variables no entry names (the RMSNorm scales) follow the generic rule.
FAMILY_RULES: dict[str, tuple[tuple[str, int], ...]] = {
    "llama": (
        (r"embed_tokens[/_]embeddings", 1),  # [V, H]
        (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)[/_]kernel", 0),  # [H, out]
        (r"(o_proj|down_proj)[/_]kernel", 1),  # [in, H]
        (r"lm_head[/_]kernel", 0),  # [H, V], untied embeddings only
    ),
    # ELECTRA (models.Electra): the shared embedding tables [V | P | 2, E] on their width E,
    # as Llama's (the vocabulary, which the tokenizer sets, would otherwise decide, and the
    # 2-row token-type table has no other axis to split); the discriminator's one-logit
    # kernel [H, 1] on H. The encoders' kernels follow the generic rule.
    "electra": (
        (r"(word|position|type)[/_]embeddings", 1),
        (r"discriminator_prediction[/_]kernel", 0),
    ),
}


def family_axis(family: str | None, path: str) -> int | None:
    """The axis the family's table splits for the variable at `path`, or None."""
    for pattern, axis in FAMILY_RULES.get(family or "", ()):
        if re.search(pattern, path):
            return axis
    return None
