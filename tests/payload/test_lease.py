"""One writer per output: the lease, locally and against a real fake-gcs-server.

Expiry is tested with an injected clock (and an injected sleep that advances it), never by
waiting for real time to pass. Holders killed with SIGKILL are real child processes; the test
synchronises on the line they print once the lease object exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from train_helpers import assert_user_error, job_document, run_cli, write_corpus

from payload.core import lease, storage

TTL, BEAT = 60.0, 10.0
PROCESS_TIMEOUT_S = 120


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.emulator)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    return str(request.getfixturevalue("gcs_root"))


class Clock:
    """A wall clock the test moves; ``sleep`` advances it instead of waiting."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def other_host(pid: int = 4242, host: str = "other-vm") -> lease.Identity:
    return lease.Identity(host=host, pid=pid, boot_id="b-other", pid_ns="pid:[1]", proc_start="77")


def make(root: str, clock: Clock, **kwargs: object) -> tuple[lease.Lease, list[str], list[int]]:
    said: list[str] = []
    lost: list[int] = []
    options: dict[str, object] = {
        "command": "run",
        "ttl_s": TTL,
        "heartbeat_s": BEAT,
        "clock": clock,
        "sleep": clock.sleep,
        "echo": said.append,
        "on_lost": lost.append,
        "background": False,  # the test calls renew(); no thread on the real clock
        **kwargs,
    }
    return lease.Lease(root, **options), said, lost  # type: ignore[arg-type]


def read_doc(root: str) -> dict[str, object]:
    return dict(json.loads(storage.read_text(storage.join(root, lease.LEASE_NAME))))


def test_acquire_renew_release(root: str) -> None:
    clock = Clock()
    held, _, lost = make(root, clock)
    held.acquire()
    try:
        doc = read_doc(root)
        me = lease.Identity.current()
        assert (doc["host"], doc["pid"], doc["command"]) == (me.host, os.getpid(), "run")
        assert doc["proc_start"] == me.proc_start != ""
        assert lease.LEASE_NAME not in [Path(p).name for p in storage.walk_files(root)]
        first = held.generation
        clock.now += BEAT
        assert held.renew()
        assert held.generation != first
        renewed = read_doc(root)
        assert renewed["started_at"] == doc["started_at"]
        assert renewed["heartbeat_at"] != doc["heartbeat_at"]
        assert lease._seconds(renewed["expires_at"]) == clock.now + TTL
    finally:
        held.release()
    assert not storage.exists(storage.join(root, lease.LEASE_NAME))
    assert lost == []
    held.release()  # twice is harmless


def test_second_run_refused_with_one_line_naming_the_holder(root: str) -> None:
    clock = Clock()
    first, _, _ = make(root, clock, identity=other_host())
    first.acquire()
    clock.now += 5
    second, _, _ = make(root, clock)
    with pytest.raises(lease.LeaseHeldError) as caught:
        second.acquire()
    message = str(caught.value)
    assert "\n" not in message
    for part in ("other-vm", "pid 4242", first.doc["started_at"], "--take-over", "tpu-payload run"):
        assert str(part) in message, message
    assert "last heartbeat 5s ago" in message
    assert read_doc(root)["token"] == first.token  # untouched
    first.release()


def test_expired_lease_is_taken_over_and_the_old_holder_stops(root: str) -> None:
    clock = Clock()
    old, _, old_lost = make(root, clock, identity=other_host())
    old.acquire()
    clock.now += TTL  # no heartbeat for a whole ttl: expired
    new, said, _ = make(root, clock)
    new.acquire()
    assert new.held and read_doc(root)["token"] == new.token
    assert said == [
        f"lease: took over {root} from {lease.describe(old.doc)}: its lease expired at "
        f"{old.doc['expires_at']}"
    ]
    assert clock.slept == []
    # The old holder wakes up: its conditional renewal fails and it stops.
    assert not old.renew()
    assert old_lost == [lease.LOST_EXIT]
    assert old.lost and f"pid {os.getpid()}" in old.lost and "taken over" in old.lost
    old.release()  # must not delete the new holder's lease
    assert read_doc(root)["token"] == new.token
    new.release()


def test_stopped_heartbeats_are_waited_out_but_a_live_holder_is_refused(root: str) -> None:
    clock = Clock()
    old, _, _ = make(root, clock, identity=other_host())
    old.acquire()
    clock.now += 2 * BEAT + 1  # two heartbeats missed, lease still valid for 39 s
    new, said, _ = make(root, clock)
    new.acquire()
    assert clock.slept == [TTL - 2 * BEAT - 1 + 1.0]
    assert said[0].startswith(f"lease: {root} is held by ") and "waiting 40s" in said[0]
    assert "expired" in said[1]
    new.release()

    # Same start, but the holder renews while the newcomer waits: refused then.
    clock = Clock()
    old, _, _ = make(root, clock, identity=other_host())
    old.acquire()
    clock.now += 2 * BEAT + 1
    alive, said, _ = make(root, clock)
    alive.sleep = lambda seconds: (setattr(clock, "now", clock.now + 1), old.renew())
    with pytest.raises(lease.LeaseHeldError, match="last heartbeat 0s ago"):
        alive.acquire()
    assert read_doc(root)["token"] == old.token
    old.release()


