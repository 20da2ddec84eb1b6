"""Inputs a user can get wrong or that occur in real dumps: each ends in a clear answer.

Pathological words, corrupt .gz files, bad output paths, bad buckets and credentials,
Ctrl-C, and interrupted checkpoint writes. Real tokenizers, real files, real processes,
and a real fake-gcs-server (or a dead endpoint on 127.0.0.1) for storage.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from payload import encode, spec, tokenizer
from payload import manifest as mf
from payload.status import StatusWriter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def job_for(tmp_path: Path, corpus: list[str], **sections: dict) -> spec.JobSpec:
    doc: dict = {
        "name": "robust",
        "output": str(tmp_path / "out"),
        "corpus": {"paths": corpus},
        "tokenizer": {"kind": "wordpiece", "vocab_size": 1200},
        "data": {"objective": "mlm", "seq_length": 32, "records_per_shard": 100},
        "model": {"family": "bert"},
        "train": {"steps": 2},
    }
    for section, values in sections.items():
        doc[section].update(values)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return spec.load_job(str(path))


# --------------------------------------------------------------------------- long words


def _letters(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", k=n))


@pytest.mark.parametrize(
    ("kind", "family", "expected"),
    # 3 runs of 250 letters are too long for every kind; 40 Hangul syllables are 120 UTF-8
    # bytes, too long only for byte-level BPE, whose limit counts bytes.
    [("wordpiece", "bert", 3), ("bpe", "roberta", 4), ("unigram", "roberta", 3)],
)
def test_long_words_are_cut_in_training_and_encoding(
    tmp_path: Path, kind: str, family: str, expected: int
) -> None:
    text = (EXAMPLES / "corpus" / "mixed.txt").read_text(encoding="utf-8")[:40_000]
    hangul = "".join(chr(0xAC00 + 7 * i) for i in range(40))
    odd = (
        f"{_letters(250, 1)} and {_letters(99, 2)} then {_letters(250, 3)}\n"
        f"{hangul} {_letters(250, 4)}\n"
    )
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(text + "\n\n" + odd + "\n\n" + text[:2000], encoding="utf-8")
    job = job_for(
        tmp_path,
        [str(corpus_file)],
        tokenizer={"kind": kind, "max_word_length": 100},
        model={"family": family},
    )
    status = StatusWriter(job.paths.status, job.name, min_interval_s=0)
    tokenizer.train_tokenizer(job, status)
    stage = json.loads(Path(job.paths.tokenizer, "stage.json").read_text())
    assert stage["corpus"]["long_words"] == expected

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(job.paths.tokenizer, "tokenizer.json")))
    assert tokenizer.max_word_length_of(tok) == 100
    words = tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(odd))
    assert max(len(word) for word, _ in words) <= 100
    assert tokenizer.LongWordCounter(tok).count([odd]) == expected
    if kind == "bpe":  # byte-level: nothing is lost, the cut pieces decode back to the text
        assert tok.decode(tok.encode(odd).ids) == odd

    manifest = encode.encode(job, status)
    assert manifest.corpus["long_words"] == expected
    assert manifest.corpus["max_word_length"] == 100
    assert mf.load_manifest(job.paths.data).corpus["long_words"] == expected
