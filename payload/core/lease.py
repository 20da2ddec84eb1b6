"""One writer per output: an exclusive, expiring hold on a job's output, local or gs://.

A run that writes (``tokenizer``, ``encode``, ``train``, ``run``) creates ``<output>/.lease.json``
before it writes anything else, create-only, and keeps it fresh from a background thread
(a heartbeat every ``heartbeat_s``; each one moves ``expires_at`` to now + ``ttl_s``). The
document names the holder: host, pid, command, start time, last heartbeat and expiry.

Every change is conditional on the version the writer last saw: on gs:// the object's
generation (``if_generation_match=0`` to create, ``=<generation>`` to renew, take over or
delete: Cloud Storage decides, so two hosts cannot both win); locally the same protocol under
an ``flock`` of a lock file beside the lease, with atomic renames (payload.core.storage
``*_versioned``). A second run finds the lease and refuses with one line naming the holder
and how to take over (:class:`LeaseHeldError`, exit 2), before it writes anything (not even
``status.json``, which is the holder's).

A lease is taken over, instead of refused, when

* it has expired (the holder was killed with SIGKILL, its VM is gone, its heartbeats stopped);
* its holder was a process on this machine that no longer exists (same host name, boot id and
  pid namespace, and that pid is gone or is another process: its start time differs), so a
  run that systemd restarts after an OOM kill does not wait for the expiry;
* the user says so (``--take-over``: for a holder known to be gone, without waiting for the
  expiry). A holder that is still alive sees the changed generation at its next heartbeat and
  stops at once (:data:`LOST_EXIT`), writing nothing more.

When the holder's heartbeats have stopped (its last one is older than two heartbeat
intervals) but the lease has not expired yet, a new run waits for the expiry (at most
``ttl_s``), saying so, instead of refusing: a VM recreated after a preemption then resumes
without a user. A holder whose heartbeats are fresh is refused at once.

Expiry is judged on the clock of the run that looks, against the holder's clock: hosts'
clocks must agree to well within ``ttl_s`` (NTP-synchronised clocks do).

The heartbeat thread shares the process's google-cloud-storage client ("safe to share
instances across threads": python-storage's docs/index.rst).

Release: on every normal end, on a handled error and on Ctrl-C (the CLI), and at interpreter
exit as a backstop. A process killed outright (SIGKILL, an unhandled SIGTERM) or a lost VM
leaves it behind: then the expiry, or the dead-pid rule above, applies.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from payload.core import storage
from payload.core.errors import UserError

LEASE_NAME = ".lease.json"
TTL_S = 180.0
HEARTBEAT_S = 30.0
WRITING_COMMANDS = ("tokenizer", "encode", "train", "run")
LOST_EXIT = 2  # another run took the output over: stop, and let systemd not restart us
STALE_EXIT = 1  # the lease could not be renewed before it expired (storage unreachable)
TAKE_OVER_HINT = "--take-over"


class LeaseHeldError(UserError):
    """Another run holds the output."""


@dataclass(frozen=True)
class Identity:
    """Who holds a lease: enough to tell, on the same machine, whether it is still alive."""

    host: str
    pid: int
    boot_id: str  # /proc/sys/kernel/random/boot_id: this boot of this kernel
    pid_ns: str  # the pid namespace (containers on one kernel have their own)
    proc_start: str  # /proc/<pid>/stat field 22: the process's start, in clock ticks since boot

    @classmethod
    def current(cls) -> Identity:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            boot_id=_read("/proc/sys/kernel/random/boot_id"),
            pid_ns=_pid_namespace(),
            proc_start=process_start(pid),
        )


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot), "" if there is none."""
    stat = _read(f"/proc/{pid}/stat")
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields follow the last ")".
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def is_writer(environ: Mapping[str, str]) -> bool:
    """False for a process of a multi-worker cluster that is not its chief.

    TF's rule (tensorflow/python/distribute/multi_worker_util.py ``is_chief``): the task of
    type ``chief``, or ``worker`` 0 when the cluster has no ``chief``. On a TPU slice the
    payload runs on worker 0 only (one TPUStrategy client), which is the writer.
    """
    raw = environ.get("TF_CONFIG")
    if not raw:
        return True
    try:
        config = json.loads(raw)
        cluster, task = config.get("cluster") or {}, config.get("task") or {}
        task_type, index = task.get("type"), int(task.get("index", 0))
    except (ValueError, TypeError, AttributeError):
        return True  # TF itself will refuse a malformed TF_CONFIG
    if not task_type:
        return True
    return task_type == "chief" or (task_type == "worker" and index == 0 and "chief" not in cluster)


