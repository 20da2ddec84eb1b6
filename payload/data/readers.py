"""Every corpus format, and the contract a format's reader keeps for one file.

The contract. A reader takes a ``FileRead`` (the file, its ``text_field``, the
``on_bad_input`` rule, the ``CorpusStats`` it counts in) and yields ``(document, position)``:
each document normalised the same way in every format (``normalise``: ``\\r\\n`` read as
``\\n``, outer whitespace removed; an empty document is no document). It counts files, bytes
and skips in ``read.stats`` (never documents: ``payload.data.corpus`` does, as it groups them), and
opens the file with ``read.open()`` so that groups can say how many input bytes they used.
``reader_for`` picks the reader from the file's name (the suffix table: ``STRUCTURED``, the
refused suffixes, and text under any other name).

Text. A document is a run of non-blank lines; one or more blank (empty or whitespace-only)
lines separate documents. Lines inside a document are kept with their newline. ``\\r\\n`` is
read as ``\\n``. Files ending in ``.gz`` are decompressed on the fly. Files are read in blocks
of ``CHUNK_BYTES``, a document is held whole (positions: 1-based line numbers).

Bad input (``corpus.on_bad_input``):

* ``skip`` (default): a binary file (a NUL byte in its first 8 KiB) or a corrupt ``.gz``
  (truncated, failing its CRC, or not gzip at all) is skipped whole and counted in
  ``skipped_files``; a document that is not valid UTF-8 is skipped and counted in
  ``skipped_documents``. Both counts are reported in status.json and manifest.json.
* ``fail``: the first binary file, corrupt ``.gz`` or undecodable document stops the stage
  with a one-line CorpusError naming the file (and the byte offset).

gzip keeps its CRC and length at the end of the file, so a ``.gz`` is decompressed once to
check it before any of its text is used (cheap next to tokenizing it).

Structured formats: JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and Parquet. The
text of a record is its ``text_field`` (``corpus.text_field``, default ``text``): the
top-level JSON field of a line, or the Parquet column.

JSON Lines. One JSON object per line (UTF-8); blank lines are ignored. A line that is not
valid JSON, not an object, has no ``text_field`` or whose value is not a string is bad input:
under ``corpus.on_bad_input: skip`` it is counted in ``skipped_documents``, under ``fail`` it
is a one-line CorpusError naming the file and the line. A compressed file (``.gz``,
``.zst``) is decompressed once to its end before any of its lines is used, so a truncated or
corrupt file is skipped whole (``skipped_files``) or refused, never used in part. zstd is
read frame by frame with ``ZstdDecompressor().decompressobj()``, whose ``eof`` says whether a
frame ended: the library's ``stream_reader`` returns a truncated frame's bytes as a short read
without an error (checked with zstandard 0.25.0).

Parquet. Read one row group at a time (``ParquetFile.read_row_group``), only the text column,
never the whole file. A file without the column, or whose column is not a string column, is
a bad file (skipped whole or refused); a null value is a bad document (``row group R row
I``); a row group that cannot be decoded is bad input for all its rows: counted in
``skipped_documents`` (its row count from the footer) or refused naming the row group.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any, cast

from payload.core import storage
from payload.core.errors import CorpusError
from payload.data import readers_hub

CHUNK_BYTES = 1 << 20  # fixed (not derived from the worker count) so output is deterministic
BINARY_SNIFF_BYTES = 8192
READ_BYTES = 1 << 20
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_BLANK_LINES_BYTES = re.compile(rb"\n[ \t\r\f\v]*\n\s*")

# --------------------------------------------------------------------------- one file


@dataclass
class CorpusStats:
    files: int = 0
    bytes: int = 0
    documents: int = 0
    skipped_files: int = 0
    skipped_documents: int = 0
    long_words: int = 0  # words cut by tokenizer.max_word_length (see payload.data.tokenizer)

    def add(self, other: CorpusStats) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def open_input(path: str) -> IO[bytes]:
    """A binary file object streaming ``path`` (local, gs:// or hf://), never read whole."""
    return readers_hub.open_read(path) if readers_hub.is_hub(path) else storage.open_read(path)


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
    handle = open_input(path)
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=handle, mode="rb")  # type: ignore[return-value]
    return handle


