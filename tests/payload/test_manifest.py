"""manifest: truncated, altered or missing shards are caught; a manifest is never overwritten."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from payload.core import records, storage
from payload.core.errors import DataError
from payload.schema import manifest as mf


def _write_shards(root: str, count: int = 3, per_shard: int = 5, seq: int = 16) -> mf.Manifest:
    shards = []
    rng = np.random.default_rng(0)
    for i in range(count):
        data = records.frame_records(rng.integers(0, 500, (per_shard, seq)), "uint16")
        name = f"shard-{i:05d}-of-{count:05d}.tfrecord"
        storage.write_bytes(storage.join(root, name), data)
        shards.append(mf.Shard(name, per_shard, len(data), hashlib.sha256(data).hexdigest()))
    return mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        objective="mlm",
        seq_length=seq,
        vocab_size=500,
        token_dtype="uint16",  # noqa: S106
        tokenizer_sha256="0" * 64,
        special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
        shards=tuple(shards),
        total_records=count * per_shard,
        total_tokens=count * per_shard * seq,
        corpus={"documents": 9},
    )


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.emulator)])
def data_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "data")
    return request.getfixturevalue("gcs_root") + "/data"


def test_roundtrip_and_verify(data_dir: str) -> None:
    manifest = _write_shards(data_dir)
    mf.write_manifest(data_dir, manifest)
    loaded = mf.load_manifest(data_dir)
    assert loaded == manifest
    assert loaded.special_ids["mask"] == 4
    mf.verify_shards(data_dir, loaded)
    assert [storage.basename(p) for p in mf.shard_paths(data_dir, loaded)] == [
        s.name for s in manifest.shards
    ]


def test_finished_manifest_is_never_overwritten(data_dir: str) -> None:
    manifest = _write_shards(data_dir)
    mf.write_manifest(data_dir, manifest)
    loaded = mf.load_manifest(data_dir)  # mappingproxy fields, as the trainer sees them
    with pytest.raises(DataError, match="never overwritten"):
        mf.write_manifest(data_dir, loaded)
    other = mf.Manifest(**{**manifest.__dict__, "tokenizer_sha256": "f" * 64})
    with pytest.raises(DataError, match="never overwritten"):
        mf.write_manifest(data_dir, other)
    assert mf.load_manifest(data_dir).tokenizer_sha256 == "0" * 64


def test_missing_manifest(data_dir: str) -> None:
    _write_shards(data_dir)
    with pytest.raises(DataError, match=r"no manifest\.json"):
        mf.load_manifest(data_dir)


def test_truncated_shard_is_named(data_dir: str) -> None:
    manifest = _write_shards(data_dir)
    path = storage.join(data_dir, manifest.shards[1].name)
    data = storage.read_bytes(path)
    storage.write_bytes(path, data[: len(data) - (len(data) // 5)])  # cut between records
    with pytest.raises(DataError, match=r"shard shard-00001-of-00003\.tfrecord has \d+ bytes"):
        mf.verify_shards(data_dir, manifest, checksums=False)


def test_altered_byte_is_named(data_dir: str) -> None:
    manifest = _write_shards(data_dir)
    path = storage.join(data_dir, manifest.shards[2].name)
    data = bytearray(storage.read_bytes(path))
    data[100] ^= 0x01
    storage.write_bytes(path, bytes(data))
    mf.verify_shards(data_dir, manifest, checksums=False)  # same size: only sha256 sees it
    with pytest.raises(DataError, match=r"shard shard-00002-of-00003\.tfrecord .*sha256"):
        mf.verify_shards(data_dir, manifest)


def test_missing_shard_is_named(data_dir: str) -> None:
    manifest = _write_shards(data_dir)
    storage.remove(storage.join(data_dir, manifest.shards[0].name))
    with pytest.raises(DataError, match=r"shard shard-00000-of-00003\.tfrecord .* missing"):
        mf.verify_shards(data_dir, manifest)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "invalid manifest"),
        ('{"format_version": 1}', "invalid manifest"),
    ],
)
def test_invalid_manifest(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / mf.MANIFEST_NAME).write_text(text)
    with pytest.raises(DataError, match=match):
        mf.load_manifest(str(tmp_path))


def test_inconsistent_manifest_is_rejected(tmp_path: Path) -> None:
    manifest = _write_shards(str(tmp_path))
    bad = mf.Manifest(**{**manifest.__dict__, "total_records": 99})
    (tmp_path / mf.MANIFEST_NAME).write_text(bad.to_json())
    with pytest.raises(DataError, match="total_records"):
        mf.load_manifest(str(tmp_path))


def test_a_subset_checks_only_its_own_shards(data_dir: str) -> None:
    """A host of a slice verifies the files it reads: an altered or missing shard of
    another host is not its to find; its own are checked as the whole set would be."""
    manifest = _write_shards(data_dir)
    storage.remove(storage.join(data_dir, manifest.shards[0].name))
    mine = [manifest.shards[1].name, manifest.shards[2].name]
    mf.verify_shards(data_dir, manifest, names=mine)
    path = storage.join(data_dir, manifest.shards[2].name)
    data = bytearray(storage.read_bytes(path))
    data[100] ^= 0x01
    storage.write_bytes(path, bytes(data))
    mf.verify_shards(data_dir, manifest, names=mine, checksums=False)  # sizes only
    with pytest.raises(DataError, match=r"shard shard-00002-of-00003\.tfrecord .*sha256"):
        mf.verify_shards(data_dir, manifest, names=mine)
    with pytest.raises(ValueError, match=r"not shards of manifest\.json"):
        mf.verify_shards(data_dir, manifest, names=["elsewhere.tfrecord"])


def test_a_manifest_of_format_2_still_reads(tmp_path: Path) -> None:
    """Data encoded before format 3 (no held_out, no sources) is read and verified as is."""
    root = str(tmp_path / "data")
    current = _write_shards(root)
    old = {  # the keys format 2 wrote (payload/schema/manifest.py before format 3)
        "format_version": 2,
        "objective": "mlm",
        "seq_length": 16,
        "vocab_size": 500,
        "token_dtype": "uint16",
        "tokenizer_sha256": "0" * 64,
        "special_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
        "shards": [
            {"name": s.name, "records": s.records, "bytes": s.bytes, "sha256": s.sha256}
            for s in current.shards
        ],
        "total_records": 15,
        "total_tokens": 240,
        "corpus": {"documents": 9, "dropped_tokens": 3},
        "packing": "mlm: [CLS] + (seq_length-1) tokens of the stream 'doc [SEP] doc [SEP] ...'",
        "eval_shards": [],
        "eval_records": 0,
        "eval_tokens": 0,
    }
    Path(root, mf.MANIFEST_NAME).write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    manifest = mf.load_manifest(root)
    assert manifest.format_version == 2 and manifest.sources == () and not manifest.held_out
    mf.verify_shards(root, manifest)
    assert json.loads(manifest.to_json()) == old  # written back as format 2 wrote it
    assert mf.shard_paths(root, manifest) == [storage.join(root, s.name) for s in current.shards]


def test_format_3_carries_the_split_and_the_sources(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    manifest = dataclasses.replace(
        _write_shards(root),
        held_out={"rule": "blake2b", "fraction": 0.25},
        sources=({"budget": 100, "tokens": 104, "documents": 3, "exhausted": True},),
    )
    mf.write_manifest(root, manifest)
    loaded = mf.load_manifest(root)
    assert loaded.held_out == {"rule": "blake2b", "fraction": 0.25}
    assert [dict(s) for s in loaded.sources] == [dict(s) for s in manifest.sources]


def test_an_unknown_format_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "data")
    manifest = dataclasses.replace(_write_shards(root), format_version=4)
    Path(root, mf.MANIFEST_NAME).write_text(manifest.to_json())
    with pytest.raises(DataError, match=r"format_version 4; this payload reads versions 2, 3"):
        mf.load_manifest(root)
