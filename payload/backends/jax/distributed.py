"""Multi-process JAX: one program per host, joined by `jax.distributed.initialize()`.

On a Cloud TPU slice every worker runs the same trainer unit and JAX finds the coordinator,
the process count and this worker's index itself (`jax.distributed.initialize()` with no
arguments; its cluster detection for Cloud TPU, jax/_src/clusters/cloud_tpu_cluster.py):
the unit sets TPU_PAYLOAD_JAX_DISTRIBUTED=auto. Anywhere else the three values are given
explicitly, `<coordinator host:port>,<process count>,<process index>` (the tests' two CPU
processes on 127.0.0.1). Unset: one process, no initialisation.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax

from payload.backends.jax import joining, progress
from payload.core import errors, hosts, storage
from payload.core.errors import TRANSIENT_EXIT, TransientError, UserError
from payload.training import export as export_lib
from payload.training import shared

ENV = "TPU_PAYLOAD_JAX_DISTRIBUTED"
_EXPLICIT = re.compile(
    r"^(?P<address>[A-Za-z0-9.\-]+:[0-9]{1,5}),(?P<count>[0-9]+),(?P<index>[0-9]+)$"
)


def parse(value: str) -> tuple[str, int, int] | None:
    """None for `auto`; else (coordinator, count, index); UserError when malformed."""
    if value == "auto":
        return None
    match = _EXPLICIT.match(value)
    if not match:
        raise UserError(
            f"{ENV}: {value!r} must be `auto` (a Cloud TPU slice) or "
            "`<coordinator host:port>,<process count>,<process index>`"
        )
    count, index = int(match["count"]), int(match["index"])
    if count < 1 or not 0 <= index < count:
        raise UserError(f"{ENV}: process index {index} is not in 0..{count - 1}")
    return match["address"], count, index


def initialize_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Join the other processes if the environment says so (before any other JAX call), with
    the coordination service's heartbeat and shutdown timeouts of this module (a host that
    dies without a word ends the others within HEARTBEAT_TIMEOUT_S). The join itself is
    bounded (joining.py): a process that is not joined by then says which host it waits for
    and exits 1."""
    value = environ.get(ENV, "")
    if not value:
        return False
    explicit = parse(value)
    address, count, index = explicit if explicit is not None else (None, None, None)
    timeout = joining.timeout(environ)
    joined = joining.watch(timeout, _state)
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=count,
        process_id=index,
        # JAX's own bound (it aborts the process, SIGABRT, naming nobody) comes after ours.
        initialization_timeout=int(timeout + joining.MARGIN_S),
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    joined.set()
    return True


# The coordination service's own bounds (jax 0.10.2 jax/_src/distributed.py `initialize`:
# heartbeat_timeout_seconds, default 100; shutdown_timeout_seconds, default 300). A process
# that stops sending heartbeats (SIGKILL, the kernel's OOM killer, a segfault, a lost VM)
# is declared dead after HEARTBEAT_TIMEOUT_S and every other process of the slice then
# terminates itself (XLA's client: "Terminating process because the JAX distributed service
# detected fatal errors", SIGABRT; jax-ml/jax docs/fault_tolerance.rst "Fault Intolerant By
# Default"). At its exit every process passes the service's shutdown barrier (JAX's atexit
# `jax.distributed.shutdown()`, or the guard's `_leave`), which waits at most
# SHUTDOWN_TIMEOUT_S for all: a process that skipped it, or one later than that, makes it
# fail, and then every process still there aborts (SIGABRT). So every process of a slice
# that leaves together leaves through it, and the service (process 0's) goes last.
HEARTBEAT_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 60

