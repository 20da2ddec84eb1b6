"""Model presets, compatibility checks, and the losses checked against the real HF models."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from payload.backends.tf import model as tf_model
from payload.backends.tf import schedule
from payload.backends.tf.masking import causal_labels, mask_tokens
from payload.core.errors import SpecError
from payload.model import configs
from payload.spec import parse_job

REPO = Path(__file__).resolve().parents[2]
BERT_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
ROBERTA_IDS = {"cls": 0, "bos": 0, "pad": 1, "sep": 2, "eos": 2, "unk": 3, "mask": 4}
GPT2_IDS = {"bos": 0, "pad": 1, "eos": 2, "unk": 3}
VOCAB = 300
SEQ = 32


def _job(family: str, seq_length: int = 128, config: dict | None = None, **tokenizer: object):
    objective = "clm" if family == "gpt2" else "mlm"
    doc = {
        "name": "m",
        "output": "/tmp/unused-output",
        "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": 1000, **tokenizer},
        "data": {"objective": objective, "seq_length": seq_length},
        "model": {"family": family, **({"config": config} if config else {})},
        "train": {"steps": 10},
    }
    return parse_job(doc, source="/tmp/job.yaml")


@pytest.mark.parametrize(
    ("family", "size", "width", "layers"),
    [
        ("bert", "tiny", 128, 2),
        ("roberta", "mini", 256, 4),
        ("gpt2", "small", 512, 4),
        ("bert", "base", 768, 12),
    ],
)
def test_presets(family: str, size: str, width: int, layers: int) -> None:
    ids = {"bert": BERT_IDS, "roberta": ROBERTA_IDS, "gpt2": GPT2_IDS}[family]
    config = configs.build_config(family, size, {}, vocab_size=VOCAB, special_ids=ids)
    assert config.vocab_size == VOCAB
    assert config.hidden_size == width and config.num_hidden_layers == layers
    assert config.pad_token_id == ids["pad"]


@pytest.mark.parametrize("family", ["bert", "roberta", "gpt2", "electra"])
def test_presets_train_without_attention_dropout(family: str) -> None:
    """The pre-training presets' attention dropout is 0 (today's recipes; the fused kernels
    have none); the hidden dropout stays 0.1, and 0.1 is one model.config key away."""
    key = "attn_pdrop" if family == "gpt2" else "attention_probs_dropout_prob"
    hidden = "resid_pdrop" if family == "gpt2" else "hidden_dropout_prob"
    for size in configs.PRESETS[family]:
        config = configs.build_config(family, size, {}, vocab_size=VOCAB, special_ids={})
        assert getattr(config, key) == 0.0 and getattr(config, hidden) == 0.1, (size, config)
        settings = configs.resolved_settings(family, size, {})
        assert configs.attention_dropout(family, settings) == 0.0
    back = configs.build_config(family, "tiny", {key: 0.1}, vocab_size=VOCAB, special_ids={})
    assert getattr(back, key) == 0.1
    assert configs.attention_dropout(family, back.to_dict()) == 0.1


def test_overrides_and_their_errors() -> None:
    config = configs.build_config(
        "bert",
        "tiny",
        {"num_hidden_layers": 3, "hidden_dropout_prob": 0.0},
        vocab_size=VOCAB,
        special_ids=BERT_IDS,
    )
    assert config.num_hidden_layers == 3 and config.hidden_dropout_prob == 0.0
    assert (
        configs.build_config(
            "gpt2", "tiny", {"n_layer": 1}, vocab_size=VOCAB, special_ids=GPT2_IDS
        ).n_layer
        == 1
    )
    with pytest.raises(SpecError, match=r"model\.config\.n_embd: not a bert setting"):
        configs.build_config("bert", "tiny", {"n_embd": 64}, vocab_size=VOCAB, special_ids={})
    with pytest.raises(
        SpecError, match="hidden_size=130 must be a positive multiple of num_attention_heads=4"
    ):
        configs.build_config(
            "roberta",
            "tiny",
            {"hidden_size": 130, "num_attention_heads": 4},
            vocab_size=VOCAB,
            special_ids={},
        )


def test_check_compatible_sequence_length_vs_positions() -> None:
    _job("bert", 512)
    _job("roberta", 512)  # the roberta presets carry 514 positions
    _job("gpt2", 1024)
    with pytest.raises(SpecError, match=r"data\.seq_length: 513 .*max_position_embeddings=512"):
        _job("bert", 513)
    with pytest.raises(SpecError, match=r"max_position_embeddings=512 allows at most 510.*\+ 2"):
        _job("roberta", 512, config={"max_position_embeddings": 512})
    with pytest.raises(SpecError, match=r"n_positions=64 allows at most 64"):
        _job("gpt2", 128, config={"n_positions": 64})
    with pytest.raises(SpecError, match=r"model\.config: hidden_size=100"):
        _job("bert", 128, config={"hidden_size": 100, "num_attention_heads": 3})


def test_roberta_needs_pad_at_id_one() -> None:
    with pytest.raises(
        SpecError, match=r"tokenizer\.special_tokens: roberta needs the pad token '<pad>' at id 1"
    ):
        _job("roberta", 128, special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<mask>"])


def test_check_compatible_imports_neither_tensorflow_nor_transformers(tmp_path: Path) -> None:
    """Validating a job builds no config: the stages that never build a model (validate,
    encode) do not import transformers (~2 s of CPU each) or TensorFlow."""
    job = tmp_path / "job.yaml"
    job.write_text(
        textwrap.dedent(
            """
            output: out
            corpus: {paths: [c.txt]}
            tokenizer: {kind: wordpiece, vocab_size: 500}
            data: {objective: mlm, seq_length: 600}
            model: {family: bert}
            train: {steps: 1}
            """
        )
    )
    code = (
        "import sys\n"
        "from payload.spec import load_job\n"
        "from payload.core.errors import SpecError\n"
        "try:\n"
        f"    load_job({str(job)!r})\n"
        "except SpecError as e:\n"
        "    print('SpecError', e)\n"
        "print('tensorflow' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert "SpecError data.seq_length: 600" in out.stdout
    assert out.stdout.strip().endswith("False False"), out.stdout


def _mlm_batch(vocab: int, special: dict[str, int], seed: int = 3) -> dict[str, tf.Tensor]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, size=(4, SEQ), dtype=np.int32)
    ids[:, 0] = special["cls"]
    ids[1, 20:] = special["pad"]
    return mask_tokens(
        tf.constant(ids),
        seed=tf.constant([seed, 0], tf.int64),
        vocab_size=vocab,
        special_ids=special.values(),
        mask_id=special["mask"],
        pad_id=special["pad"],
        max_predictions=8,
    )


@pytest.mark.parametrize(("family", "special"), [("bert", BERT_IDS), ("roberta", ROBERTA_IDS)])
def test_gathered_head_equals_full_model_logits(family: str, special: dict[str, int]) -> None:
    config = configs.build_config(family, "tiny", {}, vocab_size=VOCAB, special_ids=special)
    model = tf_model.create_model(family, config, SEQ)
    batch = _mlm_batch(VOCAB, special)

    gathered = tf_model.masked_lm_logits(model, family, batch, training=False)
    full = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], training=False
    ).logits
    expected = tf.gather(full, batch["masked_lm_positions"], batch_dims=1)
    assert gathered.shape == (4, 8, VOCAB)
    np.testing.assert_allclose(gathered.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)

    # Our loss equals the HF model's own loss with -100 everywhere but the masked positions.
    loss_sum, weight_sum, _ = tf_model.loss_terms(model, family, "mlm", batch, training=False)
    labels = np.full((4, SEQ), -100, np.int32)
    w = batch["masked_lm_weights"].numpy() > 0
    pos, ids = batch["masked_lm_positions"].numpy(), batch["masked_lm_ids"].numpy()
    for r in range(4):
        labels[r, pos[r][w[r]]] = ids[r][w[r]]
    hf = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=tf.constant(labels),
        training=False,
    ).loss
    np.testing.assert_allclose(
        (loss_sum / weight_sum).numpy(), tf.reduce_mean(hf).numpy(), rtol=1e-4
    )

    # The head is the model's own and tied to the input embeddings: no separate decoder matrix.
    _, head = tf_model.encoder_and_head(model, family)
    names = {v.name for v in model.trainable_variables}
    assert not any("decoder/kernel" in n for n in names)
    assert head.trainable_variables


def test_causal_loss_matches_hf_shifted_loss() -> None:
    config = configs.build_config("gpt2", "tiny", {}, vocab_size=VOCAB, special_ids=GPT2_IDS)
    model = tf_model.create_model("gpt2", config, SEQ)
    ids = np.random.default_rng(0).integers(4, VOCAB, size=(3, SEQ), dtype=np.int32)
    batch = causal_labels(tf.constant(ids), pad_id=GPT2_IDS["pad"])
    loss_sum, weight_sum, _ = tf_model.loss_terms(model, "gpt2", "clm", batch, training=False)
    assert weight_sum.numpy() == 3 * (SEQ - 1)
    # HF shifts internally: labels=input_ids gives the next-token loss over S-1 positions.
    hf = model(input_ids=tf.constant(ids), labels=tf.constant(ids), training=False).loss
    np.testing.assert_allclose(
        (loss_sum / weight_sum).numpy(), tf.reduce_mean(hf).numpy(), rtol=1e-4
    )


@pytest.mark.parametrize(("family", "special"), [("bert", BERT_IDS), ("gpt2", GPT2_IDS)])
def test_weight_decay_skips_norms_and_biases(family: str, special: dict[str, int]) -> None:
    config = configs.build_config(family, "tiny", {}, vocab_size=VOCAB, special_ids=special)
    model = tf_model.create_model(family, config, SEQ)
    job = _job(family)
    optimizer = schedule.create_optimizer(job.train, jit_compile=False)
    optimizer.build(model.trainable_variables)
    decayed = {v.name for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    skipped = {v.name for v in model.trainable_variables} - decayed
    assert decayed and skipped
    assert all("bias" in n or "LayerNorm" in n or "/ln_" in n for n in skipped), skipped
    assert not any("bias" in n or "LayerNorm" in n or "/ln_" in n for n in decayed), decayed
