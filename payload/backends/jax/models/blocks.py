"""What more than one family's module builds on (models/__init__.py says what each family
mirrors in transformers): the activations by transformers' names, HeadInputs, the weight
initializer and the biased Dense, the Dropout layer (16-bit draws, two per random word),
BERT's embedding tables (BERT/RoBERTa and ELECTRA), the
biased multi-head SelfAttention (BERT's and GPT-2's), the post-LayerNorm EncoderBlock
(BERT/RoBERTa and ELECTRA), the block loop that keeps the activations' rows on the batch
axes (`through`, mesh.keep_rows), and the packed documents' numbers (GPT-2 and Llama)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
from keras import layers, ops

from payload.backends.jax import attention as attention_lib
from payload.backends.jax import mesh as mesh_lib


def gelu_exact(x: Any) -> Any:
    return keras.activations.gelu(x, approximate=False)


def _gelu_tanh(x: Any) -> Any:
    return keras.activations.gelu(x, approximate=True)


ACTIVATIONS = {"gelu": gelu_exact, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh}


class HeadInputs(NamedTuple):
    """What a language model's vocabulary projection reads, for a loss that computes the
    logits itself a chunk of tokens at a time (steps.chunked_loss_terms): logits = features
    @ kernel (+ bias). What `call(..., head_inputs=True)` returns instead of the logits."""

    features: Any  # [B, S, H] (MLM: [B, P, H] at the masked positions), compute dtype
    kernel: Any  # [H, V], compute dtype (tied: the word embeddings transposed)
    bias: Any | None  # [V] or None


def init(config: Any) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=float(config.initializer_range))


def dense(units: int, config: Any, name: str) -> layers.Dense:
    return layers.Dense(units, kernel_initializer=init(config), name=name)


# A dropout decision is a 16-bit uniform integer against round(rate x 2^16): the rate to
# within 2^-17 (0.1 -> 0.1000061), the kept values scaled by that exact keep probability.
DROPOUT_BITS = 16


class Dropout(layers.Dropout):
    """keras.layers.Dropout (its rate, seed generator and state; inference, rate 0 and 1
    and a noise_shape as Keras has them) whose training mask costs half the random bits:
    Keras draws a float32 uniform per element (jax.random.bernoulli), one threefry2x32
    hash each; here one 32-bit word (`jax.random.bits`, the same partitionable threefry)
    gives two 16-bit draws, so an element costs half a hash (tiny BERT: 4.72M -> 2.36M
    hashes a step; on CPU 2-8 % of the step's CPU time, docs/performance.md)."""

    def call(self, inputs: Any, training: bool = False) -> Any:
        if not training or not 0.0 < self.rate < 1.0 or self.noise_shape is not None:
            return super().call(inputs, training=training)
        return dropout(inputs, float(self.rate), self.seed_generator.next())


def dropout(inputs: Any, rate: float, seed: Any) -> Any:
    """`inputs` with each element zeroed where its 16-bit draw is below round(rate x 2^16),
    the others divided by the keep probability that threshold gives (the expectation is
    the input's exactly). `seed`: a threefry2x32 key's uint32[2] data (Keras'
    SeedGenerator state), whatever jax_default_prng_impl says."""
    scale = 1 << DROPOUT_BITS
    threshold = round(rate * scale)
    key = jax.random.wrap_key_data(jnp.asarray(seed, jnp.uint32), impl="threefry2x32")
    *lead, last = inputs.shape
    words = jax.random.bits(key, (*lead, (last + 1) // 2), jnp.uint32)
    draws = jnp.concatenate([words & (scale - 1), words >> DROPOUT_BITS], axis=-1)
    keep = draws[..., :last] >= threshold
    return jnp.where(keep, inputs / ((scale - threshold) / scale), jnp.zeros_like(inputs))


def bert_embeddings(config: Any, width: int) -> tuple[Any, Any, Any]:
    """BERT's word, position and token-type tables (layer names word, position, type: the
    checkpoint and export key on them), shared by the BERT/RoBERTa encoder and ELECTRA."""
    return (
        layers.Embedding(
            int(config.vocab_size), width, embeddings_initializer=init(config), name="word"
        ),
        layers.Embedding(
            int(config.max_position_embeddings),
            width,
            embeddings_initializer=init(config),
            name="position",
        ),
        layers.Embedding(
            int(config.type_vocab_size), width, embeddings_initializer=init(config), name="type"
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
        self.query = dense(width, config, "query")
        self.key = dense(width, config, "key")
        self.value = dense(width, config, "value")
        self.dropout = Dropout(dropout)

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
        self.attention_output = dense(width, config, "attention_output")
        self.attention_norm = layers.LayerNormalization(epsilon=eps, name="attention_norm")
        self.intermediate = dense(int(config.intermediate_size), config, "intermediate")
        self.output_dense = dense(width, config, "output")
        self.output_norm = layers.LayerNormalization(epsilon=eps, name="output_norm")
        self.dropout = Dropout(drop)
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


def document_ids(input_ids: Any, attention_mask: Any, bos_id: int) -> Any:
    """[B, S] int32: each token's document in its packed row (`data.document_mask`), counted
    from 1 and up by one at every BOS (each CLM document is `<s> d </s>`, encode.py; tokens
    before a row's first BOS are the end of a document begun in the previous window); 0 at
    padding. Positions are not restarted: RoPE's scores depend on relative positions only."""
    starts = ops.cast(ops.equal(input_ids, int(bos_id)), "int32")
    tokens = ops.cast(ops.not_equal(attention_mask, 0), "int32")
    return (ops.cumsum(starts, axis=1) + 1) * tokens