# How the processes of a slice agree (docs/backends.md, "how hosts agree on stopping"):
# through the coordination service `jax.distributed.initialize()` started (process 0 hosts
# it): its key-value store (`DistributedRuntimeClient.key_value_set`, `key_value_dir_get`,
# jax 0.10's jax/_src/distributed.py `global_state.client`). These are host-to-coordinator
# RPCs: nothing is queued on the devices, so agreeing never waits for a running chunk. With
# one process nothing is called. A name may be used once per run (the coordination service
# is new at every start).
#
# Every wait is a poll of the store, not the service's barrier (`wait_at_barrier`): between
# polls a process looks for an abort that another process published (`leave_with`: any
# exception or signal that ends it) and for a signal of its own, so a slice that one host
# leaves ends on every host with the same one line. A process that cannot poll (its main
# thread inside a device collective, a compile, a long read) is ended by its SliceGuard.
PREFIX = "tpu-pretrain"
# Processes reach a chunk's agreement at most a checkpoint write or an evaluation apart.
AGREE_TIMEOUT_S = 3600
# The chief's export (gathering, writing, uploading the weights) while the others wait.
EXPORT_TIMEOUT_S = 4 * 3600
# How long a process that aborts waits for every other process to have read its abort
# (each one's guard reads it within GUARD_POLL_S).
ABORT_ACK_TIMEOUT_S = 60.0
# The poll interval grows from the first to the last: a chunk's agreement, where every
# process arrives within milliseconds, costs a few ms; a long wait costs 10 RPCs a second.
POLL_FIRST_S, POLL_LAST_S = 0.002, 0.1
# The guard thread: how often it looks at the abort list (an RPC), and how long the main
# thread has to act on a stop or an abort itself before the guard ends the process.
GUARD_POLL_S = 0.5
GUARD_GRACE_S = 2.0
ABORT = f"{PREFIX}/abort"
ABORT_SEEN = f"{PREFIX}/abort-seen"
# The abort that decides how every process leaves: the first one the coordination service
# records (a key set once: `key_value_set` without overwrite answers ALREADY_EXISTS to every
# later one). Two hosts that abort at once with different classes (a user error on one, a bug
# on another) would otherwise each leave with its own, and a third with whichever it read
# first: the units then disagree on whether to restart.
DECIDED = f"{PREFIX}/abort-decided"
# An abort's kind: the name of a UserError or TransientError class (payload.core.errors,
# payload.core.hosts), SIGNAL_KIND, or ERROR_KIND (anything else: a bug, device out of
# memory, a timeout).
SIGNAL_KIND = "signal"
ERROR_KIND = "error"
# A process whose progress watchdog fired (progress.py): every process leaves at once with
# progress.HUNG_EXIT and the same line; the chief's status.json says `hung` and the phase.
HUNG_KIND = "hung"
# Exit codes by class, as the CLI gives them (payload/cli.py).
USER_ERROR_EXIT, ERROR_EXIT = 2, 1


class PeerAbortError(Exception):
    """Marks an exception raised because another process aborted: `index`, the process it
    came from; `decided`, read from the deciding abort (DECIDED) rather than from an
    agreement's outcome (agree_on_checks)."""

    def __init__(self, index: int, *, decided: bool):
        super().__init__(f"process {index}")
        self.index, self.decided = index, decided


class PeerFailed(SystemExit):
    """Another process of the slice left with an error that is not a user error (a bug, out
    of memory, a timeout): this one leaves too, exit 1, with the same line (printed here:
    the CLI prints nothing for a SystemExit)."""

    def __init__(self, line: str):
        super().__init__(ERROR_EXIT)
        self.line = line

    def __str__(self) -> str:
        return self.line


class _PeerInterrupted(shared.TrainingInterrupted):
    """Another process of the slice was stopped by a signal before training could agree on a
    checkpoint: this one stops too, like the signal (exit 128 + signum)."""


def _state() -> Any:
    # jax.distributed's own state, not jax.process_count(): that initialises the backend,
    # which may be what failed (a TPU VM whose JAX finds no TPU).
    from jax._src import distributed as jax_distributed  # noqa: PLC0415  (the client lives here)

    return jax_distributed.global_state


def _joined() -> bool:
    state = _state()
    return state.client is not None and state.num_processes > 1


def _client():
    client = _state().client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised but JAX sees several processes")
    return client


def _entries(client: Any, directory: str) -> dict[int, str]:
    return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(directory)}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__


