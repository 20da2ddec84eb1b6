"""The TF backend's models (transformers' TF classes) and the losses of the two objectives.

The MLM loss runs the encoder, gathers the hidden states at the (static number of) masked
positions and applies the real model's own LM head to those only: logits are [B, P, V]
instead of [B, S, V]. Because the head used is the `TF*ForMaskedLM` model's own
(`model.mlm` / `model.lm_head`, tied to the input embeddings), the exported model carries
the trained head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import tensorflow as tf

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def create_model(family: str, config: PretrainedConfig, seq_length: int) -> Any:
    """The transformers TF model for the family, with its weights built.

    Call inside `strategy.scope()` (and after setting the mixed-precision policy).
    """
    from transformers import TFBertForMaskedLM, TFGPT2LMHeadModel, TFRobertaForMaskedLM  # noqa: PLC0415

    model_cls = {
        "bert": TFBertForMaskedLM,
        "roberta": TFRobertaForMaskedLM,
        "gpt2": TFGPT2LMHeadModel,
    }[family]
    model = model_cls(config)
    dummy = tf.fill([1, seq_length], tf.constant(max(2, config.vocab_size - 1), tf.int32))
    model(dummy, training=False)
    return model


def encoder_and_head(model: Any, family: str) -> tuple[Any, Any]:
    """The main layer and the LM head of a TF*ForMaskedLM model."""
    if family == "bert":
        return model.bert, model.mlm
    if family == "roberta":
        return model.roberta, model.lm_head
    raise ValueError(f"{family} has no masked-LM head")


def masked_lm_logits(
    model: Any, family: str, batch: Mapping[str, tf.Tensor], *, training: bool
) -> tf.Tensor:
    """Logits [B, P, V] at the masked positions only (float32)."""

    encoder, head = encoder_and_head(model, family)
    hidden = encoder(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], training=training
    )[0]  # [B, S, H]
    gathered = tf.gather(hidden, batch["masked_lm_positions"], batch_dims=1)  # [B, P, H]
    logits = head(gathered, training=training) if family == "bert" else head(gathered)
    return tf.cast(logits, tf.float32)


def causal_lm_logits(model: Any, batch: Mapping[str, tf.Tensor], *, training: bool) -> tf.Tensor:

    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], training=training
    )
    return tf.cast(out.logits, tf.float32)


def loss_terms(
    model: Any, family: str, objective: str, batch: Mapping[str, tf.Tensor], *, training: bool
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(sum of per-token losses, sum of weights, number of correct predictions) for a batch.

    The caller divides by the weight sum of the GLOBAL batch, so that the loss is the mean
    over all predicted tokens whatever the number of replicas.
    """

    if objective == "mlm":
        logits = masked_lm_logits(model, family, batch, training=training)
        labels, weights = batch["masked_lm_ids"], batch["masked_lm_weights"]
    else:
        logits = causal_lm_logits(model, batch, training=training)
        labels, weights = batch["labels"], batch["label_weights"]
    per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    correct = tf.cast(
        tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels), tf.float32
    )
    return (
        tf.reduce_sum(per_token * weights),
        tf.reduce_sum(weights),
        tf.reduce_sum(correct * weights),
    )
