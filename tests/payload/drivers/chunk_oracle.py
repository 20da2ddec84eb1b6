"""The encoder's old chunk reader, kept as a test oracle for payload/data/readers.py's text reader.

No product code reads through it: ``iter_groups`` (payload/data/corpus.py) replaced it. The tests
check that the text reader gives the documents and counts this reader gives, and test its own
chunking (a file cut into chunks of about ``chunk_bytes`` at document boundaries, a document
longer than ``MAX_DOCUMENT_BYTES`` cut at a line break).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from payload.core.errors import CorpusError
from payload.data import readers
from payload.data.corpus import MAX_DOCUMENT_BYTES
from payload.data.readers import (
    _BLANK_LINES,
    _BLANK_LINES_BYTES,
    _GZIP_ERRORS,
    CorpusStats,
    _bad_gzip,
    _open,
    _read,
)


@dataclass(frozen=True)
class Chunk:
    """A piece of one file that ends at a document boundary unless ``ends_document`` is False."""

    index: int
    path: str
    offset: int
    data: bytes
    ends_document: bool
    first_in_file: bool = False
    starts_document: bool = True


@dataclass
class ChunkText:
    documents: list[str] = field(default_factory=list)
    stats: CorpusStats = field(default_factory=CorpusStats)
    # True when the last document continues in the next chunk (no separator after it).
    continues: bool = False


def _cut(buf: bytes, final: bool, max_document_bytes: int) -> tuple[int, int, bool] | None:
    """Where to cut ``buf``: (end of piece, start of rest, piece ends a document) or None."""
    if final:
        return len(buf), len(buf), True
    idx = buf.rfind(b"\n\n")
    if idx >= 0:
        return idx, idx + 2, True
    last = None
    for last in _BLANK_LINES_BYTES.finditer(buf):  # noqa: B007  (we want the last match)
        pass
    if last is not None:
        return last.start(), last.end(), True
    if len(buf) < max_document_bytes:
        return None  # keep reading: the document is not finished yet
    idx = buf.rfind(b"\n")
    if idx >= 0:
        return idx, idx + 1, False
    end = len(buf)
    while end > 0 and buf[end - 1] & 0xC0 == 0x80:  # never cut inside a UTF-8 sequence
        end -= 1
    if end > 0 and buf[end - 1] >= 0xC0:
        end -= 1
    return end, end, False


def iter_chunks(
    files: list[str],
    on_bad_input: str,
    stats: CorpusStats,
    *,
    chunk_bytes: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Generator[Chunk, None, None]:
    """Stream every file as chunks of about ``chunk_bytes`` cut at document boundaries.

    Updates ``stats.files``/``bytes``/``skipped_files``; ``on_bytes`` gets the number of
    raw bytes read as reading progresses (for progress bars).
    """
    chunk_bytes = chunk_bytes or readers.CHUNK_BYTES
    index = 0
    for path in files:
        if _bad_gzip(path, on_bad_input, stats):
            continue
        try:
            with _open(path) as handle:
                head = handle.read(readers.BINARY_SNIFF_BYTES)
                if b"\x00" in head:
                    if on_bad_input == "fail":
                        raise CorpusError(
                            f"{path} looks binary (NUL byte in its first "
                            f"{readers.BINARY_SNIFF_BYTES} bytes); remove it or set "
                            "corpus.on_bad_input: skip"
                        )
                    stats.skipped_files += 1
                    continue
                stats.files += 1
                if on_bytes:
                    on_bytes(len(head))
                buf, offset, first, eof = head, 0, True, False
                starts = True
                while True:
                    while not eof and len(buf) < chunk_bytes:
                        block = _read(handle, chunk_bytes, on_bytes)
                        eof = not block
                        buf += block
                    cut = _cut(buf, eof, MAX_DOCUMENT_BYTES)
                    if cut is None:  # a long document: read on until it ends
                        block = _read(handle, chunk_bytes, on_bytes)
                        eof = not block
                        buf += block
                        continue
                    end, rest, ends_document = cut
                    if buf[:end].strip():
                        yield Chunk(index, path, offset, buf[:end], ends_document, first, starts)
                        index += 1
                        first = False
                        starts = ends_document
                    stats.bytes += rest
                    offset += rest
                    buf = buf[rest:]
                    if eof and not buf:
                        break
        except _GZIP_ERRORS as exc:  # changed since it was checked: never use half of it
            raise CorpusError(f"{path} became unreadable while reading it: {exc}") from None
        except OSError as exc:  # permissions, a path that vanished, a dead disk or network
            raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None


def split_documents(chunk: Chunk, on_bad_input: str) -> ChunkText:
    """Decode one chunk into documents; runs in encoder workers (no TensorFlow here)."""
    out = ChunkText(continues=not chunk.ends_document)
    try:
        texts = [chunk.data.decode("utf-8")]
    except UnicodeDecodeError:
        texts = []
        pos = 0
        for piece in [*_BLANK_LINES_BYTES.split(chunk.data)]:
            start = chunk.data.find(piece, pos) if piece else pos
            pos = start + len(piece)
            try:
                texts.append(piece.decode("utf-8"))
            except UnicodeDecodeError as exc:
                if on_bad_input == "fail":
                    raise CorpusError(
                        f"{chunk.path}: invalid UTF-8 at byte {chunk.offset + start + exc.start}; "
                        "fix the file or set corpus.on_bad_input: skip"
                    ) from None
                out.stats.skipped_documents += 1
    if chunk.first_in_file and texts:
        texts[0] = texts[0].removeprefix("\ufeff")
    for text in texts:
        pieces = _BLANK_LINES.split(text.replace("\r\n", "\n"))
        out.documents.extend(stripped for piece in pieces if (stripped := piece.strip()))
    if not out.documents:
        out.continues = False
    out.stats.documents = len(out.documents) - (1 if out.continues else 0)
    return out


def iter_document_batches(
    files: list[str],
    on_bad_input: str,
    stats: CorpusStats,
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[list[str]]:
    """Documents in batches (one per chunk), streaming: for tokenizer training."""
    for chunk in iter_chunks(files, on_bad_input, stats, on_bytes=on_bytes):
        text = split_documents(chunk, on_bad_input)
        stats.documents += text.stats.documents
        stats.skipped_documents += text.stats.skipped_documents
        if text.documents:
            yield text.documents