class _Abort:
    """One process's published exit: its class, exit code and the line every host prints."""

    def __init__(self, index: int, entry: str):
        doc = json.loads(entry)
        self.index, self.kind, self.code = index, str(doc["kind"]), int(doc["code"])
        self.message, self.line = str(doc["message"]), str(doc["line"])
        self.phase: str | None = str(doc["phase"]) if self.kind == HUNG_KIND else None

    def raised_here(self) -> BaseException:
        """The exception this process leaves with (its line logged first where the CLI
        prints none)."""
        exc: BaseException
        if self.kind == SIGNAL_KIND:
            text = f"process {self.index} of the slice {self.message}"
            shared.log(f"train: {text}")
            exc = _PeerInterrupted(self.code - 128, text)
        elif self.kind == ERROR_KIND:
            shared.log(self.line)
            exc = PeerFailed(self.line)
        else:
            if self.kind == HUNG_KIND:  # nothing to save: this process ends here, as the guard
                SliceGuard.end_now(self.code, self.line, self.phase)
            exc = _classified_error(self.kind, self.code, self.message)
        exc.__cause__ = PeerAbortError(self.index, decided=True)
        return exc

    def hard_exit_line(self) -> str:
        """What the guard prints when it ends this process in place of the main thread."""
        if self.kind == SIGNAL_KIND:
            return f"train: process {self.index} of the slice {self.message}"
        return self.line


def _peer_abort(client: Any) -> _Abort | None:
    """The abort that decides how the slice leaves (DECIDED), once another process published
    one, marked as read by this one."""
    me = _state().process_id
    others = {i: v for i, v in _entries(client, f"{ABORT}/").items() if i != me}
    if not others:
        return None
    abort = _decided(client) or _Abort(min(others), others[min(others)])
    if abort.index == me:  # this process's own abort decides: its main thread is leaving
        return None
    client.key_value_set(f"{ABORT_SEEN}/{me}", str(abort.index), allow_overwrite=True)
    return abort


def _decided(client: Any) -> _Abort | None:
    """The deciding abort, if one was recorded (every publisher records it first)."""
    try:
        doc = json.loads(client.key_value_try_get(DECIDED))
    except Exception:  # NOT_FOUND (none yet) or the service gone: nothing decided here
        return None
    return _Abort(int(doc["index"]), json.dumps(doc))


def _decide(client: Any, origin: int, entry: dict[str, Any]) -> _Abort:
    """Record `entry` (an abort of process `origin`) as the deciding abort unless one was
    recorded first; the one that decides."""
    mine = _Abort(origin, json.dumps(entry))
    try:
        client.key_value_set(DECIDED, json.dumps({**entry, "index": origin}))
    except Exception:  # ALREADY_EXISTS: another abort came first (or the service is gone)
        return _decided(client) or mine
    return mine


def _raise_if_aborted(client: Any) -> None:
    """Raise, on this process, the abort another process published; and a signal of this
    process's own that must stop it now (training.stop_point)."""
    abort = _peer_abort(client)
    if abort is not None:
        raise abort.raised_here()
    shared.stop_point()


def _wait_for_all(client: Any, directory: str, timeout_s: float) -> dict[int, str]:
    """Every process's entry under `directory`, polling (and watching for aborts) until all
    are there; bounded by `timeout_s`."""
    count = jax.process_count()
    deadline = time.monotonic() + timeout_s
    pause = POLL_FIRST_S
    while True:
        entries = _entries(client, directory)
        if len(entries) >= count:
            return entries
        _raise_if_aborted(client)
        if time.monotonic() > deadline:
            missing = sorted(set(range(count)) - set(entries))
            raise RuntimeError(
                f"{directory}: processes {missing} did not arrive within {timeout_s:.0f} s"
            )
        time.sleep(pause)
        pause = min(pause * 2, POLL_LAST_S)


def barrier(name: str, timeout_s: float = AGREE_TIMEOUT_S) -> None:
    """Every process waits here until all have arrived (bounded); nothing with one process."""
    gather_strings(name, "", timeout_s=timeout_s)


def gather_strings(name: str, mine: str, timeout_s: float = AGREE_TIMEOUT_S) -> list[str]:
    """Every process's `mine`, by process index: each publishes its own, then all read the
    same complete set (a process that aborts meanwhile ends the wait on every other). A stop
    signal this process recorded is acted on first (training.stop_point)."""
    shared.stop_point()
    if jax.process_count() == 1:
        return [mine]
    client = _client()
    client.key_value_set(f"{PREFIX}/{name}/{jax.process_index()}", mine)
    by_process = _wait_for_all(client, f"{PREFIX}/{name}/", timeout_s)
    return [by_process[i] for i in range(jax.process_count())]


def agree_on_minimum(name: str, mine: int | None) -> int | None:
    """The smallest of every process's `mine` (None where a process has none; None if no
    process has one): e.g. the device memory every host plans with."""
    values = [int(v) for v in gather_strings(name, "" if mine is None else str(mine)) if v]
    return min(values) if values else None


