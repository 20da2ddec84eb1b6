"""Dynamic masked-language-model masking, vectorised over a batch, with static shapes.

Runs inside tf.data on whole batches (after `records.parse_batch`), so the masking of a
batch of 256 x 128 tokens is a handful of tensor ops instead of 256 Python calls. Every
output has a static shape so that TPU/XLA never recompiles:

    input_ids            [B, S]  int32  the corrupted input
    attention_mask       [B, S]  int32  1 for real tokens, 0 for padding
    masked_lm_positions  [B, P]  int32  positions chosen for prediction (0 in unused slots)
    masked_lm_ids        [B, P]  int32  the original tokens there (0 in unused slots)
    masked_lm_weights    [B, P]  float32  1.0 for used slots, 0.0 for unused ones

Selection follows BERT: per sequence, n = min(P, max(1, round(p * candidates))) positions are
drawn uniformly among the candidate tokens (every token that is neither a special token nor
padding); of those, 80% become the mask token, 10% a random token, 10% stay unchanged.
Random replacements are drawn from the non-special part of the vocabulary only.
Randomness is stateless: the same (seed, batch) always gives the same masks, which is what
makes resumed training reproduce the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf


def replacement_vocabulary(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """Token ids that may be used as random replacements: the vocabulary minus specials."""
    special = {int(i) for i in special_ids}
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError(f"vocabulary of {vocab_size} ids has no non-special token")
    return ids


def mask_tokens(
    input_ids: Any,
    *,
    seed: Any,
    vocab_size: int,
    special_ids: Iterable[int],
    mask_id: int,
    pad_id: int | None,
    max_predictions: int,
    mask_probability: float = 0.15,
    mask_token_ratio: float = 0.8,
    random_token_ratio: float = 0.1,
) -> dict[str, Any]:
    """Mask a batch of token ids [B, S] (int32). `seed` is a shape-[2] integer tensor."""
    special = sorted(
        {int(i) for i in special_ids} | ({int(pad_id)} if pad_id is not None else set())
    )
    input_ids = tf.convert_to_tensor(input_ids, tf.int32)
    seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
    seq_length = input_ids.shape[1]
    if seq_length is None:
        raise ValueError("mask_tokens needs a static sequence length")
    p_slots = int(max_predictions)

    # Candidates: neither special nor padding. Special ids usually form one contiguous
    # block (0..4): two comparisons then, instead of one per special id.
    if special == list(range(special[-1] + 1)):
        candidate = input_ids > special[-1]
    elif special == list(range(special[0], special[-1] + 1)):
        candidate = (input_ids < special[0]) | (input_ids > special[-1])
    else:
        candidate = tf.reduce_all(
            tf.not_equal(input_ids[:, :, None], tf.constant(special, tf.int32)), axis=-1
        )
    num_candidates = tf.reduce_sum(tf.cast(candidate, tf.int32), axis=1)  # [B]
    num_to_mask = tf.cast(
        tf.round(tf.cast(num_candidates, tf.float32) * mask_probability), tf.int32
    )
    num_to_mask = tf.minimum(tf.maximum(num_to_mask, 1), tf.minimum(num_candidates, p_slots))

    seeds = tf.random.experimental.stateless_split(seed, num=3)
    # Uniform scores in [0, 1) for candidates, -1 for the rest: the top-P scores are a
    # uniformly random subset of the candidates, in random order.
    scores = tf.random.stateless_uniform(tf.shape(input_ids), seed=seeds[0])
    scores = tf.where(candidate, scores, -1.0)
    _, positions = tf.math.top_k(scores, k=p_slots, sorted=True)  # [B, P]
    used = tf.range(p_slots)[None, :] < num_to_mask[:, None]  # [B, P]
    positions = tf.where(used, positions, 0)
    weights = tf.cast(used, tf.float32)
    original = tf.gather(input_ids, positions, batch_dims=1)  # [B, P]
    labels = tf.where(used, original, 0)

    # 80/10/10 is decided per slot ([B, P] random numbers, not [B, S]).
    slot_shape = tf.shape(positions)
    action = tf.random.stateless_uniform(slot_shape, seed=seeds[1])
    replacements = tf.constant(replacement_vocabulary(vocab_size, special), tf.int32)
    random_index = tf.random.stateless_uniform(
        slot_shape, seed=seeds[2], minval=0, maxval=int(replacements.shape[0]), dtype=tf.int32
    )
    new_tokens = tf.where(
        action < mask_token_ratio,
        mask_id,
        tf.where(
            action < mask_token_ratio + random_token_ratio,
            tf.gather(replacements, random_index),
            original,
        ),
    )
    # Write the new tokens back as an addition of (new - old): used positions are distinct,
    # and unused slots (all pointing at position 0) add exactly 0, so duplicates are harmless.
    delta = tf.where(used, new_tokens - original, 0)
    rows = tf.broadcast_to(tf.range(slot_shape[0])[:, None], slot_shape)
    corrupted = tf.tensor_scatter_nd_add(input_ids, tf.stack([rows, positions], axis=-1), delta)

    if pad_id is None:
        attention_mask = tf.ones_like(input_ids)
    else:
        attention_mask = tf.cast(tf.not_equal(input_ids, pad_id), tf.int32)

    def fix(t: Any, width: int) -> Any:
        return tf.ensure_shape(t, [input_ids.shape[0], width])

    return {
        "input_ids": fix(corrupted, seq_length),
        "attention_mask": fix(attention_mask, seq_length),
        "masked_lm_positions": fix(positions, p_slots),
        "masked_lm_ids": fix(labels, p_slots),
        "masked_lm_weights": fix(weights, p_slots),
    }


def causal_labels(input_ids: Any, *, pad_id: int | None) -> dict[str, Any]:
    """Next-token targets for a batch [B, S] with the sequence length kept static.

    labels[:, t] = input_ids[:, t + 1]; the last position has no target (weight 0), and
    targets that are padding get weight 0. The model sees all S tokens.
    """
    input_ids = tf.convert_to_tensor(input_ids, tf.int32)
    seq_length = input_ids.shape[1]
    labels = tf.concat([input_ids[:, 1:], tf.zeros_like(input_ids[:, :1])], axis=1)
    has_target = tf.concat(
        [tf.ones_like(input_ids[:, 1:], tf.bool), tf.zeros_like(input_ids[:, :1], tf.bool)], axis=1
    )
    if pad_id is None:
        attention_mask = tf.ones_like(input_ids)
    else:
        attention_mask = tf.cast(tf.not_equal(input_ids, pad_id), tf.int32)
        has_target &= tf.not_equal(labels, pad_id) & tf.not_equal(input_ids, pad_id)
    shape = [input_ids.shape[0], seq_length]
    return {
        "input_ids": tf.ensure_shape(input_ids, shape),
        "attention_mask": tf.ensure_shape(attention_mask, shape),
        "labels": tf.ensure_shape(labels, shape),
        "label_weights": tf.ensure_shape(tf.cast(has_target, tf.float32), shape),
    }
