"""Run by test_jax_multihost.py: the JAX backend's `train` stage in ONE process that reads
with N input pipelines (`trainer.train(..., input_pipelines=N)`), i.e. exactly the global
batches N processes of a slice would assemble from their own shard files.

argv: job.yaml N   (XLA_FLAGS gives the process its CPU devices)
"""

import json
import sys

from payload.backends.jax import train as trainer
from payload.core.status import StatusWriter
from payload.spec import load_job

job = load_job(sys.argv[1])
stats = trainer.train(
    job, StatusWriter(job.paths.status, job.name), input_pipelines=int(sys.argv[2])
)
print(json.dumps({k: v for k, v in stats.items() if isinstance(v, int | float | str)}))