def agree_on_stop(
    name: str, signum: int | None, chunk: int | None
) -> tuple[int | None, int | None]:
    """(the stop, the next chunk's length) every process agrees on at `name`: the signal one
    of them received (the smallest number if several did; None if none did), and the
    smallest of the chunk lengths they propose (None if none does). Each host times its own
    steps and may be told another TPU_PAYLOAD_CHUNK_SECONDS; JAX does not check a plain
    number across hosts, and a chunk of another length on one host hangs the collectives of
    all. The same answer on every process, so all run the same chunks, checkpoint the same
    step and exit alike."""
    mine = json.dumps({"signal": signum or 0, "chunk": chunk})
    if jax.process_count() == 1:
        return signum, chunk
    seen = [json.loads(entry) for entry in gather_strings(name, mine)]
    signals = [int(e["signal"]) for e in seen if int(e["signal"])]
    chunks = [int(e["chunk"]) for e in seen if e["chunk"] is not None]
    return (min(signals) if signals else None), (min(chunks) if chunks else None)


def agree_on_checks(name: str, check: Callable[[], None]) -> None:
    """Run `check` on every process; if it raises a UserError on any, raise the first such
    error (by process index) on every process, so a user error exits 2 on every host with
    the same line instead of leaving the others in a collective. Anything else that ends
    `check` (a bug, a stop by signal) leaves this process the way it leaves anywhere
    (`leave_with`): the others read its class from the abort it publishes while they wait
    here, and leave with it (a SIGTERM during the checks is a stop on every host)."""
    try:
        check()
    except UserError as exc:
        mine = f"{type(exc).__name__}\n{exc}"
        failure: UserError | None = exc
    else:
        mine, failure = "ok\n", None
    outcomes = gather_strings(f"checks/{name}", mine)
    for index, outcome in enumerate(outcomes):
        kind, _, message = outcome.partition("\n")
        if kind == "ok":
            continue
        if failure is not None and index == jax.process_index():
            raise failure
        peer = _classified_error(kind, USER_ERROR_EXIT, message)
        peer.__cause__ = PeerAbortError(index, decided=False)  # published by its own process
        _name_host(peer, index)
        raise peer


def _classified_error(kind: str, code: int, message: str) -> UserError | TransientError:
    """The UserError or TransientError of class `kind` (payload.core.errors or
    payload.core.hosts); for another name, the base class its exit `code` stands for."""
    found = getattr(errors, kind, None) or getattr(hosts, kind, None)
    if code == TRANSIENT_EXIT:
        transient = found if isinstance(found, type) and issubclass(found, TransientError) else None
        return (transient or TransientError)(message)
    user = found if isinstance(found, type) and issubclass(found, UserError) else None
    return (user or UserError)(message)


def _name_host(exc: UserError | TransientError, index: int) -> None:
    """On a slice a user error's (or a transient failure's) line names the process it
    happened on, the same on every host (`error: process 1 of the slice: ...`); not a
    SliceError's, which compares every host."""
    if isinstance(exc, errors.SliceError):  # every host found it, none caused it alone
        return
    if _joined() and not str(exc).startswith("process "):
        exc.args = (f"process {index} of the slice: {exc}",)


def exit_code_of(exc: BaseException) -> int:
    """The exit code the CLI gives `exc` (payload/cli.py): 2 for a user error, 75 for a
    transient failure, 128 + the signal for a stop, a SystemExit's own, 130 for Ctrl-C,
    else 1."""
    if isinstance(exc, UserError):
        return USER_ERROR_EXIT
    if isinstance(exc, TransientError):
        return TRANSIENT_EXIT
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else ERROR_EXIT
    return ERROR_EXIT


def _entry_of(exc: BaseException, me: int) -> dict[str, Any]:
    """What a process publishes when `exc` ends it: its class, exit code, and the line every
    host prints."""
    code = exit_code_of(exc)
    if isinstance(exc, shared.TrainingInterrupted):
        return {"kind": SIGNAL_KIND, "code": code, "message": exc.message, "line": exc.message}
    if isinstance(exc, KeyboardInterrupt):
        message = "stopped by signal 2 (Ctrl-C) outside the training loop"
        return {"kind": SIGNAL_KIND, "code": code, "message": message, "line": message}
    if isinstance(exc, (UserError, TransientError)):
        return {
            "kind": type(exc).__name__,
            "code": code,
            "message": str(exc),
            "line": "error: " + " ".join(str(exc).split()),  # as the CLI prints it
        }
    line = (
        f"error: process {me} of the slice failed: {type(exc).__name__}: {_one_line(exc)} "
        f"(not a user error: its traceback is in process {me}'s log)"
    )
    return {"kind": ERROR_KIND, "code": code, "message": line, "line": line}


