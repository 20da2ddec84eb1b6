"""Run by test_jax_sharding.py with 8 virtual CPU devices: the collectives of a compiled
training chunk (payload/backends/jax/steps.make_train_chunk, as the trainer builds it, on
the run's mesh), per family and mesh, as mesh.collectives reads them from the HLO.

argv: none. Prints one JSON object per (family, mesh): the global batch and sequence, the
shapes of the trainable weights and every collective's op and result arrays.
"""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload import model as model_lib  # noqa: E402
from payload.backends.jax import attention as attention_lib  # noqa: E402
from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.schedule import create_optimizer  # noqa: E402
from payload.spec import TrainSpec  # noqa: E402

VOCAB, SEQ, BATCH, SLOTS = 512, 64, 16, 8
OBJECTIVE = {"llama": "clm", "bert": "mlm"}
# (family, data, fsdp): an FSDP mesh and a data x FSDP one for the decoder; the encoder with
# its masked-position head on the FSDP mesh.
CASES = (("llama", 1, 8), ("llama", 2, 4), ("bert", 1, 8))


def batches(objective: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, size=(1, BATCH, SEQ)).astype("int32")
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if objective == "clm":
        return {**batch, "labels": ids, "label_weights": np.ones(ids.shape, "float32")}
    positions = np.sort(rng.choice(SEQ, size=(1, BATCH, SLOTS)), -1).astype("int32")
    return {
        **batch,
        "masked_lm_positions": positions,
        "masked_lm_ids": np.take_along_axis(ids, positions, -1),
        "masked_lm_weights": np.ones(positions.shape, "float32"),
    }


assert len(jax.devices()) == 8, jax.devices()
for family, data, fsdp in CASES:
    objective = OBJECTIVE[family]
    keras.backend.clear_session()
    mesh = mesh_lib.build_mesh(mesh_lib.MeshPlan("fsdp", data, fsdp, "test"))
    config = model_lib.build_config(family, "tiny", {}, vocab_size=VOCAB, special_ids={})
    keras.utils.set_random_seed(0)
    with mesh_lib.sharded_distribution(mesh, family).scope():
        attention = attention_lib.Attention("reference", "test", mesh)
        model = models.create_model(family, config, SEQ, attention=attention)
        optimizer = create_optimizer(TrainSpec(steps=10))
        optimizer.build(model.trainable_variables)
    state = steps.TrainState.of(model, optimizer)
    chunk = steps.make_train_chunk(
        model, optimizer, objective, state_sharding=mesh_lib.shardings_of(state)
    )
    sharding = mesh_lib.batch_sharding(mesh, chunk=True)
    placed = {k: jax.device_put(v, sharding) for k, v in batches(objective).items()}
    text = chunk.lower(state, placed, np.int32(1)).compile().as_text()
    report = {
        "family": family,
        "mesh": [data, fsdp],
        "batch": BATCH,
        "seq": SEQ,
        "weights": sorted({tuple(v.shape) for v in model.trainable_variables}),
        "collectives": mesh_lib.collectives(text),
    }
    print(json.dumps(report), flush=True)
