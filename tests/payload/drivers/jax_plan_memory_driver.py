"""Run by test_plan_memory.py with 8 virtual CPU devices: the JAX backend's real train step
(steps.make_train_chunk, one step per call) for a Llama model, built as the trainer builds
it (train.py _build: variables created sharded on the mesh), lowered and compiled, never
run; prints XLA's memory analysis of the compiled program (bytes per device), its while
loops' trip counts and its matmul flops per device (payload/backends/jax/hlo.py).

argv: a JSON list of cases {"size", "config", "vocab", "seq", "batch", "sharding", "remat"}
(batch = the global batch). Prints one JSON line per case.
"""

import json
import sys

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402
import keras  # noqa: E402

from payload.backends.jax import attention as attention_lib  # noqa: E402
from payload.backends.jax import hlo, models, steps  # noqa: E402
from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax.schedule import create_optimizer  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.spec import TrainSpec  # noqa: E402


def measure(case: dict) -> dict:
    mesh_plan = mesh_lib.plan(case["sharding"], parameters=0, devices=8, memory=None)
    mesh = mesh_lib.build_mesh(mesh_plan)
    config = configs.build_config(
        "llama", case["size"], case["config"], vocab_size=case["vocab"], special_ids={}
    )
    keras.config.set_dtype_policy("float32")  # what the trainer runs on CPU
    with mesh_lib.sharded_distribution(mesh, "llama").scope():
        # The trainer's model: its attention carries the mesh, to which every block
        # boundary holds the activations' rows (mesh.keep_rows).
        attention = attention_lib.Attention("reference", "plan memory", mesh)
        model = models.create_model(
            "llama", config, case["seq"], remat=case["remat"], attention=attention
        )
        optimizer = create_optimizer(TrainSpec(steps=10))
        optimizer.build(model.trainable_variables)
    state = steps.TrainState.of(model, optimizer)
    chunk = steps.make_train_chunk(
        model, optimizer, "clm", state_sharding=mesh_lib.shardings_of(state)
    )
    batch_sharding = mesh_lib.batch_sharding(mesh, chunk=True)
    shape = (1, case["batch"], case["seq"])
    batch = {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
        for name, dtype in (
            ("input_ids", "int32"),
            ("attention_mask", "int32"),
            ("labels", "int32"),
            ("label_weights", "float32"),
        )
    }
    abstract_state = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    compiled = chunk.lower(abstract_state, batch).compile()
    memory = compiled.memory_analysis()
    program = hlo.summarize(compiled.as_text(), causal=True)
    return {
        "layers": int(config.num_hidden_layers),
        "hidden": int(config.hidden_size),
        "loops": program.loops,
        "flops_per_device": program.total_flops(),  # one call of one step
        "parameters": int(sum(v.value.size for v in model.trainable_variables)),
        "argument": int(memory.argument_size_in_bytes),
        "output": int(memory.output_size_in_bytes),
        "alias": int(memory.alias_size_in_bytes),
        "temp": int(memory.temp_size_in_bytes),
        "state_per_device": sum(
            max(s.data.nbytes for s in x.addressable_shards)
            for x in jax.tree_util.tree_leaves(state)
        ),
    }


assert len(jax.devices()) == 8, jax.devices()
for case in json.loads(sys.argv[1]):
    print(json.dumps(measure(case)), flush=True)
    keras.backend.clear_session()
