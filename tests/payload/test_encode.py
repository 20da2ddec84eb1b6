"""Encode stage: the shards hold exactly the packed token stream, deterministically."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from encode_helpers import (
    expected_rows,
    make_job,
    prepared,
    read_rows_python,
    read_rows_tf,
    status_for,
)

from payload.core import storage
from payload.core.errors import CorpusError, DataError
from payload.data import corpus, readers, tokenizer
from payload.data.encode import stage
from payload.schema import manifest as mf


@pytest.mark.parametrize(("objective", "kind"), [("mlm", "wordpiece"), ("clm", "bpe")])
def test_shards_hold_exactly_the_packed_stream(tmp_path, corpus_files, objective, kind) -> None:
    job = prepared(make_job(tmp_path, corpus_files, objective=objective, kind=kind))
    manifest = stage.encode(job, status_for(job))
    expected = expected_rows(job, corpus_files)
    assert manifest.total_records == len(expected)
    np.testing.assert_array_equal(read_rows_python(job.paths.data), expected)
    np.testing.assert_array_equal(read_rows_tf(job.paths.data), expected)

    mf.verify_shards(job.paths.data, manifest)
    assert [s.records for s in manifest.shards[:-1]] == [100] * (len(manifest.shards) - 1)
    assert manifest.total_tokens == manifest.total_records * 32
    assert manifest.corpus["documents"] == sum(
        1
        for f in corpus_files
        for d in re.split(r"\n\s*\n", Path(f).read_text(encoding="utf-8"))
        if d.strip()
    )
    assert manifest.tokenizer_sha256 == tokenizer.tokenizer_sha256(job.paths.tokenizer)
    assert manifest.vocab_size == len(tokenizer.load_tokenizer(job.paths.tokenizer))
    # No per-line padding anywhere, and the literal "[MASK]" in the corpus is not a mask token.
    stream = read_rows_python(job.paths.data)
    assert not np.any(stream == manifest.special_ids["pad"])
    if objective == "mlm":
        assert not np.any(stream == manifest.special_ids["mask"])
        assert np.all(stream[:, 0] == manifest.special_ids["cls"])
    names = sorted(p.name for p in Path(job.paths.data).iterdir())
    assert names == sorted([s.name for s in manifest.shards] + ["manifest.json", "stage.json"])


def test_output_is_independent_of_workers_and_reading(tmp_path, corpus_files, monkeypatch) -> None:
    """Many groups (small ones here), 1 or 2 workers, any read size: the same bytes."""
    monkeypatch.setattr(corpus, "GROUP_BYTES", 16_384)
    one = prepared(make_job(tmp_path / "one", corpus_files, data__workers=1))
    first = stage.encode(one, status_for(one))
    np.testing.assert_array_equal(
        read_rows_python(one.paths.data), expected_rows(one, corpus_files, 16_384)
    )
    two = make_job(tmp_path / "two", corpus_files, data__workers=2)
    storage.upload_tree(one.paths.tokenizer, two.paths.tokenizer)
    monkeypatch.setattr(readers, "CHUNK_BYTES", 4_096)  # the text reader's read size
    second = stage.encode(two, status_for(two))
    assert second.shards == first.shards
    assert mf.as_dict(second) == mf.as_dict(first)
    for shard in first.shards:
        assert (
            Path(one.paths.data, shard.name).read_bytes()
            == Path(two.paths.data, shard.name).read_bytes()
        )


def test_long_document_stays_whole(tmp_path, monkeypatch) -> None:
    long_doc = tmp_path / "long.txt"
    long_doc.write_text(
        "\n".join(f"sentence {i} keeps going without a blank line" for i in range(4000))
        + "\n\nshort tail document\n"
    )
    job = prepared(make_job(tmp_path, [str(long_doc)]))
    monkeypatch.setattr(readers, "CHUNK_BYTES", 8_192)
    monkeypatch.setattr(corpus, "GROUP_BYTES", 10_000)  # the long document is a group alone
    manifest = stage.encode(job, status_for(job))
    np.testing.assert_array_equal(
        read_rows_python(job.paths.data), expected_rows(job, [str(long_doc)], 10_000)
    )
    assert manifest.corpus["documents"] == 2


def test_bad_input_is_skipped_and_counted(tmp_path, corpus_files) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "blob.bin").write_bytes(b"\x00\x01\x02" * 1000)
    (bad / "latin1.txt").write_bytes(
        "good document\n\ncaf\xe9 is latin-1\n\nanother good one\n".encode("latin-1")
    )
    job = prepared(make_job(tmp_path, [*corpus_files, str(bad)]))
    manifest = stage.encode(job, status_for(job))
    assert manifest.corpus["skipped_files"] == 1
    assert manifest.corpus["skipped_documents"] == 1
    status = yaml.safe_load(Path(job.paths.status).read_text())
    assert status["stages"]["encode"]["metrics"]["skipped_documents"] == 1


def test_bad_input_fails_when_asked(tmp_path, corpus_files) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok\n\ncaf\xe9\n".encode("latin-1"))
    job = prepared(make_job(tmp_path, corpus_files))
    failing = make_job(tmp_path, [*corpus_files, str(bad)], corpus__on_bad_input="fail")
    with pytest.raises(CorpusError, match=r"latin1\.txt: invalid UTF-8 at .*byte 7"):
        stage.encode(failing, status_for(failing))
    assert not stage.is_complete(job)
    assert not any(p.suffix == ".tfrecord" for p in Path(job.paths.data).rglob("*"))


def test_corpus_too_small_for_one_sequence(tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("a few words of text here and there and more of them\n\nyes\n" * 3)
    job = prepared(
        make_job(tmp_path, [str(small)], tokenizer__vocab_size=200, tokenizer__min_frequency=1)
    )
    big = make_job(tmp_path, [str(small)], data__seq_length=512, tokenizer__vocab_size=200)
    with pytest.raises(CorpusError, match=r"corpus too small: \d+ tokens do not fill one sequence"):
        stage.encode(big, status_for(big))
    assert not stage.is_complete(job)


def test_complete_is_skipped_and_stale_data_detected(tmp_path, corpus_files) -> None:
    job = prepared(make_job(tmp_path, corpus_files[1:]))
    first = stage.encode(job, status_for(job))
    manifest_bytes = Path(mf.manifest_path(job.paths.data)).read_bytes()
    assert stage.encode(job, status_for(job)) == first
    assert Path(mf.manifest_path(job.paths.data)).read_bytes() == manifest_bytes
    # Retrained: the same job trains the same tokenizer.json, so the data still matches.
    tokenizer_file = Path(job.paths.tokenizer, "tokenizer.json")
    tokenizer_file.unlink()
    tokenizer.train_tokenizer(job, status_for(job))
    assert stage.encode(job, status_for(job)) == first
    # Another tokenizer (any other bytes): the finished data is not silently reused.
    tokenizer_file.write_text(tokenizer_file.read_text() + "\n")
    with pytest.raises(DataError, match="different tokenizer"):
        stage.encode(job, status_for(job))


def test_encode_without_tokenizer(tmp_path, corpus_files) -> None:
    job = make_job(tmp_path, corpus_files)
    with pytest.raises(DataError, match=r"no tokenizer\.json .* run `tpu-payload tokenizer"):
        stage.encode(job, status_for(job))


def test_worker_modules_do_not_import_tensorflow() -> None:
    code = (
        "import sys, payload.data.encode.stage, payload.data.encode.local,"
        " payload.data.corpus, payload.data.tokenizer, payload.core.records;"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported';"
        "assert payload.data.encode.local.mp.get_context('spawn')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
