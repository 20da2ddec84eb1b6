"""The held-out split: whole documents, never in both splits, deterministic, verified."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_encode
from test_encode import make_job, prepared, status_for

from payload import corpus, encode, records, storage, tokenizer
from payload import manifest as mf
from payload.errors import DataError, SpecError

corpus_files = test_encode.corpus_files  # the same module-scoped corpus fixture


def _documents(job, files: list[str]) -> list[list[int]]:
    """Each document's tokens with its separators, computed with the transformers tokenizer."""
    tok = tokenizer.load_tokenizer(job.paths.tokenizer)
    out = []
    for path in files:
        text = Path(path).read_text(encoding="utf-8-sig").replace("\r\n", "\n")
        for document in re.split(r"\n[ \t\r\f\v]*\n", text):
            if document.strip():
                ids = tok(document.strip(), add_special_tokens=False, split_special_tokens=True)[
                    "input_ids"
                ]
                if job.data.objective == "mlm":
                    out.append([*ids, tok.sep_token_id])
                else:
                    out.append([tok.bos_token_id, *ids, tok.eos_token_id])
    return out


def _stream(data_dir: str, manifest: mf.Manifest, split: str, lead: bool) -> list[int]:
    rows = []
    for path in mf.shard_paths(data_dir, manifest, split=split):
        with storage.open_read(path) as handle:
            rows += [
                records.decode_record(r, manifest.token_dtype) for r in records.iter_records(handle)
            ]
    return [int(t) for row in rows for t in (row[1:] if lead else row)]


def _assign(documents: list[list[int]], train: list[int], held: list[int]) -> list[str]:
    """Walk both streams in corpus order; every document must be a whole run of exactly one."""
    t = h = 0
    where = []
    for doc in documents:
        if t == len(train) and h == len(held):
            break  # the dropped tail
        n = len(doc)
        in_train = train[t : t + n] == doc
        in_held = held[h : h + n] == doc
        if in_train:
            where.append("train")
            t += n
        elif in_held:
            where.append("eval")
            h += n
        else:
            # A document cut by the end of a stream (the dropped last window) is a prefix.
            tail_t, tail_h = train[t:], held[h:]
            assert doc[: len(tail_t)] == tail_t or doc[: len(tail_h)] == tail_h, (
                f"document {len(where)} is in neither stream as a whole"
            )
            where.append("tail")
            t, h = (len(train), h) if doc[: len(tail_t)] == tail_t and tail_t else (t, len(held))
    assert t == len(train) and h == len(held), "tokens left over that belong to no document"
    return where


@pytest.mark.parametrize(("objective", "kind"), [("mlm", "wordpiece"), ("clm", "bpe")])
def test_held_out_documents_are_whole_and_never_in_training(
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
    manifest = encode.encode(job, status_for(job))
    lead = objective == "mlm"
    train = _stream(job.paths.data, manifest, "train", lead)
    held = _stream(job.paths.data, manifest, "eval", lead)
    where = _assign(_documents(job, corpus_files), train, held)
    # The last held-out document may sit in the dropped last window of its stream.
    counted = manifest.corpus["eval_documents"]
    assert where.count("eval") <= counted <= where.count("eval") + where.count("tail")
    assert counted > 10
    # Spread through the corpus, not bunched at one end.
    positions = [i for i, w in enumerate(where) if w == "eval"]
    assert positions[0] < len(where) * 0.1 and positions[-1] > len(where) * 0.9
    # About the asked share of the sequences (documents are whole, so not exact).
    share = manifest.eval_records / (manifest.eval_records + manifest.total_records)
    assert 0.035 < share < 0.065, share
    assert manifest.eval_tokens == manifest.eval_records * 32
    names = [s.name for s in manifest.eval_shards]
    assert names[0] == f"eval-00000-of-{len(names):05d}.tfrecord"
    mf.verify_shards(job.paths.data, manifest)


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
    manifest = encode.encode(floor, status_for(floor))
    total = manifest.eval_records + manifest.total_records
    assert 0.001 * total < 20, "the fraction alone would give far fewer than the floor"
    assert 34 <= manifest.eval_records <= 100, manifest.eval_records

    cap = make_job(
        tmp_path / "cap",
        small,
        data__eval_fraction=0.5,
        data__eval_min_sequences=0,
        data__eval_max_sequences=25,
    )
    storage.upload_tree(floor.paths.tokenizer, cap.paths.tokenizer)
    manifest = encode.encode(cap, status_for(cap))
    assert manifest.eval_records == 25  # exactly the cap; the surplus is dropped and counted
    assert manifest.corpus["eval_dropped_tokens"] >= 0


def test_split_is_deterministic_across_workers_and_chunking(
    tmp_path, corpus_files, monkeypatch
) -> None:
    settings = {"data__eval_fraction": 0.05, "data__eval_min_sequences": 10}
    one = prepared(make_job(tmp_path / "one", corpus_files, data__workers=1, **settings))
    first = encode.encode(one, status_for(one))
    two = make_job(tmp_path / "two", corpus_files, data__workers=2, **settings)
    storage.upload_tree(one.paths.tokenizer, two.paths.tokenizer)
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 16_384)
    second = encode.encode(two, status_for(two))
    assert second.eval_shards == first.eval_shards and second.shards == first.shards
    assert first.eval_records > 0


def test_altered_held_out_shard_is_caught(tmp_path, corpus_files) -> None:
    job = prepared(make_job(tmp_path, corpus_files[1:], data__eval_fraction=0.05))
    manifest = encode.encode(job, status_for(job))
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