def test_take_over_flag_takes_a_live_lease(root: str) -> None:
    clock = Clock()
    old, _, old_lost = make(root, clock, identity=other_host())
    old.acquire()
    new, said, _ = make(root, clock)
    new.acquire(take_over=True)
    assert "--take-over" in said[0]
    assert not old.renew() and old_lost == [lease.LOST_EXIT]
    new.release()


def test_unreadable_lease_is_taken_over(root: str) -> None:
    storage.write_text(storage.join(root, lease.LEASE_NAME), "not json")
    new, said, _ = make(root, Clock())
    new.acquire()
    assert "not readable" in said[0]
    new.release()


def test_racing_runs_exactly_one_wins(root: str) -> None:
    clock = Clock()
    # Different machines: none may treat another's lease as a dead process of its own.
    contenders = [
        make(root, clock, identity=other_host(pid, f"vm-{pid}"))[0] for pid in range(100, 106)
    ]
    barrier = threading.Barrier(len(contenders))
    outcome: dict[int, str] = {}

    def contend(index: int) -> None:
        barrier.wait(timeout=PROCESS_TIMEOUT_S)
        try:
            contenders[index].acquire()
            outcome[index] = "held"
        except lease.LeaseHeldError:
            outcome[index] = "refused"

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(contenders))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=PROCESS_TIMEOUT_S)
    assert sorted(outcome.values()) == ["held"] + ["refused"] * (len(contenders) - 1)
    winner = next(c for i, c in enumerate(contenders) if outcome[i] == "held")
    assert read_doc(root)["token"] == winner.token
    for contender in contenders:
        contender.release()
    assert not storage.exists(storage.join(root, lease.LEASE_NAME))


def test_renewal_that_cannot_reach_storage_stops_only_after_the_expiry(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    held, said, lost = make(root, clock)
    held.acquire()

    def down(*args: object, **kwargs: object) -> int:
        raise storage.StorageError("cannot reach Cloud Storage")

    monkeypatch.setattr(storage, "write_versioned", down)
    clock.now += BEAT
    assert held.renew() and lost == [] and "retrying" in said[-1]
    clock.now += TTL
    assert not held.renew()
    assert lost == [lease.STALE_EXIT] and "before it expired" in said[-1]
    monkeypatch.undo()
    held.release()  # no longer ours: leaves the (expired) object alone
    assert storage.exists(storage.join(root, lease.LEASE_NAME))


# --------------------------------------------------------------------------- real processes

HOLDER = textwrap.dedent(
    """
    import sys
    from payload.core import lease

    root, ttl, beat, host = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    identity = lease.Identity.current()
    if host:
        identity = lease.Identity(host, identity.pid, "b-other", "pid:[1]", "1")
    held = lease.Lease(root, command="train", ttl_s=ttl, heartbeat_s=beat, identity=identity)
    held.acquire()
    print("held", held.generation, flush=True)
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    held.release()
    print("released", flush=True)
    """
)


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=PROCESS_TIMEOUT_S)


def start_holder(
    holders: list[subprocess.Popen[str]], root: str, *, ttl: float, beat: float, host: str = ""
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root, str(ttl), str(beat), host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    holders.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the lease object exists (or the holder died)
    assert line.startswith("held "), proc.communicate(timeout=PROCESS_TIMEOUT_S)
    return proc


def test_holder_killed_with_sigkill_on_this_machine_is_taken_over_at_once(
    root: str, holders: list[subprocess.Popen[str]]
) -> None:
    proc = start_holder(holders, root, ttl=TTL, beat=BEAT)
    clock = Clock(now=time.time())
    refused, _, _ = make(root, clock)
    with pytest.raises(lease.LeaseHeldError, match=rf"pid {proc.pid} on host "):
        refused.acquire()
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=PROCESS_TIMEOUT_S) == -signal.SIGKILL
    assert storage.exists(storage.join(root, lease.LEASE_NAME))  # SIGKILL: nothing released
    new, said, _ = make(root, clock)
    new.acquire()  # long before the expiry: the holder's pid is gone
    assert said == [
        f"lease: took over {root} from `tpu-payload train` (pid {proc.pid} on host "
        f"{lease.Identity.current().host}, started {read_doc_started(said)}): that process "
        "no longer exists"
    ]
    assert clock.slept == []
    new.release()


def read_doc_started(said: list[str]) -> str:
    return said[0].split(", started ")[1].split(")")[0]


