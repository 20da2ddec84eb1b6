"""The bounds of a slice's waits, in one process (the slices themselves:
test_slice_bounds.py): the progress watchdog's phases and bounds (backends/jax/progress.py),
the guard thread that keeps watching when the coordination service does not answer
(distributed.SliceGuard), the join's line naming the host waited for (joining.py), the
export's scratch directory (training/export.py), and docs/pod-slices.md's table of the ways
a host leaves against the constants it names."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from payload.backends.jax import distributed, joining, progress
from payload.core.errors import UserError
from payload.training import export

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(environ: dict[str, str] | None = None, state_bytes: int = 0, hosts: int = 1):
    clock = Clock()
    bounds = progress.Bounds.of(state_bytes, hosts, environ or {})
    return progress.Watch(bounds, clock), clock


def test_the_first_chunk_is_the_compile_then_the_bound_follows_the_longest_chunk() -> None:
    watch, clock = _watch()
    assert watch.overdue() is None  # nothing watched yet
    watch.enter("compile")
    clock.now += progress.COMPILE_S - 1
    assert watch.overdue() is None
    watch.finished()  # the first chunk: compiled, not timed
    assert watch.phase == "train" and watch.longest_chunk_s == 0
    clock.now += progress.STEP_FLOOR_S + 1
    late = watch.overdue()
    assert late is not None and late.phase == "train" and late.bound_s == progress.STEP_FLOOR_S
    watch.finished()  # a chunk of 301 s: the bound is now 10 x that
    assert watch.longest_chunk_s == progress.STEP_FLOOR_S + 1
    clock.now += progress.STEP_FACTOR * (progress.STEP_FLOOR_S + 1) - 1
    assert watch.overdue() is None
    clock.now += 2
    late = watch.overdue()
    assert late is not None and late.bound_s == progress.STEP_FACTOR * (progress.STEP_FLOOR_S + 1)
    assert "10 x the longest chunk" in late.line(2, 4)
    assert late.line(2, 4).startswith("error: process 2 of the slice hung: no progress in train")
    assert f"exit {progress.HUNG_EXIT}" in late.line(2, 4)


def test_each_phase_has_its_own_bound_and_the_setting_raises_them_all() -> None:
    gigabytes = 40 * 10**9
    watch, clock = _watch(state_bytes=gigabytes, hosts=4)
    expected = {
        "compile": progress.COMPILE_S,
        "restore": gigabytes / 4 / progress.IO_BYTES_PER_S,  # 1,000 s: above the floor
        "checkpoint": gigabytes / 4 / progress.IO_BYTES_PER_S,
        "export": gigabytes / progress.IO_BYTES_PER_S,  # the chief alone
        "evaluate": progress.STEP_FLOOR_S,
        "train": progress.STEP_FLOOR_S,
    }
    for phase, bound in expected.items():
        watch.enter(phase)
        clock.now += bound - 1
        assert watch.overdue() is None, phase
        clock.now += 2
        late = watch.overdue()
        assert late is not None and (late.phase, late.bound_s) == (phase, bound)
    small, _ = _watch(state_bytes=10**6)
    assert small.bound("checkpoint")[0] == progress.IO_FLOOR_S
    raised = progress.Bounds.of(10**6, 1, {progress.HANG_ENV: "5000"})
    assert raised.describe() == {
        "step_floor_s": 5000.0, "step_factor": progress.STEP_FACTOR, "compile_s": 5000.0,
        "restore_s": 5000.0, "checkpoint_s": 5000.0, "export_s": 5000.0,
    }  # fmt: skip
    lowered = progress.Bounds.of(10**6, 1, {progress.HANG_ENV: "30"})
    assert (lowered.floor_s, lowered.compile_s) == (30.0, progress.COMPILE_S)
    for bad in ("0", "-3", "soon"):
        with pytest.raises(UserError, match=progress.HANG_ENV):
            progress.Bounds.of(0, 1, {progress.HANG_ENV: bad})


def test_idle_and_during_leave_nothing_watched() -> None:
    watch, clock = _watch()
    with watch.during("checkpoint"):
        assert watch.phase == "checkpoint"
    assert watch.phase is None
    with watch.during("evaluate", then="train"):
        pass
    assert watch.phase == "train"
    watch.idle()
    clock.now += 10**6
    assert watch.overdue() is None
    with pytest.raises(ValueError, match="phase"):
        watch.enter("napping")


# ------------------------------------------------------------------------- the guard


class _Exited(BaseException):  # os._exit, taken in a test
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _FailingClient:
    """jax.distributed's client, not answering `failures` times."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0

    def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        return []

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        raise RuntimeError("UNAVAILABLE")

    def shutdown(self) -> None:
        pass


