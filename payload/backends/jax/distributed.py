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
from collections.abc import Callable, Mapping

import jax

from payload import errors
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
# it): its key-value store and its barriers (`DistributedRuntimeClient.key_value_set`,
# `key_value_dir_get`, `wait_at_barrier(barrier_id, timeout_in_ms)`, jax 0.10's
# jax/_src/distributed.py `global_state.client`; orbax's multihost `sync_global_processes`
# uses the same barrier). These are host-to-coordinator RPCs: nothing is queued on the
# devices, so agreeing never waits for a running chunk. With one process nothing is called.
# A barrier name may be used once per run (the coordination service is new at every start).
PREFIX = "tpu-pretrain"
# Processes reach a chunk's agreement at most a checkpoint write or an evaluation apart.
AGREE_TIMEOUT_S = 3600
# The chief's export (gathering, writing, uploading the weights) while the others wait.
EXPORT_TIMEOUT_S = 4 * 3600


def _client():
    from jax._src import distributed as jax_distributed  # noqa: PLC0415  (the client lives here)

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised but JAX sees several processes")
    return client


def barrier(name: str, timeout_s: float = AGREE_TIMEOUT_S) -> None:
    """Every process waits here until all have arrived (bounded); nothing with one process."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(f"{PREFIX}/{name}", int(timeout_s * 1000))


def gather_strings(name: str, mine: str, timeout_s: float = AGREE_TIMEOUT_S) -> list[str]:
    """Every process's `mine`, by process index: each publishes its own, all meet at a
    barrier, then all read the same complete set."""
    if jax.process_count() == 1:
        return [mine]
    client = _client()
    client.key_value_set(f"{PREFIX}/{name}/{jax.process_index()}", mine)
    client.wait_at_barrier(f"{PREFIX}/{name}", int(timeout_s * 1000))
    entries = client.key_value_dir_get(f"{PREFIX}/{name}/")
    by_process = {int(key.rsplit("/", 1)[1]): value for key, value in entries}
    return [by_process[i] for i in range(jax.process_count())]


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
