"""Corpus groups: the document interface the encoder builds on (payload/data/corpus.py
iter_groups)."""

from __future__ import annotations

import copy
import gzip
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from drivers.chunk_oracle import iter_document_batches

from payload import spec
from payload.core.errors import CorpusError, SpecError
from payload.data import corpus, readers
from payload.spec import CorpusSource, CorpusSpec


def groups(
    paths: list[Path] | CorpusSpec, **kwargs: Any
) -> tuple[list[corpus.Group], corpus.CorpusStats]:
    stats = corpus.CorpusStats()
    if isinstance(paths, CorpusSpec):
        spec_ = paths
    else:
        spec_ = CorpusSpec(paths=tuple(str(p) for p in paths))
    return list(corpus.iter_groups(spec_, stats, **kwargs)), stats


def docs_of(found: list[corpus.Group]) -> list[str]:
    return [d for g in found for d in g.documents]


def test_text_documents_match_the_chunk_reader(tmp_path: Path) -> None:
    """iter_groups reads text exactly as the encoder's chunk reader does today."""
    (tmp_path / "a.txt").write_bytes(
        "\ufeffone\r\nstill one\r\n\r\ntwo\n \t \nthree\n\n\n\nfour  \n".encode()
    )
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n\n압축된 문서\n\n  second\tdoc \n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt.gz")]
    old_stats = corpus.CorpusStats()
    old = [d for b in iter_document_batches(files, "skip", old_stats) for d in b]
    found, stats = groups([Path(f) for f in files])
    assert (
        docs_of(found)
        == old
        == ["one\nstill one", "two", "three", "four", "압축된 문서", "second\tdoc"]
    )
    assert stats == old_stats
    assert [(Path(g.path).name, g.index, g.position, g.source) for g in found] == [
        ("a.txt", 0, "line 1", 0),
        ("b.txt.gz", 0, "line 3", 0),
    ]
    assert found[0].nbytes == (tmp_path / "a.txt").stat().st_size
    assert found[1].nbytes == (tmp_path / "b.txt.gz").stat().st_size


