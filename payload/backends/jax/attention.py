"""Attention for every family as a kernel the accelerator has, chosen by the runtime.

One call for all families: `Attention.__call__(query, key, value, causal=..., mask=...)` in
jax.nn.dot_product_attention's layout, query [B, T, N, H], key and value [B, S, K, H], N a
multiple of K (grouped-query attention: query head n reads key/value head n // (N / K), as
transformers' repeat_kv, without repeating K/V), `mask` [B, S] the attention mask (1: token,
0: padding; every example its own) or, with `data.document_mask`, each token's document
number in its packed row (> 0; a token reads only keys of its own document), `causal` for
the decoders (Llama, GPT-2).

Implementations (`train.attention`: auto | fused | reference; `choose`):
- `reference`: XLA's einsums, on every platform. The scores QK^T are accumulated and kept in
  float32 (`preferred_element_type`, MaxText's `float32_qk_product`, src/maxtext/configs/
  base.yml at e591f30), not rounded to bf16 before the float32 softmax.
- `cudnn` (NVIDIA GPUs): cuDNN flash attention through
  `jax.nn.dot_product_attention(..., implementation="cudnn")`; no [T, S] array is held.
- `splash` (TPUs): the Pallas splash-attention kernel
  (jax.experimental.pallas.ops.tpu.splash_attention), called as MaxText's
  src/maxtext/layers/attention_op.py `tpu_flash_attention` calls it (e591f30): a CausalMask or
  FullMask per head, `SegmentIds` from the attention mask, the kernel vmapped over the
  batch inside `shard_map` over the mesh's batch axes.
`auto` takes the platform's kernel where it computes the job exactly, else the reference
(and says why); `fused` insists on the kernel (a one-line error where there is none).

Padding: a token's output never depends on a padding key, in every implementation. What a
PADDING position's own output is differs (reference: it attends to the tokens, as
transformers' eager attention; splash: to the other padding positions; cuDNN: zeros). No
token reads it (its key is masked) and no loss counts it, so logits at tokens, losses and
gradients are the same. cuDNN takes padding as lengths (`key_value_seq_lengths`), i.e.
padding at the END of each row: the data pipeline writes none (packed windows, encode.py),
and transformers' tokenizers pad on the right.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from payload.errors import SpecError

SETTINGS = ("auto", "fused", "reference")
IMPLEMENTATIONS = ("reference", "cudnn", "splash")
# The platform's kernel (runtime._platform names: gpu, tpu, cpu).
KERNELS = {"gpu": "cudnn", "tpu": "splash"}
# jax 0.10.2 jax/_src/cudnn/fused_attention_stablehlo.py: check_layout refuses any query
# dtype but fp16/bf16 (fp8 aside); check_is_flash_attention wants a head size that is a
# multiple of 8 and <= 128 (<= 256 from compute capability 9.0: 128 is what every GPU takes).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD = 128
# splash_attention_kernel.py (jax 0.10.2) `_splash_attention_forward`: block_kv_compute must
# be a multiple of NUM_LANES = 128, and the blocks divide the sequence; MaxText's default
# blocks are 512 (configs/base.yml `sa_block_*`), capped at the sequence length as its
# `create_sa_config` does (min(block, length)).
SPLASH_LANES = 128
SPLASH_BLOCK = 512
# The batch axes of the mesh (mesh.BATCH: the batch is split over both).
BATCH_AXES = ("data", "fsdp")


@dataclass(frozen=True)
class Attention:
    """The attention implementation of a run and why it was chosen. `mesh`: the run's mesh
    (splash runs under shard_map over its batch axes); `interpret`: splash in Pallas'
    interpret mode (on CPU, for tests only)."""

    implementation: str = "reference"
    reason: str = "default"
    mesh: Mesh | None = None
    interpret: bool = False

    def describe(self) -> dict[str, str]:
        return {"implementation": self.implementation, "reason": self.reason}

    def __call__(
        self,
        query: Any,
        key: Any,
        value: Any,
        *,
        causal: bool,
        mask: Any = None,
        probs_dropout: Callable[[Any], Any] | None = None,
    ) -> Any:
        """[B, T, N, H] in query's dtype. `probs_dropout` (the reference only: a kernel never
        holds the probabilities) is applied to the attention probabilities."""
        if self.implementation == "reference" or probs_dropout is not None:
            return reference(query, key, value, causal=causal, mask=mask, dropout=probs_dropout)
        if self.implementation == "cudnn":
            return cudnn(query, key, value, causal=causal, mask=mask)
        if self.implementation == "splash":
            mesh, interpret = self.mesh, self.interpret
            return splash(
                query, key, value, causal=causal, mask=mask, mesh=mesh, interpret=interpret
            )
        raise ValueError(f"unknown attention implementation {self.implementation!r}")


REFERENCE = Attention()


def _visible(mask: Any, causal: bool, length_q: int, length_k: int) -> Any:
    """[B or 1, 1, 1, T, S] bool: which keys a query reads (None: all). A token reads the
    tokens of its own document (mask: 1 everywhere but padding without document numbers);
    a padding position reads every token, as in transformers' eager attention."""
    visible = None
    if causal:
        visible = jnp.tril(jnp.ones((length_q, length_k), dtype=bool))[None, None, None]
    if mask is not None:
        ids = jnp.asarray(mask).astype(jnp.int32)
        query_ids = ids[:, None, None, :, None]
        key_ids = ids[:, None, None, None, :]
        same = jnp.logical_or(query_ids == key_ids, query_ids == 0)
        keys = jnp.logical_and(key_ids != 0, same)
        visible = keys if visible is None else jnp.logical_and(visible, keys)
    return visible


