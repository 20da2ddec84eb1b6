"""Dynamic masking (MLM, ELECTRA's rtd) and next-token targets in numpy, for the JAX
backend's input (payload/backends/jax/input.py): the same rules and the same features as
masking.py's tf.data version, without TensorFlow.

    input_ids            [B, S]  int32  the corrupted input
    attention_mask       [B, S]  int32  1 for real tokens, 0 for padding
    masked_lm_positions  [B, P]  int32  positions chosen for prediction (0 in unused slots)
    masked_lm_ids        [B, P]  int32  the original tokens there (0 in unused slots)
    masked_lm_weights    [B, P]  float32  1.0 for used slots, 0.0 for unused ones

Selection follows BERT, as in masking.py: per sequence, n = min(P, max(1, round(p *
candidates))) positions drawn uniformly among the candidates (neither special nor padding);
of those, `mask_token_ratio` become the mask token, `random_token_ratio` a random non-special
token, the rest stay unchanged.

Randomness is a pure function of (seed, step, row): every random number is a hash
(SplitMix64's finalizer, Steele, Lea & Flood 2014) of the seed, the global step, the row of
the global batch, the stream and the position (or slot), so a row's masks do not depend on
which host built it, on the batch's split between hosts, or on whether the run was resumed.
The bits are defined here, not by a library's generator, so no numpy release changes them.
(masking.py draws from TensorFlow's Philox instead: the two backends mask differently.)
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32, _S11 = (np.uint64(n) for n in (30, 27, 31, 32, 11))
_LOW32 = np.uint64(0xFFFFFFFF)
# The streams of one (seed, step, row): which positions are chosen, what each chosen slot
# becomes (and which random token).
SCORES, SLOTS = 1, 2


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function: a bijective avalanche of uint64 values (wrapping); a
    new array, computed in place."""
    z = np.add(x, _GOLDEN, dtype=np.uint64)
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


def hash64(*keys: object) -> np.ndarray:
    """One uint64 per element of the broadcast of `keys` (ints or integer arrays): a chained
    hash, so (1, 2) and (2, 1) differ."""
    with np.errstate(over="ignore"):
        h = np.zeros((), np.uint64)
        for key in keys:
            h = mix64(h ^ np.asarray(key, np.int64).view(np.uint64))
    return h


def uniform(*keys: object) -> np.ndarray:
    """Uniform float64 in [0, 1) per element: the top 53 bits of `hash64(*keys)`."""
    return (hash64(*keys) >> _S11).astype(np.float64) * (1.0 / (1 << 53))


def permutation(n: int, *keys: object) -> np.ndarray:
    """A permutation of range(n) that is a pure function of `keys` (sorted by hash)."""
    return np.argsort(hash64(*keys, np.arange(n)), kind="stable")


def _stream(rows: np.ndarray, width: int, stream: int) -> np.ndarray:
    """[len(rows), width] hashes: row r's `rows[r]` (a per-row hash) with each column."""
    with np.errstate(over="ignore"):
        columns = hash64(stream, np.arange(width))
        return mix64(rows[:, None] ^ columns[None, :])


def replacement_vocabulary(vocab_size: int, special_ids: Iterable[int]) -> np.ndarray:
    """Token ids that may be used as random replacements: the vocabulary minus specials."""
    special = {int(i) for i in special_ids}
    ids = np.array([i for i in range(vocab_size) if i not in special], np.int32)
    if not ids.size:
        raise ValueError(f"vocabulary of {vocab_size} ids has no non-special token")
    return ids


