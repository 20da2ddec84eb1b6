"""BERT / RoBERTa masked LMs and the GPT-2 causal LM as Keras 3 layers, written to compute
exactly what transformers' PyTorch classes compute, so that one export serves both backends.

Why our own layers and not keras-hub's: keras-hub's BERT encoder uses the tanh approximation
of GELU and its MLM head another LayerNorm epsilon, so its logits drift from BertForMaskedLM
(the spike of docs/backends.md measured it); keras-hub also needs tensorflow-text, i.e. the
full `tensorflow` wheel beside tensorflow-cpu. What each piece mirrors, in transformers 5's
modeling files (the classes the export names in config.json):
- BERT (modeling_bert.py): embeddings = word + position + token type 0, LayerNorm, dropout;
  post-LayerNorm blocks (self-attention with biases, softmax(QK^T / sqrt(d) + mask), output
  dense + residual + LayerNorm; intermediate dense + GELU ("gelu": the exact erf form) +
  output dense + residual + LayerNorm); the MLM head BertLMPredictionHead: dense, GELU,
  LayerNorm, then the decoder tied to the word embeddings plus its own bias.
- RoBERTa (modeling_roberta.py): BERT's blocks; positions numbered from padding_idx + 1
  over the non-pad tokens (create_position_ids_from_input_ids), one token type; the head
  RobertaLMHead (dense, GELU, layer_norm, tied decoder, bias).
- GPT-2 (modeling_gpt2.py): token + position embeddings; pre-LayerNorm blocks (ln_1,
  c_attn -> q, k, v, causal softmax, c_proj; ln_2, c_fc, "gelu_new" = the tanh GELU,
  c_proj); ln_f; lm_head tied to wte without a bias.
- Llama (modeling_llama.py, LlamaForCausalLM): embed_tokens; pre-norm blocks of LlamaRMSNorm
  (x in float32 times rsqrt(mean(x^2) + eps), cast back, times the weight), attention
  without biases with rotary embeddings (default RoPE: inv_freq = 1 / theta^(2i / D),
  cos/sin of position x inv_freq duplicated over both halves, q * cos + rotate_half(q) * sin,
  positions 0..S-1 whatever the padding) and grouped-query attention (query head h reads
  key/value head h // (A / K), as repeat_kv), softmax in float32, o_proj; the SwiGLU MLP
  down_proj(silu(gate_proj(x)) * up_proj(x)); the final norm; lm_head tied to embed_tokens
  or its own matrix (tie_word_embeddings), no bias. The decoder layers are one Keras layer
  (LlamaLayers) whose weights are stacked over the layers [L, ...] and run as one
  `lax.scan` of one layer body (MaxText's scan_layers): compile time does not grow with L;
  the export slices the stacks per layer into transformers' names.
- ELECTRA (modeling_electra.py, ElectraForPreTraining and ElectraForMaskedLM over one shared
  ElectraEmbeddings): embeddings word + position + token type 0, embedding_size wide,
  LayerNorm, dropout; per network `embeddings_project` (a Linear embedding_size -> width,
  only when they differ) then BERT's blocks; the discriminator's head
  ElectraDiscriminatorPredictions (dense, hidden_act, dense_prediction to one logit per
  token); the generator's ElectraGeneratorPredictions (dense to embedding_size, GELU,
  LayerNorm) then generator_lm_head tied to the word embeddings plus its own bias. As in
  google-research/electra (model/modeling.py: both networks' embeddings live in the one
  "electra/embeddings" scope), word, position and token-type embeddings and their LayerNorm
  are ONE set of weights trained by both; each export holds a copy.
Dense kernels are Keras' [in, out]; `hf_state_dict` (hf_weights.py) maps every weight to the
PyTorch name and shape (nn.Linear [out, in]; GPT-2's Conv1D keeps [in, out]). Attention is
attention.py's (the kernel the runtime chose, or the reference, whose masked scores get
float32's most negative value as transformers' eager attention gives them its dtype's).
On the run's mesh (the attention's), every block boundary holds the activations to the
batch's rows (`through`, mesh.keep_rows): FSDP gathers weights, not activations.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from keras import layers, ops

from payload.backends.jax import attention as attention_lib
from payload.backends.jax import mesh as mesh_lib
from payload.model.sharding import REMAT_SAVES


def _gelu_exact(x: Any) -> Any:
    return keras.activations.gelu(x, approximate=False)


def _gelu_tanh(x: Any) -> Any:
    return keras.activations.gelu(x, approximate=True)


ACTIVATIONS = {"gelu": _gelu_exact, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh}


class HeadInputs(NamedTuple):
    """What a language model's vocabulary projection reads, for a loss that computes the
    logits itself a chunk of tokens at a time (steps.chunked_loss_terms): logits = features
    @ kernel (+ bias). What `call(..., head_inputs=True)` returns instead of the logits."""

    features: Any  # [B, S, H] (MLM: [B, P, H] at the masked positions), compute dtype
    kernel: Any  # [H, V], compute dtype (tied: the word embeddings transposed)
    bias: Any | None  # [V] or None


def _init(config: Any) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=float(config.initializer_range))


def _dense(units: int, config: Any, name: str) -> layers.Dense:
    return layers.Dense(units, kernel_initializer=_init(config), name=name)


def _bert_embeddings(config: Any, width: int) -> tuple[Any, Any, Any]:
    """BERT's word, position and token-type tables (layer names word, position, type: the
    checkpoint and export key on them), shared by the BERT/RoBERTa encoder and ELECTRA."""
    return (
        layers.Embedding(
            int(config.vocab_size), width, embeddings_initializer=_init(config), name="word"
        ),
        layers.Embedding(
            int(config.max_position_embeddings),
            width,
            embeddings_initializer=_init(config),
            name="position",
        ),
        layers.Embedding(
            int(config.type_vocab_size), width, embeddings_initializer=_init(config), name="type"
        ),
    )


class SelfAttention(layers.Layer):
    """Multi-head attention with biases; `causal`: GPT-2's lower-triangular mask. The
    attention itself is `attention` (attention.py: the kernel the runtime chose)."""

    def __init__(
        self,
        width: int,
        heads: int,
        dropout: float,
        config: Any,
        *,
        causal: bool = False,
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.width, self.heads, self.head_size = width, heads, width // heads
        self.causal, self.attend = causal, attention
        self.query = _dense(width, config, "query")
        self.key = _dense(width, config, "key")
        self.value = _dense(width, config, "value")
        self.dropout = layers.Dropout(dropout)

    def _split(self, x: Any) -> Any:
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        return ops.reshape(x, (batch, length, self.heads, self.head_size))  # [B, S, N, H]

    def call(self, x: Any, mask: Any, training: bool = False) -> Any:
        """`mask` [B, S]: the attention mask (1: token, 0: padding)."""
        q, k, v = (self._split(f(x)) for f in (self.query, self.key, self.value))
        drop = None
        if training and self.dropout.rate > 0:
            drop = lambda probs: self.dropout(probs, training=True)  # noqa: E731
        out = self.attend(q, k, v, causal=self.causal, mask=mask, probs_dropout=drop)
        return ops.reshape(out, (ops.shape(x)[0], ops.shape(x)[1], self.width))


class EncoderBlock(layers.Layer):
    """One post-LayerNorm BERT/RoBERTa layer."""

    def __init__(
        self,
        config: Any,
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        eps, drop = float(config.layer_norm_eps), float(config.hidden_dropout_prob)
        width = int(config.hidden_size)
        self.attention = SelfAttention(
            width,
            int(config.num_attention_heads),
            float(config.attention_probs_dropout_prob),
            config,
            attention=attention,
            name="attention",
        )
        self.attention_output = _dense(width, config, "attention_output")
        self.attention_norm = layers.LayerNormalization(epsilon=eps, name="attention_norm")
        self.intermediate = _dense(int(config.intermediate_size), config, "intermediate")
        self.output_dense = _dense(width, config, "output")
        self.output_norm = layers.LayerNormalization(epsilon=eps, name="output_norm")
        self.dropout = layers.Dropout(drop)
        self.activation = ACTIVATIONS[config.hidden_act]

    def call(self, x: Any, mask: Any, training: bool = False) -> Any:
        attended = self.attention_output(self.attention(x, mask, training=training))
        x = self.attention_norm(x + self.dropout(attended, training=training))
        inner = self.output_dense(self.activation(self.intermediate(x)))
        return self.output_norm(x + self.dropout(inner, training=training))


def through(blocks: list[Any], x: Any, mesh: Any, run: Any) -> Any:
    """`x` through `blocks` in order (`run(block, x)` -> x), its rows kept on the batch axes
    at every block boundary (mesh.keep_rows: on an FSDP mesh only the weights are gathered,
    never the activations)."""
    x = mesh_lib.keep_rows(x, mesh)
    for block in blocks:
        x = mesh_lib.keep_rows(run(block, x), mesh)
    return x


def at_positions(hidden: Any, positions: Any, mesh: Any) -> Any:
    """hidden [B, S, H] at `positions` [B, P]: [B, P, H], its rows kept on the batch axes."""
    picked = ops.take_along_axis(hidden, ops.expand_dims(positions, -1), axis=1)
    return mesh_lib.keep_rows(picked, mesh)


class MaskedLM(keras.Model):
    """BertForMaskedLM / RobertaForMaskedLM. `call` returns logits [B, S, V]; `hidden` and
    `head` let training apply the head at the masked positions only."""

    def __init__(
        self,
        config: Any,
        family: str,
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.config, self.family = config, family
        width, eps = int(config.hidden_size), float(config.layer_norm_eps)
        self.word_embeddings, self.position_embeddings, self.token_type_embeddings = (
            _bert_embeddings(config, width)
        )
        self.embedding_norm = layers.LayerNormalization(epsilon=eps, name="embedding_norm")
        self.dropout = layers.Dropout(float(config.hidden_dropout_prob))
        self.blocks = [
            EncoderBlock(config, attention, name=f"layer_{i}")
            for i in range(config.num_hidden_layers)
        ]
        self.head_dense = _dense(width, config, "head_dense")
        self.head_norm = layers.LayerNormalization(epsilon=eps, name="head_norm")
        self.activation = ACTIVATIONS[config.hidden_act]
        self.pad_id = int(config.pad_token_id) if config.pad_token_id is not None else 1
        self.mesh = attention.mesh

    def build(self, input_shape: Any) -> None:
        self.head_bias = self.add_weight(
            shape=(int(self.config.vocab_size),), initializer="zeros", name="head_bias"
        )
        super().build(input_shape)

    def _positions(self, input_ids: Any) -> Any:
        length = ops.shape(input_ids)[1]
        if self.family != "roberta":
            return ops.expand_dims(ops.arange(length), 0)
        # RoBERTa: padding_idx + the running count of non-pad tokens; pads keep padding_idx.
        mask = ops.cast(ops.not_equal(input_ids, self.pad_id), "int32")
        return ops.cumsum(mask, axis=1) * mask + self.pad_id

    def hidden(self, input_ids: Any, attention_mask: Any, training: bool = False) -> Any:
        x = self.word_embeddings(input_ids) + self.position_embeddings(self._positions(input_ids))
        x = x + self.token_type_embeddings(ops.zeros_like(input_ids))
        x = self.dropout(self.embedding_norm(x), training=training)
        return through(
            self.blocks, x, self.mesh, lambda b, h: b(h, attention_mask, training=training)
        )

    def head_inputs(self, hidden: Any) -> HeadInputs:
        """The head's transform (dense, activation, LayerNorm), the tied decoder and its bias."""
        x = self.head_norm(self.activation(self.head_dense(hidden)))
        table = ops.cast(self.word_embeddings.embeddings, x.dtype)
        return HeadInputs(x, ops.transpose(table), ops.cast(self.head_bias, x.dtype))

    def head(self, hidden: Any) -> Any:
        x, kernel, bias = self.head_inputs(hidden)
        return ops.matmul(x, kernel) + bias

    def call(
        self, inputs: dict[str, Any], training: bool = False, head_inputs: bool = False
    ) -> Any:
        """Logits [B, S, V]; with `masked_lm_positions` [B, P] in the inputs, the head runs at
        those positions only and the logits are [B, P, V] (the training loss's shape).
        `head_inputs`: the HeadInputs of those logits instead of the logits."""
        hidden = self.hidden(inputs["input_ids"], inputs["attention_mask"], training)
        if "masked_lm_positions" in inputs:
            hidden = at_positions(hidden, inputs["masked_lm_positions"], self.mesh)
        return self.head_inputs(hidden) if head_inputs else self.head(hidden)


