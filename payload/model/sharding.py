"""How the training state is laid over the chips, as data: the one copy of the rules.

Read by the JAX backend, which applies them all (payload/backends/jax/mesh.py: the mesh, each
weight's PartitionSpec, the `auto` choice), by the plan, which sizes a job before anything
exists with the bytes per parameter, the `auto` share and REMAT_FAMILIES (payload/plan/estimate.py),
and by the job's vocabularies (payload/schema/job.py: SHARDINGS, REMAT_FAMILIES). Framework-free,
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

# train.remat (jax.checkpoint around each decoder layer) applies to these families' decoder
# layers only: the spec refuses it for the others and the plan offers no remat layouts.
REMAT_FAMILIES = ("llama",)

# train.remat -> the activations one decoder layer keeps for its backward pass, by MaxText's
# checkpoint names (AI-Hypercomputer/maxtext src/maxtext/layers/decoders.py get_remat_policy
# at e591f30: `jax.checkpoint_policies.save_only_these_names(...)`; the names are those of
# its attentions.py and linears.py, which models.llama_layer gives the same activations):
# query_proj / key_proj (q and k after RoPE), value_proj, out_proj (the attention's output
# projection), mlpwi_0 / mlpwi_1 (the MLP's gate and up projections), mlpwo (its down
# projection). Everything else a layer's backward pass needs is recomputed from what is kept
# and the layer's input, which the scan over layers always keeps. `none`: no jax.checkpoint
# at all (every intermediate the backward pass reads is kept); `full` keeps nothing but the
# layer's input (MaxText's default); `block` is this project's earlier name of `full`.
# Ordered from the most kept (fastest) to the least (MaxText's base.yml orders them so).
REMAT_SAVES: dict[str, tuple[str, ...] | None] = {
    "none": None,
    "minimal": (
        "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo",
    ),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_out_proj": ("out_proj",),
    "full": (),
    "block": (),
}  # fmt: skip
# Earlier names of a policy: what the plan and the trainer treat them as.
REMAT_ALIASES = {"block": "full"}

# A family table's axis for a weight that stays whole on every device (a norm's scales
# stacked over the layers [L, H], which the generic rule would split).
REPLICATED = -1

# family -> a regular expression searched in a variable's path that marks weights stacked
# over the decoder's layers ([L, ...], models.LlamaLayers): their leading layer axis is
# never split over a mesh axis (the generic rule skips it too), as MaxText's `layers`
# logical axis maps to no mesh axis.
STACKED_LAYERS: dict[str, str] = {"llama": r"(^|[/_])layers[/_]"}

# family -> ((a regular expression searched in the variable's path, the axis split over
# fsdp or REPLICATED), ...): the first match decides. `[/_]` matches a weight's path
# (llama/layers/q_proj) and its optimizer slots' (adamw/llama_layers_q_proj_momentum).
# Variables no entry names follow the generic rule.
FAMILY_RULES: dict[str, tuple[tuple[str, int], ...]] = {
    # The decoder layers' kernels stacked [L, in, out]: split on their hidden-size axis.
    "llama": (
        (r"embed_tokens[/_]embeddings", 1),  # [V, H]
        (r"layers[/_](q_proj|k_proj|v_proj|gate_proj|up_proj)", 1),  # [L, H, out]
        (r"layers[/_](o_proj|down_proj)", 2),  # [L, in, H]
        (r"layers[/_]\w*layernorm", REPLICATED),  # [L, H]
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
    """The axis the family's table splits for the variable at `path` (REPLICATED: none), or
    None when the table does not name it."""
    for pattern, axis in FAMILY_RULES.get(family or "", ()):
        if re.search(pattern, path):
            return axis
    return None


def stacked_layers(family: str | None, path: str) -> bool:
    """Whether the variable at `path` is stacked over the decoder's layers (axis 0: L)."""
    pattern = STACKED_LAYERS.get(family or "")
    return pattern is not None and re.search(pattern, path) is not None