def leave_with(exc: BaseException) -> BaseException:
    """This process is leaving the slice with `exc` (any exception, a stop by signal, a user
    error): the exception it leaves with, which is `exc` unless another process's abort was
    recorded first (DECIDED: one rule for every host, so two hosts that abort at once with
    different classes do not end the slice with different exit codes). Its own abort is
    published with its class, so every other process leaves with the same class of exit
    code and the same line, at its next agreement or, if it cannot get there (inside a
    device collective), from its guard; then it waits (bounded) until each has read it (the
    coordination service lives in process 0, and the others must read the abort before it
    is gone). All of them then pass the service's shutdown barrier at their exit, within
    seconds of each other, and end there (`_leave`, at exit, before JAX's own clean-up: the
    rest of the interpreter's teardown takes seconds and decides nothing). Nothing with one
    process; not re-published for an exception that came from another process's abort. A
    user error's message gets the process's name (`_name_host`). A bug of this process that
    leaves with another's abort keeps its traceback in this process's log."""
    if SliceGuard.ending():
        _wait_for_the_guard()
    if not _joined():
        SliceGuard.stop()
        return exc
    state = _state()
    me, client = state.process_id, state.client
    if isinstance(exc, (UserError, TransientError)):
        _name_host(exc, me)
    cause = exc.__cause__ if isinstance(exc.__cause__, PeerAbortError) else None
    if cause is not None and cause.decided:  # read from DECIDED: the slice's own class
        _left(exc, client, me, publish=None)
        return exc
    origin = cause.index if cause is not None else me
    entry = _entry_of(exc, origin)
    decided = _decide(client, origin, entry)
    if decided.line == entry["line"] and decided.code == entry["code"]:  # this abort decides
        if cause is None and entry["kind"] == ERROR_KIND:
            shared.log(entry["line"])
        _left(exc, client, me, publish=entry if cause is None else None)
        return exc
    if cause is None:
        shared.log(
            f"train: this process's own failure ({type(exc).__name__}: {_one_line(exc)}) is "
            f"not what the slice leaves with: process {decided.index}'s abort came first"
        )
        if entry["kind"] == ERROR_KIND:  # a bug: its traceback stays in this log
            traceback.print_exception(exc, file=sys.stderr)
    leaving = decided.raised_here()
    _left(leaving, client, me, publish=None)
    return leaving


def _wait_for_the_guard() -> None:
    """The guard is ending this process (SliceGuard._end: the shutdown barrier, then
    `os._exit`) and an exception reached the main thread meanwhile (the collective it was in,
    cancelled by the shutdown): the main thread waits for that exit (bounded) instead of
    tearing the interpreter down under it (process 0, inside the model build's first
    collective when two others aborted, ended with SIGSEGV so)."""
    deadline = time.monotonic() + SliceGuard.BACKSTOP_S
    while time.monotonic() < deadline:
        time.sleep(POLL_LAST_S)


def _left(exc: BaseException, client: Any, me: int, *, publish: dict[str, Any] | None) -> None:
    """This process leaves with `exc`: the guard keeps only a backstop, the exit passes the
    shutdown barrier (`_leave`), and the others are told (`publish`: its own abort) or the
    abort it leaves with is marked read."""
    code = exit_code_of(exc)
    SliceGuard.leaving(code)
    atexit.register(_leave, code)  # registered after JAX's clean_up: runs before it
    if publish is None:
        _acknowledge(client, me)
    else:
        _publish(client, me, publish)
    SliceGuard.published()


def _acknowledge(client: Any, me: int) -> None:
    """This process leaves with another's abort, read from the abort list (`_peer_abort`
    marked it) or from an agreement's outcome (agree_on_checks: every process has the line
    before the failing one publishes): mark it read, so the publisher waits for nobody who
    already knows. Without it, a user error found by agree_on_checks on the chief (another
    run's run.json) kept both hosts 60 s (ABORT_ACK_TIMEOUT_S) in `_publish`'s wait."""
    with contextlib.suppress(Exception):  # the service may be gone already: the exit goes on
        client.key_value_set(f"{ABORT_SEEN}/{me}", "peer", allow_overwrite=True)


