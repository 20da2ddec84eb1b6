"""Reading the corpus: files, documents, and what happens to bad input.

Inputs. ``corpus.paths`` entries are files, directories (every non-hidden file under them,
recursively), or glob patterns; each may be local or a gs:// URI (gs:// objects are
streamed, never loaded whole). Files ending in ``.gz`` are decompressed on the fly. The
file list is sorted, so the order (and therefore the output) is deterministic.

Documents. A document is a run of non-blank lines; one or more blank (empty or
whitespace-only) lines separate documents. Lines inside a document are kept with their
newline. ``\\r\\n`` is read as ``\\n``. A document longer than ``MAX_DOCUMENT_BYTES`` is
cut at a line break into pieces that the encoder keeps together (no separator between them).

Bad input (``corpus.on_bad_input``):

* ``skip`` (default): a binary file (a NUL byte in its first 8 KiB) or a corrupt ``.gz``
  (truncated, failing its CRC, or not gzip at all) is skipped whole and counted in
  ``skipped_files``; a document that is not valid UTF-8 is skipped and counted in
  ``skipped_documents``. Both counts are reported in status.json and manifest.json.
* ``fail``: the first binary file, corrupt ``.gz`` or undecodable document stops the stage
  with a one-line CorpusError naming the file (and the byte offset).

gzip keeps its CRC and length at the end of the file, so a ``.gz`` is decompressed once to
check it before any of its text is used (cheap next to tokenizing it).

No usable text at all (no files, only empty or skipped files) is always a CorpusError.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from payload import storage
from payload.errors import CorpusError
from payload.spec import CorpusSpec

CHUNK_BYTES = 1 << 20  # fixed (not derived from the worker count) so output is deterministic
MAX_DOCUMENT_BYTES = 8 << 20
BINARY_SNIFF_BYTES = 8192
_GLOB_CHARS = re.compile(r"[*?\[]")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_BLANK_LINES_BYTES = re.compile(rb"\n[ \t\r\f\v]*\n\s*")


@dataclass
class CorpusStats:
    files: int = 0
    bytes: int = 0
    documents: int = 0
    skipped_files: int = 0
    skipped_documents: int = 0
    long_words: int = 0  # words cut by tokenizer.max_word_length (see payload.tokenizer)

    def add(self, other: CorpusStats) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


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


def resolve_files(corpus: CorpusSpec) -> list[str]:
    """Expand ``corpus.paths`` into a sorted, de-duplicated file list (CorpusError if none)."""
    files: list[str] = []
    for i, path in enumerate(corpus.paths):
        key = f"corpus.paths[{i}]"
        if _GLOB_CHARS.search(path):
            matches = storage.glob(path)
            if not matches:
                raise CorpusError(f"{key}: pattern {path} matched no files")
            files.extend(matches)
        elif _is_file(path):
            files.append(path)
        elif storage.is_dir(path):
            found = storage.walk_files(path)
            if not found:
                raise CorpusError(f"{key}: directory {path} contains no files")
            files.extend(found)
        else:
            raise CorpusError(f"{key}: no such file or directory: {path}")
    return list(dict.fromkeys(files))


def _is_file(path: str) -> bool:
    if storage.is_gcs(path):
        return storage.exists(path)  # an object; a "directory" is only a prefix
    return Path(path).is_file()


def total_bytes(files: list[str]) -> int:
    """Sum of (compressed) file sizes, for progress reporting."""
    return sum(storage.size(f) for f in files)


_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def _gzip_problem(path: str) -> str | None:
    """Why ``path`` (a .gz) cannot be decompressed to its end, or None if it can."""
    try:
        with _open(path) as handle:
            while handle.read(CHUNK_BYTES):
                pass
    except _GZIP_ERRORS as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    return None


def _bad_gzip(path: str, on_bad_input: str, stats: CorpusStats) -> bool:
    """True (and counted) when ``path`` is a corrupt .gz to skip; CorpusError under fail."""
    problem = _gzip_problem(path) if path.endswith(".gz") else None
    if problem is None:
        return False
    if on_bad_input == "fail":
        raise CorpusError(
            f"{path} is not a readable gzip file ({problem}); "
            "fix or remove it, or set corpus.on_bad_input: skip"
        )
    stats.skipped_files += 1
    return True


def _open(path: str) -> IO[bytes]:
    handle = storage.open_read(path)
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=handle, mode="rb")  # type: ignore[return-value]
    return handle


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
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    index = 0
    for path in files:
        if _bad_gzip(path, on_bad_input, stats):
            continue
        try:
            with _open(path) as handle:
                head = handle.read(BINARY_SNIFF_BYTES)
                if b"\x00" in head:
                    if on_bad_input == "fail":
                        raise CorpusError(
                            f"{path} looks binary (NUL byte in its first "
                            f"{BINARY_SNIFF_BYTES} bytes); remove it or set "
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


def _read(handle: IO[bytes], size: int, on_bytes: Callable[[int], None] | None) -> bytes:
    """The next block (empty at end of file), reported to ``on_bytes``."""
    block = handle.read(size)
    if on_bytes and block:
        on_bytes(len(block))
    return block


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


def require_text(stats: CorpusStats, corpus: CorpusSpec) -> None:
    """CorpusError when reading found no usable document."""
    if stats.documents == 0:
        skipped = ""
        if stats.skipped_files or stats.skipped_documents:
            skipped = (
                f" ({stats.skipped_files} binary or corrupt .gz files and "
                f"{stats.skipped_documents} non-UTF-8 documents skipped)"
            )
        raise CorpusError(
            f"corpus has no text: corpus.paths {list(corpus.paths)} gave {stats.files} "
            f"readable files with 0 documents{skipped}"
        )