class Masker:
    """`mask_tokens` with the vocabulary's replacements computed once."""

    def __init__(
        self,
        *,
        vocab_size: int,
        special_ids: Iterable[int],
        mask_id: int,
        pad_id: int | None,
        max_predictions: int,
        mask_probability: float = 0.15,
        mask_token_ratio: float = 0.8,
        random_token_ratio: float = 0.1,
    ):
        special = {int(i) for i in special_ids} | ({int(pad_id)} if pad_id is not None else set())
        self.special = np.array(sorted(special), np.int32)
        self.replacements = replacement_vocabulary(vocab_size, self.special.tolist())
        self.mask_id, self.pad_id = int(mask_id), pad_id
        self.slots = int(max_predictions)
        self.mask_probability = float(mask_probability)
        self.mask_token_ratio = float(mask_token_ratio)
        self.random_token_ratio = float(random_token_ratio)

    def __call__(
        self, input_ids: np.ndarray, *, seed: int, step: int, first_row: int = 0
    ) -> dict[str, np.ndarray]:
        """Mask a batch [B, S]; row r of it is row `first_row + r` of the global batch of
        `step`."""
        ids = np.asarray(input_ids).astype(np.int32)
        rows, seq_length = ids.shape
        p_slots = self.slots
        row_hash = hash64(seed, step, np.arange(first_row, first_row + rows))
        special = self.special
        if special.size and special[-1] - special[0] + 1 == special.size:
            candidate = (ids < special[0]) | (ids > special[-1])  # one block of ids (0..4)
        else:
            candidate = ~np.isin(ids, special)
        num_candidates = candidate.sum(axis=1)
        num_to_mask = np.round(num_candidates * self.mask_probability).astype(np.int64)
        num_to_mask = np.minimum(np.maximum(num_to_mask, 1), np.minimum(num_candidates, p_slots))

        # A random 64-bit score per candidate (odd, so > 0), 0 for the rest: the P largest
        # are a uniformly random subset of the candidates, taken in descending order.
        scores = _stream(row_hash, seq_length, SCORES) | np.uint64(1)
        scores[~candidate] = 0
        width = min(p_slots, seq_length)
        top = np.argpartition(scores, seq_length - width, axis=1)[:, seq_length - width :]
        order = np.argsort(np.take_along_axis(scores, top, axis=1), axis=1)[:, ::-1]
        positions = np.take_along_axis(top, order, axis=1)
        if p_slots > seq_length:  # more slots than positions: the rest are unused
            positions = np.pad(positions, ((0, 0), (0, p_slots - seq_length)))
        used = np.arange(p_slots)[None, :] < num_to_mask[:, None]
        positions = np.where(used, positions, 0).astype(np.int32)
        original = np.take_along_axis(ids, positions, axis=1)
        labels = np.where(used, original, 0).astype(np.int32)

        # What each slot becomes, per slot ([B, P] numbers, not [B, S]): the high 32 bits of
        # its hash decide mask / random / unchanged, the low 32 bits which random token.
        slot_hash = _stream(row_hash, p_slots, SLOTS)
        action = (slot_hash >> _S32).astype(np.float64) * (1.0 / (1 << 32))
        pick = ((slot_hash & _LOW32) * np.uint64(self.replacements.size)) >> _S32
        random_tokens = self.replacements[pick.astype(np.int64)]
        new_tokens = np.where(
            action < self.mask_token_ratio,
            self.mask_id,
            np.where(
                action < self.mask_token_ratio + self.random_token_ratio, random_tokens, original
            ),
        )
        corrupted = ids.copy()
        batch_rows = np.broadcast_to(np.arange(rows)[:, None], positions.shape)
        corrupted[batch_rows[used], positions[used]] = new_tokens[used]
        return {
            "input_ids": corrupted,
            "attention_mask": attention_mask(ids, self.pad_id),
            "masked_lm_positions": positions,
            "masked_lm_ids": labels,
            "masked_lm_weights": used.astype(np.float32),
        }


def attention_mask(ids: np.ndarray, pad_id: int | None) -> np.ndarray:
    if pad_id is None:
        return np.ones(ids.shape, np.int32)
    return (ids != pad_id).astype(np.int32)


def causal_labels(input_ids: np.ndarray, *, pad_id: int | None) -> dict[str, np.ndarray]:
    """Next-token targets for a batch [B, S] (masking.causal_labels' rule): labels[:, t] =
    input_ids[:, t + 1]; the last position and padding targets (or inputs) get weight 0."""
    ids = np.asarray(input_ids, np.int32)
    labels = np.zeros_like(ids)
    labels[:, :-1] = ids[:, 1:]
    has_target = np.ones(ids.shape, bool)
    has_target[:, -1] = False
    if pad_id is not None:
        has_target &= (labels != pad_id) & (ids != pad_id)
    return {
        "input_ids": ids,
        "attention_mask": attention_mask(ids, pad_id),
        "labels": labels,
        "label_weights": has_target.astype(np.float32),
    }