@pytest.fixture
def joined(monkeypatch: pytest.MonkeyPatch) -> Any:
    """jax.distributed's state as on process 1 of 3, with a client the test gives; the
    process's exit recorded instead of taken."""
    state = distributed._state()

    def install(client: Any) -> None:
        monkeypatch.setattr(state, "client", client)
        monkeypatch.setattr(state, "num_processes", 3)
        monkeypatch.setattr(state, "process_id", 1)

    def exit_(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(distributed.os, "_exit", exit_)
    return install


def test_the_guard_keeps_watching_when_the_service_does_not_answer(joined, capsys) -> None:
    """A failed RPC used to end the guard thread for good: now it tries again at the next
    poll and keeps watching; only GUARD_GIVE_UP_S without an answer ends the process."""
    client = _FailingClient(failures=5)
    joined(client)
    guard = distributed.SliceGuard()
    now = 0.0
    for _ in range(8):  # 5 failures, then answers again
        now += distributed.GUARD_POLL_S
        guard._tick(now)
    assert client.calls == 8 and guard._failing_since is None
    assert capsys.readouterr().err.count("cannot reach the coordination service") == 1

    client = _FailingClient(failures=10**6)
    joined(client)
    guard = distributed.SliceGuard()
    first = now = distributed.GUARD_POLL_S
    while now <= first + distributed.GUARD_GIVE_UP_S:  # the first failure, then as long again
        guard._tick(now)
        now += distributed.GUARD_POLL_S
    with pytest.raises(_Exited) as exited:
        guard._tick(now)
    assert exited.value.code == distributed.ERROR_EXIT
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: process 1 of the slice cannot reach the coordination service")


def test_the_guard_ends_a_process_that_made_no_progress(joined, capfd) -> None:
    """Past its phase's bound the guard writes every thread's stack, records the hang (the
    chief's status.json) and ends the process with HUNG_EXIT, even while the service does
    not answer (the abort is published best effort)."""
    joined(_FailingClient(failures=10**6))
    recorded: list[tuple[str, str]] = []
    watch, clock = _watch({progress.HANG_ENV: "30"})
    guard = distributed.SliceGuard(on_hang=lambda phase, line: recorded.append((phase, line)))
    guard.watch = watch
    watch.enter("compile")
    watch.finished()
    clock.now += 29
    guard._tick(0.0)
    clock.now += 2
    with pytest.raises(_Exited) as exited:
        guard._tick(0.0)
    assert exited.value.code == progress.HUNG_EXIT
    err = capfd.readouterr().err
    assert recorded and recorded[0][0] == "train"
    assert recorded[0][1].startswith("error: process 1 of the slice hung: no progress in train")
    assert "thread 0x" in err and "(most recent call first)" in err  # faulthandler's stacks
    assert "test_the_guard_ends_a_process_that_made_no_progress" in err


# -------------------------------------------------------------------------- the join


def test_the_join_names_worker_0_when_its_coordinator_is_not_up() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        up = SimpleNamespace(process_id=2, num_processes=4, coordinator_address=f"127.0.0.1:{port}")
        line = joining.failure_line(20, up)
        assert "process 0 (worker 0, the coordinator at" in line and "is up, but not all 4" in line
    down = joining.failure_line(20, up)  # the port closed: nothing listens there
    assert down.startswith(
        f"error: process 2 of the slice could not join it within 20 s ({joining.ENV}): process "
        f"0 (worker 0, the coordinator at 127.0.0.1:{port}) is not up"
    )
    chief = SimpleNamespace(process_id=0, num_processes=4, coordinator_address="10.0.0.2:8476")
    assert "did not see all 4 processes join" in joining.failure_line(20, chief)
    assert joining.timeout({}) == joining.TIMEOUT_S
    with pytest.raises(UserError, match=joining.ENV):
        joining.timeout({joining.ENV: "0"})


# ------------------------------------------------------------------ the export's scratch


def test_an_export_leaves_no_scratch_directory(tmp_path) -> None:
    job = SimpleNamespace(paths=SimpleNamespace(export=str(tmp_path / "out" / "export")))
    left = export.scratch_path(job)  # type: ignore[arg-type]
    left.mkdir(parents=True, exist_ok=True)
    (left / "pytorch_model.safetensors").write_text("half of a model")  # a SIGKILLed export
    with export.scratch_directory(job) as scratch:  # type: ignore[arg-type]
        assert Path(scratch) == left and not any(left.iterdir())
        Path(scratch, "config.json").write_text("{}")
        export.remove_scratch()  # the guard's exit, from another thread
        assert not left.exists()
    with pytest.raises(RuntimeError), export.scratch_directory(job) as scratch:  # type: ignore[arg-type]
        Path(scratch, "config.json").write_text("{}")
        raise RuntimeError("a stop at one of the export's stop points")
    assert not left.exists()


def test_what_a_leaving_process_still_does_is_cut_before_the_shutdown_barrier(joined) -> None:
    """Once a process has told the others (they are on their way into the shutdown
    barrier, which waits SHUTDOWN_TIMEOUT_S), its status write and lease release are cut
    after LEAVE_WORK_S: the guard enters the barrier itself; storage retries are shortened
    to fit."""
    from payload.core import storage

    joined(_FailingClient(failures=0))
    guard = distributed.SliceGuard()
    distributed.SliceGuard._current = guard
    before = storage.RETRY_DEADLINE_S
    try:
        distributed.SliceGuard.leaving(1)
        distributed.SliceGuard.published()
        assert storage.RETRY_DEADLINE_S <= distributed.LEAVE_WORK_S / 2
        assert distributed.LEAVE_WORK_S < distributed.SHUTDOWN_TIMEOUT_S
        start = guard._work_deadline - distributed.LEAVE_WORK_S
        guard._tick(start + distributed.LEAVE_WORK_S - 1)  # still working: nothing happens
        with pytest.raises(_Exited) as exited:
            guard._tick(start + distributed.LEAVE_WORK_S + 1)
        assert exited.value.code == 1
    finally:
        distributed.SliceGuard._current = None
        storage.set_retry_deadline(before)


# ----------------------------------------------------- docs/pod-slices.md's table

TABLE = re.compile(r"<!-- leaving:begin -->\n(.*?)<!-- leaving:end -->", re.S)
CONSTANT = re.compile(r"`(distributed|progress|joining)\.([A-Z_]+)` \(([0-9.]+)(?: s)?\)")
TEST_NAME = re.compile(r"`(test_\w+)`")


def _test_functions() -> dict[str, set[str]]:
    """Every test function of tests/payload, by file."""
    return {
        path.name: set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.M))
        for path in (ROOT / "tests" / "payload").glob("test_*.py")
    }


