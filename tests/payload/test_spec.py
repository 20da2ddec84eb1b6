"""Job spec: defaults, path resolution, and one-line errors that name the key."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from payload import spec
from payload.core.errors import SpecError

BASE: dict[str, Any] = {
    "name": "unit",
    "output": "../runs/unit",
    "corpus": {"paths": ["corpus/*.txt"]},
    "tokenizer": {"kind": "wordpiece", "vocab_size": 2000},
    "data": {"objective": "mlm", "seq_length": 64},
    "model": {"family": "bert", "size": "tiny"},
    "train": {"steps": 20},
}


def _write(tmp_path: Path, document: Any, name: str = "job.yaml") -> str:
    path = tmp_path / "jobs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document) if name.endswith(".yaml") else json.dumps(document))
    return str(path)


def _with(**changes: Any) -> dict[str, Any]:
    """BASE with dotted-key changes; a value of ... deletes the key."""
    doc = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = doc
        for part in parents:
            target = target.setdefault(part, {})
        if value is ...:
            target.pop(last, None)
        else:
            target[last] = value
    return doc


def test_defaults_and_paths(tmp_path: Path) -> None:
    job = spec.load_job(_write(tmp_path, BASE))
    assert job.name == "unit"
    assert job.output == str(tmp_path / "runs" / "unit")
    assert job.corpus.paths == (str(tmp_path / "jobs" / "corpus" / "*.txt"),)
    assert job.corpus.on_bad_input == "skip"
    assert job.tokenizer.special_tokens == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    assert job.tokenizer.min_frequency == 2
    assert job.data.records_per_shard == 10000
    assert job.data.max_predictions == 16  # ceil(64 * 0.15) = 10 -> multiple of 8
    assert job.train.global_batch_size == 32
    assert job.train.decay == "linear"
    assert job.paths.data == str(tmp_path / "runs" / "unit" / "data")
    assert job.paths.status == str(tmp_path / "runs" / "unit" / "status.json")
    assert job.special_roles["mask"] == "[MASK]"
    assert json.loads(job.to_json())["data"]["max_predictions"] == 16


@pytest.mark.parametrize(
    ("family", "kind", "expected"),
    [
        ("bert", "wordpiece", ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")),
        ("bert", "bpe", ("<s>", "<pad>", "</s>", "<unk>", "<mask>")),
        # TF RoBERTa numbers positions from pad id 1: the RoBERTa layout even for WordPiece.
        ("roberta", "wordpiece", ("<s>", "<pad>", "</s>", "<unk>", "<mask>")),
    ],
)
def test_default_special_tokens_follow_tokenizer_and_model(
    tmp_path: Path, family: str, kind: str, expected: tuple[str, ...]
) -> None:
    job = spec.load_job(_write(tmp_path, _with(model__family=family, tokenizer__kind=kind)))
    assert job.tokenizer.special_tokens == expected
    assert job.special_roles["pad"] == expected[0 if expected[0] == "[PAD]" else 1]


def test_json_and_name_from_file(tmp_path: Path) -> None:
    job = spec.load_job(_write(tmp_path, _with(name=...), name="my-job.json"))
    assert job.name == "my-job"


def test_an_exponent_without_a_dot_is_a_number(tmp_path: Path) -> None:
    """1e-08 is what json.dumps writes for 1.0e-8 (infra renders the VMs' job specs as JSON)
    and what people write in YAML; PyYAML alone reads it as a string."""
    doc = _with(train__adam_epsilon=1.0e-8, train__learning_rate=0.00001)
    text = json.dumps(doc)
    assert '"adam_epsilon": 1e-08' in text and '"learning_rate": 1e-05' in text
    (tmp_path / "job.json").write_text(text)
    job = spec.load_job(str(tmp_path / "job.json"))
    assert (job.train.adam_epsilon, job.train.learning_rate) == (1e-8, 1e-5)
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(_with(train=...)) + "train: {steps: 20, learning_rate: 3e-4}\n"
    )
    assert spec.load_job(str(tmp_path / "job.yaml")).train.learning_rate == 3e-4
    assert spec.parse_document("a: 1e5\nb: '1e5'\nc: 1_000\nd: e5") == {
        "a": 1e5,
        "b": "1e5",
        "c": 1000,
        "d": "e5",
    }


def test_grant_ends_is_a_date(tmp_path: Path) -> None:
    assert spec.load_job(_write(tmp_path, _with())).grant_ends is None
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_with()) + "grant_ends: 2027-01-31\n")
    assert spec.load_job(str(tmp_path / "job.yaml")).grant_ends == "2027-01-31"
    with pytest.raises(SpecError, match=r"^grant_ends: '31/01/2027' is not a date \(allowed: YYYY"):
        spec.load_job(_write(tmp_path, _with(grant_ends="31/01/2027")))


def test_gcs_output_and_clm_defaults(tmp_path: Path) -> None:
    doc = _with(
        output="gs://bucket/runs/x/",
        data__objective="clm",
        model__family="gpt2",
        model__config={"n_layer": 2, "resid_pdrop": 0.0},
        tokenizer__kind="bpe",
        tokenizer__vocab_size=1000,
    )
    job = spec.load_job(_write(tmp_path, doc))
    assert job.output == "gs://bucket/runs/x"
    assert job.paths.tokenizer == "gs://bucket/runs/x/tokenizer"
    assert job.tokenizer.special_tokens == ("<s>", "<pad>", "</s>", "<unk>")
    assert dict(job.model.config) == {"n_layer": 2, "resid_pdrop": 0.0}


def test_max_predictions_rounding() -> None:
    assert spec.DataSpec(objective="mlm", seq_length=128).max_predictions == 24
    assert spec.DataSpec(objective="mlm", seq_length=512).max_predictions == 80
    assert spec.DataSpec(objective="mlm", seq_length=8, mask_probability=0.9).max_predictions == 8


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"extra": 1}, r"^extra: unknown key \(allowed: "),
        ({"train__stepz": 5}, r"^train\.stepz: unknown key"),
        ({"train__steps": ...}, r"^train\.steps is required$"),
        ({"train__steps": 0}, r"^train\.steps: 0 is too small \(minimum 1\)$"),
        ({"train__steps": "10"}, r"^train\.steps: expected an integer, got '10'$"),
        ({"train__steps": True}, r"^train\.steps: expected an integer"),
        ({"train__warmup_steps": 50}, r"^train\.warmup_steps: 50 is too large \(maximum 20\)$"),
        ({"train__precision": "fp16"}, r"^train\.precision: 'fp16' is not allowed \(allowed: auto"),
        ({"train__learning_rate": 0}, r"^train\.learning_rate: 0\.0 must be > 0\.0$"),
        ({"train__adam_beta2": 1.0}, r"^train\.adam_beta2: 1\.0 must be < 1\.0$"),
        ({"data__objective": "seq2seq"}, r"^data\.objective: 'seq2seq' is not allowed"),
        ({"data__seq_length": 4}, r"^data\.seq_length: 4 is too small \(minimum 8\)$"),
        ({"data__mask_probability": 1.5}, r"^data\.mask_probability: 1\.5 must be < 1\.0$"),
        ({"model__family": "gpt2"}, r"^model\.family: 'gpt2' cannot train objective 'mlm'"),
        ({"model__size": "huge"}, r"^model\.size: 'huge' is not allowed"),
        ({"model__config": {"n_layer": 2}}, r"^model\.config\.n_layer: unknown bert config key"),
        ({"model__config": {"hidden_size": 0}}, r"^model\.config\.hidden_size: 0 is too small"),
        ({"tokenizer__kind": "sentencepiece"}, r"^tokenizer\.kind: 'sentencepiece' is not allowed"),
        ({"tokenizer__vocab_size": 50}, r"^tokenizer\.vocab_size: 50 is too small .*minimum 105"),
        ({"tokenizer__lowercase": "yes"}, r"^tokenizer\.lowercase: expected true or false"),
        ({"tokenizer__special_tokens": ["[PAD]", "[UNK]"]}, r"^tokenizer\.special_tokens: .*needs"),
        ({"corpus__paths": []}, r"^corpus\.paths: expected a non-empty list"),
        ({"corpus__on_bad_input": "ignore"}, r"^corpus\.on_bad_input: 'ignore' is not allowed"),
        ({"corpus": "text.txt"}, r"^corpus: expected a mapping"),
        ({"output": ...}, r"^output is required$"),
        ({"name": "bad name!"}, r"^name: 'bad name!' must be"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        spec.load_job(_write(tmp_path, _with(**changes)))
    assert "\n" not in str(info.value)


def test_bpe_minimum_includes_byte_alphabet(tmp_path: Path) -> None:
    doc = _with(tokenizer__kind="bpe", tokenizer__vocab_size=200)
    with pytest.raises(SpecError, match=r"minimum 261 = 5 special tokens \+ 256"):
        spec.load_job(_write(tmp_path, doc))


@pytest.mark.parametrize(
    ("text", "message"),
    [("a: [1, 2", r"invalid YAML/JSON"), ("- just\n- a list\n", r"^job spec: expected a mapping")],
)
def test_unreadable_documents(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        spec.load_job(str(path))


def test_missing_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="job spec not found"):
        spec.load_job(str(tmp_path / "nope.yaml"))


@pytest.mark.emulator
def test_spec_from_gcs(gcs_root: str) -> None:
    from payload.core import storage

    uri = f"{gcs_root}/jobs/job.yaml"
    storage.write_text(uri, yaml.safe_dump(_with(output="runs/x")))
    job = spec.load_job(uri)
    assert job.source == uri
    assert job.output == f"{gcs_root}/jobs/runs/x"
    assert job.corpus.paths == (f"{gcs_root}/jobs/corpus/*.txt",)
