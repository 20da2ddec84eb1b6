"""Dynamic MLM masking and CLM targets: statistics, specials, static shapes, determinism; the
same rules for both implementations: tf.data's (masking.py, TF backend) and numpy's
(numpy_masking.py, the JAX backend's input)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from payload.backends.tf.masking import causal_labels, mask_tokens, replacement_vocabulary
from payload.data import numpy_masking

VOCAB = 1000
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIALS = (PAD, UNK, CLS, SEP, MASK)
SEQ = 128
SLOTS = 24  # ceil(128 * 0.15) = 20 rounded up to a multiple of 8
IMPLEMENTATIONS = pytest.mark.parametrize("impl", ["tf", "numpy"])


def _batch(rows: int = 512, seed: int = 0) -> np.ndarray:
    """Random non-special tokens framed by CLS/SEP, some UNKs, and padded tails."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, size=(rows, SEQ), dtype=np.int32)
    ids[:, 0] = CLS
    ids[rng.random((rows, SEQ)) < 0.05] = SEP
    ids[rng.random((rows, SEQ)) < 0.02] = UNK
    for row in range(0, rows, 4):  # every 4th row ends with padding
        ids[row, rng.integers(20, SEQ) :] = PAD
    return ids


def _mask(
    ids: np.ndarray, seed: tuple[int, int] = (1, 2), impl: str = "tf", **kw: object
) -> dict[str, np.ndarray]:
    """`impl`'s masks of `ids`; numpy's take (seed, step) for TF's seed pair."""
    args = {
        "vocab_size": VOCAB,
        "special_ids": SPECIALS,
        "mask_id": MASK,
        "pad_id": PAD,
        "max_predictions": SLOTS,
        "mask_probability": 0.15,
    }
    args.update(kw)
    if impl == "numpy":
        masker = numpy_masking.Masker(**args)  # type: ignore[arg-type]
        return masker(ids, seed=seed[0], step=seed[1])
    out = mask_tokens(tf.constant(ids), seed=tf.constant(seed, tf.int64), **args)
    return {k: v.numpy() for k, v in out.items()}


@IMPLEMENTATIONS
def test_masking_statistics_and_never_special_or_padding(impl: str) -> None:
    ids = _batch()
    out = _mask(ids, impl=impl)
    candidates = ~np.isin(ids, SPECIALS)
    n_candidates = candidates.sum(axis=1)
    weights = out["masked_lm_weights"]
    used = weights > 0

    # BERT's rule: round(15% of the candidates) per sequence, at least 1, at most the slots.
    expected = np.minimum(np.maximum(np.round(n_candidates * 0.15), 1), SLOTS)
    assert (used.sum(axis=1) == expected).all()
    assert abs(used.sum() / n_candidates.sum() - 0.15) < 0.005

    positions, labels = out["masked_lm_positions"], out["masked_lm_ids"]
    rows = np.repeat(np.arange(ids.shape[0])[:, None], SLOTS, axis=1)
    # Chosen positions hold candidates only (never special, never padding) and are distinct.
    assert candidates[rows[used], positions[used]].all()
    for r in range(ids.shape[0]):
        p = positions[r][used[r]]
        assert len(set(p.tolist())) == len(p)
    # Labels are the original tokens; unused slots are all zeros.
    assert (labels[used] == ids[rows[used], positions[used]]).all()
    assert (positions[~used] == 0).all() and (labels[~used] == 0).all()
    assert (weights[~used] == 0).all()

    # 80 / 10 / 10 over the chosen positions.
    corrupted = out["input_ids"]
    at = corrupted[rows[used], positions[used]]
    original = labels[used]
    total = used.sum()
    as_mask = (at == MASK).sum() / total
    kept = (at == original).sum() / total
    randomised = ((at != MASK) & (at != original)).sum() / total
    assert abs(as_mask - 0.8) < 0.02, as_mask
    assert abs(kept - 0.1) < 0.015, kept
    assert abs(randomised - 0.1) < 0.015, randomised
    # Random replacements are never special tokens.
    assert not np.isin(at[(at != MASK) & (at != original)], SPECIALS).any()

    # Everything that was not chosen is untouched, padding and specials included.
    chosen = np.zeros_like(ids, dtype=bool)
    chosen[rows[used], positions[used]] = True
    assert (corrupted[~chosen] == ids[~chosen]).all()
    assert (out["attention_mask"] == (ids != PAD)).all()


@IMPLEMENTATIONS
def test_rows_without_candidates_predict_nothing(impl: str) -> None:
    ids = np.full((3, SEQ), PAD, np.int32)
    ids[1, :10] = [CLS, SEP, UNK, SEP, CLS, SEP, PAD, PAD, PAD, PAD]
    ids[2, :3] = [CLS, 17, SEP]
    out = _mask(ids, impl=impl)
    assert out["masked_lm_weights"][:2].sum() == 0
    assert (out["input_ids"][:2] == ids[:2]).all()
    # A single candidate is still predicted (at least one per sequence).
    assert out["masked_lm_weights"][2].sum() == 1
    assert out["masked_lm_positions"][2, 0] == 1 and out["masked_lm_ids"][2, 0] == 17