def reference(
    query: Any,
    key: Any,
    value: Any,
    *,
    causal: bool,
    mask: Any = None,
    dropout: Callable[[Any], Any] | None = None,
) -> Any:
    """XLA's attention with the scores in float32: softmax(QK^T / sqrt(H) + mask) V. Masked
    scores get float32's most negative value (never -inf, never added twice), so a row with
    no visible key has a finite, uniform softmax, as transformers' eager attention."""
    batch, length_q, heads, size = query.shape
    length_k, kv_heads = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = jnp.reshape(query, (batch, length_q, kv_heads, groups, size))
    # [B, K, G, T, S]: accumulated and kept in float32 (MaxText float32_qk_product; jax's own
    # _dot_product_attention_core, jax/_src/nn/functions.py, does the same).
    scores = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=jnp.float32)
    scores = scores * np.float32(size**-0.5)
    visible = _visible(mask, causal, length_q, length_k)
    if visible is not None:
        scores = jnp.where(visible, scores, np.finfo(np.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, value)
    return jnp.reshape(out, (batch, length_q, heads, size))


def cudnn(query: Any, key: Any, value: Any, *, causal: bool, mask: Any = None) -> Any:
    """cuDNN flash attention (jax 0.10.2 jax/_src/nn/functions.py `dot_product_attention`,
    case 'cudnn': layout BTNH, K/V with fewer heads than the query taken as they are, the
    lengths turn on cuDNN's PADDING(_CAUSAL) mask, `is_causal` its CAUSAL one; bf16/fp16 only)."""
    lengths = None
    if mask is not None:
        lengths = jnp.sum(jnp.asarray(mask) != 0, axis=1).astype(jnp.int32)
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        is_causal=causal,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )


@functools.lru_cache(maxsize=32)
def _splash_kernel(causal: bool, length: int, heads: int, interpret: bool) -> Any:
    """The kernel for one example: q [N, T, H], k/v [K, S, H], K dividing N (the kernel's own
    grouping: splash_attention_kernel.py `_splash_attention_forward`, q_heads_per_kv_head);
    the static mask per head as MaxText builds it (attention_op.py: CausalMask, or FullMask
    for bidirectional attention, in a MultiHeadMask of one per query head). Built once per
    shape: the mask's block tables are numpy work at trace time (MaxText builds it once in a
    jitted function of static arguments, `wrap_jax_splash_kernel`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_mask as mask_lib,
    )

    shape = (length, length)
    one: Any = mask_lib.CausalMask(shape=shape) if causal else mask_lib.FullMask(shape)
    block = min(SPLASH_BLOCK, length)
    blocks = kernel_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # The mask's tables become arrays (jnp.array in _make_splash_attention): concrete ones,
    # even when first built inside a trace, so that the cached kernel holds no tracer.
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mha(
            mask_lib.MultiHeadMask(masks=(one,) * heads),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def splash(
    query: Any,
    key: Any,
    value: Any,
    *,
    causal: bool,
    mask: Any = None,
    mesh: Mesh | None = None,
    interpret: bool = False,
) -> Any:
    """Pallas splash attention. The kernel does not scale the scores (splash_attention_kernel.py
    flash_attention_kernel: `qk = lax.dot_general(q, k, ...)`; its reference
    `_attention_reference_default` likewise): the query is scaled by 1 / sqrt(H) first, as
    MaxText folds that factor into the query (layers/attentions.py, "depth_scaling"). The
    segment ids are the mask (0: padding, else the token's document): a token reads its own
    document only, a padding position padding only, so no row is empty (the kernel's
    SegmentIds docstring asks for that)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_kernel as kernel_lib,
    )

    batch, length, heads, size = query.shape
    if key.shape[1] != length or length % SPLASH_LANES:
        raise ValueError(
            f"splash attention: self-attention over a multiple of {SPLASH_LANES} tokens, "
            f"got {length} queries and {key.shape[1]} keys"
        )
    kernel = _splash_kernel(causal, length, heads, interpret)
    q = jnp.swapaxes(query * jnp.asarray(size**-0.5, query.dtype), 1, 2)  # [B, N, T, H]
    k, v = jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2)  # [B, K, S, H]
    if mask is None:
        segments = jnp.ones((batch, length), jnp.int32)
    else:
        segments = jnp.asarray(mask).astype(jnp.int32)

    def per_example(q: Any, k: Any, v: Any, s: Any) -> Any:
        return kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=s, kv=s))

    def local(q: Any, k: Any, v: Any, s: Any) -> Any:
        return jax.vmap(per_example)(q, k, v, s)

    run: Callable[..., Any] = local
    axes = tuple(a for a in BATCH_AXES if mesh is not None and a in mesh.shape)
    shards = int(np.prod([mesh.shape[a] for a in axes])) if mesh is not None else 1
    # A Pallas call is opaque to XLA's partitioner: each device runs the kernel on its own
    # rows (MaxText: jax.shard_map with the batch on data x fsdp, check_vma=False). A batch
    # the mesh does not divide (Keras' symbolic build with one row) runs unsharded.
    if mesh is not None and shards > 1 and batch % shards == 0:
        rows = P(axes)
        run = jax.shard_map(
            local, mesh=mesh, in_specs=(rows, rows, rows, rows), out_specs=rows, check_vma=False
        )
    out = run(q, k, v, segments)
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)


