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
from collections.abc import Mapping

import jax

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
