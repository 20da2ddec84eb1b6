"""The export in PyTorch layout: same logits as the trained TF model, for all three families.

1. PT layout -> TF (no PyTorch needed): `model.safetensors` is read with safetensors.numpy
   and loaded into a fresh TF model by transformers 4.57's own PT->TF loader
   (`load_pytorch_state_dict_in_tf2_model`, the name mapping the export inverts); every
   weight must be used and every TF weight found, and its logits must equal those of the
   trained model (`tf_model.h5`) to 1e-4.
2. transformers 5 + PyTorch (the `.venv-pt` environment, requirements/pt-check.txt):
   `AutoModelForMaskedLM` / `AutoModelForCausalLM.from_pretrained(export_dir)` with no
   missing, unexpected or mismatched keys, and the same logits to 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from train_helpers import job_document, prepare_data, write_corpus, write_job

from payload import export as export_lib
from payload import manifest as mf
from payload import records, storage, train
from payload.status import StatusWriter

REPO = Path(__file__).resolve().parents[2]
PT_SCRIPT = Path(__file__).parent / "pt" / "load_with_transformers5.py"
TOLERANCE = 1e-4
FAMILIES = ("bert", "roberta", "gpt2")


def _pt_python() -> Path | None:
    configured = os.environ.get("PAYLOAD_PT_PYTHON")
    if configured:
        return Path(configured)
    default = REPO / ".venv-pt" / "bin" / "python"
    return default if default.exists() else None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", lines=600)


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, corpus):
    family = request.param
    root = tmp_path_factory.mktemp(f"export-{family}")
    objective = "clm" if family == "gpt2" else "mlm"
    doc = job_document(root, corpus, objective, family=family, steps=6, log_every=3)
    doc["train"].update(checkpoint_every=6, eval_every=3)
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    job = write_job(root, doc)
    prepare_data(job)
    status = StatusWriter(job.paths.status, job.name, min_interval_s=0.0)
    stats = train.train(job, status)
    return job, stats


def _inputs(job) -> tuple[np.ndarray, np.ndarray]:
    manifest = mf.load_manifest(job.paths.data)
    path = mf.shard_paths(job.paths.data, manifest, split="eval")[0]
    with storage.open_read(path) as handle:
        rows = [
            records.decode_record(r, manifest.token_dtype) for r in records.iter_records(handle)
        ]
    ids = np.stack(rows[:4]).astype(np.int32)
    return ids, np.ones_like(ids)


def _tf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return model(input_ids=tf.constant(ids), attention_mask=tf.constant(mask), training=False)[
        "logits"
    ].numpy()


def _auto_tf(job):
    from transformers import TFAutoModelForCausalLM, TFAutoModelForMaskedLM

    return TFAutoModelForCausalLM if job.model.family == "gpt2" else TFAutoModelForMaskedLM


def test_export_layout_config_and_card(trained) -> None:
    job, stats = trained
    export = Path(job.paths.export)
    names = {p.name for p in export.iterdir()}
    assert {"model.safetensors", "tf_model.h5", "config.json", "README.md"} <= names
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == [export_lib.PYTORCH_CLASSES[job.model.family]]

    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        shapes = {k: f.get_slice(k).get_shape() for k in keys}
    # Tied weights are stored once, as transformers' own save_pretrained does.
    assert not keys & set(export_lib.TIED_KEYS[job.model.family])
    assert set(export_lib.TIED_KEYS[job.model.family].values()) <= keys
    if job.model.family == "bert":
        assert shapes["bert.encoder.layer.0.intermediate.dense.weight"] == [512, 128]  # [out, in]
    if job.model.family == "gpt2":
        assert shapes["transformer.h.0.mlp.c_fc.weight"] == [128, 512]  # Conv1D stays [in, out]
        assert shapes["transformer.h.0.attn.c_attn.bias"] == [384]

    # The model card holds this run's figures and nothing made up.
    card = (export / "README.md").read_text()
    manifest = mf.load_manifest(job.paths.data)
    status = json.loads(Path(job.paths.status).read_text())
    metrics = status["stages"]["train"]["metrics"]
    marker = json.loads((export / train.EXPORT_MARKER).read_text())
    assert f"| parameters | {marker['parameters']:,} " in card
    assert f"| training sequences / tokens | {manifest.total_records:,} / " in card
    assert f"| held-out sequences / tokens | {manifest.eval_records:,} / " in card
    assert f"| documents | {manifest.corpus['documents']:,} |" in card
    assert f"| loss | {metrics['loss']:.4f} | {metrics['eval_loss']:.4f} |" in card
    assert f"| {metrics['eval_perplexity']:.2f} |" in card
    assert f"{metrics['eval_accuracy']:.4f} |" in card
    assert metrics["eval_step"] == stats["step"] == 6
    assert "| hardware | cpu, 1 replica(s) |" in card
    assert "| precision | float32 " in card
    assert "| not recorded" not in card and "not recorded |" not in card


def test_pytorch_layout_loads_into_tf_with_the_same_logits(trained) -> None:
    """PT -> TF with transformers 4.57's own loader: no PyTorch needed."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    from transformers.modeling_tf_pytorch_utils import load_pytorch_state_dict_in_tf2_model

    job, _ = trained
    export = job.paths.export
    auto = _auto_tf(job)
    reference = auto.from_pretrained(export, use_safetensors=False)  # tf_model.h5: trained
    fresh = auto.from_config(AutoConfig.from_pretrained(export))
    loaded, info = load_pytorch_state_dict_in_tf2_model(
        fresh,
        load_file(str(Path(export, "model.safetensors"))),
        output_loading_info=True,
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["mismatched_keys"] == []
    ids, mask = _inputs(job)
    expected = _tf_logits(reference, ids, mask)
    worst = float(np.abs(_tf_logits(loaded, ids, mask) - expected).max())
    assert worst <= TOLERANCE, worst
    assert float(np.abs(expected).max()) > 1.0  # not a degenerate comparison


def test_transformers5_pytorch_loads_the_export_with_the_same_logits(trained, tmp_path) -> None:
    python = _pt_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run this check: build .venv-pt with `make venv-pt`")
        pytest.skip("no PyTorch environment: `make venv-pt` builds .venv-pt")
    job, _ = trained
    ids, mask = _inputs(job)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    result = subprocess.run(
        [
            str(python),
            str(PT_SCRIPT),
            job.paths.export,
            str(tmp_path / "ids.npy"),
            str(tmp_path / "mask.npy"),
            str(tmp_path / "logits.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["transformers"].startswith("5.")
    assert report["class"] == export_lib.PYTORCH_CLASSES[job.model.family]
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == []
    reference = _auto_tf(job).from_pretrained(job.paths.export, use_safetensors=False)
    expected = _tf_logits(reference, ids, mask)
    worst = float(np.abs(np.load(tmp_path / "logits.npy") - expected).max())
    assert worst <= TOLERANCE, worst
