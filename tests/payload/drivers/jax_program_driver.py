"""Run by test_jax_sharding.py with 8 virtual CPU devices: the compile path's programs of
each job (payload/backends/jax/aot.py build_for, with the facts STATED, not read from the
devices: a CPU, 8 devices, no device memory) and their fingerprints, which the test
compares with the ones the real run logged (program.py: sha256 of the lowered text).

argv: job files. Prints one JSON line per job: {"job", "fingerprints"}.
"""

import json
import sys

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402

from payload.backends.jax import aot  # noqa: E402
from payload.backends.jax import runtime as runtime_lib  # noqa: E402
from payload.spec import load_job  # noqa: E402

devices = jax.devices()
assert len(devices) == 8, devices
facts = runtime_lib.Facts(platform="cpu", device_kind="cpu", local_devices=8, device_memory=None)
for path in sys.argv[1:]:
    job = load_job(path)
    programs = aot.build_for(job, facts, devices)
    print(json.dumps({"job": path, "fingerprints": programs.fingerprints()}), flush=True)
