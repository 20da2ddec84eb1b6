"""BERT and RoBERTa: the masked LM (BertForMaskedLM / RobertaForMaskedLM) over blocks.py's
embeddings and EncoderBlocks."""

from __future__ import annotations

from typing import Any

import keras
from keras import layers, ops

from payload.backends.jax import attention as attention_lib
from payload.backends.jax.models.blocks import (
    ACTIVATIONS,
    Dropout,
    EncoderBlock,
    HeadInputs,
    at_positions,
    bert_embeddings,
    dense,
    through,
)


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
            bert_embeddings(config, width)
        )
        self.embedding_norm = layers.LayerNormalization(epsilon=eps, name="embedding_norm")
        self.dropout = Dropout(float(config.hidden_dropout_prob))
        self.blocks = [
            EncoderBlock(config, attention, name=f"layer_{i}")
            for i in range(config.num_hidden_layers)
        ]
        self.head_dense = dense(width, config, "head_dense")
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
