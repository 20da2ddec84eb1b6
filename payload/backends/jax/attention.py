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
Which one runs is payload/model/kernels.py's table (the plan reads the same one): `auto` takes the
chip's kernel where the case meets its requirements (dtype, head size, dropout, sequence),
else the reference with the reason, and on an accelerator one warning line (log and
status.json); `fused` insists on the kernel (a one-line error where there is none).

Masks: a token's output never depends on a padding key, in every implementation. What a
PADDING position's own output is differs (reference: it attends to the tokens, as
transformers' eager attention; splash: to the other padding positions; cuDNN: zeros, or with
a causal mask the positions before it). No token reads it (its key is masked, or lies after
every token under a causal mask) and no loss counts it, so logits at tokens, losses and
gradients are the same. Padding is at the END of each row: the data pipeline writes none
(packed windows, encode.py), and transformers' tokenizers pad on the right. cuDNN gets:
- causal, no document mask (Llama, GPT-2): plain CAUSAL. Under a causal mask a token never
  reads a later position, so right padding needs no mask of its own (cuDNN's
  PADDING_CAUSAL would also skip the padding blocks; MaxText's cudnn_flash_jax trains with
  CAUSAL alone, layers/attention_op.py at e591f30);
- bidirectional (BERT, RoBERTa, ELECTRA): each row's token count as `key_value_seq_lengths`
  (cuDNN's PADDING mask);
- data.document_mask: a boolean [B, 1, T, S] same-document mask with `is_causal`. jax 0.10.2
  turns it into an additive bias (fused_attention_stablehlo.py combine_bias_and_mask) and,
  since `should_export_dbias` is always True there, its backward also writes a [B, 1, T, S]
  bias gradient that nothing reads (jax-ml/jax#39512 later skips it). Still flash attention:
  no [B, N, T, S] scores or probabilities exist.
On a mesh both kernels run under `shard_map` over its batch axes (each device its own rows;
MaxText runs splash so): XLA's partitioner never sees them, so no sequence or head-dim
sharding can reach the cuDNN call, which refuses them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from payload.model import configs, kernels

SETTINGS = kernels.SETTINGS
IMPLEMENTATIONS = kernels.IMPLEMENTATIONS
SPLASH_LANES = kernels.SPLASH_LANES
# The batch axes of the mesh (mesh.BATCH: the batch is split over both).
BATCH_AXES = ("data", "fsdp")
# jax.nn.dot_product_attention's implementation for the cuDNN path: "cudnn". The tests set
# "xla" to run every argument this module gives cuDNN through JAX's XLA attention on a CPU.
CUDNN_IMPLEMENTATION = "cudnn"


@dataclass(frozen=True)
class Attention:
    """The attention implementation of a run and why it was chosen. `mesh`: the run's mesh
    (the kernels run under shard_map over its batch axes); `block`: splash's block (0: from
    the sequence, kernels.splash_block); `documents`: the mask is data.document_mask's
    document numbers (models.create_model sets it from the model's own flag); `warning`: the
    line a fallback to the reference on an accelerator logs; `interpret`: splash in Pallas'
    interpret mode (on CPU, for tests only)."""

    implementation: str = "reference"
    reason: str = "default"
    mesh: Mesh | None = None
    interpret: bool = False
    block: int = 0
    documents: bool = False
    warning: str = ""

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"implementation": self.implementation, "reason": self.reason}
        if self.implementation == "splash" and self.block:
            out["block"] = self.block
        if self.warning:
            out["warning"] = self.warning
        return out

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
            return cudnn(
                query, key, value, causal=causal, mask=mask, documents=self.documents,
                mesh=self.mesh,
            )  # fmt: skip
        if self.implementation == "splash":
            return splash(
                query, key, value, causal=causal, mask=mask, mesh=self.mesh,
                interpret=self.interpret, block=self.block,
            )  # fmt: skip
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


def on_rows(fn: Callable[..., Any], mesh: Mesh | None, *arrays: Any) -> Any:
    """fn(*arrays) with each device computing its own rows: `shard_map` over the mesh's
    batch axes (MaxText runs its attention kernels so, check_vma=False), the arrays' batch
    on axis 0. A kernel is opaque to XLA's partitioner, which must not split a sequence or
    head across devices; a batch the mesh does not divide (Keras' symbolic build with one
    row) runs unsharded."""
    axes = tuple(a for a in BATCH_AXES if mesh is not None and a in mesh.shape)
    shards = int(np.prod([mesh.shape[a] for a in axes])) if mesh is not None else 1
    if mesh is None or shards <= 1 or arrays[0].shape[0] % shards:
        return fn(*arrays)
    rows = P(axes)
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(rows,) * len(arrays), out_specs=rows, check_vma=False
    )
    return mapped(*arrays)


def cudnn_arguments(mask: Any, *, causal: bool, documents: bool) -> dict[str, Any]:
    """The mask arguments of jax.nn.dot_product_attention for the cuDNN call (module
    docstring): none for causal padding (CAUSAL), the token counts for bidirectional padding
    (PADDING), a boolean same-document mask for data.document_mask."""
    if mask is None:
        return {}
    ids = jnp.asarray(mask).astype(jnp.int32)
    if documents:
        # [B, 1, T, S]: a token reads its own document; padding (0) reads padding.
        return {"mask": ids[:, None, :, None] == ids[:, None, None, :]}
    if causal:
        return {}
    lengths = jnp.sum(ids != 0, axis=1).astype(jnp.int32)
    return {"query_seq_lengths": lengths, "key_value_seq_lengths": lengths}


