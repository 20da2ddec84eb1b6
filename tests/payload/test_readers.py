"""Readers: JSON Lines (.jsonl, .gz, .zst) and Parquet, local, gs:// and hf://, and bad input.

The files are written here with the standard library, zstandard and pyarrow. hf:// goes
through huggingface_hub's real HfFileSystem, pointed (HF_ENDPOINT) at a loopback server that
answers the Hub API calls it makes for a dataset laid out in a local directory.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from corpus_formats import COMMIT, REPO, Hub, jsonl_bytes, write_all_formats

from payload.core import storage
from payload.core.errors import CorpusError
from payload.data import corpus
from payload.spec import CorpusSource, CorpusSpec

DOCS = [
    "first document\nwith two lines",
    "짧은 문서",
    "x" * 300,
    "tabs\tand  spaces",
    "emoji 🙂 and accents é",
    *((f"document number {i} " + "word " * (i % 17)).strip() for i in range(40)),
]


def read(
    spec: CorpusSpec | list[str], **kwargs: Any
) -> tuple[list[corpus.Group], corpus.CorpusStats]:
    if not isinstance(spec, CorpusSpec):
        spec = CorpusSpec(paths=tuple(spec))
    stats = corpus.CorpusStats()
    return list(corpus.iter_groups(spec, stats, **kwargs)), stats


def shape(groups: list[corpus.Group]) -> list[tuple[int, int, list[str]]]:
    return [(g.source, g.index, g.documents) for g in groups]


@pytest.mark.parametrize("group_bytes", [1, 200, corpus.GROUP_BYTES])
def test_every_format_gives_the_same_groups(tmp_path: Path, group_bytes: int) -> None:
    paths = write_all_formats(tmp_path, DOCS)
    expected, text_stats = read([str(paths["text"])], group_bytes=group_bytes)
    assert [d for g in expected for d in g.documents] == DOCS
    for name, path in paths.items():
        found, stats = read([str(path)], group_bytes=group_bytes)
        assert shape(found) == shape(expected), name
        assert (stats.files, stats.documents, stats.skipped_documents) == (1, len(DOCS), 0)
        assert found[0].nbytes > 0
    assert text_stats.bytes == paths["text"].stat().st_size


def test_positions(tmp_path: Path) -> None:
    paths = write_all_formats(tmp_path, DOCS)
    found = {name: read([str(p)], group_bytes=200)[0] for name, p in paths.items()}
    firsts = [0]  # index in DOCS of each group's first document
    for g in found["text"][:-1]:
        firsts.append(firsts[-1] + len(g.documents))
    lines = [1]  # the text file: documents separated by one blank line
    for doc in DOCS:
        lines.append(lines[-1] + doc.count("\n") + 2)
    assert len(firsts) > 5
    assert [g.position for g in found["text"]] == [f"line {lines[i]}" for i in firsts]
    for name in ("jsonl", "jsonl.gz", "jsonl.zst"):
        assert [g.position for g in found[name]] == [f"line {i + 1}" for i in firsts]
    assert [g.position for g in found["parquet"]] == [  # row groups of 7 rows
        f"row group {i // 7} row {i % 7}" for i in firsts
    ]


def test_long_lines_and_upper_case_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from payload.data import readers

    monkeypatch.setattr(readers, "READ_BYTES", 5)  # every line spans several blocks
    docs = ["a" * 23, "b", "c" * 11]
    path = tmp_path / "UPPER.JSONL.ZST"
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(docs).rstrip(b"\n")))
    found, stats = read([str(path)])
    assert [d for g in found for d in g.documents] == docs
    assert stats.bytes == len(jsonl_bytes(docs)) - 1
    assert [g.position for g in read([str(path)], group_bytes=1)[0]] == [
        "line 1",
        "line 2",
        "line 3",
    ]


def test_text_field_and_normalisation(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"content": "  padded\r\nline  "}),
                "",
                json.dumps({"content": "   "}),  # whitespace only: no document
                json.dumps({"content": "last"}),
            ]
        ),
        encoding="utf-8",
    )
    spec = CorpusSpec(paths=(str(path),), text_field="content")
    found, stats = read(spec)
    assert [d for g in found for d in g.documents] == ["padded\nline", "last"]
    assert (stats.documents, stats.skipped_documents) == (2, 0)
    table = pa.table({"body": ["a", None, "b"]})
    pq.write_table(table, tmp_path / "b.parquet")
    mix = CorpusSpec(
        sources=(
            CorpusSource(paths=(str(tmp_path / "b.parquet"),), text_field="body"),
            CorpusSource(paths=(str(path),), text_field="content"),
        )
    )
    found, stats = read(mix)
    assert [(g.source, g.documents) for g in found] == [
        (0, ["a", "b"]),
        (1, ["padded\nline", "last"]),
    ]
    assert stats.skipped_documents == 1  # the null


BAD_LINES = [
    (b'{"text": "ok"', r"line 2: invalid JSON \(Expecting ',' delimiter at column 14\)"),
    (b'["text"]', r"line 2: expected a JSON object, got list"),
    (b'{"body": "x"}', r"line 2: no field 'text' \(fields: body; corpus\.text_field names it\)"),
    (b'{"text": 5}', r"line 2: field 'text' is int, not a string"),
    (b'{"text": null}', r"line 2: field 'text' is null, not a string"),
    (b'{"text": "\xff"}', r"line 2: invalid UTF-8 at column 11"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_bad_json_lines(tmp_path: Path, line: bytes, message: str, suffix: str) -> None:
    data = b'{"text": "one"}\n' + line + b'\n{"text": "three"}\n'
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if suffix.endswith(".zst") else data)
    found, stats = read([str(path)])
    assert [d for g in found for d in g.documents] == ["one", "three"]
    assert (stats.documents, stats.skipped_documents, stats.skipped_files) == (2, 1, 0)
    with pytest.raises(CorpusError) as info:
        read(CorpusSpec(paths=(str(path),), on_bad_input="fail"))
    text = str(info.value)
    assert re.fullmatch(
        re.escape(f"{path}: ") + message + r"; fix the file or set corpus\.on_bad_input: skip", text
    ), text


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("cut.jsonl.zst", zstandard.ZstdCompressor().compress(jsonl_bytes(DOCS))[:-9],
         r"is not a readable zstd file \(the file ends inside a zstd frame \(truncated\?\)\)"),
        ("junk.jsonl.zst", b"not zstd at all" * 10,
         r"is not a readable zstd file \(zstd decompressor error"),
        # mtime=0: the same bytes (and test id) in every pytest-xdist worker's collection
        ("cut.jsonl.gz", gzip.compress(jsonl_bytes(DOCS), mtime=0)[:-12],
         r"is not a readable gzip file"),
        ("junk.parquet", b"PAR1 not really", r"is not a readable Parquet file"),
    ],
)  # fmt: skip
def test_unreadable_files(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl_bytes(["fine"]))
    found, stats = read([str(path), str(good)])
    assert [d for g in found for d in g.documents] == ["fine"]  # nothing of the bad file used
    assert (stats.files, stats.skipped_files, stats.documents) == (1, 1, 1)
    with pytest.raises(CorpusError, match=re.escape(str(path)) + " " + message) as info:
        read(CorpusSpec(paths=(str(path),), on_bad_input="fail"))
    assert "\n" not in str(info.value)


def test_parquet_column_problems(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    for name, message in [
        ("nocol.parquet", r"has no column 'text' \(columns: body; corpus\.text_field names it\)"),
        ("ints.parquet", r"column 'text' is int64, not a string column"),
    ]:
        path = tmp_path / name
        found, stats = read([str(path)])
        assert (found, stats.skipped_files) == ([], 1)
        with pytest.raises(CorpusError, match=re.escape(str(path)) + " " + message):
            read(CorpusSpec(paths=(str(path),), on_bad_input="fail"))


def test_parquet_corrupt_row_group(tmp_path: Path) -> None:
    path = tmp_path / "rg.parquet"
    docs = [f"row {i} " + "z" * 50 for i in range(30)]
    pq.write_table(pa.table({"text": docs}), path, row_group_size=10, compression="zstd")
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xee" * column.total_compressed_size
    path.write_bytes(bytes(data))
    found, stats = read([str(path)])
    assert [d for g in found for d in g.documents] == docs[:10] + docs[20:]
    assert [g.position for g in read([str(path)], group_bytes=1)[0]][9:11] == [
        "row group 0 row 9",
        "row group 2 row 0",
    ]
    assert (stats.documents, stats.skipped_documents) == (20, 10)
    with pytest.raises(CorpusError, match=re.escape(f"{path}: row group 1 cannot be read (")):
        read(CorpusSpec(paths=(str(path),), on_bad_input="fail"))


def test_parquet_reads_only_the_text_column_by_row_group(tmp_path: Path) -> None:
    """Bytes read through the file object: the text column's chunks, not the big column."""
    rows = 200
    blobs = [bytes([i % 251]) * 20_000 for i in range(rows)]
    table = pa.table({"blob": blobs, "text": [f"doc {i}" for i in range(rows)]})
    path = tmp_path / "wide.parquet"
    pq.write_table(table, path, row_group_size=50, compression="none", use_dictionary=False)
    progress: list[int] = []
    found, _ = read([str(path)], on_bytes=progress.append, group_bytes=1)
    assert len(found) == rows
    assert sum(progress) < path.stat().st_size / 20  # 4 MB of blob never read


