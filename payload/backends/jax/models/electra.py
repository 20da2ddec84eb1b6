"""ELECTRA: the generator and the discriminator over one set of shared embeddings, and one
replaced-token-detection pass (Electra)."""

from __future__ import annotations

from typing import Any

import jax
import keras
from keras import layers, ops

from payload.backends.jax import attention as attention_lib
from payload.backends.jax.models.blocks import (
    ACTIVATIONS,
    Dropout,
    EncoderBlock,
    at_positions,
    bert_embeddings,
    dense,
    gelu_exact,
    through,
)


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
            bert_embeddings(config, width)
        )
        self.embedding_norm = layers.LayerNormalization(epsilon=eps, name="embedding_norm")
        self.dropout = Dropout(float(config.hidden_dropout_prob))
        hidden, gen_width = int(config.hidden_size), int(gen.hidden_size)
        self.discriminator_project = (
            dense(hidden, config, "discriminator_project") if hidden != width else None
        )
        self.discriminator_blocks = [
            EncoderBlock(config, attention, name=f"discriminator_layer_{i}")
            for i in range(config.num_hidden_layers)
        ]
        self.discriminator_dense = dense(hidden, config, "discriminator_dense")
        self.discriminator_prediction = dense(1, config, "discriminator_prediction")
        self.discriminator_activation = ACTIVATIONS[config.hidden_act]
        self.generator_project = (
            dense(gen_width, config, "generator_project") if gen_width != width else None
        )
        self.generator_blocks = [
            EncoderBlock(gen, attention, name=f"generator_layer_{i}")
            for i in range(gen.num_hidden_layers)
        ]
        self.generator_dense = dense(width, config, "generator_dense")
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
        x = self.generator_norm(gelu_exact(self.generator_dense(hidden)))
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
