"""Export to a gs:// output root, against the real fake-gcs-server emulator.

TensorFlow's own gs:// filesystem cannot be pointed at an emulator, so training itself runs
on local paths in tests; the export step is what our code uploads through
google-cloud-storage (save_pretrained to a temp dir, upload, marker last), and that is
exercised here for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import job_document, prepare_data, write_corpus, write_job

from payload.backends.tf import input as data_lib
from payload.backends.tf import model as tf_model
from payload.backends.tf import strategy as strategy_lib
from payload.backends.tf import train
from payload.core import storage
from payload.core.status import StatusWriter
from payload.model import configs
from payload.schema import manifest as mf


@pytest.mark.emulator
def test_export_to_gcs_uploads_model_and_tokenizer_marker_last(
    tmp_path: Path, gcs_root: str
) -> None:
    from transformers import AutoTokenizer, TFAutoModelForMaskedLM

    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    local = write_job(tmp_path / "local", job_document(tmp_path / "local", corpus, "mlm"))
    prepare_data(local)
    manifest = mf.load_manifest(local.paths.data)

    doc = job_document(tmp_path, corpus, "mlm")
    doc["output"] = f"{gcs_root}/out"
    job = write_job(tmp_path / "remote", doc)
    storage.upload_tree(local.paths.tokenizer, job.paths.tokenizer)
    config = configs.build_config(
        "bert",
        "tiny",
        {},
        vocab_size=manifest.vocab_size,
        special_ids=data_lib.special_ids_of(manifest),
    )
    model = tf_model.create_model("bert", config, 32)

    # A stale, unfinished export is replaced, not mixed with the new one.
    storage.write_text(storage.join(job.paths.export, "stale.txt"), "old")
    assert not train.is_complete(job)
    train.export(
        job,
        model,
        {"step": 7, "loss": 1.5},
        manifest=manifest,
        runtime=strategy_lib.setup("fp32", "cpu"),
        status=StatusWriter(job.paths.status, job.name),
    )

    names = set(storage.listdir(job.paths.export))
    expected = {
        "config.json",
        "tf_model.h5",
        "pytorch_model.safetensors",
        "README.md",
        "tokenizer.json",
    }
    assert expected | {train.EXPORT_MARKER} <= names
    assert "stale.txt" not in names
    assert train.is_complete(job)
    marker = json.loads(storage.read_text(storage.join(job.paths.export, train.EXPORT_MARKER)))
    assert marker["step"] == 7

    # What was uploaded loads back with the standard auto classes.
    download = tmp_path / "download"
    storage.download_tree(job.paths.export, str(download))
    loaded = TFAutoModelForMaskedLM.from_pretrained(str(download))
    assert loaded.config.vocab_size == manifest.vocab_size
    assert len(AutoTokenizer.from_pretrained(str(download))) == manifest.vocab_size
