"""Run by test_jax_gcs.py in a child process with TensorFlow unimportable (as on a JAX VM)
and the storage emulator in the environment: the JAX backend's two users of gs:// that go
through `etils.epath` (which, without TensorFlow, goes through gcsfs):

 1. JAX's persistent compilation cache (compile_cache.enable) in a gs:// directory: a
    program compiled once is written there; after `jax.clear_caches()` the same program
    is loaded from it instead of compiled;
 2. Orbax checkpoints (checkpoint.Checkpoints) in a gs:// directory: steps 1..3 saved with
    keep=2, the newest restored bitwise.
Prints one JSON line with what the test checks.

argv: gs://bucket/prefix
"""

import json
import sys

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import checkpoint as checkpoints  # noqa: E402
from payload.backends.jax import compile_cache, steps  # noqa: E402
from payload.core import storage  # noqa: E402

root = sys.argv[1]
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
cache_dir, counts = compile_cache.enable(storage.join(root, "compilation-cache"))


def program(x: jax.Array) -> jax.Array:
    return (x @ x.T).sum(axis=0) * 3.0


x = np.arange(64, dtype=np.float32).reshape(8, 8)
first = np.asarray(jax.jit(program)(x))
after_compile = dict(counts.describe())
jax.clear_caches()
second = np.asarray(jax.jit(program)(x))
cached_files = [name for name in storage.listdir(cache_dir) if name.endswith("-cache")]

layout = checkpoints.Layout(
    {
        "trainable": [("dense/kernel", (16, 4))],
        "non_trainable": [("seed_generator/state", (2,))],
        "optimizer": [("adamw/iterations", ())],
    }
)
rng = np.random.default_rng(0)
directory = storage.join(root, "checkpoints")
store = checkpoints.Checkpoints(directory, layout, keep=2)
saved = None
for step in (1, 2, 3):
    saved = steps.TrainState(
        [rng.standard_normal((16, 4)).astype("float32")],
        [np.array([7, step], "uint32")],
        [np.array(step, "int32")],
    )
    store.save(step, jax.tree.map(jax.device_put, saved))
store.close()
reader = checkpoints.Checkpoints(directory, layout, keep=2)
found = reader.steps()
like = jax.tree.map(lambda a: jax.device_put(np.zeros_like(a)), saved)
restored = jax.device_get(reader.restore(found[-1], like))
reader.close()
print(
    json.dumps(
        {
            "cache_dir": cache_dir,
            "after_compile": after_compile,
            "after_reload": counts.describe(),
            "same_result": bool((first == second).all()),
            "cached_files": len(cached_files),
            "steps": found,
            "listed": sorted(storage.listdir(directory)),
            "bitwise": all(
                np.asarray(a).tobytes() == np.asarray(b).tobytes()
                for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True)
            ),
            "tensorflow_imported": "tensorflow" in sys.modules,
        }
    )
)
