"""Run by test_jax_train.py in a fresh process (Keras 3 picks its backend at import): the
logits of the JAX backend's model as training left it, rebuilt from the job's newest
checkpoint (not from the export), on the given input.

argv: job.yaml input_ids.npy attention_mask.npy logits_out.npy (ELECTRA: one file per
network, logits_out.discriminator.npy and logits_out.generator.npy)
"""

import sys

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import numpy as np  # noqa: E402

from payload.backends.jax import checkpoint as checkpoints  # noqa: E402
from payload.backends.jax import runtime as runtime_lib  # noqa: E402
from payload.backends.jax import steps  # noqa: E402
from payload.backends.jax import train as trainer  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.schema import manifest as manifest_lib  # noqa: E402
from payload.spec import load_job  # noqa: E402

job_file, ids_path, mask_path, out_path = sys.argv[1:5]
job = load_job(job_file)
manifest = manifest_lib.load_manifest(job.paths.data)
rt = runtime_lib.runtime(job.train.precision)
config = configs.config_for(job, manifest)
model, optimizer = trainer._build(job, config, manifest, rt)
layout = checkpoints.Layout.of(model, optimizer)
store = checkpoints.Checkpoints(job.paths.checkpoints, layout, keep=job.train.keep_checkpoints)
latest = store.steps()[-1]
store.restore(latest, steps.TrainState.of(model, optimizer)).write_back(model, optimizer)
store.close()
inputs = {"input_ids": np.load(ids_path), "attention_mask": np.load(mask_path)}
outputs = model(inputs, training=False)
if isinstance(outputs, dict):  # ELECTRA: <out>.discriminator.npy and <out>.generator.npy
    for name, value in outputs.items():
        np.save(out_path.replace(".npy", f".{name}.npy"), np.asarray(value, dtype=np.float32))
else:
    np.save(out_path, np.asarray(outputs, dtype=np.float32))
print(latest)
