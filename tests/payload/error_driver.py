"""The real `tpu-payload` command line with a user error injected on this process only:

    python error_driver.py MODULE:ATTR:N MESSAGE COMMAND ARGS...

The N-th call of ``MODULE.ATTR`` (ATTR may be ``Class.method``) raises
``payload.errors.SpecError(MESSAGE)`` instead of running: what one host of a slice would see
of a user error the others do not (its own disk, its own environment). Everything else is
`python -m payload COMMAND ARGS...`.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any


def _failing(target: Callable[..., Any], nth: int, message: str) -> Callable[..., Any]:
    calls = 0

    @functools.wraps(target)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth:
            from payload.errors import SpecError

            raise SpecError(message)
        return target(*args, **kwargs)

    return wrapped


if __name__ == "__main__":
    where, message, *command = sys.argv[1:]
    module_name, attr, nth = where.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, _failing(getattr(owner, name), int(nth), message))
    sys.argv = ["tpu-payload", *command]
    from payload.cli import main

    raise SystemExit(main())