def _publish(client: Any, me: int, entry: dict[str, Any]) -> None:
    """Publish this process's abort and wait (bounded) until every other process has read
    it or left with an abort of its own."""
    try:
        client.key_value_set(f"{ABORT}/{me}", json.dumps(entry), allow_overwrite=True)
        deadline = time.monotonic() + ABORT_ACK_TIMEOUT_S
        others = set(range(_state().num_processes)) - {me}
        while time.monotonic() < deadline:
            done = set(_entries(client, f"{ABORT_SEEN}/")) | set(_entries(client, f"{ABORT}/"))
            if others <= done:
                return
            time.sleep(POLL_LAST_S)
        shared.log(
            f"train: processes {sorted(others - done)} did not read this process's abort "
            f"within {ABORT_ACK_TIMEOUT_S:.0f} s"
        )
    except Exception as failure:  # the service may be gone already: the exit goes on
        shared.log(f"train: could not tell the other processes ({failure})")


def _leave(code: int) -> None:
    """End this process now with `code` (at exit, or from the guard thread while the main
    thread may be inside a device collective): through the coordination service's shutdown
    barrier, as every other process of the slice leaves (bounded by SHUTDOWN_TIMEOUT_S;
    process 0's service stops last), then at once."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: nothing to flush
            stream.flush()
    export_lib.remove_scratch()  # an export cut short here leaves no directory behind
    if _joined():
        with contextlib.suppress(Exception):  # the service is gone: nothing to wait for
            jax.distributed.shutdown()
    os._exit(code)


class SliceGuard:
    """A daemon thread beside the trainer, from `jax.distributed.initialize()` to the end of
    training, that ends this process when its main thread cannot:

    - a stop signal that must stop the process now (training.STOP: outside a training loop,
      or a second signal inside one): the other processes are told at once (an abort of
      class signal); if the main thread has not acted on it within GUARD_GRACE_S (at a
      boundary or an agreement), the guard logs the line and exits 128 + the signal;
    - another process's abort (its exit, any class): read within GUARD_POLL_S, marked as
      read; if the main thread has not left with it within GUARD_GRACE_S (it may wait inside
      a device collective for the process that left, which no abort reaches), the guard
      prints the same line and exits with the same code (a hang: at once, status `hung`);
    - no progress within the bound of the main thread's phase (`watch`, progress.py; also
      with one process): every thread's stack to the log, the other processes told (an
      abort of class hung), exit progress.HUNG_EXIT (`_hung`);
    - once the main thread is leaving (`leaving`), only a backstop: a process still alive
      long after it should have ended is ended; and once it has published its exit
      (`published`), what it still does before the shutdown barrier (the chief's status
      write, the lease) is cut after LEAVE_WORK_S, so it reaches the barrier in time.

    A failed call to the coordination service (an RPC) does not end the guard: it tries
    again at every poll and ends the process (exit 1) once the service has not answered for
    GUARD_GIVE_UP_S (by then the service has declared this process dead anyway).

    Ending the process from here passes the coordination service's shutdown barrier with
    the other processes (`_leave`) and skips the rest of Python's cleanup; nothing is
    half-written by that (outputs are written whole and moved into place, an unfinished
    Orbax checkpoint is ignored at the next start, the export's scratch directory is removed
    in `_leave`), and hooks record the failure (`on_exit`, `on_hang`: the chief's
    status.json), bounded by STATUS_WRITE_S."""

    _current: SliceGuard | None = None

    def __init__(
        self,
        on_exit: Callable[[str], None] | None = None,
        *,
        on_hang: Callable[[str, str], None] | None = None,
        watch: progress.Watch | None = None,
    ):
        self.on_exit, self.on_hang, self.watch = on_exit, on_hang, watch
        self._closed = threading.Event()
        self._leaving: tuple[int, float] | None = None  # (exit code, backstop time)
        self._work_deadline: float | None = None  # set once the exit is published
        self._pending: tuple[int, str, str | None] | None = None  # (code, line, hung phase)
        self._deadline = self._next_poll = 0.0
        self._failing_since: float | None = None
        self._ending = False  # `_end` runs: this process's exit is on its way
        self._thread = threading.Thread(target=self._run, name="slice-guard", daemon=True)

    @classmethod
    def start(cls, watch: progress.Watch | None = None) -> SliceGuard:
        guard = cls(watch=watch)
        cls._current = guard
        guard._thread.start()
        return guard

    # A process that is leaving but still alive this long after (its exit waits for at most
    # the abort's reading and the shutdown barrier) is ended by the guard.
    BACKSTOP_S = ABORT_ACK_TIMEOUT_S + SHUTDOWN_TIMEOUT_S + 2 * GUARD_GRACE_S

    @classmethod
    def leaving(cls, code: int) -> None:
        """The main thread is leaving with `code`: the guard only keeps a backstop."""
        guard = cls._current
        if guard is not None and guard._leaving is None:
            guard._leaving = (code, time.monotonic() + cls.BACKSTOP_S)

    @classmethod
    def published(cls) -> None:
        """The main thread has told the other processes (or read their abort): they are on
        their way into the shutdown barrier, which waits SHUTDOWN_TIMEOUT_S for this one.
        What it still does first is cut after LEAVE_WORK_S; storage's retries are shortened
        to fit."""
        guard = cls._current
        if guard is not None and guard._work_deadline is None:
            guard._work_deadline = time.monotonic() + LEAVE_WORK_S
        storage.set_retry_deadline(min(storage.RETRY_DEADLINE_S, LEAVE_WORK_S / 2))

    @classmethod
    def stop(cls) -> None:
        """Close the current guard, if any."""
        if cls._current is not None:
            cls._current.close()

    def close(self) -> None:
        self._closed.set()
        if SliceGuard._current is self:
            SliceGuard._current = None

    def _run(self) -> None:
        while not self._closed.wait(POLL_LAST_S):
            self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        """One look: the main thread's exit, its progress, a signal, the others' aborts."""
        if self._leaving is not None:
            code, backstop = self._leaving
            if now > backstop and _joined():
                shared.log(f"train: still running {self.BACKSTOP_S:.0f} s after leaving")
                _leave(code)
            work = self._work_deadline
            if work is not None and now > work and _joined():
                shared.log(
                    f"train: leaving now: the work after this process told the others took "
                    f"over {LEAVE_WORK_S:.0f} s (the shutdown barrier waits "
                    f"{SHUTDOWN_TIMEOUT_S:.0f} s)"
                )
                _leave(code)
            return
        late = self.watch.overdue() if self.watch is not None else None
        if late is not None and self._pending is None:
            self._hung(late)
            return
        try:
            self._look(now)
        except Exception as failure:  # the service does not answer: again at the next poll
            self._unreachable(now, failure)
        else:
            self._failing_since = None
        pending = self._pending
        if pending is not None and (now > self._deadline or pending[2] is not None):
            self._end(*pending)

    def _look(self, now: float) -> None:
        if self._pending is None and shared.STOP.at_once():
            self._deadline = now + GUARD_GRACE_S
            self._signalled(int(shared.STOP.signum or 0))
        elif self._pending is None and _joined() and now >= self._next_poll:
            self._next_poll = now + GUARD_POLL_S
            abort = _peer_abort(_state().client)
            if abort is not None:
                self._pending = (abort.code, abort.hard_exit_line(), abort.phase)
                self._deadline = now + GUARD_GRACE_S

    def _unreachable(self, now: float, failure: Exception) -> None:
        if self._failing_since is None:
            self._failing_since = now
            shared.log(
                f"train: the slice guard cannot reach the coordination service ({failure}); "
                f"trying again every {GUARD_POLL_S} s for up to {GUARD_GIVE_UP_S:.0f} s"
            )
        elif now - self._failing_since > GUARD_GIVE_UP_S and self._pending is None:
            me = _state().process_id
            line = (
                f"error: process {me} of the slice cannot reach the coordination service "
                f"(process 0) for {GUARD_GIVE_UP_S:.0f} s ({_one_line(failure)}); leaving, "
                f"exit {ERROR_EXIT}"
            )
            self._end(ERROR_EXIT, line, None)

    def _signalled(self, signum: int) -> None:
        """A stop by signal outside a loop's agreement: tell the others now (the exit does
        not wait for that call: it is decided first)."""
        message = shared.stop_message(signum)
        self._pending = (128 + signum, f"train: {message}", None)
        if _joined():
            state = _state()
            me, client = state.process_id, state.client
            entry = {"kind": SIGNAL_KIND, "code": 128 + signum, "message": message, "line": message}
            decided = _decide(client, me, entry)
            client.key_value_set(f"{ABORT}/{me}", json.dumps(entry), allow_overwrite=True)
            if decided.index != me:  # another process's abort came first: leave with it
                self._pending = (decided.code, decided.hard_exit_line(), decided.phase)

    @classmethod
    def ending(cls) -> bool:
        """Whether the guard is ending this process now (`_end`, `_hung`)."""
        guard = cls._current
        return guard is not None and guard._ending

    def _hung(self, late: progress.Late) -> None:
        """No progress within the phase's bound: the stacks, the others told, exit. When
        another process's hang is already published (every host of a slice waits on the
        same stalled collective), this one leaves with that one's line."""
        self._ending = True
        joined = _joined()
        me, count = (_state().process_id, _state().num_processes) if joined else (0, 1)
        with contextlib.suppress(Exception):  # the service does not answer: our own line
            first = _peer_abort(_state().client) if joined else None
            if first is not None and first.kind == HUNG_KIND:
                self._end(first.code, first.line, first.phase)
        line = late.line(me, count)
        shared.log(line)
        progress.dump_stacks()
        self._leaving = (progress.HUNG_EXIT, time.monotonic() + self.BACKSTOP_S)
        self._record(line, late.phase)
        if joined:
            entry = {"kind": HUNG_KIND, "code": progress.HUNG_EXIT, "message": line,
                     "line": line, "phase": late.phase}  # fmt: skip
            client = _state().client
            decided = _decide(client, me, entry)  # the first abort recorded decides the class
            _publish(client, me, entry)
            if decided.index != me:
                self._end(decided.code, decided.hard_exit_line(), decided.phase)
        _leave(progress.HUNG_EXIT)

    def _end(self, code: int, line: str, phase: str | None) -> None:
        self._ending = True
        shared.log(line)
        if phase is not None:  # another process hung: where this one waited for it
            progress.dump_stacks()
        self._leaving = (code, time.monotonic() + self.BACKSTOP_S)
        self._record(line, phase)
        _leave(code)

    def _record(self, line: str, phase: str | None) -> None:
        """The failure in the chief's status.json (hung, with the phase, or failed),
        bounded: a status write that hangs must not keep the process from the barrier."""
        if phase is not None and self.on_hang is not None:
            hang = self.on_hang
            _bounded(lambda: hang(phase, line), STATUS_WRITE_S, "record the hang")
        elif phase is None and self.on_exit is not None:
            on_exit = self.on_exit
            _bounded(lambda: on_exit(line), STATUS_WRITE_S, "record the failure")

    @classmethod
    def end_now(cls, code: int, line: str, phase: str | None) -> None:
        """End this process now, from the main thread, as the guard would (a peer's hang
        read at an agreement: nothing is left to save)."""
        guard = cls._current or cls()
        guard._end(code, line, phase)


