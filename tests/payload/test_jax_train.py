"""The JAX backend (`train.backend: jax`) through the real CLI: tokenizer -> encode -> train
-> export for BERT, RoBERTa and GPT-2, and the export loaded the way its users load it.

For each family, `tpu-payload run` trains a tiny model with held-out evaluation and
exports; transformers 5 (PyTorch, .venv-pt) loads the export with the plain
`AutoModelFor*.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`, with no
missing, unexpected or mismatched keys, and its logits match the logits of the model as
training left it (rebuilt from the newest checkpoint in a JAX process:
drivers/jax_checkpoint_logits.py) within 1e-4. Every record of the run names the backend:
status.json's runtime, run.json, export_complete.json and the model card.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from export_checks import TOLERANCE, checkpoint_logits, expected_tokens
from pt_runner import PT_SCRIPT, require_pt_python, run_pt
from train_helpers import job_document, run_cli, write_corpus, write_job

from payload.spec import JobSpec
from payload.training import export as export_lib

FAMILIES = {"bert": "mlm", "roberta": "mlm", "gpt2": "clm"}


def jax_job(tmp_path: Path, family: str, **train: object) -> tuple[JobSpec, dict]:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    doc = job_document(
        tmp_path,
        corpus,
        FAMILIES[family],
        family,
        steps=12,
        checkpoint_every=6,
        log_every=3,
        eval_every=6,
        backend="jax",
        **train,
    )
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    return write_job(tmp_path, doc), doc


@pytest.mark.parametrize("family", list(FAMILIES))
def test_jax_backend_pipeline_exports_what_transformers5_loads(family: str, tmp_path: Path) -> None:
    require_pt_python()
    job, _ = jax_job(tmp_path, family)
    result = run_cli("run", "--job", str(tmp_path / "job.yaml"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    # The run's records name the backend.
    status = json.loads(Path(job.paths.status).read_text())
    assert status["state"] == "complete", status
    runtime = status["runtime"]
    assert runtime["backend"] == "jax" and runtime["accelerator"] == "cpu", runtime
    metrics = status["stages"]["train"]["metrics"]
    assert metrics["step"] == 12 and metrics["eval_step"] == 12, metrics
    run_identity = json.loads(Path(job.paths.checkpoints, "run.json").read_text())
    assert run_identity["backend"] == "jax"
    marker = json.loads(Path(job.paths.export, export_lib.EXPORT_MARKER).read_text())
    assert marker["backend"] == "jax" and marker["step"] == 12, marker
    assert marker["pytorch_class"] == export_lib.PYTORCH_CLASSES[family]
    card = Path(job.paths.export, export_lib.MODEL_CARD).read_text()
    assert "| backend | Keras 3 on JAX" in card
    # The attention the runtime chose (on CPU XLA's reference), recorded three times.
    assert runtime["attention"] == {
        "implementation": "reference",
        "reason": "auto: cpu has no fused attention kernel (cuDNN on NVIDIA GPUs, splash on TPUs)",
    }, runtime
    assert run_identity["attention"] == runtime["attention"], run_identity
    assert "| attention | XLA reference (einsum): auto: cpu has no fused attention" in card
    assert "tf_model.h5" not in card.replace("no `tf_model.h5`", "")
    exported = {p.name for p in Path(job.paths.export).iterdir()}
    # MODEL_FILES without the TF backend's own (no tf_model.h5, no generation config).
    assert exported == {
        *export_lib.MODEL_FILES - set(export_lib.TF_MODEL_FILES),
        export_lib.EXPORT_MARKER,
    }, exported
    assert not exported & set(export_lib.TF_PREFERRED_FILES), exported
    checkpoints = sorted(p.name for p in Path(job.paths.checkpoints).iterdir())
    assert checkpoints == ["12", "6", "run.json"], checkpoints  # Orbax step directories
    assert "eval step 6/12" in result.stderr and "eval step 12/12" in result.stderr

    # transformers 5 loads it with the plain calls; logits = the trained model's.
    rng = np.random.default_rng(1)
    config = json.loads(Path(job.paths.export, "config.json").read_text())
    ids = rng.integers(5, config["vocab_size"], size=(3, 32)).astype("int32")
    mask = np.ones_like(ids)
    if family != "gpt2":  # right padding in one row
        pad = 1 if family == "roberta" else 0
        ids[1, 20:], mask[1, 20:] = pad, 0
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    step = checkpoint_logits(
        tmp_path / "job.yaml", tmp_path / "ids.npy", tmp_path / "mask.npy", tmp_path / "jax.npy"
    )
    assert step == 12
    report = run_pt(
        PT_SCRIPT,
        job.paths.export,
        str(tmp_path / "ids.npy"),
        str(tmp_path / "mask.npy"),
        str(tmp_path / "pt.npy"),
    )
    assert report["class"] == export_lib.PYTORCH_CLASSES[family]
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == []
    assert report["tokens"] == expected_tokens(job, "hello world")
    keep = mask.astype(bool)
    jax_logits, pt_logits = np.load(tmp_path / "jax.npy"), np.load(tmp_path / "pt.npy")
    worst = float(np.abs(jax_logits[keep] - pt_logits[keep]).max())
    print(f"{family}: worst |trained jax - transformers 5| = {worst:.2e}")
    assert worst <= TOLERANCE, worst
    assert float(np.abs(pt_logits[keep]).max()) > 1.0