def _model_shapes(family: str, config: Any) -> tuple[list[int], float]:
    """(the head sizes of the model's attention layers, its attention dropout)."""
    if family == "llama":
        head = int(config.hidden_size) // int(config.num_attention_heads)
        return [head], float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if family == "gpt2":
        return [int(config.n_embd) // int(config.n_head)], float(config.attn_pdrop)
    heads = [int(config.hidden_size) // int(config.num_attention_heads)]
    if family == "electra":
        from payload import model as model_lib  # noqa: PLC0415  (framework-free)

        gen = model_lib.generator_config(config)
        heads.append(int(gen.hidden_size) // int(gen.num_attention_heads))
    return heads, float(config.attention_probs_dropout_prob)


def choose(
    setting: str,
    *,
    platform: str,
    family: str,
    config: Any,
    seq_length: int,
    compute_dtype: str,
    document_mask: bool = False,
    mesh: Mesh | None = None,
) -> Attention:
    """The implementation for `train.attention: setting` on `platform` (gpu | tpu | cpu) for
    a `family` model of `config` over `seq_length` tokens computing in `compute_dtype`,
    with documents masked from each other (`data.document_mask`) or not."""
    if setting not in SETTINGS:
        raise SpecError(f"train.attention: {setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "reference":
        return Attention("reference", "train.attention: reference", mesh)
    kernel = KERNELS.get(platform)
    head_sizes, dropout = _model_shapes(family, config)
    obstacle = None
    if kernel is None:
        obstacle = (
            f"{platform} has no fused attention kernel (cuDNN on NVIDIA GPUs, splash on TPUs)"
        )
    elif dropout > 0:
        obstacle = (
            f"the model's attention dropout {dropout:g} needs the attention probabilities, "
            f"which {kernel} never holds (set it to 0 in model.config for the kernel)"
        )
    elif kernel == "cudnn" and document_mask:
        # jax.nn.dot_product_attention's cuDNN case passes lengths, no segment ids; the
        # packed layout (q_offsets) of the cuDNN call below it is not wired here.
        obstacle = "cuDNN flash attention here takes padding lengths, not data.document_mask"
    elif kernel == "cudnn" and compute_dtype not in CUDNN_DTYPES:
        obstacle = (
            f"cuDNN flash attention takes bfloat16/float16 only, this run computes in "
            f"{compute_dtype} (train.precision: bf16 for the kernel)"
        )
    elif kernel == "cudnn" and any(h % 8 or h > CUDNN_MAX_HEAD for h in head_sizes):
        obstacle = (
            f"cuDNN flash attention takes head sizes that are multiples of 8 up to "
            f"{CUDNN_MAX_HEAD}, this model's are {head_sizes}"
        )
    elif kernel == "splash" and seq_length % SPLASH_LANES:
        obstacle = (
            f"splash attention tiles the sequence in blocks of {SPLASH_LANES} tokens; "
            f"data.seq_length {seq_length} is not a multiple of {SPLASH_LANES}"
        )
    if obstacle is None and kernel is not None:
        return Attention(kernel, f"train.attention: {setting} on {platform}", mesh)
    if setting == "fused":
        raise SpecError(
            f"train.attention: fused: {obstacle}; use train.attention: auto or reference"
        )
    return Attention("reference", f"auto: {obstacle}", mesh)