# What a process that leaves still does after it told the others (the chief's status.json,
# the lease's release), at most, before it enters the shutdown barrier.
LEAVE_WORK_S = 20.0
# How long the guard keeps trying to reach the coordination service before it ends the
# process (the service declares a process dead after HEARTBEAT_TIMEOUT_S without a word).
GUARD_GIVE_UP_S = float(HEARTBEAT_TIMEOUT_S)
# How long a status write may take when the guard records a failure or a hang.
STATUS_WRITE_S = 15.0


def _bounded(work: Callable[[], None], seconds: float, what: str) -> None:
    """Run `work` in a daemon thread and wait for it at most `seconds`."""

    def run() -> None:
        try:
            work()
        except Exception as failure:
            shared.log(f"train: could not {what} ({failure})")

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        shared.log(f"train: could not {what} within {seconds:.0f} s; leaving without it")


def after_chief(name: str, is_chief: bool, work: Callable[[], None], *, timeout_s: float) -> None:
    """The chief does `work` while the other processes wait for it (bounded), so none exits
    into JAX's shutdown barrier while the chief still works. If the work fails, the chief
    leaves the slice with that error (`leave_with`) and the others, waiting here, leave with
    the same line."""
    if jax.process_count() == 1:
        work()
        return
    if is_chief:
        work()
    gather_strings(name, "ok", timeout_s=timeout_s)