def test_the_ways_a_host_leaves_are_the_codes_bounds_and_the_tests_cases() -> None:
    """docs/pod-slices.md "When a host leaves": every bound and exit code it names is the
    code's, every test it names exists, and every case of test_slice_bounds.py is a row."""
    page = (ROOT / "docs" / "pod-slices.md").read_text()
    found = TABLE.search(page)
    assert found, "docs/pod-slices.md: no <!-- leaving:begin --> table"
    rows = [line for line in found.group(1).splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 15
    modules = {"distributed": distributed, "progress": progress, "joining": joining}
    tests = _test_functions()
    every_test = set().union(*tests.values())
    named: set[str] = set()
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 7, row
        phase, event, _, within, exit_, kept, tested_by = cells
        assert phase and event and within and exit_ and kept, row
        for module, name, value in CONSTANT.findall(row):
            assert float(getattr(modules[module], name)) == float(value), (module, name, row)
        names = TEST_NAME.findall(tested_by)
        assert names, f"no test for: {phase} / {event}"
        for name in names:
            assert name in every_test, f"{name} (docs/pod-slices.md) is no test in tests/payload"
        named |= set(names)
    assert tests["test_slice_bounds.py"] <= named, tests["test_slice_bounds.py"] - named
    section = page.split("## When a host leaves", 1)[1].split("\n## ", 1)[0]
    settings = set(re.findall(r"`(TPU_PAYLOAD_[A-Z_]+)", section))
    assert {joining.ENV, progress.HANG_ENV, progress.STALL_ENV} <= settings
    assert settings <= {
        joining.ENV,
        progress.HANG_ENV,
        progress.STALL_ENV,
        "TPU_PAYLOAD_JAX_DISTRIBUTED",
    }
