"""End-to-end training on CPU with the real stages, tiny models, and the exported model.

Data comes from the real tokenizer and encode stages (train_helpers.py); the models are the
real transformers TF models at tiny size; nothing of ours is mocked.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from train_helpers import copy_prepared, job_document, prepare_data, write_corpus, write_job

from payload.backends.tf import input as data_lib
from payload.backends.tf import model as tf_model
from payload.backends.tf import train
from payload.core import storage
from payload.core.errors import DataError
from payload.core.status import StatusWriter
from payload.model import configs
from payload.schema import manifest as mf
from payload.spec import JobSpec


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def mlm_data(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> JobSpec:
    job = write_job(
        tmp_path_factory.mktemp("mlm-data"), job_document(Path("unused"), corpus, "mlm")
    )
    prepare_data(job)
    return job


@pytest.fixture(scope="module")
def clm_data(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> JobSpec:
    job = write_job(
        tmp_path_factory.mktemp("clm-data"), job_document(Path("unused"), corpus, "clm")
    )
    prepare_data(job)
    return job


def _status(job: JobSpec) -> StatusWriter:
    return StatusWriter(job.paths.status, job.name, min_interval_s=0.0)


def _scalars(logdir: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for path in Path(logdir).glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return out


def _assert_trained_and_exported(job: JobSpec, stats: dict, steps: int) -> dict[str, list[float]]:
    assert stats["step"] == steps
    assert train.is_complete(job)
    marker = json.loads(storage.read_text(storage.join(job.paths.export, train.EXPORT_MARKER)))
    assert marker["step"] == steps
    scalars = _scalars(job.paths.logs)
    losses = scalars["loss"]
    assert len(losses) == steps // job.train.log_every
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    assert {"learning_rate", "sequences_per_second", "tokens_per_second"} <= set(scalars)
    status = json.loads(Path(job.paths.status).read_text())
    assert status["stage"] == "train" and status["metrics"]["step"] == steps
    checkpoints = sorted(p.name for p in Path(job.paths.checkpoints).glob("ckpt-*.index"))
    assert checkpoints[-1] == f"ckpt-{steps}.index"
    assert len(checkpoints) <= job.train.keep_checkpoints
    return scalars


def test_mlm_end_to_end_and_export_loads(tmp_path: Path, corpus: Path, mlm_data: JobSpec) -> None:
    from transformers import AutoTokenizer, TFAutoModelForMaskedLM, TFBertForMaskedLM

    job = copy_prepared(mlm_data, tmp_path, job_document(tmp_path, corpus, "mlm"))
    stats = train.train(job, _status(job))
    _assert_trained_and_exported(job, stats, 30)

    model = TFAutoModelForMaskedLM.from_pretrained(job.paths.export)
    tok = AutoTokenizer.from_pretrained(job.paths.export)
    assert isinstance(model, TFBertForMaskedLM)
    manifest = mf.load_manifest(job.paths.data)
    assert model.config.vocab_size == manifest.vocab_size == len(tok)
    # The exported head is the trained one (its bias starts at zero).
    assert np.abs(model.mlm.predictions.bias.numpy()).max() > 0
    enc = tok(["the cat [MASK] fish at home ."], return_tensors="tf")
    assert model(**enc).logits.shape == (1, enc["input_ids"].shape[1], manifest.vocab_size)
    # The exported weights are the trained ones: on held-out masking of the data, the loaded
    # model's loss is far below the loss training started from.
    batch = next(iter(data_lib.make_dataset(job, manifest, batch_size=16, seed=99, training=False)))
    loss_sum, weight_sum, _ = tf_model.loss_terms(model, "bert", "mlm", batch, training=False)
    assert float(loss_sum / weight_sum) < stats["first_loss"] - 0.5

    # A rerun finds the finished checkpoint: no training, same step, still complete.
    again = train.train(job, _status(job))
    assert again["step"] == 30 and again["resumed_from"] == 30
    assert train.is_complete(job)


def test_clm_end_to_end_and_export_loads(tmp_path: Path, corpus: Path, clm_data: JobSpec) -> None:
    from transformers import AutoTokenizer, TFAutoModelForCausalLM, TFGPT2LMHeadModel

    job = copy_prepared(clm_data, tmp_path, job_document(tmp_path, corpus, "clm"))
    stats = train.train(job, _status(job))
    _assert_trained_and_exported(job, stats, 30)

    model = TFAutoModelForCausalLM.from_pretrained(job.paths.export)
    tok = AutoTokenizer.from_pretrained(job.paths.export)
    assert isinstance(model, TFGPT2LMHeadModel)
    ids = tok("the cat eats", add_special_tokens=False, return_tensors="tf")["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    next_token = tok.decode([int(np.argmax(logits[0, -1]))]).strip()
    assert next_token.startswith("f"), next_token  # "fish"


def test_roberta_trains_with_its_position_offset(tmp_path: Path, corpus: Path) -> None:
    from transformers import TFAutoModelForMaskedLM, TFRobertaForMaskedLM

    doc = job_document(tmp_path, corpus, "mlm", family="roberta", steps=10)
    doc["data"]["seq_length"] = 64
    doc["model"]["config"] = {"max_position_embeddings": 66}  # 64 tokens + offset 2
    job = write_job(tmp_path, doc)
    prepare_data(job)
    stats = train.train(job, _status(job))
    assert stats["step"] == 10 and np.isfinite(stats["loss"])
    assert isinstance(
        TFAutoModelForMaskedLM.from_pretrained(job.paths.export),
        TFRobertaForMaskedLM,
    )


def test_data_model_mismatches_are_one_line_data_errors(
    tmp_path: Path, corpus: Path, mlm_data: JobSpec
) -> None:
    doc = job_document(tmp_path, corpus, "mlm")

    longer = json.loads(json.dumps(doc))
    longer["data"]["seq_length"] = 64
    job = copy_prepared(mlm_data, tmp_path / "a", longer)
    with pytest.raises(DataError, match=r"seq_length 32 but the job says data\.seq_length: 64"):
        train.train(job, _status(job))

    job = copy_prepared(mlm_data, tmp_path / "b", doc)
    tokenizer_json = Path(job.paths.tokenizer) / "tokenizer.json"
    tokenizer_json.write_text(
        json.dumps(json.loads(tokenizer_json.read_text()))
    )  # same vocab, new bytes
    with pytest.raises(DataError, match="encoded with a different tokenizer"):
        train.train(job, _status(job))

    job = copy_prepared(mlm_data, tmp_path / "c", doc)
    shard = sorted(Path(job.paths.data).glob("*.tfrecord"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"shard {shard.name} does not match its sha256"):
        train.train(job, _status(job))

    for letter in "abc":
        assert not (tmp_path / letter / "out" / "export").exists()
        assert not (tmp_path / letter / "out" / "checkpoints" / "checkpoint").exists()


def test_checkpoints_of_another_run_are_refused(
    tmp_path: Path, corpus: Path, mlm_data: JobSpec
) -> None:
    doc = job_document(tmp_path, corpus, "mlm", steps=10)
    job = copy_prepared(mlm_data, tmp_path, doc)
    train.train(job, _status(job))
    doc["train"].update(steps=20, global_batch_size=8)
    job = write_job(tmp_path, doc)
    with pytest.raises(
        DataError, match=r"belong to a different run \(global_batch_size: 16 -> 8\)"
    ):
        train.train(job, _status(job))


def test_nan_loss_stops_with_a_clear_error_and_keeps_checkpoints(
    tmp_path: Path, corpus: Path, mlm_data: JobSpec
) -> None:
    from payload.backends.tf import checkpoint as checkpoint_lib
    from payload.backends.tf import schedule

    doc = job_document(tmp_path, corpus, "mlm", steps=10)
    job = copy_prepared(mlm_data, tmp_path, doc)
    train.train(job, _status(job))
    storage.remove_tree(job.paths.export)

    # Poison the step-10 checkpoint's weights, then ask for 10 more steps.
    manifest = mf.load_manifest(job.paths.data)
    config = configs.build_config(
        "bert", "tiny", {}, vocab_size=manifest.vocab_size, special_ids=manifest.special_ids
    )
    model = tf_model.create_model("bert", config, 32)
    optimizer = schedule.create_optimizer(job.train, jit_compile=False)
    optimizer.build(model.trainable_variables)
    ckpt, manager = checkpoint_lib.make_manager(model, optimizer, job.paths.checkpoints, keep=3)
    assert checkpoint_lib.restore_latest(ckpt, manager) == 10
    embeddings = model.bert.embeddings.weight
    embeddings.assign(tf.fill(embeddings.shape, float("nan")))
    manager.save(checkpoint_number=10)

    doc["train"]["steps"] = 20
    job = write_job(tmp_path, doc)
    with pytest.raises(
        train.TrainingDivergedError, match=r"loss became nan between steps 10 and 15"
    ):
        train.train(job, _status(job))
    assert tf.train.latest_checkpoint(job.paths.checkpoints).endswith("ckpt-10")
    assert not train.is_complete(job)


def test_bf16_mixed_precision_when_asked_on_cpu(
    tmp_path: Path, corpus: Path, clm_data: JobSpec
) -> None:
    import tf_keras
    from transformers import TFAutoModelForCausalLM

    job = copy_prepared(
        clm_data, tmp_path, job_document(tmp_path, corpus, "clm", steps=10, precision="bf16")
    )
    try:
        stats = train.train(job, _status(job))
        assert tf_keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(stats["loss"]) and stats["loss"] < stats["first_loss"]
    exported = TFAutoModelForCausalLM.from_pretrained(job.paths.export)
    assert {w.dtype for w in exported.weights} == {tf.float32}  # master weights stay fp32
