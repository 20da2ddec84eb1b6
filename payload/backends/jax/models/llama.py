"""Llama (LlamaForCausalLM): RMSNorm, RoPE, one decoder layer as a function of its weights
(llama_layer), the L layers as one Keras layer of stacked weights run as one `lax.scan`
(LlamaLayers, with the remat policy of train.remat), and the causal LM."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from keras import layers, ops

from payload.backends.jax import attention as attention_lib
from payload.backends.jax import mesh as mesh_lib
from payload.backends.jax.models.blocks import HeadInputs, document_ids, init
from payload.model.sharding import REMAT_SAVES


class RMSNorm(layers.Layer):
    """LlamaRMSNorm: normalised in float32, cast back to the input's dtype, then scaled.
    The scale is named `gamma` so that weight decay skips it (schedule.NO_DECAY_NAMES)."""

    def __init__(self, eps: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.eps = eps

    def build(self, input_shape: Any) -> None:
        self.gamma = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="gamma")

    def call(self, x: Any) -> Any:
        x32 = ops.cast(x, "float32")
        variance = ops.mean(ops.square(x32), axis=-1, keepdims=True)
        normed = ops.cast(x32 * ops.rsqrt(variance + self.eps), x.dtype)
        return ops.cast(self.gamma, x.dtype) * normed


def rope_theta(config: Any) -> float:
    """RoPE's base: LlamaConfig.rope_theta in transformers 4; transformers 5's LlamaConfig
    keeps it in `rope_parameters["rope_theta"]` instead (a GPU machine's preinstalled
    transformers may be either)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = config.rope_parameters["rope_theta"]
    return float(theta)


def rotary_tables(length: int, head_size: int, theta: float, dtype: Any) -> tuple[Any, Any]:
    """(cos, sin) [S, D] of LlamaRotaryEmbedding's default RoPE for positions 0..S-1,
    computed in float32 and cast to the activations' dtype as transformers does."""
    exponents = np.arange(0, head_size, 2, dtype=np.float32) / np.float32(head_size)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    freqs = ops.cast(ops.arange(length), "float32")[:, None] * inv_freq[None, :]
    emb = ops.concatenate([freqs, freqs], axis=-1)
    return ops.cast(ops.cos(emb), dtype), ops.cast(ops.sin(emb), dtype)


# The stacked weights of the decoder's layers (LlamaLayers), in the order of one
# LlamaDecoderLayer's parameters: (name, per-layer shape as a function of the config's
# hidden size H, intermediate size I, query heads x head size AD, key/value heads x head
# size KD). Kernels are Keras' [in, out]; the export transposes them (hf_weights.py).
def _llama_layer_shapes(config: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    width, inner = int(config.hidden_size), int(config.intermediate_size)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    size = width // heads
    return (
        ("input_layernorm_gamma", (width,)),
        ("q_proj", (width, heads * size)),
        ("k_proj", (width, kv_heads * size)),
        ("v_proj", (width, kv_heads * size)),
        ("o_proj", (heads * size, width)),
        ("post_attention_layernorm_gamma", (width,)),
        ("gate_proj", (width, inner)),
        ("up_proj", (width, inner)),
        ("down_proj", (inner, width)),
    )


def _rms_norm(x: Any, gamma: Any, eps: float) -> Any:
    """LlamaRMSNorm (the RMSNorm layer's arithmetic): float32 statistics, cast back, scaled."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return gamma.astype(x.dtype) * (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """RoPE on [B, S, heads, D]: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None] + rotated * sin[None, :, None]


def llama_layer(
    weights: dict[str, Any],
    x: Any,
    mask: Any,
    cos: Any,
    sin: Any,
    *,
    config: Any,
    attention: attention_lib.Attention,
) -> Any:
    """One LlamaDecoderLayer as a function of its weights (one layer's slice of LlamaLayers'
    stacked variables, float32): x + attn(norm(x)), then h + mlp(norm(h)) with the SwiGLU
    MLP; attention without biases, RoPE on q and k, grouped-query attention (query head h
    reads key/value head h // (heads / kv_heads), as repeat_kv, without repeating K/V).
    Every weight is cast to the activations' dtype where it is read (MaxText's DenseGeneral:
    `jnp.asarray(kernel, self.dtype)`), so that under FSDP the sharded float32 slice is
    cast before XLA gathers it (bf16 on the wire under mixed_bfloat16). The activations a
    remat policy may keep carry MaxText's checkpoint names (sharding.REMAT_SAVES)."""
    dtype = x.dtype
    w = {name: value.astype(dtype) for name, value in weights.items()}
    eps = float(config.rms_norm_eps)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    batch, length, width = x.shape
    size = width // heads
    h = _rms_norm(x, w["input_layernorm_gamma"], eps)
    q = jnp.reshape(h @ w["q_proj"], (batch, length, heads, size))
    k = jnp.reshape(h @ w["k_proj"], (batch, length, kv_heads, size))
    v = jnp.reshape(h @ w["v_proj"], (batch, length, kv_heads, size))
    q = checkpoint_name(_rotate(q, cos, sin), "query_proj")
    k = checkpoint_name(_rotate(k, cos, sin), "key_proj")
    v = checkpoint_name(v, "value_proj")
    out = attention(q, k, v, causal=True, mask=mask)
    out = checkpoint_name(jnp.reshape(out, (batch, length, heads * size)) @ w["o_proj"], "out_proj")
    x = x + out
    h = _rms_norm(x, w["post_attention_layernorm_gamma"], eps)
    gate = checkpoint_name(h @ w["gate_proj"], "mlpwi_0")
    up = checkpoint_name(h @ w["up_proj"], "mlpwi_1")
    down = checkpoint_name((jax.nn.silu(gate) * up) @ w["down_proj"], "mlpwo")
    return x + down


