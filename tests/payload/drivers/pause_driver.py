"""The real `tpu-payload` command line, paused once at a point the test chooses.

Signal tests deliver their signal while the command waits here, instead of after a sleep
that a fast machine outruns:

    python pause_driver.py READY_FD GATE_FD POINT COMMAND ARGS...

POINT is ``before:MODULE:ATTR:N`` / ``after:MODULE:ATTR:N`` (pause before the N-th call of
``MODULE.ATTR`` starts, or after it returns; ATTR may be ``Class.method``) or ``exit``
(pause while the interpreter tears itself down after ``main`` returned: CPython has by then
given SIGINT back its default action unless the program ignores it). At the pause the driver
writes one line to READY_FD and then reads GATE_FD until the test closes its end.
Everything else is `python -m payload COMMAND ARGS...` started from a terminal: the same
``payload.cli.main``, with Python's own SIGINT handler even when the test runner was started
with SIGINT ignored (as a script's background job is), which Python would otherwise keep.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


class _Pause:
    """Tells the test where it is, then waits for the gate to close (EOF)."""

    def __init__(self, ready_fd: int, gate_fd: int, label: str):
        # Bound now: during interpreter teardown module globals may be gone.
        self._write, self._read, self._close = os.write, os.read, os.close
        self.ready_fd, self.gate_fd, self.label = ready_fd, gate_fd, label

    def wait(self) -> None:
        self._write(self.ready_fd, f"paused at {self.label}\n".encode())
        self._close(self.ready_fd)
        while self._read(self.gate_fd, 4096):
            pass


class _AtExit:
    """Pauses from ``__del__``, run when the driver's module globals are cleared at exit."""

    def __init__(self, pause: _Pause):
        self.pause = pause

    def __del__(self) -> None:
        self.pause.wait()


def _wrap(target: Callable[..., Any], when: str, nth: int, pause: _Pause) -> Callable[..., Any]:
    calls = 0

    @functools.wraps(target)
    def paused(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if when == "before" and calls == nth:
            pause.wait()
        result = target(*args, **kwargs)
        if when == "after" and calls == nth:
            pause.wait()
        return result

    return paused


def _install(point: str, pause: _Pause) -> object | None:
    if point == "exit":
        return _AtExit(pause)
    when, module_name, attr, nth = point.split(":")
    if when not in ("before", "after"):
        raise SystemExit(f"pause_driver: {point!r}: expected before|after:MODULE:ATTR:N")
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, _wrap(getattr(owner, name), when, int(nth), pause))
    return None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ready, gate, where, *command = sys.argv[1:]
    _at_exit = _install(where, _Pause(int(ready), int(gate), where))
    sys.argv = ["tpu-payload", *command]
    from payload.cli import main

    raise SystemExit(main())