@IMPLEMENTATIONS
def test_prediction_slots_cap_the_masked_count(impl: str) -> None:
    out = _mask(_batch(64), impl=impl, mask_probability=0.5, max_predictions=8)
    assert out["masked_lm_positions"].shape == (64, 8)
    assert (out["masked_lm_weights"].sum(axis=1) == 8).all()


@IMPLEMENTATIONS
def test_masking_is_seeded(impl: str) -> None:
    ids = _batch(32)
    a, b = _mask(ids, (5, 9), impl=impl), _mask(ids, (5, 9), impl=impl)
    c = _mask(ids, (5, 10), impl=impl)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not (a["masked_lm_positions"] == c["masked_lm_positions"]).all()


def test_static_shapes_inside_tf_function() -> None:
    @tf.function(
        input_signature=[tf.TensorSpec([None, SEQ], tf.int32), tf.TensorSpec([2], tf.int64)]
    )
    def run(ids: tf.Tensor, seed: tf.Tensor) -> dict[str, tf.Tensor]:
        return mask_tokens(
            ids,
            seed=seed,
            vocab_size=VOCAB,
            special_ids=SPECIALS,
            mask_id=MASK,
            pad_id=PAD,
            max_predictions=SLOTS,
        )

    spec = run.get_concrete_function().structured_outputs
    assert spec["input_ids"].shape.as_list() == [None, SEQ]
    assert spec["attention_mask"].shape.as_list() == [None, SEQ]
    for key in ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights"):
        assert spec[key].shape.as_list() == [None, SLOTS], key
    assert spec["masked_lm_weights"].dtype == tf.float32


def test_replacement_vocabulary_excludes_specials() -> None:
    vocab = replacement_vocabulary(10, [0, 3, 9])
    assert vocab == [1, 2, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="no non-special"):
        replacement_vocabulary(2, [0, 1])


def _causal(ids: np.ndarray, pad_id: int | None, impl: str) -> dict[str, np.ndarray]:
    if impl == "numpy":
        return numpy_masking.causal_labels(ids, pad_id=pad_id)
    return {k: v.numpy() for k, v in causal_labels(tf.constant(ids), pad_id=pad_id).items()}


@IMPLEMENTATIONS
def test_causal_labels_are_next_tokens(impl: str) -> None:
    ids = np.array([[2, 10, 11, 12, 3, 0, 0], [2, 20, 21, 22, 23, 24, 3]], np.int32)
    out = _causal(ids, 0, impl)
    np.testing.assert_array_equal(out["input_ids"], ids)
    np.testing.assert_array_equal(out["labels"][:, :-1], ids[:, 1:])
    # No target after the last token, and none into or out of padding.
    np.testing.assert_array_equal(out["label_weights"][0], [1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(out["label_weights"][1], [1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(out["attention_mask"][0], [1, 1, 1, 1, 1, 0, 0])
    assert _causal(ids, None, impl)["label_weights"][:, :-1].all()


@IMPLEMENTATIONS
@pytest.mark.parametrize("special", [(0, 7, 500), (3, 4, 5), (0, 1, 2, 3, 4)])
def test_any_layout_of_special_ids_is_never_masked(special: tuple[int, ...], impl: str) -> None:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 600, size=(256, 64), dtype=np.int32)
    ids[:, ::3] = rng.choice(special, size=ids[:, ::3].shape)  # specials everywhere
    out = _mask(
        ids,
        (3, 4),
        impl=impl,
        vocab_size=600,
        special_ids=special,
        mask_id=special[-1],
        pad_id=None,
        max_predictions=16,
    )
    used = out["masked_lm_weights"] > 0
    assert used.sum() > 0
    assert not np.isin(out["masked_lm_ids"][used], special).any()
    corrupted, original = out["input_ids"], ids
    changed = corrupted != original
    assert not np.isin(original[changed], special).any()
    # Only the mask token may appear as a new special token.
    assert set(np.unique(corrupted[changed & np.isin(corrupted, special)])) <= {special[-1]}


def test_numpy_masks_of_a_row_depend_on_seed_step_and_row_only() -> None:
    """Row r of the global batch gets the same masks whichever host (first_row) masks it."""
    masker = numpy_masking.Masker(
        vocab_size=VOCAB, special_ids=SPECIALS, mask_id=MASK, pad_id=PAD, max_predictions=SLOTS
    )
    ids = _batch(16)
    whole = masker(ids, seed=3, step=7)
    halves = [masker(ids[:8], seed=3, step=7), masker(ids[8:], seed=3, step=7, first_row=8)]
    for key, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), value)
    # The same row as row 0 of another host's batch is masked differently.
    other = masker(ids[8:], seed=3, step=7)
    assert not np.array_equal(other["masked_lm_positions"], halves[1]["masked_lm_positions"])
    # Unsigned inputs (the shard's uint16 ids) give int32 features.
    assert masker(ids.astype(np.uint16), seed=3, step=7)["input_ids"].dtype == np.int32