def _read(handle: IO[bytes], size: int, on_bytes: Callable[[int], None] | None) -> bytes:
    """The next block (empty at end of file), reported to ``on_bytes``."""
    block = handle.read(size)
    if on_bytes and block:
        on_bytes(len(block))
    return block


class Counted:
    """A read-only file wrapper that counts (and reports) the bytes read through it."""

    def __init__(self, handle: IO[bytes], on_bytes: Callable[[int], None] | None):
        self.handle = handle
        self.on_bytes = on_bytes
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        block = self.handle.read(size)
        self.total += len(block)
        if self.on_bytes and block:
            self.on_bytes(len(block))
        return block

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()

    def __getattr__(self, name: str) -> object:  # seek, tell, seekable... for Parquet
        return getattr(self.handle, name)


def normalise(text: str) -> str:
    """A document as every format gives it: ``\\r\\n`` read as ``\\n``, outer whitespace removed."""
    return text.replace("\r\n", "\n").strip()


@dataclass
class FileRead:
    """What a reader needs for one file, and the wrapper counting its raw input bytes."""

    path: str
    text_field: str
    on_bad_input: str
    stats: CorpusStats
    on_bytes: Callable[[int], None] | None
    raw: Counted | None = None

    def open(self) -> Counted:
        self.raw = Counted(open_input(self.path), self.on_bytes)
        return self.raw

    @property
    def read(self) -> int:
        return self.raw.total if self.raw else 0


def bad_file(read: FileRead, problem: str) -> None:
    """Count the file as skipped, or CorpusError under ``on_bad_input: fail``."""
    if read.on_bad_input == "fail":
        raise CorpusError(
            f"{read.path} {problem}; fix or remove it, or set corpus.on_bad_input: skip"
        )
    read.stats.skipped_files += 1


def bad_document(read: FileRead, problem: str) -> None:
    """Count a skipped document, or CorpusError naming the file and position under fail."""
    if read.on_bad_input == "fail":
        raise CorpusError(f"{read.path}: {problem}; fix the file or set corpus.on_bad_input: skip")
    read.stats.skipped_documents += 1


# A reader yields (normalised non-empty document, position) for one file and counts files,
# bytes and skips in ``read.stats`` (never documents); it opens the file with ``read.open()``
# so that groups can say how many input bytes they used.
_Reader = Callable[[FileRead], Iterator[tuple[str, str]]]

FORMATS_HELP = (
    "allowed: .jsonl, .jsonl.gz, .jsonl.zst, .parquet, and text under any other name, "
    "optionally .gz"
)


# --------------------------------------------------------------------------- text


def _text_documents(read: FileRead) -> Iterator[tuple[str, str]]:
    """Documents of a text file: runs of non-blank lines, positions as 1-based line numbers."""
    path, stats = read.path, read.stats
    if _bad_gzip(path, read.on_bad_input, stats):
        return
    try:
        with read.open() as raw:
            # GzipFile holds nothing but ``raw``, which the with-block closes.
            gz = path.endswith(".gz")
            handle: Any = gzip.GzipFile(fileobj=cast(IO[bytes], raw)) if gz else raw
            buf = handle.read(BINARY_SNIFF_BYTES)
            if b"\x00" in buf:
                bad_file(read, f"looks binary (NUL byte in its first {BINARY_SNIFF_BYTES} bytes)")
                return
            stats.files += 1
            line = 1  # line number of buf[0]
            first = True
            eof = False
            scanned = 0  # buf[:scanned] holds no document boundary
            while True:
                cut = None if eof else _boundary(buf, scanned)
                if cut is None and not eof:
                    scanned = _rescan_from(buf)
                    block = _read(handle, CHUNK_BYTES, None)  # Counted reports bytes
                    eof = not block
                    buf += block
                    continue
                end, rest = cut if cut is not None else (len(buf), len(buf))
                for text, start in _split_piece(read, buf[:end], line, stats.bytes):
                    document = text
                    if first:  # a byte-order mark opens the file, not its first document
                        first = False
                        document = text.removeprefix("\ufeff").strip()
                        if not document:
                            continue
                    yield document, f"line {start}"
                line += buf.count(b"\n", 0, rest)
                stats.bytes += rest
                buf = buf[rest:]
                scanned = 0
                if eof and not buf:
                    break
    except _GZIP_ERRORS as exc:  # changed since it was checked: never use half of it
        raise CorpusError(f"{path} became unreadable while reading it: {exc}") from None
    except OSError as exc:  # permissions, a path that vanished, a dead disk or network
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None