class DecoderBlock(layers.Layer):
    """One pre-LayerNorm GPT-2 block."""

    def __init__(
        self,
        config: Any,
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        width, eps = int(config.n_embd), float(config.layer_norm_epsilon)
        inner = int(config.n_inner) if config.n_inner else 4 * width
        self.ln_1 = layers.LayerNormalization(epsilon=eps, name="ln_1")
        self.attention = SelfAttention(
            width,
            int(config.n_head),
            float(config.attn_pdrop),
            config,
            causal=True,
            attention=attention,
            name="attn",
        )
        self.c_proj = _dense(width, config, "c_proj")
        self.ln_2 = layers.LayerNormalization(epsilon=eps, name="ln_2")
        self.c_fc = _dense(inner, config, "c_fc")
        self.mlp_proj = _dense(width, config, "mlp_proj")
        self.dropout = layers.Dropout(float(config.resid_pdrop))
        self.activation = ACTIVATIONS[config.activation_function]

    def call(self, x: Any, mask: Any, training: bool = False) -> Any:
        attended = self.c_proj(self.attention(self.ln_1(x), mask, training=training))
        x = x + self.dropout(attended, training=training)
        inner = self.mlp_proj(self.activation(self.c_fc(self.ln_2(x))))
        return x + self.dropout(inner, training=training)


class CausalLM(keras.Model):
    """GPT2LMHeadModel: logits [B, S, V] from the tied token embeddings."""

    def __init__(
        self,
        config: Any,
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        document_mask: bool = False,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.config, self.family = config, "gpt2"
        self.document_mask = document_mask
        width = int(config.n_embd)
        self.wte = layers.Embedding(
            int(config.vocab_size), width, embeddings_initializer=_init(config), name="wte"
        )
        self.wpe = layers.Embedding(
            int(config.n_positions), width, embeddings_initializer=_init(config), name="wpe"
        )
        self.dropout = layers.Dropout(float(config.embd_pdrop))
        self.blocks = [
            DecoderBlock(config, attention, name=f"h_{i}") for i in range(config.n_layer)
        ]
        self.ln_f = layers.LayerNormalization(epsilon=float(config.layer_norm_epsilon), name="ln_f")
        self.mesh = attention.mesh

    def call(
        self, inputs: dict[str, Any], training: bool = False, head_inputs: bool = False
    ) -> Any:
        """Logits [B, S, V], or with `head_inputs` their HeadInputs."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        length = ops.shape(input_ids)[1]
        x = self.wte(input_ids) + self.wpe(ops.expand_dims(ops.arange(length), 0))
        x = self.dropout(x, training=training)
        if self.document_mask:
            attention_mask = document_ids(input_ids, attention_mask, self.config.bos_token_id)
        x = through(self.blocks, x, self.mesh, lambda b, h: b(h, attention_mask, training=training))
        x = self.ln_f(x)
        kernel = ops.transpose(ops.cast(self.wte.embeddings, x.dtype))
        return HeadInputs(x, kernel, None) if head_inputs else ops.matmul(x, kernel)


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
                initializer="ones" if len(shape) == 1 else _init(self.config),
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
            int(config.vocab_size), width, embeddings_initializer=_init(config), name="embed_tokens"
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


def document_ids(input_ids: Any, attention_mask: Any, bos_id: int) -> Any:
    """[B, S] int32: each token's document in its packed row (`data.document_mask`), counted
    from 1 and up by one at every BOS (each CLM document is `<s> d </s>`, encode.py; tokens
    before a row's first BOS are the end of a document begun in the previous window); 0 at
    padding. Positions are not restarted: RoPE's scores depend on relative positions only."""
    starts = ops.cast(ops.equal(input_ids, int(bos_id)), "int32")
    tokens = ops.cast(ops.not_equal(attention_mask, 0), "int32")
    return (ops.cumsum(starts, axis=1) + 1) * tokens


def _linear_no_bias(units: int, config: Any, name: str) -> layers.Dense:
    return layers.Dense(units, use_bias=False, kernel_initializer=_init(config), name=name)


class Electra(keras.Model):
    """ELECTRA's generator and discriminator over shared embeddings (`config`: the
    discriminator's ElectraConfig with `generator_hidden_size`; model.generator_config).

    `call` without `masked_lm_positions` runs both networks on the same input and returns
    {"discriminator": [B, S] logits, "generator": [B, S, V] logits}: what the two exports'
    ElectraForPreTraining and ElectraForMaskedLM compute. With `masked_lm_positions`,
    `masked_lm_ids`, `masked_lm_weights` and `sample_key` (a jax.random key's uint32 data),
    it is one replaced-token-detection pass (`replaced_token_detection`)."""

    def __init__(
        self,
        config: Any,
        attention: attention_lib.Attention = attention_lib.REFERENCE,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        from payload.model import configs  # noqa: PLC0415  (framework-free)

        self.config, self.family = config, "electra"
        self.generator_config = configs.generator_config(config)
        gen = self.generator_config
        width, eps = int(config.embedding_size), float(config.layer_norm_eps)
        self.word_embeddings, self.position_embeddings, self.token_type_embeddings = (
            _bert_embeddings(config, width)
        )
        self.embedding_norm = layers.LayerNormalization(epsilon=eps, name="embedding_norm")
        self.dropout = layers.Dropout(float(config.hidden_dropout_prob))
        hidden, gen_width = int(config.hidden_size), int(gen.hidden_size)
        self.discriminator_project = (
            _dense(hidden, config, "discriminator_project") if hidden != width else None
        )
        self.discriminator_blocks = [
            EncoderBlock(config, attention, name=f"discriminator_layer_{i}")
            for i in range(config.num_hidden_layers)
        ]
        self.discriminator_dense = _dense(hidden, config, "discriminator_dense")
        self.discriminator_prediction = _dense(1, config, "discriminator_prediction")
        self.discriminator_activation = ACTIVATIONS[config.hidden_act]
        self.generator_project = (
            _dense(gen_width, config, "generator_project") if gen_width != width else None
        )
        self.generator_blocks = [
            EncoderBlock(gen, attention, name=f"generator_layer_{i}")
            for i in range(gen.num_hidden_layers)
        ]
        self.generator_dense = _dense(width, config, "generator_dense")
        self.generator_norm = layers.LayerNormalization(epsilon=eps, name="generator_norm")
        self.temperature = float(configs.ELECTRA_TEMPERATURE)
        self.mesh = attention.mesh

    def build(self, input_shape: Any) -> None:
        self.generator_bias = self.add_weight(
            shape=(int(self.config.vocab_size),), initializer="zeros", name="generator_bias"
        )
        super().build(input_shape)

    def _encode(self, input_ids: Any, attention_mask: Any, network: str, training: bool) -> Any:
        length = ops.shape(input_ids)[1]
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(ops.expand_dims(ops.arange(length), 0))
        x = x + self.token_type_embeddings(ops.zeros_like(input_ids))
        x = self.dropout(self.embedding_norm(x), training=training)
        project = getattr(self, f"{network}_project")
        if project is not None:
            x = project(x)
        blocks = getattr(self, f"{network}_blocks")
        return through(blocks, x, self.mesh, lambda b, h: b(h, attention_mask, training=training))

    def discriminator_logits(self, input_ids: Any, attention_mask: Any, training: bool) -> Any:
        """[B, S]: ElectraForPreTraining's logits (> 0: replaced)."""
        x = self._encode(input_ids, attention_mask, "discriminator", training)
        x = self.discriminator_activation(self.discriminator_dense(x))
        return self.discriminator_prediction(x)[..., 0]

    def generator_head(self, hidden: Any) -> Any:
        """ElectraGeneratorPredictions + the tied generator_lm_head: logits over the vocabulary."""
        x = self.generator_norm(_gelu_exact(self.generator_dense(hidden)))
        table = ops.cast(self.word_embeddings.embeddings, x.dtype)
        return ops.matmul(x, ops.transpose(table)) + ops.cast(self.generator_bias, x.dtype)

    def replaced_token_detection(self, inputs: dict[str, Any], training: bool) -> dict[str, Any]:
        """One RTD pass (google-research/electra run_pretraining.py PretrainingModel): the
        generator reads the masked input and predicts the masked positions; a token sampled
        from softmax(logits / temperature) by the Gumbel-max trick (argmax of logits /
        temperature + Gumbel noise, pretrain_helpers.sample_from_softmax) replaces the
        original at EVERY chosen position (masked or kept); the discriminator reads that
        input and a token counts as replaced when the sample differs from the original.
        Returns the generator's logits at the positions [B, P, V], the discriminator's
        logits [B, S] and the replaced labels [B, S] (float32)."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        positions = inputs["masked_lm_positions"]
        originals = inputs["masked_lm_ids"]
        used = inputs["masked_lm_weights"] > 0
        hidden = self._encode(input_ids, attention_mask, "generator", training)
        hidden = at_positions(hidden, positions, self.mesh)
        generator_logits = self.generator_head(hidden)
        key = jax.random.wrap_key_data(inputs["sample_key"])
        logits32 = ops.cast(generator_logits, "float32") / self.temperature
        noise = jax.random.gumbel(key, logits32.shape, "float32")
        sampled = ops.cast(ops.argmax(jax.lax.stop_gradient(logits32) + noise, axis=-1), "int32")
        # The sample goes where the masked input has its [MASK] (or kept token): an addition
        # of (sample - current) at each used slot; positions of used slots are distinct and
        # unused slots (position 0) add 0.
        rows = ops.broadcast_to(ops.arange(ops.shape(positions)[0])[:, None], positions.shape)
        current = ops.take_along_axis(input_ids, positions, axis=1)
        delta = ops.where(used, sampled - current, 0)
        corrupted = input_ids.at[rows, positions].add(delta)
        replaced = ops.cast(ops.logical_and(used, ops.not_equal(sampled, originals)), "float32")
        labels = ops.zeros(ops.shape(input_ids), "float32").at[rows, positions].add(replaced)
        return {
            "generator": generator_logits,
            "discriminator": self.discriminator_logits(corrupted, attention_mask, training),
            "replaced": labels,
            "sampled": sampled,
        }

    def call(self, inputs: dict[str, Any], training: bool = False) -> Any:
        if "masked_lm_positions" in inputs:
            return self.replaced_token_detection(inputs, training)
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        hidden = self._encode(input_ids, attention_mask, "generator", training)
        return {
            "discriminator": self.discriminator_logits(input_ids, attention_mask, training),
            "generator": self.generator_head(hidden),
        }


Model = MaskedLM | CausalLM | LlamaCausalLM | Electra


def create_model(
    family: str,
    config: Any,
    seq_length: int,
    *,
    remat: str = "none",
    attention: attention_lib.Attention = attention_lib.REFERENCE,
    document_mask: bool = False,
) -> Model:
    """A built model (weights created) for `seq_length`-token inputs; `remat` (train.remat)
    applies to the Llama family's blocks (spec.py refuses it for the other families);
    `attention` computes every attention layer (attention.choose: train.attention);
    `document_mask` (data.document_mask, the causal families): a token attends to its own
    packed document only (document_ids)."""
    # The kernels read the mask as document numbers where the model makes them (cuDNN turns
    # them into a same-document mask, attention.cudnn_arguments).
    attention = attention_lib.with_documents(
        attention, document_mask and family in ("llama", "gpt2")
    )
    # Named by the family: the variables' paths (checkpoints.Layout) do not depend on how
    # many models this process built before.
    model: Model
    if family == "llama":
        model = LlamaCausalLM(
            config, remat=remat, attention=attention, document_mask=document_mask, name=family
        )
    elif family == "electra":
        model = Electra(config, attention, name=family)
    elif family == "gpt2":
        model = CausalLM(config, attention, document_mask=document_mask, name=family)
    else:
        model = MaskedLM(config, family, attention, name=family)
    # A symbolic call builds every weight without computing anything: on a slice the
    # weights are global arrays, and an eager forward pass would be hundreds of small
    # computations every process must run in step (one of them hung two CPU processes here).
    ids = keras.KerasTensor((1, seq_length), dtype="int32")
    model({"input_ids": ids, "attention_mask": ids})
    return model
