"""Corpus reading: file discovery, document boundaries, chunking and bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from drivers import chunk_oracle

from payload.core.errors import CorpusError
from payload.data import corpus
from payload.spec import CorpusSpec


def documents(
    files: list[str], on_bad_input: str = "skip", **kwargs
) -> tuple[list[str], corpus.CorpusStats]:
    stats = corpus.CorpusStats()
    docs = [
        d
        for batch in chunk_oracle.iter_document_batches(files, on_bad_input, stats, **kwargs)
        for d in batch
    ]
    return docs, stats


def test_document_boundaries(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes("\ufeffone\r\nstill one\r\n\r\ntwo\n \t \nthree\n\n\n\nfour  \n".encode())
    docs, stats = documents([str(path)])
    assert docs == ["one\nstill one", "two", "three", "four"]
    assert (stats.files, stats.documents, stats.bytes) == (1, 4, path.stat().st_size)


def test_discovery_dirs_globs_gzip(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("b doc")
    (tmp_path / "d" / "sub" / "a.txt").write_text("a doc")
    (tmp_path / "d" / ".hidden").write_text("never read")
    with gzip.open(tmp_path / "c.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("압축된 문서\n\nsecond")
    spec = CorpusSpec(
        paths=(str(tmp_path / "d"), str(tmp_path / "*.gz"), str(tmp_path / "d" / "b.txt"))
    )
    files = corpus.resolve_files(spec)
    assert [Path(f).name for f in files] == ["b.txt", "a.txt", "c.txt.gz"]  # de-duplicated
    docs, _ = documents(files)
    assert docs == ["b doc", "a doc", "압축된 문서", "second"]


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (("missing.txt",), r"corpus\.paths\[0\]: no such file or directory"),
        (("*.none",), r"corpus\.paths\[0\]: pattern .* matched no files"),
        (("emptydir",), r"corpus\.paths\[0\]: directory .* contains no files"),
    ],
)
def test_discovery_errors(tmp_path: Path, paths: tuple[str, ...], message: str) -> None:
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match=message):
        corpus.resolve_files(CorpusSpec(paths=tuple(str(tmp_path / p) for p in paths)))


def test_chunks_cut_at_document_boundaries(tmp_path: Path) -> None:
    path = tmp_path / "many.txt"
    text = "".join(f"document number {i} 문서\nwith a second line\n\n" for i in range(2000))
    path.write_text(text, encoding="utf-8")
    stats = corpus.CorpusStats()
    seen = []
    chunks = list(
        chunk_oracle.iter_chunks([str(path)], "skip", stats, chunk_bytes=9000, on_bytes=seen.append)
    )
    assert len(chunks) > 5
    assert all(c.ends_document and c.starts_document for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert sum(seen) == path.stat().st_size
    docs = [d for c in chunks for d in chunk_oracle.split_documents(c, "skip").documents]
    assert len(docs) == 2000
    assert docs[1234] == "document number 1234 문서\nwith a second line"


def test_bad_utf8_document_is_skipped_or_named(tmp_path: Path) -> None:
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"fine\n\nbroken \xc3\x28 here\n\nalso fine\n")
    docs, stats = documents([str(path)])
    assert docs == ["fine", "also fine"]
    assert stats.skipped_documents == 1
    with pytest.raises(CorpusError, match=r"mixed\.txt: invalid UTF-8 at byte 13"):
        documents([str(path)], "fail")


def test_binary_file_is_skipped_or_named(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("text")
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    files = corpus.resolve_files(CorpusSpec(paths=(str(tmp_path),)))
    docs, stats = documents(files)
    assert docs == ["text"]
    assert (stats.files, stats.skipped_files) == (1, 1)
    with pytest.raises(CorpusError, match=r"img\.png looks binary"):
        documents(files, "fail")


def test_require_text() -> None:
    with pytest.raises(
        CorpusError, match=r"corpus has no text: .* \(2 binary or corrupt \.gz files and 1 non"
    ):
        corpus.require_text(
            corpus.CorpusStats(files=0, skipped_files=2, skipped_documents=1),
            CorpusSpec(paths=("x",)),
        )
