"""The same documents as text, JSON Lines, Parquet or a Hub dataset give the same shards; the
manifest records the Hub dataset's commit; a long document is tokenized in pieces, kept whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from corpus_formats import COMMIT, REPO, write_all_formats
from encode_helpers import (
    expected_rows,
    file_documents,
    make_job,
    prepared,
    read_rows_python,
    status_for,
)

from payload.core import storage
from payload.data import corpus
from payload.data.encode import stage


def test_every_format_of_the_same_documents_gives_the_same_shards(
    tmp_path, corpus_files, hub
) -> None:
    documents = [d for f in corpus_files for d in file_documents(f)]
    files = write_all_formats(tmp_path / "formats", documents)
    settings = {"data__eval_fraction": 0.05, "data__eval_min_sequences": 0}
    text = prepared(make_job(tmp_path / "text", [str(files["text"])], **settings))
    reference = stage.encode(text, status_for(text))
    assert reference.eval_records > 0 and not reference.hub_revisions
    data = hub.root / "data"
    data.mkdir(parents=True)
    (data / "docs.parquet").write_bytes(files["parquet"].read_bytes())
    inputs = {
        "jsonl.zst": str(files["jsonl.zst"]),
        "parquet": str(files["parquet"]),
        "hub": f"hf://datasets/{REPO}@{COMMIT}/data/docs.parquet",
    }
    for name, path in inputs.items():
        job = make_job(tmp_path / name, [path], **settings)
        storage.upload_tree(text.paths.tokenizer, job.paths.tokenizer)
        manifest = stage.encode(job, status_for(job))
        assert manifest.shards == reference.shards, name
        assert manifest.eval_shards == reference.eval_shards, name
        assert manifest.corpus["used_tokens"] == reference.corpus["used_tokens"], name
        expected = {REPO: COMMIT} if name == "hub" else {}
        assert dict(manifest.hub_revisions) == expected, name


def test_a_long_document_is_tokenized_in_pieces_kept_together(tmp_path, monkeypatch) -> None:
    long_doc = tmp_path / "long.txt"
    lines = [f"sentence {i} keeps going without a blank line" for i in range(400)]
    long_doc.write_text("\n".join(lines) + "\n\nshort tail document\n")
    job = prepared(make_job(tmp_path, [str(long_doc)]))
    monkeypatch.setattr(corpus, "MAX_DOCUMENT_BYTES", 1_000)  # read when the plan is made
    manifest = stage.encode(job, status_for(job))
    assert manifest.corpus["documents"] == 2
    # Tokens of the pieces, one separator after the whole document: here the same ids as
    # the document in one piece, since every cut falls on a line break (whitespace).
    np.testing.assert_array_equal(
        read_rows_python(job.paths.data), expected_rows(job, [str(long_doc)])
    )
    assert len(corpus.document_pieces(long_doc.read_text().split("\n\n")[0], 1_000)) > 10
    assert Path(job.paths.data, "manifest.json").exists()
