"""The corpus as the encoder reads it: sources, their files, and groups of documents.

Groups. ``iter_groups`` is what the encoder reads: every document of every source, file by
file, in runs of consecutive documents of one file (``Group``). A group ends after the
document with which the UTF-8 length of its documents reaches ``GROUP_BYTES`` (1 MiB), and
at the end of each file, so groups depend on the documents alone: the same documents in a
text, jsonl or Parquet file give the same groups. A document is held whole in memory (the
``MAX_DOCUMENT_BYTES`` cut is the encoder's business: ``document_pieces``, a pure function
of the document, the same for every format). Each file is read by its format's reader
(``payload.data.readers``: the formats, the documents they give, and what happens to bad input).

Inputs. ``corpus.paths`` entries are files, directories (every non-hidden file under them,
recursively), or glob patterns; each may be local or a gs:// URI (gs:// objects are
streamed, never loaded whole). Files ending in ``.gz`` are decompressed on the fly. The
file list is sorted, so the order (and therefore the output) is deterministic.

A document longer than ``MAX_DOCUMENT_BYTES`` is cut at a line break into pieces that the
encoder keeps together (no separator between them).

No usable text at all (no files, only empty or skipped files) is always a CorpusError.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from payload.core import storage
from payload.core.errors import CorpusError
from payload.data import readers_hub
from payload.data.readers import FORMATS_HELP, CorpusStats, FileRead, bad_file, reader_for
from payload.schema.job import HF_DATASET_RE, CorpusSpec

GROUP_BYTES = 1 << 20  # a group ends after the document that brings its text to 1 MiB
MAX_DOCUMENT_BYTES = 8 << 20
_GLOB_CHARS = re.compile(r"[*?\[]")


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


def _file_groups(source: int, read: FileRead, group_bytes: int) -> Iterator[Group]:
    reader = reader_for(read.path)
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
