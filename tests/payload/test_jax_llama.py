"""The Llama family on the JAX backend (payload/backends/jax/models/llama.py LlamaCausalLM).

- Random weights (every weight, the RMSNorm scales included), saved in the export layout,
  load into transformers 5's LlamaForCausalLM with the plain `from_pretrained` (no missing,
  unexpected or mismatched keys) and give the same logits within 1e-4, with padding, for
  tied embeddings + grouped-query attention and for untied embeddings + one key/value head
  per query head, at a rope_theta other than the default.
- The parameter count of payload/model/configs.py equals the built model's, for tied and untied.
- The spec: presets by size, LlamaConfig overrides, unknown keys and bad shapes refused in
  one line; llama needs data.objective clm.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from export_checks import CYCLE, PROMPT_WORDS, expected_tokens
from pt_runner import GENERATE_SCRIPT, PT_SCRIPT, require_pt_python, run_pt
from train_helpers import (
    assert_user_error,
    job_document,
    run_cli,
    write_corpus,
    write_job,
)

from payload.core.errors import SpecError
from payload.model import configs
from payload.spec import parse_job
from payload.training import export as export_lib
from payload.training import shared as training

DRIVER = Path(__file__).parent / "drivers" / "jax_export_driver.py"
STEPS_DRIVER = Path(__file__).parent / "drivers" / "jax_llama_steps_driver.py"
LOGITS_DRIVER = Path(__file__).parent / "drivers" / "jax_checkpoint_logits.py"
TOLERANCE = 1e-4
VOCAB, SEQ = 300, 16
VARIANTS = {
    "tied-gqa": {"rope_theta": 500000.0},
    "untied-mha": {"tie_word_embeddings": False, "num_key_value_heads": 4, "rms_norm_eps": 1e-6},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_matches_transformers5(variant: str, tmp_path: Path) -> None:
    require_pt_python()
    rng = np.random.default_rng(3)
    ids = rng.integers(5, VOCAB, size=(3, SEQ)).astype("int32")
    mask = np.ones_like(ids)
    ids[1, 10:], mask[1, 10:] = 1, 0  # right padding in one row
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    built = subprocess.run(
        [sys.executable, str(DRIVER), "llama", "tiny", str(VOCAB), str(SEQ), str(model_dir),
         str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy"), str(tmp_path / "jax.npy"),
         json.dumps(VARIANTS[variant])],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["transformers_weights"] == export_lib.PT_WEIGHTS
    report = run_pt(
        PT_SCRIPT, str(model_dir), str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy"),
        str(tmp_path / "pt.npy"),
    )  # fmt: skip
    assert report["class"] == "LlamaForCausalLM"
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == []
    jax_logits, pt_logits = np.load(tmp_path / "jax.npy"), np.load(tmp_path / "pt.npy")
    keep = mask.astype(bool)
    worst = float(np.abs(jax_logits[keep] - pt_logits[keep]).max())
    print(f"llama {variant}: worst |jax - pt| = {worst:.2e}")
    assert worst <= TOLERANCE, worst
    assert float(np.abs(pt_logits[keep]).max()) > 1.0  # not a degenerate comparison


def _job(model: dict, objective: str = "clm", **train: object) -> dict:
    return {
        "name": "llama",
        "output": "/tmp/unused-llama-out",
        "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": 600},
        "data": {"objective": objective, "seq_length": 32},
        "model": model,
        "train": {"steps": 2, "global_batch_size": 8, **train},
    }


def test_presets_counts_and_shapes() -> None:
    expected = {  # at a 49,152-token vocabulary (SmolLM2's), tied embeddings
        "125m": 134_515_008,
        "350m": 361_821_120,
        "1b": 1_073_809_408,
        "3b": 2_969_742_336,
    }
    for size, count in expected.items():
        config = configs.build_config("llama", size, {}, vocab_size=49152, special_ids={})
        assert configs.parameter_count("llama", config) == count, size
    # Llama 3.2 1B's own vocabulary: its published 1.24B.
    config = configs.build_config("llama", "1b", {}, vocab_size=128256, special_ids={})
    assert configs.parameter_count("llama", config) == 1_235_814_400
    untied = configs.build_config(
        "llama", "tiny", {"tie_word_embeddings": False}, vocab_size=300, special_ids={}
    )
    tied = configs.build_config("llama", "tiny", {}, vocab_size=300, special_ids={})
    assert (
        configs.parameter_count("llama", untied) - configs.parameter_count("llama", tied)
        == 300 * tied.hidden_size
    )


def test_spec_takes_llama_config_names() -> None:
    job = parse_job(
        _job(
            {
                "family": "llama",
                "size": "125m",
                "config": {
                    "num_key_value_heads": 9,
                    "rope_theta": 5e5,
                    "tie_word_embeddings": False,
                },
            },
            remat="block",
            grad_accum_steps=2,
        ),
        source="/tmp/job.yaml",
    )
    assert job.model.config["tie_word_embeddings"] is False
    assert job.train.remat == "block" and job.train.grad_accum_steps == 2


@pytest.mark.parametrize(
    ("model", "train", "message"),
    [
        ({"family": "llama", "config": {"n_embd": 64}}, {},
         "model.config.n_embd: unknown llama config key (allowed: "),
        ({"family": "llama", "size": "base"}, {},
         "model.size: 'base' is not allowed (allowed: tiny, 125m, 350m, 1b, 3b)"),
        ({"family": "llama", "config": {"num_key_value_heads": 3}}, {},
         "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
        ({"family": "llama", "config": {"tie_word_embeddings": 1}}, {},
         "model.config.tie_word_embeddings: expected true or false"),
        ({"family": "llama", "config": {"rope_theta": 0}}, {},
         "model.config.rope_theta: 0.0 must be >"),
        ({"family": "llama"}, {"grad_accum_steps": 3},
         "train.grad_accum_steps: 3 does not divide train.global_batch_size: 8"),
        ({"family": "llama"}, {"remat": "selective"},
         "train.remat: 'selective' is not allowed (allowed: none, minimal, save_dot_except_mlp, "
         "save_qkv_proj, save_out_proj, full, block)"),
        ({"family": "llama"}, {"backend": "tf"},
         "model.family: llama trains on the JAX backend only, not with train.backend: tf"),
        ({"family": "gpt2"}, {"remat": "minimal"},
         "train.remat: minimal applies to the decoder layers of model.family llama; "),
        ({"family": "gpt2"}, {"backend": "tf", "grad_accum_steps": 2},
         "train.grad_accum_steps: 2 is a JAX backend setting, not one of train.backend: tf"),
    ],
)  # fmt: skip
def test_spec_refuses_in_one_line(model: dict, train: dict, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_job(_job(model, **train), source="/tmp/job.yaml")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_auto_backend_is_jax_for_llama() -> None:
    llama = parse_job(_job({"family": "llama"}), source="/tmp/job.yaml")
    gpt2 = parse_job(_job({"family": "gpt2"}), source="/tmp/job.yaml")
    unit = {training.BACKEND_ENV: "tf"}  # a VM unit that installed the TF environment
    assert training.resolve_backend(llama, unit) == "jax"
    assert training.resolve_backend(gpt2, unit) == "tf"
    assert training.resolve_backend(gpt2, {}) == "tf"


def test_the_tf_trainer_refuses_accumulation_when_auto_resolves_to_tf(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=60)
    doc = job_document(tmp_path, corpus, "clm", "gpt2", steps=2, warmup_steps=0, grad_accum_steps=2)
    doc["train"].pop("backend", None)
    write_job(tmp_path, doc)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env={training.BACKEND_ENV: "tf"})
    line = assert_user_error(result, "train.grad_accum_steps: 2 is a JAX backend setting")
    assert "train.backend: jax" in line
    assert not Path(tmp_path, "out", "checkpoints").exists()


def test_llama_needs_clm() -> None:
    with pytest.raises(SpecError, match=r"model.family: 'llama' cannot train objective 'mlm'"):
        parse_job(_job({"family": "llama"}, objective="mlm"), source="/tmp/job.yaml")


def test_remat_and_gradient_accumulation_change_nothing_computed() -> None:
    """train.remat minimal, save_qkv_proj and block (= full) give the loss and gradients of none
    (and its program holds a checkpoint, the plain one none); train.grad_accum_steps: 2 gives
    one step of the whole batch (SGD: the weights move by the gradient itself; AdamW as
    trained), on a batch whose rows predict different numbers of tokens."""
    result = subprocess.run(
        [sys.executable, str(STEPS_DRIVER)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    assert report["checkpoint_in_remat"] and not report["checkpoint_in_plain"], report
    assert report["remat_loss_gap"] <= 1e-5 and report["remat_grad_gap"] <= 1e-5, report
    assert report["grad_scale"] > 1e-3, report
    for name in ("sgd", "adamw"):
        assert report[f"{name}_weight_gap"] <= 1e-5, report
        assert report[f"{name}_loss_gap"] <= 1e-5 and report[f"{name}_norm_gap"] <= 1e-5, report
        assert report[f"{name}_moved"] > 1e-3, report  # the step changed the weights
    assert report["mean_of_means_grad_gap"] > 1e-3, report  # what a wrong average would miss
    # Evaluation in micro-batches (train.grad_accum_steps' size) sums what one pass sums.
    assert report["eval_sums"][1] > 0 and report["eval_micro_gap"] <= 1e-3, report
    assert report["eval_micro_scans"], report


# ---------------------------------------------------------------- through the real CLI


def _llama_doc(root: Path, corpus: Path, **train: object) -> dict:
    doc = job_document(root, corpus, "clm", "llama", **train)
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    doc["train"].pop("backend", None)  # auto: jax for llama (training.resolve_backend)
    return doc


def _cycle_corpus(path: Path, documents: int = 600, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(documents):
            start, length = rng.randrange(len(CYCLE)), rng.randint(8, 20)
            f.write(" ".join(CYCLE[(start + i) % len(CYCLE)] for i in range(length)) + "\n\n")
    return path


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama trained by `tpu-payload run` (auto backend) on documents that walk a
    cycle of words, to its export."""
    root = tmp_path_factory.mktemp("llama-run")
    corpus = _cycle_corpus(root / "cycle.txt")
    doc = _llama_doc(root, corpus, steps=200, log_every=50, checkpoint_every=100)
    doc["tokenizer"].update(vocab_size=300)
    doc["train"].update(warmup_steps=20, eval_every=100)
    doc["data"].update(eval_fraction=0.05, eval_min_sequences=8)
    job = write_job(root, doc)
    result = run_cli("run", "--job", str(root / "job.yaml"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return job


def test_llama_export_is_what_transformers5_loads(trained_llama, tmp_path: Path) -> None:
    require_pt_python()
    job = trained_llama
    export = Path(job.paths.export)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    marker = json.loads((export / export_lib.EXPORT_MARKER).read_text())
    assert marker["backend"] == "jax" and marker["step"] == 200, marker
    card = (export / export_lib.MODEL_CARD).read_text()
    parameters = configs.parameter_count("llama", configs.build_config(
        "llama", "tiny", {}, vocab_size=config["vocab_size"], special_ids={}
    ))  # fmt: skip
    assert f"| parameters | {parameters:,} " in card and marker["parameters"] == parameters
    assert "| key/value heads (grouped-query attention) | 2 |" in card
    assert f"| tokens seen | {200 * 16 * 32:,} " in card
    assert "model.generate(**inputs" in card and "AutoModelForCausalLM" in card
    tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is True and tokenizer_config["add_eos_token"] is False
    assert tokenizer_config["model_input_names"] == ["input_ids", "attention_mask"]

    rng = np.random.default_rng(1)
    ids = rng.integers(5, config["vocab_size"], size=(3, 32)).astype("int32")
    mask = np.ones_like(ids)
    ids[1, 20:], mask[1, 20:] = 1, 0
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    driver = subprocess.run(
        [sys.executable, str(LOGITS_DRIVER), str(Path(job.paths.root).parent / "job.yaml"),
         str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy"), str(tmp_path / "jax.npy")],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert int(driver.stdout.strip().splitlines()[-1]) == 200
    report = run_pt(
        PT_SCRIPT, job.paths.export, str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy"),
        str(tmp_path / "pt.npy"),
    )  # fmt: skip
    assert report["class"] == "LlamaForCausalLM"
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == []
    assert report["tokens"] == expected_tokens(job, "hello world")
    keep = mask.astype(bool)
    jax_logits, pt_logits = np.load(tmp_path / "jax.npy"), np.load(tmp_path / "pt.npy")
    worst = float(np.abs(jax_logits[keep] - pt_logits[keep]).max())
    print(f"llama: worst |trained jax - transformers 5| = {worst:.2e}")
    assert worst <= TOLERANCE, worst
    assert float(np.abs(pt_logits[keep]).max()) > 1.0


def test_llama_generate_continues_the_prompt(trained_llama, tmp_path: Path) -> None:
    """The model card's recipe in transformers 5: generate(**tok(prompt, return_tensors="pt"))."""
    require_pt_python()
    prompts = {}
    for offset in (2, 7, 10):
        words = [CYCLE[(offset + i) % len(CYCLE)] for i in range(PROMPT_WORDS + 3)]
        prompts[" ".join(words[:PROMPT_WORDS])] = words[PROMPT_WORDS:]
    (tmp_path / "prompts.json").write_text(json.dumps(list(prompts)))
    report = run_pt(GENERATE_SCRIPT, trained_llama.paths.export, str(tmp_path / "prompts.json"))
    for result in report["results"]:
        ids = result["input_ids"]
        assert ids[0] == report["bos_token_id"] and report["eos_token_id"] not in ids, result
        assert result["inputs"] == ["attention_mask", "input_ids"], result
        expected = prompts[result["prompt"]]
        assert result["continuation"].split()[: len(expected)] == expected, result
