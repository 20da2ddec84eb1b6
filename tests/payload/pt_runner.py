"""The PyTorch checks' interpreter (.venv-pt: transformers 5 + PyTorch on CPU), kept running
for the test process that needs it.

Each check is a script under pt/ that loads an export with the plain calls its users make
(`AutoModelFor*.from_pretrained(path)`, `generate`). Importing torch and transformers 5 took
~6 s of CPU in every such process, and the payload suite started 15 of them. pt/serve.py
imports both once and runs the scripts one after another, each as its own `__main__` with
its argv (what `python SCRIPT ARGS...` runs); the answer is a finished process's: exit code,
stdout, stderr. A script that hangs past its timeout ends the interpreter (the next script
gets a new one).

require_pt_python finds that environment (PAYLOAD_PT_PYTHON, else .venv-pt): a check without
it skips, and fails under CI; run_pt runs a script there and returns its JSON report.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVE = Path(__file__).parent / "pt" / "serve.py"
PT_SCRIPT = Path(__file__).parent / "pt" / "load_with_transformers5.py"
GENERATE_SCRIPT = Path(__file__).parent / "pt" / "generate_with_transformers5.py"


class _Interpreter:
    def __init__(self, python: Path) -> None:
        # Its own stderr (torch's C++ warnings) goes to a file nobody must drain.
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115  (closed by close())
        self.proc = subprocess.Popen(
            [str(python), str(SERVE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )

    def run(self, script: Path, args: tuple[str, ...], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"script": str(script), "args": list(args)}).encode())
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.close()
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-3000:]
            why = "ended" if ready else f"did not answer within {timeout:.0f} s"
            raise AssertionError(f"the PyTorch interpreter {why} running {script.name}:\n{tail}")
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


_RUNNING: dict[Path, _Interpreter] = {}


def run_script(python: Path, script: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """`python script args...` in the kept interpreter of `python`: {"returncode", "stdout",
    "stderr"}."""
    interpreter = _RUNNING.get(python)
    if interpreter is None or not interpreter.alive():
        interpreter = _RUNNING[python] = _Interpreter(python)
    try:
        return interpreter.run(script, args, timeout)
    except AssertionError:
        _RUNNING.pop(python, None)
        raise


@atexit.register
def _close_all() -> None:
    for interpreter in _RUNNING.values():
        interpreter.close()
    _RUNNING.clear()


def _pt_python() -> Path | None:
    configured = os.environ.get("PAYLOAD_PT_PYTHON")
    if configured:
        # `make` names it relative to the repository (.venv-pt/bin/python); a test that runs
        # it in another directory needs it whole (not resolved: a venv's python is a link).
        return Path(configured) if Path(configured).is_absolute() else REPO / configured
    default = REPO / ".venv-pt" / "bin" / "python"
    return default if default.exists() else None


def require_pt_python() -> Path:
    python = _pt_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run this check: build .venv-pt with `make venv-pt`")
        pytest.skip("no PyTorch environment: `make venv-pt` builds .venv-pt")
    return python


def run_pt(script: Path, *args: str) -> dict:
    """A pt/ script's JSON report, run in the PyTorch environment (run_script: one kept
    interpreter per test process)."""
    result = run_script(require_pt_python(), script, *args, timeout=300)
    assert result["returncode"] == 0, result["stderr"][-3000:]
    report = json.loads(result["stdout"].strip().splitlines()[-1])
    assert report["transformers"].startswith("5.")
    return report