def _boundary(buf: bytes, scanned: int) -> tuple[int, int] | None:
    """(end of the last complete documents, start of the rest) in ``buf``, or None."""
    last = None
    for last in _BLANK_LINES_BYTES.finditer(buf, scanned):  # noqa: B007  (the last match)
        pass
    return None if last is None else (last.start(), last.end())


def _rescan_from(buf: bytes) -> int:
    """Where a boundary may still begin once more bytes arrive (keeps reading linear)."""
    pos = len(buf)
    while pos > 0 and buf[pos - 1] in b" \t\r\f\v\n":
        pos -= 1
    return max(0, pos - 1)


def _split_piece(read: FileRead, piece: bytes, line: int, offset: int) -> Iterator[tuple[str, int]]:
    """Documents of a piece that ends at a document boundary, with their first line;
    ``line`` and ``offset`` are those of the piece's first byte in the file."""
    try:
        whole = piece.decode("utf-8")
    except UnicodeDecodeError:
        yield from _split_bytes(read, piece, line, offset)
        return
    # Valid UTF-8 (the common case): split the text at once. The str pattern's trailing \s*
    # also takes Unicode spaces, which normalise() would strip anyway: the same documents.
    cursor = 0
    for match in _BLANK_LINES.finditer(whole):
        yield from _document_at(whole, cursor, match.start(), line)
        line += whole.count("\n", cursor, match.end())
        cursor = match.end()
    yield from _document_at(whole, cursor, len(whole), line)


def _document_at(whole: str, start: int, end: int, line: int) -> Iterator[tuple[str, int]]:
    span = whole[start:end]
    text = normalise(span)
    if text:
        lead = len(span) - len(span.lstrip())
        yield text, line + span.count("\n", 0, lead)


