"""Started by tests/payload/pt_runner.py in the PyTorch venv (.venv-pt): runs the scripts
next to it one after another, each as `python SCRIPT ARGS...` would run it (its own
`__main__` module from runpy.run_path, sys.argv set, its stdout and stderr captured), with
torch and transformers 5 imported once for all of them.

Protocol: one JSON request per line on stdin, {"script": path, "args": [...]}; one JSON
answer per line on the file descriptor that was stdout at start, {"returncode", "stdout",
"stderr"}. Anything written to file descriptor 1 later (a C library's print) goes to
stderr instead, so that it never corrupts an answer.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

import torch  # noqa: F401  (imported once: what this process is for)
import transformers  # noqa: F401

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

for line in sys.stdin:
    request = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [request["script"], *request["args"]]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(request["script"], run_name="__main__")
        except SystemExit as done:  # as the interpreter ends: None is 0, a message is 1
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
            if done.code is not None and not isinstance(done.code, int):
                print(done.code, file=sys.stderr)
        except BaseException:  # reported as the script's own exit would be
            traceback.print_exc()
            code = 1
    answers.write(
        json.dumps({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n"
    )
    answers.flush()
