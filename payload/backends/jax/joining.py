"""Joining a slice, bounded: every process of a slice waits in `jax.distributed.initialize()`
for all of them (JAX's RegisterTask: jax 0.10.2's `initialize` passes
`initialization_timeout` to the client, whose Connect then aborts the process, SIGABRT,
naming nobody). Worker 0's trainer may end before it joins (its job or manifest check, the
lease, a status write, an install): every other host then names worker 0 within TIMEOUT_S
(`watch`) and exits 1, instead of aborting after JAX's 300 s without a word.

Whether the host waited for is worker 0 is told by its coordinator's port: a process that
joins starts the coordination service first (process 0 only), so a closed port means worker
0's process is not there; an open one, that another worker is missing. Worker 0 itself cannot
tell which one (no API of the service lists the processes that registered).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from payload.core.errors import UserError
from payload.training import shared

TIMEOUT_S = 300.0
ENV = "TPU_PAYLOAD_JOIN_TIMEOUT_S"
# JAX's own bound is ours plus this: ours ends the process first, with its line.
MARGIN_S = 30.0
EXIT = 1  # a failure the trainer unit restarts (and counts)


def timeout(environ: Mapping[str, str] = os.environ) -> float:
    """The join's bound: ENV's seconds, or TIMEOUT_S."""
    raw = environ.get(ENV, "")
    if not raw:
        return TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{ENV}: {raw!r} must be a positive number of seconds")
    return value


def watch(timeout_s: float, state: Callable[[], Any]) -> threading.Event:
    """A thread that ends this process with one line (`failure_line`) if it has not joined
    the slice within `timeout_s`; set the event once joined. `state()`: jax.distributed's
    state, whose process id, count and coordinator `initialize` sets before it connects."""
    joined = threading.Event()
    shared.log(f"train: joining the slice (at most {timeout_s:.0f} s, {ENV})")

    def run() -> None:
        if joined.wait(timeout_s):
            return
        shared.log(failure_line(timeout_s, state()))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing to flush
                stream.flush()
        os._exit(EXIT)

    threading.Thread(target=run, name="slice-join", daemon=True).start()
    return joined


def failure_line(timeout_s: float, state: Any) -> str:
    """Who this process waited for when the join's bound passed."""
    me, count, address = state.process_id, state.num_processes, state.coordinator_address
    after = f"within {timeout_s:.0f} s ({ENV})"
    restart = f"exit {EXIT}: the trainer unit restarts it"
    if address is None:
        return f"error: this process could not find its slice {after}; {restart}"
    if me == 0:
        return (
            f"error: process 0 of the slice (worker 0, the coordinator at {address}) did not "
            f"see all {count} processes join {after}: the missing ones' logs (journalctl -u "
            f"tpu-pretrain-train on each worker) say why; {restart}"
        )
    if not answers(address):
        return (
            f"error: process {me} of the slice could not join it {after}: process 0 (worker 0, "
            f"the coordinator at {address}) is not up: its trainer ended before it joined, or "
            "its host is down (worker 0's log, journalctl -u tpu-pretrain-train, and its "
            f"status.json say why); {restart}"
        )
    return (
        f"error: process {me} of the slice could not join it {after}: process 0 (worker 0, "
        f"the coordinator at {address}) is up, but not all {count} processes joined: the "
        f"missing ones' logs say why; {restart}"
    )


def answers(address: str) -> bool:
    """Whether something listens at `address` (host:port): the coordinator's service."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5.0):
            return True
    except (OSError, ValueError):
        return False
