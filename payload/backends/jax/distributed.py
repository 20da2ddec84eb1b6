"""Multi-process JAX: one program per host, joined by `jax.distributed.initialize()`.

On a Cloud TPU slice every worker runs the same trainer unit and JAX finds the coordinator,
the process count and this worker's index itself (`jax.distributed.initialize()` with no
arguments; its cluster detection for Cloud TPU, jax/_src/clusters/cloud_tpu_cluster.py):
the unit sets TPU_PAYLOAD_JAX_DISTRIBUTED=auto. Anywhere else the three values are given
explicitly, `<coordinator host:port>,<process count>,<process index>` (the tests' two CPU
processes on 127.0.0.1). Unset: one process, no initialisation.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from payload import errors, training
from payload.errors import UserError

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
    """Join the other processes if the environment says so (before any other JAX call)."""
    value = environ.get(ENV, "")
    if not value:
        return False
    explicit = parse(value)
    if explicit is None:
        jax.distributed.initialize()
    else:
        address, count, index = explicit
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count, process_id=index
        )
    return True


# How the processes of a slice agree (docs/backends.md, "how hosts agree on stopping"):
# through the coordination service `jax.distributed.initialize()` started (process 0 hosts
# it): its key-value store (`DistributedRuntimeClient.key_value_set`, `key_value_dir_get`,
# jax 0.10's jax/_src/distributed.py `global_state.client`). These are host-to-coordinator
# RPCs: nothing is queued on the devices, so agreeing never waits for a running chunk. With
# one process nothing is called. A name may be used once per run (the coordination service
# is new at every start).
#
# Every wait is a poll of the store, not the service's barrier (`wait_at_barrier`): between
# polls a process looks for an abort that another process published (`abort_others`: a
# user error or a stop signal there), so a slice that one host leaves ends on every host
# within a poll, with the same one line, instead of the others waiting out the barrier's
# timeout and then failing with a traceback (and systemd restarting them, again and again).
PREFIX = "tpu-pretrain"
# Processes reach a chunk's agreement at most a checkpoint write or an evaluation apart.
AGREE_TIMEOUT_S = 3600
# The chief's export (gathering, writing, uploading the weights) while the others wait.
EXPORT_TIMEOUT_S = 4 * 3600
# How long a process that aborts waits for every other process to have read its abort
# (each reads it at its next agreement: at most a chunk, bounded in seconds, away).
ABORT_ACK_TIMEOUT_S = 60.0
# The poll interval grows from the first to the last: a chunk's agreement, where every
# process arrives within milliseconds, costs a few ms; a long wait costs 10 RPCs a second.
POLL_FIRST_S, POLL_LAST_S = 0.002, 0.1
ABORT = f"{PREFIX}/abort"
ABORT_SEEN = f"{PREFIX}/abort-seen"
# An abort's kind: the name of a UserError class of payload.errors, or SIGNAL_KIND.
SIGNAL_KIND = "signal"


class PeerAbortError(Exception):
    """Marks an exception raised because another process aborted (nothing to re-publish)."""


def _client():
    from jax._src import distributed as jax_distributed  # noqa: PLC0415  (the client lives here)

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised but JAX sees several processes")
    return client


def _entries(client: Any, directory: str) -> dict[int, str]:
    return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(directory)}


def _raise_if_aborted(client: Any) -> None:
    """Raise, on this process, the abort another process published (the lowest index's)."""
    me = jax.process_index()
    others = {i: v for i, v in _entries(client, f"{ABORT}/").items() if i != me}
    if not others:
        return
    index = min(others)
    kind, _, message = others[index].partition("\n")
    client.key_value_set(f"{ABORT_SEEN}/{me}", str(index), allow_overwrite=True)
    if kind == SIGNAL_KIND:
        signum, _, text = message.partition("\n")
        training.log(f"train: process {index} of the slice {text}")
        raise _PeerInterrupted(int(signum), f"process {index} of the slice {text}")
    error_class = getattr(errors, kind, UserError)
    if not (isinstance(error_class, type) and issubclass(error_class, UserError)):
        error_class = UserError
    exc = error_class(message)
    exc.__cause__ = PeerAbortError(f"process {index}")
    raise exc


class _PeerInterrupted(training.TrainingInterrupted):
    """Another process of the slice was stopped by a signal before training could agree on a
    checkpoint: this one stops too, like the signal (exit 128 + signum)."""


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
    same complete set (a process that aborts meanwhile ends the wait on every other)."""
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


def agree_on_signal(step: int, signum: int | None) -> int | None:
    """The stop decision of every process after the chunk ending at `step`: the signal one
    of them received (the smallest number if several did), else None. The same answer on
    every process, so all checkpoint this step and exit alike."""
    if jax.process_count() == 1:
        return signum
    seen = [int(s) for s in gather_strings(f"stop/{step}", str(signum or 0)) if int(s)]
    return min(seen) if seen else None


def agree_on_checks(name: str, check: Callable[[], None]) -> None:
    """Run `check` on every process; if it raises a UserError on any, raise the first such
    error (by process index) on every process, so a user error exits 2 on every host with
    the same line instead of leaving the others in a collective. A bug (any other exception)
    keeps its traceback where it happened and is a one-line error on the others."""
    try:
        check()
    except UserError as exc:
        mine = f"{type(exc).__name__}\n{exc}"
        failure: BaseException | None = exc
    except BaseException:
        gather_strings(f"checks/{name}", "bug\n")
        raise
    else:
        mine, failure = "ok\n", None
    outcomes = gather_strings(f"checks/{name}", mine)
    for index, outcome in enumerate(outcomes):
        kind, _, message = outcome.partition("\n")
        if kind == "ok":
            continue
        if failure is not None:
            raise failure
        if kind == "bug":
            raise UserError(f"process {index} of the slice failed its {name} (see its log)")
        raise getattr(errors, kind, UserError)(message)


def abort_others(exc: BaseException) -> None:
    """This process is leaving with `exc` (a user error, or a stop signal outside the
    training loop's agreement): publish it, so every other process raises the same one line
    at its next agreement (`_raise_if_aborted`) instead of waiting for this one, then wait
    (bounded) until each has read it or left itself: the coordination service lives in
    process 0, and the others must read the abort before it is gone. Nothing with one
    process, or for an exception that came from another process's abort."""
    # jax.distributed's own state, not jax.process_count(): that initialises the backend,
    # which may be what failed (a TPU VM whose JAX finds no TPU).
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    state = jax_distributed.global_state
    if state.client is None or state.num_processes <= 1 or _from_peer(exc):
        return
    if isinstance(exc, training.TrainingInterrupted):
        entry = f"{SIGNAL_KIND}\n{int(exc.code or 0) - 128}\n{exc.message}"
    elif isinstance(exc, UserError):
        entry = f"{type(exc).__name__}\n{exc}"
    else:
        return
    try:
        client = state.client
        me = state.process_id
        client.key_value_set(f"{ABORT}/{me}", entry, allow_overwrite=True)
        deadline = time.monotonic() + ABORT_ACK_TIMEOUT_S
        others = set(range(state.num_processes)) - {me}
        while time.monotonic() < deadline:
            done = set(_entries(client, f"{ABORT_SEEN}/")) | set(_entries(client, f"{ABORT}/"))
            if others <= done:
                return
            time.sleep(POLL_LAST_S)
        training.log(
            f"train: processes {sorted(others - done)} did not read this process's abort "
            f"within {ABORT_ACK_TIMEOUT_S:.0f} s"
        )
    except Exception as failure:  # the service may be gone already: the exit goes on
        training.log(f"train: could not tell the other processes ({failure})")


def _from_peer(exc: BaseException) -> bool:
    return isinstance(exc, _PeerInterrupted) or isinstance(exc.__cause__, PeerAbortError)


def after_chief(name: str, is_chief: bool, work: Callable[[], None], *, timeout_s: float) -> None:
    """The chief does `work` while the other processes wait for it (bounded), so none exits
    into JAX's shutdown barrier (300 s by default) while the chief still works, and the
    others learn whether it succeeded (a one-line error if not)."""
    if jax.process_count() == 1:
        work()
        return
    outcome = "ok"
    try:
        if is_chief:
            try:
                work()
            except BaseException:
                outcome = "failed"
                raise
    finally:
        outcomes = gather_strings(name, outcome, timeout_s=timeout_s)
    if outcomes[0] != "ok" and not is_chief:
        raise UserError(f"process 0 of the slice failed its {name} (see its log)")