def remat_policy(remat: str) -> Any:
    """The jax.checkpoint policy of `train.remat` (sharding.REMAT_SAVES: the names of the
    activations a layer keeps for its backward pass), or None for `none` (no checkpoint)."""
    saved = REMAT_SAVES[remat]
    if saved is None:
        return None
    return jax.checkpoint_policies.save_only_these_names(*saved)


class LlamaLayers(layers.Layer):
    """The decoder's L LlamaDecoderLayers as ONE layer: each kind of weight is one variable
    stacked over the layers, [L, ...] (llama/layers/q_proj [L, H, A x D], ...), and the
    layers run as one `jax.lax.scan` of `llama_layer` over the leading axis (MaxText's
    `scan_layers: true`): XLA compiles one layer body, whatever L. `remat` (train.remat)
    wraps the body in jax.checkpoint with the policy that names what it keeps
    (remat_policy); the scan stacks what is kept over the layers. On the run's mesh the
    carried activations keep their rows (mesh.keep_rows) at every layer boundary."""

    def __init__(
        self,
        config: Any,
        remat: str = "none",
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if remat not in REMAT_SAVES:
            raise ValueError(f"unknown train.remat {remat!r}")
        self.config, self.remat, self.attend = config, remat, attention
        self.count = int(config.num_hidden_layers)
        self.shapes = _llama_layer_shapes(config)

    def build(self, input_shape: Any) -> None:
        # Created float32 and read as they are (autocast off): llama_layer casts one layer's
        # slice inside the scan, not the whole stack before it.
        self.stacked = {
            name: self.add_weight(
                shape=(self.count, *shape),
                initializer="ones" if len(shape) == 1 else init(self.config),
                name=name,
                autocast=False,
            )
            for name, shape in self.shapes
        }

    def call(self, x: Any, mask: Any, cos: Any, sin: Any) -> Any:
        mesh = self.attend.mesh
        layer: Any = functools.partial(llama_layer, config=self.config, attention=self.attend)
        policy = remat_policy(self.remat)
        if policy is not None:
            # prevent_cse=False: the scan already keeps XLA from merging the recomputation
            # with the forward pass (jax.checkpoint's docstring; MaxText does the same).
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

        def body(h: Any, weights: dict[str, Any]) -> tuple[Any, None]:
            return mesh_lib.keep_rows(layer(weights, h, mask, cos, sin), mesh), None

        weights = {name: variable.value for name, variable in self.stacked.items()}
        x, _ = jax.lax.scan(body, mesh_lib.keep_rows(x, mesh), weights)
        return x


class LlamaCausalLM(keras.Model):
    """LlamaForCausalLM: logits [B, S, V]. The decoder layers are LlamaLayers (stacked
    weights, one scanned layer body); `remat` (train.remat) chooses what each layer keeps
    for the backward pass; the weights and what they compute are the same either way."""

    def __init__(
        self,
        config: Any,
        remat: str = "none",
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        document_mask: bool = False,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.config, self.family = config, "llama"
        self.document_mask = document_mask
        self.remat = remat
        width = int(config.hidden_size)
        self.embed_tokens = layers.Embedding(
            int(config.vocab_size), width, embeddings_initializer=init(config), name="embed_tokens"
        )
        self.decoder = LlamaLayers(config, remat, attention, name="layers")
        self.norm = RMSNorm(float(config.rms_norm_eps), name="norm")
        self.tied = bool(config.tie_word_embeddings)
        self.lm_head = (
            None if self.tied else _linear_no_bias(int(config.vocab_size), config, "lm_head")
        )
        self.head_size = width // int(config.num_attention_heads)
        self.theta = rope_theta(config)
        self.mesh = attention.mesh

    def call(
        self, inputs: dict[str, Any], training: bool = False, head_inputs: bool = False
    ) -> Any:
        """Logits [B, S, V], or with `head_inputs` their HeadInputs."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        length = ops.shape(input_ids)[1]
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_tables(length, self.head_size, self.theta, x.dtype)
        if self.document_mask:
            attention_mask = document_ids(input_ids, attention_mask, self.config.bos_token_id)
        x = self.norm(self.decoder(x, attention_mask, cos, sin))
        if self.lm_head is None:
            kernel = ops.transpose(ops.cast(self.embed_tokens.embeddings, x.dtype))
        elif head_inputs:
            kernel = ops.cast(self.lm_head.kernel, x.dtype)
        else:
            return self.lm_head(x)  # (the symbolic call that builds the model builds it)
        return HeadInputs(x, kernel, None) if head_inputs else ops.matmul(x, kernel)


def _linear_no_bias(units: int, config: Any, name: str) -> layers.Dense:
    return layers.Dense(units, use_bias=False, kernel_initializer=init(config), name=name)
