"""ELECTRA (`data.objective: rtd`, `model.family: electra`) on the JAX backend.

What the spec accepts and refuses (the TF backend refuses rtd in one line, `auto` picks
JAX); the presets' generator follows google-research/electra's rule; one tiny run through
the real CLI (tokenizer -> encode -> train with held-out evaluation -> two exports), whose
exports transformers 5 (.venv-pt) loads with the plain `from_pretrained`: the
discriminator's and the generator's logits within 1e-4 of the model as training left it
(rebuilt from the newest checkpoint: drivers/jax_checkpoint_logits.py), the fill-mask pipeline on
the generator, and a sequence classifier built from the discriminator whose loss falls in
a short fine-tuning run. FSDP and data parallelism on 8 virtual devices train alike:
test_jax_sharding.py (the trainer's compiled chunk on both meshes). Resume and SIGTERM:
test_resume.py covers rtd.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from export_checks import TOLERANCE, checkpoint_logits
from pt_runner import require_pt_python, run_pt
from safetensors.numpy import load_file
from train_helpers import (
    job_document,
    run_cli,
    write_corpus,
    write_job,
)

from payload.core.errors import SpecError
from payload.model import configs
from payload.spec import parse_job, tf_backend_refusal
from payload.training import export as export_lib
from payload.training import shared as training

PT_ELECTRA = Path(__file__).parent / "pt" / "electra_with_transformers5.py"
PARTS = {"discriminator": "ElectraForPreTraining", "generator": "ElectraForMaskedLM"}


def _doc(tmp_path: Path, **train: object) -> dict:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    doc = job_document(tmp_path, corpus, "rtd", "electra", backend="jax", **train)
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    return doc


# ------------------------------------------------------------------ spec (no training)


def _parsed(tmp_path: Path, **changes: dict) -> object:
    doc = _doc(tmp_path, steps=4, warmup_steps=0)
    for section, values in changes.items():
        doc[section] = {**doc[section], **values}
    return parse_job(doc, source=str(tmp_path / "job.yaml"))


def test_rtd_is_electras_and_the_jax_backends(tmp_path: Path) -> None:
    job = _parsed(tmp_path, train={"backend": "auto"})
    assert job.data.objective == "rtd" and job.model.family == "electra"
    assert job.special_roles["mask"] == "[MASK]"  # BERT-style WordPiece specials
    assert training.resolve_backend(job, {"TPU_PAYLOAD_BACKEND": "tf"}) == "jax"
    # The one list of what TF refuses says it, for `auto` resolved to tf by the TF trainer.
    refusal = tf_backend_refusal(job)
    assert refusal is not None and refusal.startswith("data.objective: rtd trains on the JAX")
    with pytest.raises(SpecError, match=r"^data.objective: rtd trains on the JAX backend only"):
        _parsed(tmp_path, train={"backend": "tf"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"family": "bert"}}, "'bert' cannot train objective 'rtd'"),
        ({"data": {"objective": "mlm"}}, "'electra' cannot train objective 'mlm'"),
        ({"model": {"size": "mini"}}, "'mini' is not allowed (allowed: tiny, small, base)"),
        ({"model": {"config": {"hidden_act": "relu"}}}, "unknown electra config key"),
        ({"model": {"config": {"generator_hidden_size": 1.5}}}, "1.5 must be <= 1.0"),
        ({"model": {"config": {"generator_hidden_size": 0}}}, "must be > 0.0"),
        # 0.75 x 256 = 192 wide, 3 heads (192 // 64): fine; 0.51 x 256 = 131, 2 heads: not.
        (
            {"model": {"size": "small", "config": {"generator_hidden_size": 0.51}}},
            "gives a generator 131 wide, which must be at least 1 and a multiple of its 2 heads",
        ),
        ({"model": {"config": {"hidden_size": 65}}}, "hidden_size=65 must be a positive multiple"),
    ],
)
def test_bad_electra_settings_are_one_line(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(SpecError, match=None) as caught:
        _parsed(tmp_path, **changes)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_config_takes_electraconfig_keys_and_the_generator_fraction(tmp_path: Path) -> None:
    job = _parsed(
        tmp_path,
        model={"config": {"embedding_size": 48, "generator_hidden_size": 0.5, "hidden_size": 96}},
    )
    config = configs.config_for(job, _Manifest())
    generator = configs.generator_config(config)
    assert (config.embedding_size, config.hidden_size) == (48, 96)
    assert (generator.hidden_size, generator.embedding_size) == (48, 48)
    assert "generator_hidden_size" not in configs.export_config(config)


class _Manifest:
    vocab_size = 400
    special_ids: ClassVar[dict[str, int]] = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


@pytest.mark.parametrize(
    ("size", "generator"),
    [
        # google-research/electra run_pretraining.py get_generator_config on the repository's
        # small (256 x 0.25) and base (768 x 0.33333) discriminators.
        ("small", {"hidden_size": 64, "num_attention_heads": 1, "intermediate_size": 256}),
        ("base", {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024}),
    ],
)
def test_presets_generator_follows_the_original_rule(size: str, generator: dict) -> None:
    config = configs.build_config(
        "electra", size, {}, vocab_size=30522, special_ids=_Manifest.special_ids
    )
    built = configs.generator_config(config)
    assert {k: getattr(built, k) for k in generator} == generator
    assert built.num_hidden_layers == config.num_hidden_layers == 12
    assert built.embedding_size == config.embedding_size


# ------------------------------------------------------------------ one run, two exports


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("electra")
    doc = _doc(root, steps=12, checkpoint_every=6, log_every=3, eval_every=6)
    job = write_job(root, doc)
    result = run_cli("run", "--job", str(root / "job.yaml"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, job, result


def test_the_run_reports_both_networks(trained) -> None:
    _, job, result = trained
    status = json.loads(Path(job.paths.status).read_text())
    assert status["state"] == "complete", status
    metrics = status["stages"]["train"]["metrics"]
    assert metrics["step"] == 12 and metrics["eval_step"] == 12, metrics
    for key in (
        "eval_loss",
        "eval_accuracy",
        "eval_discriminator_loss",
        "eval_discriminator_accuracy",
        "eval_replaced_f1",
        "eval_replaced_precision",
        "eval_replaced_recall",
    ):
        assert 0.0 <= metrics[key] < 50.0, (key, metrics)
    # The generator replaced some of the 15% chosen tokens, not all (some samples are right).
    assert 0.0 < metrics["eval_replaced_fraction"] < 0.2, metrics
    rtd_loss = metrics["eval_loss"] + 50.0 * metrics["eval_discriminator_loss"]
    assert metrics["eval_rtd_loss"] == pytest.approx(rtd_loss, abs=1e-4)
    assert "eval step 6/12  generator loss" in result.stderr
    assert "replaced F1" in result.stderr
    # The training loss is the generator's + 50 x the discriminator's: it starts near
    # ln(V) + 50 ln 2 (a uniform generator, an undecided discriminator) and falls.
    assert metrics["loss"] < status["stages"]["train"]["metrics"].get("first_loss", 1e9)


def test_two_exports_and_one_marker(trained) -> None:
    _, job, _ = trained
    export = Path(job.paths.export)
    assert sorted(p.name for p in export.iterdir()) == [
        "discriminator",
        export_lib.EXPORT_MARKER,
        "generator",
    ]
    marker = json.loads((export / export_lib.EXPORT_MARKER).read_text())
    assert marker["backend"] == "jax" and marker["objective"] == "rtd" and marker["step"] == 12
    assert marker["pytorch_class"] == "ElectraForPreTraining"
    manifest = json.loads(Path(job.paths.data, "manifest.json").read_text())
    config = configs.build_config(
        "electra", "tiny", {}, vocab_size=manifest["vocab_size"], special_ids={}
    )
    embeddings, discriminator, generator = configs.electra_parameters(config)
    expected = {"discriminator": embeddings + discriminator, "generator": embeddings + generator}
    for part, cls in PARTS.items():
        files = {p.name for p in (export / part).iterdir()}
        assert files == export_lib.MODEL_FILES - set(export_lib.TF_MODEL_FILES), files
        assert marker["parts"][part]["pytorch_class"] == cls
        assert marker["parts"][part]["parameters"] == expected[part]
        state = load_file(str(export / part / export_lib.PT_WEIGHTS))
        assert sum(a.size for a in state.values()) == expected[part]
        exported = json.loads((export / part / "config.json").read_text())
        assert exported["architectures"] == [cls] and "generator_hidden_size" not in exported
        card = (export / part / export_lib.MODEL_CARD).read_text()
        assert f"`{cls}`" in card and "replaced-token detection" in card
        assert "| replaced-token F1 |" in card
    # The embeddings are one set of weights, in both exports.
    a = load_file(str(export / "discriminator" / export_lib.PT_WEIGHTS))
    b = load_file(str(export / "generator" / export_lib.PT_WEIGHTS))
    shared = [k for k in a if k.startswith("electra.embeddings.")]
    assert len(shared) == 5
    assert all(np.array_equal(a[k], b[k]) for k in shared)
    assert "generator_lm_head.weight" not in b  # tied to the word embeddings on load
    # tiny: embedding 32, discriminator 64 and generator 16 wide: both project.
    assert a["electra.embeddings_project.weight"].shape == (64, 32)
    assert b["electra.embeddings_project.weight"].shape == (16, 32)


def test_transformers5_loads_both_and_fine_tunes_the_discriminator(trained) -> None:
    require_pt_python()
    root, job, _ = trained
    manifest = json.loads(Path(job.paths.data, "manifest.json").read_text())
    rng = np.random.default_rng(1)
    ids = rng.integers(5, manifest["vocab_size"], size=(3, 32)).astype("int32")
    mask = np.ones_like(ids)
    ids[1, 20:], mask[1, 20:] = 0, 0  # right padding in one row
    np.save(root / "ids.npy", ids)
    np.save(root / "mask.npy", mask)
    step = checkpoint_logits(
        root / "job.yaml", root / "ids.npy", root / "mask.npy", root / "jax.npy"
    )
    assert step == 12
    out = root / "pt"
    out.mkdir()
    report = run_pt(
        PT_ELECTRA, job.paths.export, str(root / "ids.npy"), str(root / "mask.npy"), str(out)
    )
    keep = mask.astype(bool)
    for part, cls in PARTS.items():
        loaded = report[part]
        assert loaded["class"] == cls
        assert loaded["missing_keys"] == [] and loaded["unexpected_keys"] == [], loaded
        assert loaded["mismatched_keys"] == []
        jax_logits = np.load(root / f"jax.{part}.npy")
        pt_logits = np.load(out / f"{part}.npy")
        assert jax_logits.shape == pt_logits.shape
        worst = float(np.abs(jax_logits[keep] - pt_logits[keep]).max())
        print(f"{part}: worst |trained jax - transformers 5| = {worst:.2e}")
        assert worst <= TOLERANCE, (part, worst)
        assert float(np.abs(pt_logits[keep]).max()) > 0.1
    assert len(report["fill_mask"]) == 3
    assert all(p["token_str"].strip() and 0 < p["score"] <= 1 for p in report["fill_mask"])
    classifier = report["classifier"]
    assert classifier["class"] == "ElectraForSequenceClassification"
    assert classifier["missing_keys"] and all(
        k.startswith("classifier.") for k in classifier["missing_keys"]
    ), classifier  # only the new head is new: the encoder is the discriminator's
    losses = report["fine_tune_losses"]
    print(f"fine-tune losses: {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------ sharded like the others


def test_the_tf_backend_refuses_rtd_in_one_line(tmp_path: Path) -> None:
    doc = _doc(tmp_path, steps=4, warmup_steps=0)
    doc["train"]["backend"] = "tf"
    (tmp_path / "job.yaml").write_text(json.dumps(doc))
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "data.objective: rtd trains on the JAX backend only" in errors[0]
