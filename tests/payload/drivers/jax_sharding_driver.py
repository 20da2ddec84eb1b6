"""Run by test_jax_sharding.py with 8 virtual CPU devices: for each family's tiny model,
the variables created under the (1 x 8) FSDP mesh's Keras distribution, as the trainer
creates them (payload/backends/jax/train.py _build), and what the test checks of them.

argv: none. Prints one JSON object per family.
"""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402
import keras  # noqa: E402

from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax import models  # noqa: E402
from payload.backends.jax.schedule import create_optimizer  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.spec import TrainSpec  # noqa: E402

VOCAB = {"bert": 400, "roberta": 600, "gpt2": 600, "llama": 600, "electra": 400}
SEQ = 32

assert len(jax.devices()) == 8, jax.devices()
plan = mesh_lib.plan("fsdp", parameters=0, devices=8, memory=None)
mesh = mesh_lib.build_mesh(plan)
for family in ("bert", "roberta", "gpt2", "llama", "electra"):
    special = {"pad": 1} if family == "roberta" else {}
    config = configs.build_config(family, "tiny", {}, vocab_size=VOCAB[family], special_ids=special)
    with mesh_lib.sharded_distribution(mesh, family).scope():
        model = models.create_model(family, config, SEQ)
        optimizer = create_optimizer(TrainSpec(steps=10))
        optimizer.build(model.trainable_variables)
    variables = [*model.trainable_variables, *optimizer.variables]
    report = {
        "family": family,
        "parameters": int(sum(v.value.size for v in model.trainable_variables)),
        "formula": configs.parameter_count(family, config),
        "variables": [
            {
                "path": v.path,
                "shape": list(v.shape),
                "spec": [None if a is None else str(a) for a in v.value.sharding.spec],
                "expected": [
                    None if a is None else str(a)
                    for a in mesh_lib.partition_spec(tuple(v.shape), 8, path=v.path, family=family)
                ],
                "device_bytes": max(s.data.nbytes for s in v.value.addressable_shards),
                "bytes": int(v.value.nbytes),
            }
            for v in variables
        ],
    }
    print(json.dumps(report))
    keras.backend.clear_session()
