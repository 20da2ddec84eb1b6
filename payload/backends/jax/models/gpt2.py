"""GPT-2: the pre-LayerNorm DecoderBlock and the causal LM (GPT2LMHeadModel)."""

from __future__ import annotations

from typing import Any

import keras
from keras import layers, ops

from payload.backends.jax import attention as attention_lib
from payload.backends.jax.models.blocks import (
    ACTIVATIONS,
    Dropout,
    HeadInputs,
    SelfAttention,
    dense,
    document_ids,
    init,
    through,
)


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
        self.c_proj = dense(width, config, "c_proj")
        self.ln_2 = layers.LayerNormalization(epsilon=eps, name="ln_2")
        self.c_fc = dense(inner, config, "c_fc")
        self.mlp_proj = dense(width, config, "mlp_proj")
        self.dropout = Dropout(float(config.resid_pdrop))
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
            int(config.vocab_size), width, embeddings_initializer=init(config), name="wte"
        )
        self.wpe = layers.Embedding(
            int(config.n_positions), width, embeddings_initializer=init(config), name="wpe"
        )
        self.dropout = Dropout(float(config.embd_pdrop))
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
