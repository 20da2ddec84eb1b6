"""Errors by class: what the user must fix, what a restart may fix, and bugs.

The CLI prints a ``UserError`` as ``error: <message>`` on one line and exits with status 2
(the trainer unit does not restart it). A ``TransientError`` is an infrastructure failure that
a restart may fix: one line too, exit TRANSIENT_EXIT, which the unit restarts (and counts among
its failures without a newer checkpoint). Everything else is a bug and keeps its traceback
(exit 1).
"""

from __future__ import annotations

# sysexits.h EX_TEMPFAIL ("temporary failure, indicating something that is not really an
# error"): not 2, which the trainer unit never restarts (RestartPreventExitStatus=2), and not
# 1, a bug's.
TRANSIENT_EXIT = 75


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


class SliceError(UserError):
    """The hosts of a slice do not run one program (payload, job, data, restored step,
    programs) or do not share one output."""


class TransientError(Exception):
    """An infrastructure failure a restart may fix, not the user's to fix and not a bug: the
    CLI prints 'error: <msg>' and exits TRANSIENT_EXIT."""


class StorageUnavailableError(TransientError):
    """Cloud Storage still failing when its retries ran out: unreachable, 5xx, 429."""


class TrainingInterrupted(SystemExit):
    """SIGTERM/SIGINT during training, after a checkpoint of the current step was saved.

    Exits with 128 + the signal number, as if the signal had killed the process.
    """

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.message = message

    def __str__(self) -> str:
        return self.message
