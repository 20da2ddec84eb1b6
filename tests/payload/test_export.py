"""The export loads with the plain calls in both ecosystems, for all three families.

1. TensorFlow, in this environment (transformers 4.57): `TFAutoModelFor*.from_pretrained
   (export_dir)` with no other argument loads the trained weights (`tf_model.h5`), not a
   fresh initialisation.
2. PT layout -> TF (no PyTorch needed): `pytorch_model.safetensors` is read with
   safetensors.numpy and loaded into a fresh TF model by transformers 4.57's own PT->TF
   loader (`load_pytorch_state_dict_in_tf2_model`, the name mapping the export inverts);
   every weight must be used and every TF weight found, and its logits must equal those of
   the plain TF load to 1e-4.
3. transformers 5 + PyTorch (the `.venv-pt` environment, requirements/pt-check.txt):
   `AutoModelForMaskedLM` / `AutoModelForCausalLM.from_pretrained(export_dir)` with no
   missing, unexpected or mismatched keys, and the same logits to 1e-4.
4. The exported tokenizer: `[CLS] … [SEP]` (BERT), `<s> … </s>` (RoBERTa), and for GPT-2
   `<s> …` with no `</s>`; a GPT-2 trained on a repetitive corpus continues a prompt with
   the plain `model.generate(**tok(prompt, return_tensors=...))` in both ecosystems.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from export_checks import CYCLE, PROMPT_WORDS, TOLERANCE, expected_tokens
from pt_runner import GENERATE_SCRIPT, PT_SCRIPT, require_pt_python, run_pt
from train_helpers import job_document, prepare_data, write_corpus, write_job

from payload.backends.tf import train
from payload.core import records, storage
from payload.core.status import StatusWriter
from payload.data import tokenizer as tokenizer_lib
from payload.schema import manifest as mf
from payload.training import export as export_lib

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("bert", "roberta", "gpt2")


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
    # Exactly MODEL_FILES, the names `make smoke` accepts (infra/jobspec.py's copy): TF's
    # save_pretrained writes generation_config.json only for a model that generates.
    generates = job.model.family == "gpt2"
    expected = export_lib.MODEL_FILES - (set() if generates else {"generation_config.json"})
    assert names == {*expected, train.EXPORT_MARKER}
    # Nothing TF's from_pretrained would take before tf_model.h5 (export.py's docstring).
    assert not names & set(export_lib.TF_PREFERRED_FILES)
    assert not [n for n in names if n.endswith(".safetensors") and n != export_lib.PT_WEIGHTS]
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == [export_lib.PYTORCH_CLASSES[job.model.family]]
    assert config["transformers_weights"] == export_lib.PT_WEIGHTS

    from safetensors import safe_open

    with safe_open(str(export / export_lib.PT_WEIGHTS), framework="numpy") as f:
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
    # What the trainer ran on, as the backend saw it (one CPU device here).
    assert status["runtime"]["accelerator"] == "cpu" and status["runtime"]["replicas"] == 1
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
    assert "use_safetensors" not in card
    assert f"{_auto_tf(job).__name__}.from_pretrained(path)\n" in card


def test_plain_tensorflow_call_loads_the_trained_weights(trained) -> None:
    """`TFAutoModelFor*.from_pretrained(export)`, no other argument (transformers 4.57): it
    reads tf_model.h5, written from the trained model; the next test finds the same logits
    through the PyTorch file, which a fresh initialisation cannot give."""
    from transformers import AutoConfig

    job, _ = trained
    auto = _auto_tf(job)
    loaded = auto.from_pretrained(job.paths.export)
    ids, mask = _inputs(job)
    logits = _tf_logits(loaded, ids, mask)
    tf.keras.utils.set_random_seed(0)
    fresh = _tf_logits(auto.from_config(AutoConfig.from_pretrained(job.paths.export)), ids, mask)
    assert float(np.abs(logits - fresh).max()) > 0.5


def test_pytorch_layout_loads_into_tf_with_the_same_logits(trained) -> None:
    """PT -> TF with transformers 4.57's own loader: no PyTorch needed."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    from transformers.modeling_tf_pytorch_utils import load_pytorch_state_dict_in_tf2_model

    job, _ = trained
    export = job.paths.export
    auto = _auto_tf(job)
    reference = auto.from_pretrained(export)  # tf_model.h5: trained (test above)
    fresh = auto.from_config(AutoConfig.from_pretrained(export))
    loaded, info = load_pytorch_state_dict_in_tf2_model(
        fresh,
        load_file(str(Path(export, export_lib.PT_WEIGHTS))),
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
    require_pt_python()
    job, _ = trained
    ids, mask = _inputs(job)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    report = run_pt(
        PT_SCRIPT,
        job.paths.export,
        str(tmp_path / "ids.npy"),
        str(tmp_path / "mask.npy"),
        str(tmp_path / "logits.npy"),
    )
    assert report["class"] == export_lib.PYTORCH_CLASSES[job.model.family]
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == []
    assert report["tokens"] == expected_tokens(job, "hello world")
    reference = _auto_tf(job).from_pretrained(job.paths.export)
    expected = _tf_logits(reference, ids, mask)
    worst = float(np.abs(np.load(tmp_path / "logits.npy") - expected).max())
    assert worst <= TOLERANCE, worst


def test_exported_tokenizer_special_tokens(trained) -> None:
    """transformers 4.57 (this environment); the transformers 5 side is checked above."""
    from transformers import AutoTokenizer

    job, _ = trained
    tok = AutoTokenizer.from_pretrained(job.paths.export)
    ids = tok("hello world")["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    expected = expected_tokens(job, "hello world")
    assert tokens[0] == expected["first"]
    if expected["last"] is None:
        assert tok.eos_token_id not in ids and tok.all_special_ids.count(ids[-1]) == 0
    else:
        assert tokens[-1] == expected["last"]
    # The tokenizer stage's own copy is untouched: the data manifest records its hash.
    manifest = mf.load_manifest(job.paths.data)
    assert tokenizer_lib.tokenizer_sha256(job.paths.tokenizer) == manifest.tokenizer_sha256


# ------------------------------------------------------------ generation from a CLM export


def _write_cycle_corpus(path: Path, documents: int = 600, seed: int = 0) -> Path:
    """Documents that walk a fixed cycle of words from a random start: each word's
    successor is learnable in a few hundred steps by a tiny GPT-2."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(documents):
            start, length = rng.randrange(len(CYCLE)), rng.randint(8, 20)
            f.write(" ".join(CYCLE[(start + i) % len(CYCLE)] for i in range(length)) + "\n\n")
    return path


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("export-generate")
    corpus = _write_cycle_corpus(root / "cycle.txt")
    doc = job_document(root, corpus, "clm", family="gpt2", steps=200, log_every=50)
    doc["tokenizer"].update(vocab_size=300)
    doc["train"].update(checkpoint_every=200, warmup_steps=20)
    doc["data"].update(eval_fraction=0.05, eval_min_sequences=8)
    job = write_job(root, doc)
    prepare_data(job)
    train.train(job, StatusWriter(job.paths.status, job.name, min_interval_s=0.0))
    return job


def _prompt_and_continuation(offset: int) -> tuple[str, list[str]]:
    words = [CYCLE[(offset + i) % len(CYCLE)] for i in range(PROMPT_WORDS + 3)]
    return " ".join(words[:PROMPT_WORDS]), words[PROMPT_WORDS:]


def test_tensorflow_generate_continues_the_prompt(generator) -> None:
    from transformers import AutoTokenizer, TFAutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(generator.paths.export)
    model = TFAutoModelForCausalLM.from_pretrained(generator.paths.export)
    for offset in (2, 7):
        prompt, expected = _prompt_and_continuation(offset)
        inputs = tok(prompt, return_tensors="tf")
        ids = inputs["input_ids"][0].numpy().tolist()
        assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
        assert set(inputs) == {"input_ids", "attention_mask"}  # no token_type_ids (tokenizer.py)
        output = model.generate(**inputs, max_new_tokens=8)
        new = tok.decode(output[0][len(ids) :], skip_special_tokens=True).split()
        assert new[: len(expected)] == expected, (prompt, new)


def test_transformers5_generate_continues_the_prompt(generator, tmp_path) -> None:
    """The recipe of every model card, in transformers 5 + PyTorch:
    `model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=...)`."""
    require_pt_python()
    prompts = dict(_prompt_and_continuation(offset) for offset in (2, 7, 10))
    (tmp_path / "prompts.json").write_text(json.dumps(list(prompts)))
    report = run_pt(GENERATE_SCRIPT, generator.paths.export, str(tmp_path / "prompts.json"))
    for result in report["results"]:
        ids = result["input_ids"]
        assert ids[0] == report["bos_token_id"] and report["eos_token_id"] not in ids, result
        assert result["inputs"] == ["attention_mask", "input_ids"], result
        expected = prompts[result["prompt"]]
        assert result["continuation"].split()[: len(expected)] == expected, result
