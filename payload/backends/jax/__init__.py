"""The Keras 3 / JAX backend (`train.backend: jax`; docs/backends.md).

Keras 3 picks its backend once, when `keras` is first imported: a process that uses this
package sets KERAS_BACKEND=jax before that (`use_jax()`), and never mixes it with the
TensorFlow backend's tf_keras models in one process. The backend imports no TensorFlow:
Grain reads the shards (input.py), and etils.epath reaches gs:// through gcsfs (`use_jax`
sets EPATH_USE_TF=false, also where TensorFlow is installed for the other backend).
"""

from __future__ import annotations

import os
import sys

from payload.core.errors import UserError


def use_jax() -> None:
    """Make Keras 3 run on JAX in this process; a one-line error when it cannot."""
    if "keras" in sys.modules:
        import keras  # noqa: PLC0415

        if keras.backend.backend() != "jax":
            raise RuntimeError(
                f"keras was imported with the {keras.backend.backend()!r} backend before the "
                "JAX backend was chosen: run the JAX backend in its own process"
            )
        return
    os.environ["KERAS_BACKEND"] = "jax"
    # etils.epath (Orbax's directories, JAX's compilation cache) sends gs:// to
    # tf.io.gfile whenever TensorFlow is importable (etils 1.15 epath/gpath.py
    # `_is_tf_installed`): importing it costs seconds, and it cannot reach the storage
    # emulator. gcsfs (fsspec) serves gs:// in every JAX environment instead.
    os.environ["EPATH_USE_TF"] = "false"
    try:
        import jax  # noqa: F401, PLC0415
    except ImportError:
        raise UserError(
            "train.backend: jax needs the jax package, which this environment does not have; "
            "use train.backend: tf here, or the JAX environment (docs/backends.md)"
        ) from None