def _split_bytes(read: FileRead, piece: bytes, line: int, offset: int) -> Iterator[tuple[str, int]]:
    """``_split_piece`` for a piece with invalid UTF-8: decoded document by document."""
    cursor = 0
    for start, span in _spans(piece):
        line += piece.count(b"\n", cursor, start)
        cursor = start
        try:
            text = normalise(span.decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad_line = line + span.count(b"\n", 0, exc.start)
            where = f"line {bad_line} (byte {offset + start + exc.start})"
            bad_document(read, f"invalid UTF-8 at {where}")
            continue
        if text:
            lead = len(span) - len(span.lstrip())
            yield text, line + span.count(b"\n", 0, lead)


def _spans(piece: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of each run between blank lines."""
    start = 0
    for match in _BLANK_LINES_BYTES.finditer(piece):
        yield start, piece[start : match.start()]
        start = match.end()
    yield start, piece[start:]


# --------------------------------------------------------------------------- decompression


class _TruncatedError(Exception):
    """A compressed stream ended inside a frame or member."""


def _plain_blocks(raw: Any) -> Iterator[bytes]:
    while block := raw.read(READ_BYTES):
        yield block


def _gzip_blocks(raw: Any) -> Iterator[bytes]:
    handle = gzip.GzipFile(fileobj=raw)
    while block := handle.read(READ_BYTES):
        yield block


def _zstd_blocks(raw: Any) -> Iterator[bytes]:
    import zstandard  # noqa: PLC0415  (only .zst files need it)

    decompressor = zstandard.ZstdDecompressor()
    frame = None
    while block := raw.read(READ_BYTES):
        out = []
        while block:
            if frame is None:
                frame = decompressor.decompressobj()
            out.append(frame.decompress(block))
            block = b""
            if frame.eof:  # the frame ended; what follows it is the next frame
                block = frame.unused_data
                frame = None
        yield b"".join(out)
    if frame is not None:
        raise _TruncatedError("the file ends inside a zstd frame (truncated?)")


def _zstd_errors() -> tuple[type[BaseException], ...]:
    import zstandard  # noqa: PLC0415

    return (zstandard.ZstdError, _TruncatedError)


def _codec(path: str) -> tuple[Callable[[Any], Iterator[bytes]], str]:
    name = path.lower()  # the reader was chosen from the lower-cased name too
    if name.endswith(".zst"):
        return _zstd_blocks, "zstd"
    if name.endswith(".gz"):
        return _gzip_blocks, "gzip"
    return _plain_blocks, ""


def _stream_errors(kind: str) -> tuple[type[BaseException], ...]:
    import zlib  # noqa: PLC0415

    if kind == "zstd":
        return _zstd_errors()
    if kind == "gzip":
        return (EOFError, gzip.BadGzipFile, zlib.error)
    return ()


def _compressed_ok(read: FileRead) -> bool:
    """Decompress the whole file once; False (skipped) or CorpusError when it is corrupt."""
    blocks, kind = _codec(read.path)
    if not kind:
        return True
    try:
        with open_input(read.path) as raw:
            for _ in blocks(raw):
                pass
    except _stream_errors(kind) as exc:
        problem = " ".join(str(exc).split()) or type(exc).__name__
        bad_file(read, f"is not a readable {kind} file ({problem})")
        return False
    except OSError as exc:
        raise CorpusError(f"cannot read {read.path}: {exc.strerror or exc}") from None
    return True


# --------------------------------------------------------------------------- JSON Lines


def jsonl_documents(read: FileRead) -> Iterator[tuple[str, str]]:
    """Documents of a JSON Lines file, positioned by 1-based line number."""
    if not _compressed_ok(read):
        return
    blocks, kind = _codec(read.path)
    try:
        with read.open() as raw:
            read.stats.files += 1
            line = 0
            rest = b""
            pending: list[bytes] = []  # blocks of a line longer than a block
            for block in blocks(raw):
                read.stats.bytes += len(block)
                if b"\n" not in block:
                    pending.append(block)
                    continue
                if pending:
                    rest, pending = rest + b"".join(pending), []
                lines = (rest + block).split(b"\n")
                rest = lines.pop()
                for record in lines:
                    line += 1
                    document = _json_document(read, record, line)
                    if document:
                        yield document, f"line {line}"
            rest += b"".join(pending)
            if rest:
                document = _json_document(read, rest, line + 1)
                if document:
                    yield document, f"line {line + 1}"
    except _stream_errors(kind) as exc:  # changed since it was checked: never use half of it
        raise CorpusError(f"{read.path} became unreadable while reading it: {exc}") from None
    except OSError as exc:
        raise CorpusError(f"cannot read {read.path}: {exc.strerror or exc}") from None


def _json_document(read: FileRead, record: bytes, line: int) -> str | None:
    """The normalised text of one line, None for a blank or bad line (counted or raised)."""
    if not record.strip():
        return None
    text, problem = _json_text(record, read.text_field)
    if problem is not None:
        bad_document(read, f"line {line}: {problem}")
        return None
    return normalise(text) or None


def _json_text(record: bytes, field: str) -> tuple[str, str | None]:
    """(the record's text, None) or ("", what is wrong with the record)."""
    try:
        value = json.loads(record)
    except UnicodeDecodeError as exc:
        return "", f"invalid UTF-8 at column {exc.start + 1}"
    except ValueError as exc:  # json.JSONDecodeError
        message = getattr(exc, "msg", str(exc))
        return "", f"invalid JSON ({message} at column {getattr(exc, 'colno', 0)})"
    if not isinstance(value, dict):
        return "", f"expected a JSON object, got {type(value).__name__}"
    if field not in value:
        fields = ", ".join(sorted(map(str, value))[:10]) or "none"
        return "", f"no field {field!r} (fields: {fields}; corpus.text_field names it)"
    text = value[field]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        return "", f"field {field!r} is {kind}, not a string"
    return text, None


# --------------------------------------------------------------------------- Parquet


def parquet_documents(read: FileRead) -> Iterator[tuple[str, str]]:
    """Documents of a Parquet file, one row group at a time, positioned by row group and row."""
    import pyarrow as pa  # noqa: PLC0415  (only Parquet files need it)
    import pyarrow.parquet as pq  # noqa: PLC0415

    field = read.text_field
    try:
        with read.open() as raw:
            try:
                parquet = pq.ParquetFile(raw)
            except (pa.ArrowException, ValueError) as exc:
                bad_file(read, f"is not a readable Parquet file ({_one_line(exc)})")
                return
            schema = parquet.schema_arrow
            index = schema.get_field_index(field)
            if index < 0:
                columns = ", ".join(schema.names[:10]) or "none"
                bad_file(
                    read,
                    f"has no column {field!r} (columns: {columns}; corpus.text_field names it)",
                )
                return
            column_type = schema.field(index).type
            if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
                bad_file(read, f"column {field!r} is {column_type}, not a string column")
                return
            read.stats.files += 1
            metadata = parquet.metadata
            for group in range(parquet.num_row_groups):
                try:
                    table = parquet.read_row_group(group, columns=[field])
                except (pa.ArrowException, ValueError, OSError) as exc:
                    rows = metadata.row_group(group).num_rows
                    where = f"row group {group}"
                    if read.on_bad_input == "fail":
                        raise CorpusError(
                            f"{read.path}: {where} cannot be read ({_one_line(exc)}); fix the "
                            "file or set corpus.on_bad_input: skip"
                        ) from None
                    read.stats.skipped_documents += rows
                    continue
                values = table.column(0).to_pylist()
                del table
                read.stats.bytes += metadata.row_group(group).column(index).total_uncompressed_size
                for row, text in enumerate(values):
                    if text is None:
                        bad_document(read, f"row group {group} row {row}: {field!r} is null")
                        continue
                    document = normalise(text)
                    if document:
                        yield document, f"row group {group} row {row}"
    except OSError as exc:
        raise CorpusError(f"cannot read {read.path}: {exc.strerror or exc}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:200] + "...") if len(text) > 200 else text or type(exc).__name__


# Name suffix -> reader, longest first (".jsonl.gz" before anything shorter could match).
STRUCTURED: dict[str, Callable[[FileRead], Iterator[tuple[str, str]]]] = {
    ".jsonl.zst": jsonl_documents,
    ".jsonl.gz": jsonl_documents,
    ".jsonl": jsonl_documents,
    ".parquet": parquet_documents,
}


def reader_for(path: str) -> _Reader | None:
    """The reader for ``path``'s format, from its name; None for a format we do not read."""
    name = path.rsplit("/", 1)[-1].lower()
    for suffix, reader in STRUCTURED.items():
        if name.endswith(suffix):
            return reader
    if name.endswith(_REFUSED_SUFFIXES):
        return None
    return _text_documents


# Formats that would be misread as paragraphs of text: refused rather than guessed at.
_REFUSED_SUFFIXES = (
    ".json", ".json.gz", ".ndjson", ".zst", ".zstd", ".arrow", ".csv", ".tsv", ".bz2",
    ".xz", ".lz4", ".zip", ".tar", ".7z", ".parquet.gz", ".jsonl.bz2", ".jsonl.xz",
)  # fmt: skip
