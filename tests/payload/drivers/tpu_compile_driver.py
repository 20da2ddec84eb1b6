"""Run by test_tpu_compile.py in the TPU environment (.venv-tpu-jax: jax[tpu] + libtpu, on
this machine's CPU): each case's job compiled for a TPU type's topology by `tpu-payload
compile`'s own path (aot.compile_job: the trainer's builder, program.py), never run.

argv: a JSON list of cases {"name", "accelerator", "job": a job document}. Prints one JSON
line per case: the report (aot.Report.to_dict) or, when the programs could not be built or
compiled, {"name", "error": the exception's type and first line}.
"""

import json
import sys
import tempfile
import traceback
from pathlib import Path

from payload.backends.jax import aot
from payload.spec import parse_job

for case in json.loads(sys.argv[1]):
    with tempfile.TemporaryDirectory() as tmp:
        document = {**case["job"], "output": str(Path(tmp, "out"))}
        job = parse_job(document, source=str(Path(tmp, "job.yaml")))
        try:
            report = aot.compile_job(job, case["accelerator"])
        except Exception as exc:  # recorded: the test says which outcome is allowed
            first = " ".join(str(exc).split())[:400]
            print(traceback.format_exc()[-2000:], file=sys.stderr)
            print(json.dumps({"name": case["name"], "error": f"{type(exc).__name__}: {first}"}))
            continue
        print(json.dumps({"name": case["name"], **report.to_dict()}), flush=True)
