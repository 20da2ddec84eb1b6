"""The held-out split: whole documents chosen by a hash of their text, never in both splits,
the same whatever the order, the worker count or the read size; floor and cap; verified."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from encode_helpers import (
    draw,
    expected_split,
    file_documents,
    make_job,
    prepared,
    read_rows_python,
    status_for,
)

from payload.core import records, storage
from payload.core.errors import DataError, SpecError
from payload.data import corpus, readers
from payload.data.encode import stage
from payload.schema import manifest as mf


def _rows(data_dir: str, manifest: mf.Manifest, split: str) -> np.ndarray:
    rows = []
    for path in mf.shard_paths(data_dir, manifest, split=split):
        with storage.open_read(path) as handle:
            rows += [
                records.decode_record(r, manifest.token_dtype) for r in records.iter_records(handle)
            ]
    return np.stack(rows) if rows else np.empty((0, manifest.seq_length), dtype=np.int64)


@pytest.mark.parametrize(("objective", "kind"), [("mlm", "wordpiece"), ("clm", "bpe")])
def test_held_out_documents_are_those_their_hash_picks(
    tmp_path, corpus_files, objective, kind
) -> None:
    job = prepared(
        make_job(
            tmp_path,
            corpus_files,
            objective=objective,
            kind=kind,
            data__eval_fraction=0.05,
            data__eval_min_sequences=10,
            data__eval_max_sequences=1000,
        )
    )
    manifest = stage.encode(job, status_for(job))
    assert manifest.held_out["fraction"] == 0.05  # the corpus is large enough for the floor
    train, held_out = expected_split(job, corpus_files, 0.05)
    np.testing.assert_array_equal(read_rows_python(job.paths.data), train)
    np.testing.assert_array_equal(_rows(job.paths.data, manifest, "eval"), held_out)
    documents = [d for f in corpus_files for d in file_documents(f)]
    picked = [i for i, d in enumerate(documents) if draw(d) < 0.05]
    assert manifest.corpus["eval_documents"] == len(picked) > 10
    # Spread through the corpus, not bunched at one end.
    assert picked[0] < len(documents) * 0.2 and picked[-1] > len(documents) * 0.8
    # About the asked share of the sequences (documents are whole, so not exact).
    share = manifest.eval_records / (manifest.eval_records + manifest.total_records)
    assert 0.02 < share < 0.09, share
    assert manifest.eval_tokens == manifest.eval_records * 32
    names = [s.name for s in manifest.eval_shards]
    assert names[0] == f"eval-00000-of-{len(names):05d}.tfrecord"
    mf.verify_shards(job.paths.data, manifest)


def test_a_documents_split_does_not_depend_on_where_it_is(tmp_path, corpus_files) -> None:
    """The same documents in another file order: each lands in the same split."""
    settings = {"data__eval_fraction": 0.05, "data__eval_min_sequences": 0}
    one = prepared(make_job(tmp_path / "one", corpus_files, **settings))
    first = stage.encode(one, status_for(one))
    moved = tmp_path / "moved"
    moved.mkdir()
    for i, name in enumerate(reversed(corpus_files)):  # c, b, a: the reading order reversed
        (moved / f"{i}-{Path(name).name}").write_bytes(Path(name).read_bytes())
    two = make_job(tmp_path / "two", [str(moved)], **settings)
    storage.upload_tree(one.paths.tokenizer, two.paths.tokenizer)
    second = stage.encode(two, status_for(two))
    assert second.corpus["eval_documents"] == first.corpus["eval_documents"]
    held_one = {tuple(r) for r in _rows(one.paths.data, first, "eval")}
    held_two = {tuple(r) for r in _rows(two.paths.data, second, "eval")}
    assert held_one == held_two  # one group per file: the same sequences, in another order


def test_floor_and_cap_in_sequences(tmp_path, corpus_files) -> None:
    small = corpus_files[1:]  # ~60 kB of corpus
    floor = prepared(
        make_job(
            tmp_path / "floor",
            small,
            data__eval_fraction=0.001,
            data__eval_min_sequences=40,
            data__eval_max_sequences=100,
        )
    )
    manifest = stage.encode(floor, status_for(floor))
    used = manifest.corpus["used_tokens"]
    assert used * 0.001 < 40 * 31, "the fraction alone would give far fewer than the floor"
    assert manifest.held_out["fraction"] == pytest.approx(40 * 31 / used)
    train, held_out = expected_split(floor, small, manifest.held_out["fraction"])
    np.testing.assert_array_equal(read_rows_python(floor.paths.data), train)
    np.testing.assert_array_equal(_rows(floor.paths.data, manifest, "eval"), held_out)
    # Aimed at, not guaranteed: documents fall by their hash.
    assert 20 <= manifest.eval_records <= 100, manifest.eval_records

    cap = make_job(
        tmp_path / "cap",
        small,
        data__eval_fraction=0.5,
        data__eval_min_sequences=0,
        data__eval_max_sequences=25,
    )
    storage.upload_tree(floor.paths.tokenizer, cap.paths.tokenizer)
    manifest = stage.encode(cap, status_for(cap))
    assert manifest.eval_records == 25  # exactly the cap; the surplus is dropped and counted
    _, held_out = expected_split(cap, small, 0.5)
    np.testing.assert_array_equal(_rows(cap.paths.data, manifest, "eval"), held_out)
    assert manifest.corpus["eval_dropped_tokens"] >= 25 * 31


def test_split_is_deterministic_across_workers_and_reading(
    tmp_path, corpus_files, monkeypatch
) -> None:
    settings = {"data__eval_fraction": 0.05, "data__eval_min_sequences": 10}
    monkeypatch.setattr(corpus, "GROUP_BYTES", 16_384)
    one = prepared(make_job(tmp_path / "one", corpus_files, data__workers=1, **settings))
    first = stage.encode(one, status_for(one))
    two = make_job(tmp_path / "two", corpus_files, data__workers=2, **settings)
    storage.upload_tree(one.paths.tokenizer, two.paths.tokenizer)
    monkeypatch.setattr(readers, "CHUNK_BYTES", 4_096)
    second = stage.encode(two, status_for(two))
    assert second.eval_shards == first.eval_shards and second.shards == first.shards
    assert first.eval_records > 0


def test_altered_held_out_shard_is_caught(tmp_path, corpus_files) -> None:
    job = prepared(make_job(tmp_path, corpus_files[1:], data__eval_fraction=0.05))
    manifest = stage.encode(job, status_for(job))
    shard = Path(job.paths.data, manifest.eval_shards[0].name)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"shard {shard.name} does not match its sha256"):
        mf.verify_shards(job.paths.data, manifest)
    shard.unlink()
    with pytest.raises(DataError, match=rf"shard {shard.name} listed in manifest.json is missing"):
        mf.verify_shards(job.paths.data, manifest)


def test_bad_split_settings_are_one_line_errors(tmp_path, corpus_files) -> None:
    with pytest.raises(SpecError, match=r"data\.eval_fraction: 0\.7 must be <= 0\.5"):
        make_job(tmp_path, corpus_files, data__eval_fraction=0.7)
    with pytest.raises(SpecError, match=r"data\.eval_max_sequences: 5 is below"):
        make_job(tmp_path, corpus_files, data__eval_min_sequences=10, data__eval_max_sequences=5)