def cudnn(
    query: Any,
    key: Any,
    value: Any,
    *,
    causal: bool,
    mask: Any = None,
    documents: bool = False,
    mesh: Mesh | None = None,
) -> Any:
    """cuDNN flash attention (jax 0.10.2 jax/_src/nn/functions.py `dot_product_attention`,
    case 'cudnn': layout BTNH, K/V with fewer heads than the query taken as they are, the
    lengths turn on cuDNN's PADDING mask, `is_causal` its CAUSAL one, a boolean mask becomes
    a bias; bf16/fp16 only), each device on its own rows (on_rows)."""

    def local(q: Any, k: Any, v: Any, *rest: Any) -> Any:
        extra = cudnn_arguments(rest[0] if rest else None, causal=causal, documents=documents)
        call: Callable[..., Any] = jax.nn.dot_product_attention
        return call(q, k, v, is_causal=causal, implementation=CUDNN_IMPLEMENTATION, **extra)

    arrays = (query, key, value) if mask is None else (query, key, value, jnp.asarray(mask))
    return on_rows(local, mesh, *arrays)


@functools.lru_cache(maxsize=32)
def _splash_kernel(causal: bool, length: int, heads: int, interpret: bool, block: int = 0) -> Any:
    """The kernel for one example: q [N, T, H], k/v [K, S, H], K dividing N (the kernel's own
    grouping: splash_attention_kernel.py `_splash_attention_forward`, q_heads_per_kv_head);
    the static mask per head as MaxText builds it (attention_op.py: CausalMask, or FullMask
    for bidirectional attention, in a MultiHeadMask of one per query head); every block
    `block` (0: kernels.splash_block, which divides the sequence: process_mask raises on a
    block that does not). Built once per shape: the mask's block tables are numpy work at
    trace time (MaxText builds it once in a jitted function of static arguments,
    `wrap_jax_splash_kernel`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_mask as mask_lib,
    )

    block = block or kernels.splash_block(length) or 0
    if not block or length % block or block % SPLASH_LANES:
        raise ValueError(
            f"splash attention: blocks of a multiple of {SPLASH_LANES} tokens that divide the "
            f"sequence, got {length} tokens and block {block}"
        )
    shape = (length, length)
    one: Any = mask_lib.CausalMask(shape=shape) if causal else mask_lib.FullMask(shape)
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
    block: int = 0,
) -> Any:
    """Pallas splash attention. The kernel does not scale the scores (splash_attention_kernel.py
    flash_attention_kernel: `qk = lax.dot_general(q, k, ...)`; its reference
    `_attention_reference_default` likewise): the query is scaled by 1 / sqrt(H) first, as
    MaxText folds that factor into the query (layers/attentions.py, "depth_scaling"). The
    segment ids are the mask (0: padding, else the token's document): a token reads its own
    document only, a padding position padding only, so no row is empty (the kernel's
    SegmentIds docstring asks for that). Each device runs it on its own rows (on_rows)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_kernel as kernel_lib,
    )

    batch, length, heads, size = query.shape
    if key.shape[1] != length:
        raise ValueError(
            f"splash attention: self-attention, got {length} queries and {key.shape[1]} keys"
        )
    kernel = _splash_kernel(causal, length, heads, interpret, block)
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

    out = on_rows(local, mesh, q, k, v, segments)
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)


def model_case(
    family: str, config: Any, *, chip: kernels.Chip, seq_length: int, compute_dtype: str,
    document_mask: bool = False,
) -> kernels.Case:  # fmt: skip
    """The kernels table's case of a `family` model of `config` (a transformers config)."""
    settings = config.to_dict()
    return kernels.Case(
        chip=chip,
        dtype=compute_dtype,
        head_sizes=configs.attention_head_sizes(family, settings),
        dropout=configs.attention_dropout(family, settings),
        seq_length=int(seq_length),
        documents=bool(document_mask),
    )


def choose(
    setting: str,
    *,
    chip: kernels.Chip,
    family: str,
    config: Any,
    seq_length: int,
    compute_dtype: str,
    document_mask: bool = False,
    mesh: Mesh | None = None,
) -> Attention:
    """The implementation for `train.attention: setting` on `chip` (runtime.Runtime.chip) for
    a `family` model of `config` over `seq_length` tokens computing in `compute_dtype`,
    with documents masked from each other (`data.document_mask`) or not: kernels.select."""
    case = model_case(
        family, config, chip=chip, seq_length=seq_length, compute_dtype=compute_dtype,
        document_mask=document_mask,
    )  # fmt: skip
    picked = kernels.select(setting, case)
    return Attention(
        picked.implementation,
        picked.reason,
        mesh,
        block=picked.block,
        documents=bool(document_mask),
        warning=picked.warning,
    )


def with_documents(attention: Attention, documents: bool) -> Attention:
    """`attention` for a model whose mask is data.document_mask's document numbers or not."""
    if attention.documents == documents:
        return attention
    return dataclasses.replace(attention, documents=documents)