def _reference(text: str) -> list[str]:
    return [d for p in re.split(r"\n[ \t\r\f\v]*\n\s*", text) if (d := readers.normalise(p))]


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
def test_documents_do_not_depend_on_read_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Blank-line boundaries that straddle read blocks, long documents, odd whitespace."""
    rng = random.Random(block)
    parts = []
    for _ in range(60):
        words = " ".join(
            rng.choice(["a", "bb", "ccc", "한글", "x\ty"]) for _ in range(rng.randint(1, 12))
        )
        lines = "\n".join([words] * rng.randint(1, 4))
        parts.append(lines + rng.choice(["\n\n", "\n \n", "\r\n\r\n", "\n\t\n\n\n", "\n\n  "]))
    text = "".join(parts)
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8", newline="")
    monkeypatch.setattr(readers, "CHUNK_BYTES", block)
    monkeypatch.setattr(readers, "BINARY_SNIFF_BYTES", block)
    found, stats = groups([path], group_bytes=50)
    assert docs_of(found) == _reference(text)
    assert stats.documents == len(_reference(text))
    assert stats.bytes == path.stat().st_size
    # positions: the line each group's first document starts on
    lines = text.split("\n")
    for g in found:
        line = int(g.position.removeprefix("line "))
        assert lines[line - 1].strip().replace("\r", "") == g.documents[0].split("\n")[0]


def test_group_rule_is_a_function_of_the_documents(tmp_path: Path) -> None:
    """A group ends after the document that brings it to group_bytes, and at each file's end."""
    sizes = [3, 4, 10, 1, 1, 1, 20, 2]
    docs = [("é" * (n // 2)) + ("a" * (n % 2)) for n in sizes]  # n UTF-8 bytes each
    (tmp_path / "1.txt").write_text("\n\n".join(docs), encoding="utf-8")
    (tmp_path / "2.txt").write_text("\n\n".join(docs[:3]), encoding="utf-8")
    found, _ = groups([tmp_path / "1.txt", tmp_path / "2.txt"], group_bytes=8)
    sized = [[len(d.encode()) for d in g.documents] for g in found]
    assert sized == [[3, 4, 10], [1, 1, 1, 20], [2], [3, 4, 10]]
    assert [g.index for g in found] == [0, 1, 2, 0]
    assert [g.position for g in found] == ["line 1", "line 7", "line 15", "line 1"]
    assert sum(g.nbytes for g in found[:3]) == (tmp_path / "1.txt").stat().st_size
    with pytest.raises(ValueError, match="group_bytes"):
        groups([tmp_path / "1.txt"], group_bytes=0)


def test_one_megabyte_groups(tmp_path: Path) -> None:
    doc = "w" * 1000
    path = tmp_path / "big.txt"
    path.write_text("\n\n".join([doc] * 2500))
    progress: list[int] = []
    stats = corpus.CorpusStats()
    seen = []  # the counts as each group arrives: current, not only at the end of the file
    found = []
    for group in corpus.iter_groups(
        CorpusSpec(paths=(str(path),)), stats, on_bytes=progress.append
    ):
        seen.append(stats.documents)
        found.append(group)
    assert seen == [1049, 2098, 2500]
    assert corpus.GROUP_BYTES == 1 << 20
    assert [len(g.documents) for g in found] == [1049, 1049, 402]  # ceil(2**20 / 1000)
    assert sum(progress) == path.stat().st_size == sum(g.nbytes for g in found)
    assert stats.documents == 2500


def test_sources_are_numbered_and_counted(tmp_path: Path) -> None:
    for name, text in [("a.txt", "a1\n\na2"), ("b.txt", "b1"), ("c.txt", "c1\n\nc2\n\nc3")]:
        (tmp_path / name).write_text(text)
    mix = CorpusSpec(
        sources=(
            CorpusSource(paths=(str(tmp_path / "c.txt"),), weight=1.0),
            CorpusSource(paths=(str(tmp_path / "[ab].txt"),), weight=3.0),
        )
    )
    per_source = [corpus.CorpusStats(), corpus.CorpusStats()]
    found, stats = groups(mix, source_stats=per_source)
    assert [(g.source, Path(g.path).name, g.documents) for g in found] == [
        (0, "c.txt", ["c1", "c2", "c3"]),
        (1, "a.txt", ["a1", "a2"]),
        (1, "b.txt", ["b1"]),
    ]
    assert (per_source[0].documents, per_source[1].documents, stats.documents) == (3, 3, 6)
    assert (per_source[0].files, per_source[1].files, stats.files) == (1, 2, 3)
    assert corpus.resolve_sources(mix) == [
        [str(tmp_path / "c.txt")],
        [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
    ]
    missing = CorpusSpec(
        sources=(CorpusSource(paths=(str(tmp_path),)),) * 1
        + (CorpusSource(paths=(str(tmp_path / "none.txt"),)),)
    )
    with pytest.raises(CorpusError, match=r"^corpus\.sources\[1\]\.paths\[0\]: no such file"):
        corpus.resolve_sources(missing)


def test_bad_utf8_names_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good\n\nfine\nbad \xff here\n\nlast")
    found, stats = groups([path])
    assert docs_of(found) == ["good", "last"]
    assert stats.skipped_documents == 1
    with pytest.raises(CorpusError) as info:
        groups(CorpusSpec(paths=(str(path),), on_bad_input="fail"))
    assert str(info.value) == (
        f"{path}: invalid UTF-8 at line 4 (byte 15); fix the file or set corpus.on_bad_input: skip"
    )


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("bin.txt", b"text\x00more", r"looks binary \(NUL byte"),
        ("data.json", b'{"text": "x"}', r"is not a corpus format"),
        # mtime=0: the same bytes (and test id) in every pytest-xdist worker's collection
        ("broken.txt.gz", gzip.compress(b"doc\n\nmore", mtime=0)[:-6], "not a readable gzip file"),
    ],
    ids=["binary", "json", "broken-gzip"],
)
def test_bad_files_are_skipped_or_named(
    tmp_path: Path, name: str, data: bytes, message: str
) -> None:
    (tmp_path / name).write_bytes(data)
    (tmp_path / "ok.txt").write_text("fine")
    found, stats = groups([tmp_path / name, tmp_path / "ok.txt"])
    assert docs_of(found) == ["fine"]
    assert (stats.files, stats.skipped_files) == (1, 1)
    fail = CorpusSpec(paths=(str(tmp_path / name),), on_bad_input="fail")
    with pytest.raises(CorpusError, match=message) as info:
        groups(fail)
    assert "\n" not in str(info.value) and str(tmp_path / name) in str(info.value)


# --------------------------------------------------------------------------- the spec

BASE: dict[str, Any] = {
    "name": "unit",
    "output": "../runs/unit",
    "corpus": {"paths": ["corpus/*.txt"]},
    "tokenizer": {"kind": "bpe", "vocab_size": 2000},
    "data": {"objective": "clm", "seq_length": 64},
    "model": {"family": "gpt2", "size": "tiny"},
    "train": {"steps": 20},
}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _load(tmp_path: Path, corpus_section: Any, **data: Any) -> spec.JobSpec:
    document = copy.deepcopy(BASE)
    document["corpus"] = corpus_section
    document["data"].update(data)
    path = tmp_path / "jobs" / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return spec.load_job(str(path))


def test_spec_sources_and_text_field(tmp_path: Path) -> None:
    job = _load(
        tmp_path,
        {
            "text_field": "content",
            "sources": [
                {"paths": ["web/*.parquet"], "weight": 0.7},
                {"paths": "code.jsonl.zst", "weight": 0.3, "text_field": "body"},
                {"paths": [f"hf://datasets/org/set@{COMMIT}/data/*.parquet"], "weight": 1},
            ],
        },
        max_tokens=1000,
    )
    root = tmp_path / "jobs"
    assert job.corpus.paths == ()
    assert job.corpus.members == (
        CorpusSource(paths=(str(root / "web" / "*.parquet"),), text_field="content", weight=0.7),
        CorpusSource(paths=(str(root / "code.jsonl.zst"),), text_field="body", weight=0.3),
        CorpusSource(
            paths=(f"hf://datasets/org/set@{COMMIT}/data/*.parquet",),
            text_field="content",
            weight=1.0,
        ),
    )
    assert job.data.max_tokens == 1000
    one = _load(tmp_path, {"paths": ["a.txt"]})
    assert one.corpus.members == (CorpusSource(paths=(str(root / "a.txt"),), text_field="text"),)
    assert one.data.max_tokens is None
    assert json.loads(one.to_json())["corpus"]["text_field"] == "text"


@pytest.mark.parametrize(
    ("section", "data", "message"),
    [
        (
            {"paths": ["a"], "sources": [{"paths": ["b"]}]},
            {},
            r"^corpus: give either paths .*not both",
        ),
        ({"on_bad_input": "skip"}, {}, r"^corpus: give either paths .*one of them is required"),
        ({"sources": []}, {}, r"^corpus\.sources: expected a non-empty list of sources"),
        (
            {"sources": [{"paths": ["a"], "wieght": 1}]},
            {},
            r"^corpus\.sources\[0\]\.wieght: unknown key \(allowed: paths, text_field, weight\)",
        ),
        (
            {"sources": [{"paths": ["a"], "weight": 0}]},
            {"max_tokens": 9},
            r"^corpus\.sources\[0\]\.weight: 0\.0 must be > 0",
        ),
        (
            {"sources": [{"paths": ["a"], "weight": 1}, {"paths": ["b"]}]},
            {"max_tokens": 9},
            r"^corpus\.sources\[1\]\.weight is required: give every source a weight, or none",
        ),
        (
            {"sources": [{"paths": ["a"], "weight": 1}]},
            {},
            r"^corpus\.sources\[0\]\.weight: weights share out data\.max_tokens",
        ),
        (
            {"sources": [{"weight": 1}]},
            {"max_tokens": 9},
            r"^corpus\.sources\[0\]\.paths is required",
        ),
        (
            {"paths": ["a"], "text_field": ""},
            {},
            r"^corpus\.text_field: expected a non-empty string",
        ),
        (
            {"paths": ["hf://datasets/org/set@main/x.parquet"]},
            {},
            r"^corpus\.paths\[0\]: revision 'main' is not a commit id",
        ),
        (
            {"paths": ["hf://datasets/org/set/x.parquet"]},
            {},
            r"^corpus\.paths\[0\]: 'hf://datasets/org/set/x\.parquet' is not a Hub dataset path",
        ),
        ({"paths": [f"hf://models/org/m@{COMMIT}/x"]}, {}, r"is not a Hub dataset path"),
        ({"paths": [f"hf://datasets/org/set@{COMMIT}"]}, {}, r"is not a Hub dataset path"),
        ({"paths": ["a"]}, {"max_tokens": 0}, r"^data\.max_tokens: 0 is too small"),
    ],
)
def test_spec_refusals(tmp_path: Path, section: Any, data: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        _load(tmp_path, section, **data)
    assert "\n" not in str(info.value)


def test_document_pieces() -> None:
    assert corpus.document_pieces("short", 8) == ["short"]
    assert corpus.document_pieces("aaa\nbbb\ncc\nd", 8) == ["aaa\nbbb", "cc\nd"]
    assert corpus.document_pieces("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    assert corpus.document_pieces("한글한글", 4) == ["한", "글", "한", "글"]  # 3 bytes each
    rng = random.Random(0)
    text = "".join(rng.choice(["a", "é", "한", "🙂", "\n", " "]) for _ in range(3000))
    for limit in (4, 5, 17, 100):
        pieces = corpus.document_pieces(text, limit)
        assert all(len(p.encode()) <= limit for p in pieces)
        assert "".join(pieces).replace("\n", "") == text.replace("\n", "")  # only line breaks go
        assert len("".join(pieces)) >= len(text) - len(pieces) + 1  # at most one per cut
    with pytest.raises(ValueError, match="max_bytes"):
        corpus.document_pieces("x", 3)
