"""The Keras 3 / JAX backend (`train.backend: jax`; docs/backends.md).

Keras 3 picks its backend once, when `keras` is first imported: a process that uses this
package sets KERAS_BACKEND=jax before that (`use_jax()`), and never mixes it with the
TensorFlow backend's tf_keras models in one process. TensorFlow stays for tf.data only.
"""

from __future__ import annotations

import os
import sys

from payload.errors import UserError


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
    try:
        import jax  # noqa: F401, PLC0415
    except ImportError:
        raise UserError(
            "train.backend: jax needs the jax package, which this environment does not have; "
            "use train.backend: tf here, or the JAX environment (docs/backends.md)"
        ) from None