def needed(command: str, environ: Mapping[str, str]) -> bool:
    """Whether ``command`` takes the lease: it writes the output, and this process is the writer.

    ``validate`` and ``export`` (which checks the finished export and may upload it to the
    Hub) only read the output.
    """
    return command in WRITING_COMMANDS and is_writer(environ)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


def _seconds(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def describe(doc: Mapping[str, Any]) -> str:
    """The holder, for a user: command, pid, host and start time."""
    return (
        f"`tpu-payload {doc.get('command', '?')}` (pid {doc.get('pid', '?')} on host "
        f"{doc.get('host', '?')}, started {doc.get('started_at', '?')})"
    )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _exit_now(code: int) -> None:
    os._exit(code)  # from the heartbeat thread: stop every thread at once, write nothing more


class Lease:
    """The hold of one run on one output; ``acquire()`` it, ``release()`` it (or use ``with``)."""

    def __init__(
        self,
        output: str,
        *,
        command: str,
        ttl_s: float = TTL_S,
        heartbeat_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        identity: Identity | None = None,
        echo: Callable[[str], None] = _stderr,
        on_lost: Callable[[int], None] = _exit_now,
        background: bool = True,
    ):
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"heartbeat_s {heartbeat_s} must be in (0, ttl_s={ttl_s})")
        self.output = output
        self.path = storage.join(output, LEASE_NAME)
        self.command = command
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self.clock, self.sleep, self.echo, self.on_lost = clock, sleep, echo, on_lost
        self.background = background  # False: no heartbeat thread, no exit hook (tests)
        self.identity = identity or Identity.current()
        self.token = uuid.uuid4().hex
        self.generation: int | None = None  # None: not held
        self.doc: dict[str, Any] = {}
        self.expires_at = 0.0
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ taking it

    def _document(self, now: float) -> dict[str, Any]:
        started = self.doc.get("started_at") or _iso(now)
        return {
            "format": 1,
            "token": self.token,
            "command": self.command,
            **asdict(self.identity),
            "started_at": started,
            "heartbeat_at": _iso(now),
            "expires_at": _iso(now + self.ttl_s),
            "ttl_s": self.ttl_s,
            "heartbeat_s": self.heartbeat_s,
        }

    def _encode(self, doc: Mapping[str, Any]) -> bytes:
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()

    def acquire(self, *, take_over: bool = False) -> Lease:
        """Take the lease, or raise :class:`LeaseHeldError` naming the holder."""
        waited_for: int | None = None
        for _ in range(1000):  # each pass ends in a return, a raise, or a changed lease
            current = storage.read_versioned(self.path)
            now = self.clock()
            if current is None:
                if self._write(now, generation=0):
                    return self._started()
                continue
            data, generation = current
            holder = _parse(data)
            reason = self._takeover_reason(holder, now, take_over=take_over)
            if reason:
                if self._write(now, generation=generation):
                    self.echo(f"lease: took over {self.output} from {describe(holder)}: {reason}")
                    return self._started()
                continue
            wait = self._wait_for_expiry(holder, now)
            if wait is None or waited_for == generation:
                raise LeaseHeldError(self._refusal(holder, now))
            if waited_for is None:
                self.echo(
                    f"lease: {self.output} is held by {describe(holder)}, whose heartbeats "
                    f"stopped at {holder.get('heartbeat_at')}; waiting {wait:.0f}s for it to "
                    f"expire (Ctrl-C stops)"
                )
            self.sleep(wait)
            waited_for = generation  # a holder that renewed meanwhile is alive: refuse then
        raise LeaseHeldError(f"{self.path}: the lease kept changing; another run is starting too")

    def _write(self, now: float, *, generation: int) -> bool:
        doc = self._document(now)
        data = self._encode(doc)
        try:
            new_generation = storage.write_versioned(self.path, data, generation=generation)
        except storage.Conflict:
            # Lost the race, or our own write landed and a retry of it was refused: look.
            current = storage.read_versioned(self.path)
            if current is None or _parse(current[0]).get("token") != self.token:
                return False
            new_generation = current[1]
        self.generation, self.doc = new_generation, doc
        self.expires_at = now + self.ttl_s
        return True

    def _takeover_reason(self, holder: Mapping[str, Any], now: float, *, take_over: bool) -> str:
        expires = _seconds(holder.get("expires_at"))
        if expires is None:
            return "the lease is not readable"
        if now >= expires:
            return f"its lease expired at {holder.get('expires_at')}"
        if self._holder_gone(holder):
            return "that process no longer exists"
        if take_over:
            return f"{TAKE_OVER_HINT} (a live holder stops at its next heartbeat)"
        return ""

    def _holder_gone(self, holder: Mapping[str, Any]) -> bool:
        """True only when the holder was a process of this very machine and pid namespace."""
        me = self.identity
        same_machine = (
            me.boot_id
            and me.pid_ns
            and (holder.get("host"), holder.get("boot_id"), holder.get("pid_ns"))
            == (me.host, me.boot_id, me.pid_ns)
        )
        if not same_machine or not isinstance(holder.get("pid"), int):
            return False
        return process_start(holder["pid"]) != holder.get("proc_start")

    def _wait_for_expiry(self, holder: Mapping[str, Any], now: float) -> float | None:
        """Seconds to wait for a lease whose heartbeats stopped; None: the holder is alive."""
        beat = _seconds(holder.get("heartbeat_at"))
        expires = _seconds(holder.get("expires_at"))
        interval = holder.get("heartbeat_s")
        if beat is None or expires is None or not isinstance(interval, int | float):
            return None
        if now - beat <= 2 * interval:
            return None
        return max(expires - now, 0.0) + min(1.0, self.heartbeat_s)

    def _refusal(self, holder: Mapping[str, Any], now: float) -> str:
        beat = _seconds(holder.get("heartbeat_at"))
        ago = f"last heartbeat {now - beat:.0f}s ago, " if beat is not None else ""
        return (
            f"{self.output} is being written by {describe(holder)}: one run per output "
            f"({ago}lease {self.path} expires {holder.get('expires_at')} unless renewed); wait "
            f"for it to finish or stop it; if it is gone (VM deleted, process killed), rerun "
            f"after that expiry, or now with {TAKE_OVER_HINT}"
        )

    def _started(self) -> Lease:
        self._stop.clear()
        if not self.background:
            return self
        atexit.register(self.release)
        self._thread = threading.Thread(
            target=self._beat, name=f"lease-heartbeat {self.path}", daemon=True
        )
        self._thread.start()
        return self

    # ------------------------------------------------------------------ keeping it

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.renew()

    def renew(self) -> bool:
        """One heartbeat; False (and ``on_lost``) when the lease is no longer ours."""
        with self._lock:
            if self.generation is None or self._stop.is_set():
                return False
            now = self.clock()
            try:
                if self._write(now, generation=self.generation):
                    return True
            except Exception as exc:  # (storage down: retried until the expiry)
                if now < self.expires_at:
                    self.echo(f"lease: could not renew {self.path} ({exc}); retrying")
                    return True
                self.lost = (
                    f"error: could not renew the lease {self.path} before it expired at "
                    f"{_iso(self.expires_at)} ({' '.join(str(exc).split())}); this run stops "
                    "so that another one can take over safely"
                )
                code = STALE_EXIT
            else:
                current = storage.read_versioned(self.path)
                holder = _parse(current[0]) if current else {}
                taker = describe(holder) if holder else "nobody (the lease was deleted)"
                self.lost = (
                    f"error: {self.output} was taken over by {taker}; this run stops now "
                    "and writes nothing more"
                )
                code = LOST_EXIT
            self.generation = None
        self.echo(self.lost)
        self.on_lost(code)
        return False

    # ------------------------------------------------------------------ giving it back

    def release(self) -> None:
        """Delete the lease if it is still ours (best effort: it expires anyway)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.heartbeat_s)
        atexit.unregister(self.release)
        with self._lock:
            generation, self.generation = self.generation, None
            if generation is None:
                return
            try:
                for _ in range(3):
                    try:
                        storage.remove_versioned(self.path, generation=generation)
                        return
                    except storage.Conflict:
                        current = storage.read_versioned(self.path)
                        if current is None or _parse(current[0]).get("token") != self.token:
                            return  # already gone, or someone else's now
                        generation = current[1]
            except Exception as exc:  # (never hide the run's own outcome)
                self.echo(f"warning: could not release the lease {self.path}: {exc}")

    @property
    def held(self) -> bool:
        return self.generation is not None

    def __enter__(self) -> Lease:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _parse(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def hold(
    output: str, command: str, environ: Mapping[str, str], *, take_over: bool = False
) -> Lease | None:
    """The CLI's entry: the lease for ``command`` on ``output``, or None when not needed."""
    if not needed(command, environ):
        return None
    return Lease(output, command=command).acquire(take_over=take_over)
