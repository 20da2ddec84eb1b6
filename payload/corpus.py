"""Reading the corpus: files, documents, groups, and what happens to bad input.

Groups. ``iter_groups`` is what the encoder reads: every document of every source, file by
file, in runs of consecutive documents of one file (``Group``). A group ends after the
document with which the UTF-8 length of its documents reaches ``GROUP_BYTES`` (1 MiB), and
at the end of each file, so groups depend on the documents alone: the same documents in a
text, jsonl or Parquet file give the same groups. A document is held whole in memory (the
``MAX_DOCUMENT_BYTES`` cut of the older chunk reader below is the encoder's business: a
pure function of the document, the same for every format). Every format gives documents
normalised the same way (``normalise``: ``\\r\\n`` read as ``\\n``, outer whitespace removed;
an empty document is no document).

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
from typing import IO, Any, cast

from payload import readers_hub, storage
from payload.errors import CorpusError
from payload.spec import HF_DATASET_RE, CorpusSpec

GROUP_BYTES = 1 << 20  # a group ends after the document that brings its text to 1 MiB
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


@dataclass(frozen=True)
class Group:
    """A run of consecutive documents of one file: the unit the encoder packs and resumes by.

    Where groups end depends on the documents alone (see ``iter_groups``), so the same
    documents give the same groups from any format, runner or worker count.
    """

    source: int  # index into corpus.members (0 without a mixture)
    path: str  # the file: local, gs://, or hf://datasets/<owner>/<name>@<commit>/<file>
    index: int  # the group's number within its file (0, 1, ...)
    documents: list[str]  # in file order, never empty
    position: str  # where the group's first document starts ("line 120", "row group 3 row 0")
    nbytes: int  # input bytes read from the file for this group (for progress)


def resolve_sources(corpus: CorpusSpec) -> list[list[str]]:
    """Each source's files (see ``resolve_files``), in the order of ``corpus.members``."""
    keyed = bool(corpus.sources)
    return [
        _resolve_paths(source.paths, f"corpus.sources[{i}].paths" if keyed else "corpus.paths")
        for i, source in enumerate(corpus.members)
    ]


def resolve_files(corpus: CorpusSpec) -> list[str]:
    """Every file of every source, de-duplicated, in reading order (CorpusError if none)."""
    return list(dict.fromkeys(f for files in resolve_sources(corpus) for f in files))


def _resolve_paths(paths: tuple[str, ...], where: str) -> list[str]:
    """Expand paths into a de-duplicated file list (CorpusError if one matches nothing)."""
    files: list[str] = []
    for i, path in enumerate(paths):
        key = f"{where}[{i}]"
        if readers_hub.is_hub(path):
            files.extend(readers_hub.resolve(path, key))
        elif _GLOB_CHARS.search(path):
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
    return sum(readers_hub.size(f) if readers_hub.is_hub(f) else storage.size(f) for f in files)


def hub_revisions(files: list[str]) -> dict[str, str]:
    """``{"<owner>/<name>": commit}`` of the Hub datasets among ``files`` (for the manifest)."""
    out: dict[str, str] = {}
    for path in files:
        match = HF_DATASET_RE.match(path)
        if match:
            out[match.group("repo")] = match.group("revision")
    return dict(sorted(out.items()))


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


# --------------------------------------------------------------------------- groups


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


def document_pieces(document: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> list[str]:
    """``document`` cut into pieces of at most ``max_bytes`` UTF-8 bytes, each ending at the
    last line break that fits (else at a character), for tokenizing a long document in parts
    that the encoder keeps together; a pure function of the text, the same for every format.
    Joining the pieces with ``"\\n"`` where a cut fell on a line break gives the document back."""
    if max_bytes < 4:
        raise ValueError(f"max_bytes must be at least 4 (one UTF-8 character), got {max_bytes}")
    data = document.encode("utf-8")
    if len(data) <= max_bytes:
        return [document]
    pieces = []
    start = 0
    while len(data) - start > max_bytes:
        window_end = start + max_bytes
        cut = data.rfind(b"\n", start, window_end + 1)
        if cut > start:
            pieces.append(data[start:cut].decode("utf-8"))
            start = cut + 1
            continue
        end = window_end
        while data[end] & 0xC0 == 0x80:  # never cut inside a UTF-8 sequence
            end -= 1
        pieces.append(data[start:end].decode("utf-8"))
        start = end
    pieces.append(data[start:].decode("utf-8"))
    return pieces


def iter_groups(
    corpus: CorpusSpec,
    stats: CorpusStats,
    *,
    on_bytes: Callable[[int], None] | None = None,
    group_bytes: int = GROUP_BYTES,
    sources: list[list[str]] | None = None,
    source_stats: list[CorpusStats] | None = None,
) -> Iterator[Group]:
    """Every document of the corpus in groups, source by source, file by file, in order.

    A group ends after the document with which the UTF-8 length of its documents reaches
    ``group_bytes``, and at the end of each file: a pure function of the documents, so a
    text, jsonl or Parquet file with the same documents gives the same groups (only
    ``path``, ``position`` and ``nbytes`` differ). ``stats`` (and ``source_stats[i]`` for
    source ``i``, when given) count files, bytes, documents and skips as reading goes;
    ``on_bytes`` gets input bytes as they are read. ``sources`` is ``resolve_sources(corpus)``
    when the caller already has it.
    """
    if group_bytes < 1:
        raise ValueError(f"group_bytes must be positive, got {group_bytes}")
    if sources is None:
        sources = resolve_sources(corpus)
    for number, (member, files) in enumerate(zip(corpus.members, sources, strict=True)):
        totals = [stats] if source_stats is None else [stats, source_stats[number]]
        for path in files:
            counts = CorpusStats()  # this file's counts since they were last passed on
            read = FileRead(path, member.text_field, corpus.on_bad_input, counts, on_bytes)
            try:
                for group in _file_groups(number, read, group_bytes):
                    _pass_on(counts, totals)  # counts are current whenever a group arrives
                    yield group
            finally:
                _pass_on(counts, totals)


def _pass_on(counts: CorpusStats, totals: list[CorpusStats]) -> None:
    for total in totals:
        total.add(counts)
    for key in counts.as_dict():
        setattr(counts, key, 0)


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


def _file_groups(source: int, read: FileRead, group_bytes: int) -> Iterator[Group]:
    reader = _reader_for(read.path)
    if reader is None:
        bad_file(read, f"is not a corpus format ({FORMATS_HELP})")
        return
    documents: list[str] = []
    size = 0
    index = 0
    position = ""
    used = 0
    for text, where in reader(read):
        if not documents:
            position = where
        documents.append(text)
        read.stats.documents += 1
        size += len(text.encode("utf-8"))
        if size >= group_bytes:
            yield Group(source, read.path, index, documents, position, read.read - used)
            used, documents, size, index = read.read, [], 0, index + 1
    if documents:
        yield Group(source, read.path, index, documents, position, read.read - used)


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


def _reader_for(path: str) -> _Reader | None:
    """The reader for ``path``'s format, from its name; None for a format we do not read."""
    from payload import readers  # noqa: PLC0415  (readers builds on this module)

    name = path.rsplit("/", 1)[-1].lower()
    for suffix, reader in readers.STRUCTURED.items():
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
            f"corpus has no text: {list(corpus.all_paths)} gave {stats.files} "
            f"readable files with 0 documents{skipped}"
        )