@pytest.mark.emulator
def test_gcs_files(tmp_path: Path, gcs_root: str) -> None:
    paths = write_all_formats(tmp_path, DOCS)
    for path in paths.values():
        storage.upload_file(str(path), f"{gcs_root}/c/{path.name}")
    expected, _ = read([str(paths["text"])], group_bytes=200)
    for name, path in paths.items():
        found, stats = read([f"{gcs_root}/c/{path.name}"], group_bytes=200)
        assert shape(found) == shape(expected), name
        assert found[0].path == f"{gcs_root}/c/{path.name}"
    found, stats = read([f"{gcs_root}/c/*.jsonl*"])
    assert stats.files == 3
    assert [Path(g.path).name for g in found] == ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst"]


# --------------------------------------------------------------------------- hf://


def test_hub_dataset(tmp_path: Path, hub: type[Hub]) -> None:
    local = write_all_formats(tmp_path / "local", DOCS)
    data = hub.root / "data"
    data.mkdir(parents=True)
    for name in ("jsonl.zst", "parquet"):
        (data / local[name].name).write_bytes(local[name].read_bytes())
    (hub.root / "README.md").write_text("---\nlicense: mit\n---\n")
    (data / ".hidden.jsonl").write_text('{"text": "never"}\n')
    expected, _ = read([str(local["text"])], group_bytes=200)
    prefix = f"hf://datasets/{REPO}@{COMMIT}"

    found, stats = read([f"{prefix}/data/*.parquet"], group_bytes=200)
    assert shape(found) == shape(expected)
    assert found[0].path == f"{prefix}/data/docs.parquet"
    assert corpus.readers_hub.revision_of(found[0].path) == COMMIT
    assert stats.files == 1
    assert any(p.endswith("/data/docs.parquet") and r for p, r in hub.requests)  # ranged reads

    files = corpus.resolve_files(CorpusSpec(paths=(f"{prefix}/data",)))
    assert files == [f"{prefix}/data/docs.jsonl.zst", f"{prefix}/data/docs.parquet"]
    found, stats = read([f"{prefix}/data/docs.jsonl.zst"], group_bytes=200)
    assert shape(found) == shape(expected)
    assert corpus.hub_revisions([*files, str(local["text"])]) == {REPO: COMMIT}
    assert corpus.total_bytes(files) == sum(
        local[n].stat().st_size for n in ("jsonl.zst", "parquet")
    )

    other = "0" * 40
    with pytest.raises(CorpusError) as info:
        corpus.resolve_files(CorpusSpec(paths=(f"hf://datasets/{REPO}@{other}/data/*.parquet",)))
    assert str(info.value).startswith(f"corpus.paths[0]: cannot list hf://datasets/{REPO}@{other}")
    assert "\n" not in str(info.value)
    with pytest.raises(CorpusError, match=r"^corpus\.paths\[0\]: pattern .* matched no files"):
        corpus.resolve_files(CorpusSpec(paths=(f"{prefix}/data/*.csv",)))
    with pytest.raises(
        CorpusError, match=r"^corpus\.paths\[0\]: no such file or directory on the Hub"
    ):
        corpus.resolve_files(CorpusSpec(paths=(f"{prefix}/nothing.parquet",)))


def test_tokenizer_stage_reads_every_format(tmp_path: Path) -> None:
    """The tokenizer trained on the bundled corpus as Parquet and as jsonl.zst is the one
    trained on its text files (the same documents give the same tokenizer)."""
    from tokenizer_helpers import EXAMPLES, make_job

    from payload.core.status import StatusWriter
    from payload.data import tokenizer

    groups, _ = read(sorted(str(p) for p in (EXAMPLES / "corpus").glob("*.txt")))
    docs = [d for g in groups for d in g.documents]
    paths = write_all_formats(tmp_path / "formats", docs)
    trained = {}
    for name in ("text", "parquet", "jsonl.zst"):
        (tmp_path / name).mkdir()
        job = make_job(tmp_path / name, kind="bpe", corpus=[str(paths[name])])
        out = tokenizer.train_tokenizer(job, StatusWriter(job.paths.status, job.name))
        trained[name] = (Path(out) / "tokenizer.json").read_bytes()
    assert trained["parquet"] == trained["text"] == trained["jsonl.zst"]
