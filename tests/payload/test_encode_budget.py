"""data.max_tokens: a token budget, per weighted source or shared in corpus order, reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from encode_helpers import file_documents, prepared, status_for

from payload import spec
from payload.core import storage
from payload.data import tokenizer
from payload.data.encode import stage


def _job(tmp_path: Path, corpus: dict, max_tokens: int) -> spec.JobSpec:
    document = {
        "name": "budget",
        "output": str(tmp_path / "out"),
        "corpus": corpus,
        "tokenizer": {"kind": "wordpiece", "vocab_size": 1500},
        "data": {
            "objective": "mlm",
            "seq_length": 32,
            "records_per_shard": 100,
            "eval_fraction": 0,
            "max_tokens": max_tokens,
        },
        "model": {"family": "bert"},
        "train": {"steps": 4},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(document))
    return spec.load_job(str(tmp_path / "job.yaml"))


def _lengths(job: spec.JobSpec, files: list[str]) -> list[int]:
    """Each document's tokens with its separator, with the transformers tokenizer."""
    tok = tokenizer.load_tokenizer(job.paths.tokenizer)
    return [
        len(tok(d, add_special_tokens=False, split_special_tokens=True)["input_ids"]) + 1
        for f in files
        for d in file_documents(f)
    ]


def _used(lengths: list[int], budget: int) -> tuple[int, int]:
    """(documents, tokens) the rule uses: documents from the start while the sum stays within
    the budget."""
    tokens = documents = 0
    for n in lengths:
        if tokens + n > budget:
            break
        tokens += n
        documents += 1
    return documents, tokens


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, corpus_files: list[str]) -> str:
    root = tmp_path_factory.mktemp("budget-tokenizer")
    job = prepared(_job(root, {"paths": corpus_files}, 1000))
    return job.paths.tokenizer


def _with_tokenizer(job: spec.JobSpec, trained: str) -> spec.JobSpec:
    storage.upload_tree(trained, job.paths.tokenizer)
    return job


def test_one_budget_stops_before_the_document_that_would_pass_it(
    tmp_path, corpus_files, trained
) -> None:
    job = _with_tokenizer(_job(tmp_path, {"paths": corpus_files}, 5000), trained)
    manifest = stage.encode(job, status_for(job))
    documents, tokens = _used(_lengths(job, corpus_files), 5000)
    assert 4800 < tokens <= 5000
    assert [dict(s) for s in manifest.sources] == [
        {"budget": 5000, "tokens": tokens, "documents": documents, "exhausted": True}
    ]
    assert manifest.corpus["used_tokens"] == tokens
    assert manifest.total_records * 31 + manifest.corpus["dropped_tokens"] == tokens
    assert manifest.corpus["documents"] > documents  # read on, counted, not used
    metrics = json.loads(Path(job.paths.status).read_text())["stages"]["encode"]["metrics"]
    assert (metrics["source0_tokens"], metrics["source0_budget"]) == (tokens, 5000)
    assert metrics["source0_exhausted"] == "yes"


def test_weighted_sources_each_get_their_share(tmp_path, corpus_files, trained) -> None:
    a, _, c = corpus_files
    mixture = {"sources": [{"paths": [a], "weight": 1}, {"paths": [c], "weight": 3.0}]}
    job = _with_tokenizer(_job(tmp_path, mixture, 8000), trained)
    manifest = stage.encode(job, status_for(job))
    expected = []
    for path, budget in ((a, 2000), (c, 6000)):
        documents, tokens = _used(_lengths(job, [path]), budget)
        expected.append(
            {"budget": budget, "tokens": tokens, "documents": documents, "exhausted": True}
        )
    assert [dict(s) for s in manifest.sources] == expected


def test_unweighted_sources_share_one_budget_in_order(tmp_path, corpus_files, trained) -> None:
    a, _, c = corpus_files
    mixture = {"sources": [{"paths": [c]}, {"paths": [a]}]}
    job = _with_tokenizer(_job(tmp_path, mixture, 1), trained)
    c_tokens = sum(_lengths(job, [c]))
    job = _with_tokenizer(_job(tmp_path / "b", mixture, c_tokens + 100), trained)
    manifest = stage.encode(job, status_for(job))
    documents, tokens = _used(_lengths(job, [a]), 100)
    first, second = (dict(s) for s in manifest.sources)
    assert first["tokens"] == c_tokens and second["tokens"] == tokens
    assert second["documents"] == documents
    assert first["budget"] == second["budget"] == c_tokens + 100
    assert first["exhausted"] and second["exhausted"]  # one budget: spent for both


def test_a_budget_beyond_the_corpus_uses_everything(tmp_path, corpus_files, trained) -> None:
    job = _with_tokenizer(_job(tmp_path, {"paths": corpus_files}, 10**9), trained)
    manifest = stage.encode(job, status_for(job))
    lengths = _lengths(job, corpus_files)
    assert [dict(s) for s in manifest.sources] == [
        {"budget": 10**9, "tokens": sum(lengths), "documents": len(lengths), "exhausted": False}
    ]
