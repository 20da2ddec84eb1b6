"""The model card writes only recorded figures: what was not measured says so."""

from __future__ import annotations

import dataclasses
import re
from importlib import metadata
from pathlib import Path

import pytest

from payload.schema import manifest as mf
from payload.spec import parse_job
from payload.training import modelcard

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"


def _inputs():
    job = parse_job(
        {
            "name": "card",
            "output": "/tmp/unused-out",
            "corpus": {"paths": ["/tmp/unused.txt"]},
            "tokenizer": {"kind": "bpe", "vocab_size": 1000},
            "data": {"objective": "clm", "seq_length": 64},
            "model": {"family": "gpt2"},
            "train": {"steps": 10, "learning_rate": 3e-4, "warmup_steps": 2, "decay": "cosine"},
        },
        source="/tmp/job.yaml",
    )
    shard = mf.Shard("shard-00000-of-00001.tfrecord", 10, 100, "0" * 64)
    held = mf.Shard("eval-00000-of-00001.tfrecord", 2, 20, "1" * 64)
    manifest = mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        objective="clm",
        seq_length=64,
        vocab_size=1000,
        token_dtype="uint16",  # noqa: S106
        tokenizer_sha256="a" * 64,
        special_ids={"bos": 0, "pad": 1, "eos": 2, "unk": 3},
        shards=(shard,),
        total_records=10,
        total_tokens=640,
        corpus={"files": 3, "bytes": 12345, "documents": 77, "eval_documents": 5},
        eval_shards=(held,),
        eval_records=2,
        eval_tokens=128,
    )
    return job, manifest


def test_card_figures_and_what_was_not_recorded() -> None:
    job, manifest = _inputs()
    card = modelcard.render(
        job=job,
        manifest=manifest,
        model_config={"n_layer": 2, "n_embd": 128, "n_head": 2, "n_positions": 1024},
        pytorch_class="GPT2LMHeadModel",
        tf_class="TFGPT2LMHeadModel",
        parameters=123456,
        runtime={"accelerator": "tpu", "replicas": 8, "policy": "mixed_bfloat16"},
        metrics={"step": 10, "loss": 2.0, "accuracy": 0.5},
    )
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation\n")
    assert "| parameters | 123,456 " in card
    assert "| corpus files | 3 (12,345 bytes) |" in card
    assert "| training sequences / tokens | 10 / 640 |" in card
    assert "| held-out sequences / tokens | 2 / 128 (5 documents" in card
    assert "AdamW, peak 0.0003, 2 warmup steps, cosine decay" in card
    assert "| hardware | tpu, 8 replica(s) |" in card
    assert "| precision | mixed_bfloat16 " in card
    assert "| loss | 2.0000 | not recorded |" in card  # no held-out evaluation was recorded
    assert "| perplexity (exp loss) | 7.39 | not recorded |" in card
    assert "| next-token accuracy | 0.5000 | not recorded |" in card
    assert "| skipped files / documents | not recorded / not recorded |" in card
    assert "AutoModelForCausalLM.from_pretrained(path)" in card
    assert "TFAutoModelForCausalLM.from_pretrained(path)\n" in card
    assert "use_safetensors" not in card
    assert "model.generate(**inputs, max_new_tokens=50)" in card
    assert "adds `<s>` (beginning of text) in front of a prompt and no `</s>`" in card
    # Which versions the plain calls were checked with, and what wrote this export.
    assert "- TensorFlow: transformers 4.57.6, safetensors 0.8.0, tensorflow 2.20.0" in card
    assert "- PyTorch: transformers 5.23.0, safetensors 0.8.0, torch 2.13.0" in card
    assert f"written with transformers {metadata.version('transformers')}, " in card


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REQUIREMENTS / name).read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


@pytest.mark.parametrize(
    ("table", "pin_file"),
    [
        (modelcard.CHECKED_TENSORFLOW, "payload.lock"),
        (modelcard.CHECKED_PYTORCH, "pt-check.txt"),
    ],
)
def test_checked_versions_are_the_pins(table, pin_file: str) -> None:
    """The card's "versions checked" are the environments the export tests run in."""
    pins = _pins(pin_file)
    assert dict(table) == {name: pins[name] for name, _ in table}


def test_mlm_card_has_no_generation_recipe() -> None:
    job, manifest = _inputs()
    job = dataclasses.replace(
        job,
        data=dataclasses.replace(job.data, objective="mlm"),
        model=dataclasses.replace(job.model, family="roberta"),
    )
    card = modelcard.render(
        job=job,
        manifest=manifest,
        model_config={},
        pytorch_class="RobertaForMaskedLM",
        tf_class="TFRobertaForMaskedLM",
        parameters=1,
        runtime={},
        metrics={},
    )
    assert "TFAutoModelForMaskedLM.from_pretrained(path)\n" in card
    assert "generate" not in card and "no `</s>`" not in card
