"""Errors a user can cause and fix. Everything else is a bug and keeps its traceback.

The CLI prints a ``UserError`` as ``error: <message>`` on one line and exits with status 2.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the CLI prints 'error: <msg>' and exits 2."""


class SpecError(UserError):
    """The job spec has an unknown key, a missing key or a bad value."""


class CorpusError(UserError):
    """The corpus is empty, missing, or cannot be decoded (with on_bad_input: fail)."""


class DataError(UserError):
    """Prepared data is missing, corrupt, or does not match the tokenizer or model."""


class StorageError(UserError):
    """An output path that cannot be written, or a bucket that is missing or refuses access."""


class DiskFullError(StorageError):
    """No space left (ENOSPC, EDQUOT) where a stage writes, or too little before it starts."""
