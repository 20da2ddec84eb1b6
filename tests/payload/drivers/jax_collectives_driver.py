"""Run by test_jax_sharding.py with 8 virtual CPU devices: the trainer's compiled training
chunk (payload/backends/jax/steps.make_train_chunk on the run's mesh, the model's attention
carrying the mesh as train.py builds it) per family and mesh:
- `collectives`: what the compiled chunk communicates, as mesh.collectives reads it from the
  HLO (compiled, not run);
- `equivalence`: two optimizer steps of the same batches from the same initial weights on
  an FSDP mesh (1 x 8, Llama with train.remat block and 2 accumulated micro-batches) and on
  a data-parallel mesh (8 x 1, plain): the losses and the trained weights of both.

argv: none. Prints one JSON object per case.
"""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import attention as attention_lib  # noqa: E402
from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.backends.jax.schedule import create_optimizer  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.spec import TrainSpec  # noqa: E402

VOCAB, SEQ, BATCH, SLOTS = 512, 64, 16, 8
OBJECTIVE = {"llama": "clm", "bert": "mlm", "electra": "rtd"}
# (family, data, fsdp): an FSDP mesh and a data x FSDP one for the decoder; the encoder with
# its masked-position head on the FSDP mesh.
COLLECTIVES = (("llama", 1, 8), ("llama", 2, 4), ("bert", 1, 8))
# family -> the FSDP run's (remat, accumulation steps); the data-parallel run has neither.
EQUIVALENCE = {"llama": ("block", 2), "electra": ("none", 1)}


def batches(objective: str, count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, size=(count, BATCH, SEQ)).astype("int32")
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if objective == "clm":
        return {**batch, "labels": ids, "label_weights": np.ones(ids.shape, "float32")}
    positions = np.sort(
        np.stack([rng.choice(SEQ, SLOTS, replace=False) for _ in range(count * BATCH)]), -1
    ).reshape(count, BATCH, SLOTS)
    return {
        **batch,
        "masked_lm_positions": positions.astype("int32"),
        "masked_lm_ids": np.take_along_axis(ids, positions, -1),
        "masked_lm_weights": np.ones(positions.shape, "float32"),
    }


def build(family: str, data: int, fsdp: int, remat: str = "none", accum: int = 1):
    """(mesh, model, optimizer, state, chunk) as the trainer builds them, seeded."""
    keras.backend.clear_session()
    mesh = mesh_lib.build_mesh(mesh_lib.MeshPlan("fsdp", data, fsdp, "test"))
    config = configs.build_config(family, "tiny", {}, vocab_size=VOCAB, special_ids={})
    seed_keras(0)
    with mesh_lib.sharded_distribution(mesh, family).scope():
        attention = attention_lib.Attention("reference", "test", mesh)
        model = models.create_model(family, config, SEQ, remat=remat, attention=attention)
        optimizer = create_optimizer(TrainSpec(steps=10))
        optimizer.build(model.trainable_variables)
    state = steps.TrainState.of(model, optimizer)
    chunk = steps.make_train_chunk(
        model,
        optimizer,
        OBJECTIVE[family],
        state_sharding=mesh_lib.shardings_of(state),
        accum_steps=accum,
    )
    return mesh, model, state, chunk


def placed(mesh, objective: str, count: int) -> dict:
    sharding = mesh_lib.batch_sharding(mesh, chunk=True)
    return {k: jax.device_put(v, sharding) for k, v in batches(objective, count).items()}


assert len(jax.devices()) == 8, jax.devices()
for family, data, fsdp in COLLECTIVES:
    mesh, model, state, chunk = build(family, data, fsdp)
    text = chunk.lower(state, placed(mesh, OBJECTIVE[family], 1), np.int32(1)).compile().as_text()
    report = {
        "kind": "collectives",
        "family": family,
        "mesh": [data, fsdp],
        "batch": BATCH,
        "weights": sorted({tuple(v.shape) for v in model.trainable_variables}),
        "collectives": mesh_lib.collectives(text),
    }
    print(json.dumps(report), flush=True)

for family, (remat, accum) in EQUIVALENCE.items():
    runs = {}
    for name, (data, fsdp, r, a) in {
        "fsdp": (1, 8, remat, accum),
        "data": (8, 1, "none", 1),
    }.items():
        mesh, model, state, chunk = build(family, data, fsdp, r, a)
        state, metrics = chunk(state, placed(mesh, OBJECTIVE[family], 2))
        runs[name] = (
            np.asarray(metrics["loss"], "float64"),
            [np.asarray(mesh_lib.gather(x), "float64") for x in state.trainable],
        )
    (loss_a, weights_a), (loss_b, weights_b) = runs["fsdp"], runs["data"]
    initial = build(family, 8, 1)[2].trainable
    report = {
        "kind": "equivalence",
        "family": family,
        "fsdp": {"remat": remat, "accum_steps": accum},
        "losses": [loss_a.tolist(), loss_b.tolist()],
        "weight_gap": max(
            float(np.abs(x - y).max()) for x, y in zip(weights_a, weights_b, strict=True)
        ),
        "moved": max(
            float(np.abs(x - np.asarray(y)).max()) for x, y in zip(weights_a, initial, strict=True)
        ),
    }
    print(json.dumps(report), flush=True)
