"""JAX backend: memory per device, data parallelism vs FSDP, on 8 virtual CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/bench_sharding.py \
        [--size base] [--vocab 30522]

The same BERT MLM (default: BERT-base, 110M parameters, vocabulary 30,522, sequence 128,
global batch 16) is built as the trainer builds it (payload/backends/jax/mesh.py: variables
created sharded in the mesh's Keras distribution) on a (8 x 1) data mesh and a (1 x 8) FSDP
mesh. For each it prints, per device: the bytes of the training state as placed (weights +
AdamW's two slots, read off the arrays' addressable shards), the compiled one-step chunk's
memory analysis (arguments, outputs, temporaries: XLA's own figures for device 0), and what
docs/backends.md's formula says (`mesh.per_device_state_bytes`: 16 B per parameter, divided
by the fsdp size for the sharded weights; 12 B of it persistent, the gradient's 4 B
temporary). Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import os

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.backends.jax.schedule import create_optimizer  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.spec import TrainSpec  # noqa: E402

SEQ, BATCH, POSITIONS = 128, 16, 20
MIB = 2**20


def batches(vocab: int, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    ids = rng.integers(10, vocab, size=(1, BATCH, SEQ)).astype("int32")
    positions = np.sort(rng.integers(0, SEQ, size=(1, BATCH, POSITIONS)), -1).astype("int32")
    host = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "masked_lm_positions": positions,
        "masked_lm_ids": np.take_along_axis(ids, positions, -1).astype("int32"),
        "masked_lm_weights": np.ones(positions.shape, "float32"),
    }
    sharding = mesh_lib.batch_sharding(mesh, chunk=True)
    return {k: jax.device_put(v, sharding) for k, v in host.items()}


def measure(size: str, vocab: int, setting: str) -> dict[str, float]:
    keras.backend.clear_session()
    special = {"pad": 0, "cls": 2, "sep": 3, "mask": 4}
    config = configs.build_config("bert", size, {}, vocab_size=vocab, special_ids=special)
    parameters = configs.parameter_count("bert", config)
    plan = mesh_lib.plan(setting, parameters=parameters, devices=8, memory=None)
    mesh = mesh_lib.build_mesh(plan)
    seed_keras(0)
    with mesh_lib.sharded_distribution(mesh).scope():
        model = models.create_model("bert", config, SEQ)
        optimizer = create_optimizer(TrainSpec(steps=10))
        optimizer.build(model.trainable_variables)
    state = steps.TrainState.of(model, optimizer)
    device0 = jax.devices()[0]
    placed = sum(
        shard.data.nbytes
        for leaf in jax.tree_util.tree_leaves(state)
        for shard in leaf.addressable_shards
        if shard.device == device0
    )
    chunk = steps.make_train_chunk(
        model, optimizer, "mlm", state_sharding=mesh_lib.shardings_of(state)
    )
    compiled = chunk.lower(state, batches(vocab, mesh), np.int32(1)).compile()
    analysis = compiled.memory_analysis()
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    formula = mesh_lib.per_device_state_bytes(shapes, plan)
    return {
        "parameters": parameters,
        "placed": placed / MIB,
        "arguments": analysis.argument_size_in_bytes / MIB,
        "outputs": analysis.output_size_in_bytes / MIB,
        "temporaries": analysis.temp_size_in_bytes / MIB,
        "formula_16": formula / MIB,
        "formula_12": formula * 12 / 16 / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="base", choices=("tiny", "mini", "small", "base"))
    parser.add_argument("--vocab", type=int, default=30522)
    args = parser.parse_args()
    if len(jax.devices()) != 8:
        raise SystemExit(
            "run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (8 virtual devices); "
            f"this process sees {len(jax.devices())} (XLA_FLAGS={os.environ.get('XLA_FLAGS')})"
        )
    rows = {setting: measure(args.size, args.vocab, setting) for setting in ("data", "fsdp")}
    parameters = rows["data"]["parameters"]
    print(f"BERT-{args.size}, {parameters:,} parameters, 8 virtual CPU devices, MiB per device")
    header = ("mesh", "state placed", "formula 12 B", "args", "outputs", "temps", "formula 16 B")
    print("  ".join(f"{h:>13}" for h in header))
    for setting, row in rows.items():
        values = (row["placed"], row["formula_12"], row["arguments"], row["outputs"])
        values += (row["temporaries"], row["formula_16"])
        print(f"{setting:>13}  " + "  ".join(f"{v:13.1f}" for v in values))
    ratio = rows["fsdp"]["placed"] / rows["data"]["placed"]
    print(f"fsdp / data, state placed per device: {ratio:.3f} (ideal 1/8 = 0.125)")


if __name__ == "__main__":
    main()
