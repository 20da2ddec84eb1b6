"""Structured corpus formats: JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and Parquet.

Each reader yields ``(document, position)`` for one file, as ``payload.corpus`` expects (see
its docstring: documents normalised the same way for every format, grouping done there).
The text of a record is its ``text_field`` (``corpus.text_field``, default ``text``): the
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
from collections.abc import Callable, Iterator
from typing import Any

from payload import corpus
from payload.corpus import FileRead, bad_document, bad_file
from payload.errors import CorpusError

READ_BYTES = 1 << 20


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
        with corpus.open_input(read.path) as raw:
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
    return corpus.normalise(text) or None


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
                    document = corpus.normalise(text)
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
