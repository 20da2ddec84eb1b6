"""The real `tpu-payload` command line with something going wrong on this process only:

    python error_driver.py [ACTION@]MODULE:ATTR:N[,...] MESSAGE COMMAND ARGS...

At the N-th call of ``MODULE.ATTR`` (ATTR may be ``Class.method``), ACTION:

- ``user`` (the default): ``payload.core.errors.SpecError(MESSAGE)`` is raised instead of the
  call: what one host of a slice would see of a user error the others do not (its own disk,
  its own environment);
- ``bug``: ``RuntimeError(MESSAGE)`` is raised instead (an error that is not a user error);
- ``gc-sigterm``: after the call returns, a garbage collection is forced whose callback
  sends SIGTERM to this process, so that Python runs the signal's handler inside the gc
  callback (where JAX's ``_xla_gc_callback`` runs; an exception raised there is printed as
  "Exception ignored in: ..." and lost);
- ``default-sigterm``: after the call returns, SIGTERM gets its default action back, as a
  library that installs its own handler would leave it (libtpu does when the TPU backend
  starts);
- ``lagging``: the call's result (a list) without its last item, as a listing that does not
  show the newest entry yet (a host whose file system lags the others');
- ``unreachable``: the call runs with Cloud Storage unreachable (STORAGE_EMULATOR_HOST
  pointed at a port nothing listens on, a fresh client), as a host whose network to the
  bucket is down; the real error of the real retries ends it;
- ``enospc``: ``OSError(ENOSPC)`` for the file MESSAGE is raised instead (a full disk);
- ``tpu-chips``: the call answers ``(4, None)``: JAX's count of the TPU chips on the PCI bus
  (``jax._src.hardware_utils.num_available_tpu_chips_and_device_id``) says four are
  attached, on a machine that has none.

Each injection prints ``injected ACTION at MODULE:ATTR:N at <unix time>`` to stderr (the
tests measure from it how long the slice takes to end). Everything else is
`python -m payload COMMAND ARGS...`.
"""

from __future__ import annotations

import errno
import functools
import gc
import importlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

ACTIONS = (
    "user",
    "bug",
    "gc-sigterm",
    "default-sigterm",
    "lagging",
    "unreachable",
    "enospc",
    "tpu-chips",
)


def _announce(action: str, where: str) -> None:
    print(f"injected {action} at {where} at {time.time():.3f}", file=sys.stderr, flush=True)


def _sigterm_inside_a_gc_callback() -> None:
    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc.callbacks.remove(callback)
            signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns

    gc.callbacks.append(callback)
    gc.collect()


def _unreachable(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from payload.core import storage

    with socket.socket() as sock:  # a free port, closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    storage.reset_client()
    try:
        return target(*args, **kwargs)
    finally:
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
        storage.reset_client()


def _injected(target: Callable[..., Any], action: str, nth: int, where: str, message: str):
    calls = 0

    @functools.wraps(target)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls != nth:
            return target(*args, **kwargs)
        _announce(action, where)
        if action == "user":
            from payload.core.errors import SpecError

            raise SpecError(message)
        if action == "bug":
            raise RuntimeError(message)
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), message)
        if action == "tpu-chips":
            return 4, None
        if action == "unreachable":
            return _unreachable(target, *args, **kwargs)
        result = target(*args, **kwargs)
        if action == "lagging":
            return result[:-1]
        if action == "gc-sigterm":
            _sigterm_inside_a_gc_callback()
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return result

    return wrapped


def _install(spec: str, message: str) -> None:
    action, _, where = spec.rpartition("@")
    action = action or "user"
    if action not in ACTIONS:
        raise SystemExit(f"error_driver: {spec!r}: the action must be one of {ACTIONS}")
    module_name, attr, nth = where.split(":")
    if module_name.startswith("payload.backends.jax."):
        from payload.backends.jax import use_jax  # Keras on JAX before a module imports it

        use_jax()
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, _injected(getattr(owner, name), action, int(nth), where, message))


if __name__ == "__main__":
    wheres, message, *command = sys.argv[1:]
    for spec in wheres.split(","):
        _install(spec, message)
    sys.argv = ["tpu-payload", *command]
    from payload.cli import main

    raise SystemExit(main())