def test_holder_killed_on_another_host_is_taken_over_after_the_expiry(
    root: str, holders: list[subprocess.Popen[str]]
) -> None:
    proc = start_holder(holders, root, ttl=TTL, beat=BEAT, host="vm-that-was-preempted")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=PROCESS_TIMEOUT_S)
    clock = Clock(now=time.time())
    early, _, _ = make(root, clock)
    with pytest.raises(lease.LeaseHeldError, match="vm-that-was-preempted"):
        early.acquire()  # its pid may be gone here, but it was another machine's pid
    clock.now += TTL + 1
    late, said, _ = make(root, clock)
    late.acquire()
    assert "its lease expired" in said[0]
    late.release()


def test_live_holder_heartbeats_and_stops_when_taken_over(
    root: str, holders: list[subprocess.Popen[str]]
) -> None:
    """The real heartbeat thread: it renews, and exits the process (LOST_EXIT) once it finds
    another run's lease."""
    proc = start_holder(holders, root, ttl=TTL, beat=0.2)
    path = storage.join(root, lease.LEASE_NAME)
    first = storage.read_versioned(path)
    assert first is not None
    for _ in range(10_000):  # bounded: ends when a heartbeat lands or the holder dies
        current = storage.read_versioned(path)
        if current is None or current[1] != first[1] or proc.poll() is not None:
            break
    assert current is not None and current[1] != first[1], "no heartbeat"
    new, _, _ = make(root, Clock(now=time.time()))
    new.acquire(take_over=True)
    assert proc.wait(timeout=PROCESS_TIMEOUT_S) == lease.LOST_EXIT
    assert proc.stderr is not None
    assert f"{root} was taken over by `tpu-payload run` (pid {os.getpid()}" in proc.stderr.read()
    assert read_doc(root)["token"] == new.token
    new.release()


def test_holder_releases_on_a_normal_end(root: str, holders: list[subprocess.Popen[str]]) -> None:
    proc = start_holder(holders, root, ttl=TTL, beat=BEAT)
    out, _ = proc.communicate("", timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == 0 and "released" in out
    assert not storage.exists(storage.join(root, lease.LEASE_NAME))


# --------------------------------------------------------------------------- the CLI


def write_job(tmp_path: Path, output: str) -> Path:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    job = tmp_path / "job.yaml"
    document = {**job_document(tmp_path, corpus), "name": "lease-test", "output": output}
    job.write_text(yaml.safe_dump(document))
    return job


def test_cli_refuses_a_second_writer_and_writes_nothing(
    root: str, tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    job = write_job(tmp_path, root)
    proc = start_holder(holders, root, ttl=TTL, beat=BEAT)
    for command in ("tokenizer", "run"):
        result = run_cli(command, "--job", str(job))
        line = assert_user_error(result, rf"being written by `tpu-payload train` \(pid {proc.pid}")
        assert "--take-over" in line
    assert storage.walk_files(root) == []  # no status.json, no stage output
    assert run_cli("validate", "--job", str(job)).returncode == 0  # reads only: no lease
    proc.communicate("", timeout=PROCESS_TIMEOUT_S)

    # The holder is gone: a run that fails with a user error still gives the lease back.
    result = run_cli("encode", "--job", str(job))
    assert_user_error(result, r"tokenizer")
    assert not storage.exists(storage.join(root, lease.LEASE_NAME))
    assert storage.exists(storage.join(root, "status.json"))


def test_cli_take_over_flag(root: str, tmp_path: Path) -> None:
    job = write_job(tmp_path, root)
    clock = Clock(now=time.time())
    gone, _, _ = make(root, clock, identity=other_host())
    gone.acquire()
    result = run_cli("encode", "--job", str(job), "--take-over")
    assert_user_error(result, r"tokenizer")  # got past the lease
    assert "lease: took over" in result.stderr and "other-vm" in result.stderr
    assert not storage.exists(storage.join(root, lease.LEASE_NAME))
    gone.release()  # taken over and released since: leaves nothing to delete


@pytest.mark.parametrize(
    ("tf_config", "writer"),
    [
        (None, True),
        ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 0}}, True),
        ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1}}, False),
        (
            {"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "worker", "index": 0}},
            False,
        ),
        (
            {"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "chief", "index": 0}},
            True,
        ),
        ({"cluster": {"worker": ["a"], "ps": ["p"]}, "task": {"type": "ps", "index": 0}}, False),
    ],
)
def test_only_the_chief_of_a_cluster_takes_the_lease(
    tf_config: dict[str, object] | None, writer: bool
) -> None:
    environ = {} if tf_config is None else {"TF_CONFIG": json.dumps(tf_config)}
    assert lease.is_writer(environ) is writer
    assert lease.needed("train", environ) is writer
    assert not lease.needed("validate", environ) and not lease.needed("export", environ)
