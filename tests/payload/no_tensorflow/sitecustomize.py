"""Loaded at start-up by the Python of a test's child process whose PYTHONPATH begins with this
directory (train_helpers.tensorflow_env), per TPU_PAYLOAD_TEST_TENSORFLOW:

- `block`: TensorFlow is unimportable as if it were not installed: the path finder answers
  "not found" for `tensorflow`, `tensorflow_*` and `tf_keras` (so `import tensorflow` raises
  ModuleNotFoundError and `importlib.util.find_spec("tensorflow")` is None, which is how
  etils, Keras and transformers decide that it is absent), as on a JAX VM.
- `watch`: TensorFlow stays importable; at exit, a line on stderr says whether it was
  imported after all, with the stack of the first lookup (the JAX backend must not import
  it where it is installed either: that import is seconds of every JAX process).
"""

import atexit
import importlib.machinery
import os
import sys
import traceback

MODE = os.environ.get("TPU_PAYLOAD_TEST_TENSORFLOW", "")
IMPORTED = "no_tensorflow: tensorflow was imported"


def _tensorflow(name: str) -> bool:
    root = name.partition(".")[0]
    return root in ("tensorflow", "tf_keras") or root.startswith("tensorflow_")


class _PathFinderWithoutTensorFlow(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if _tensorflow(fullname):
            return None
        return super().find_spec(fullname, path, target)


class _FirstLookup:
    """Before every other finder: notes where `tensorflow` is first looked up, finds
    nothing itself (None: the next finder is asked)."""

    stack: tuple[str, ...] = ()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname == "tensorflow" and not cls.stack:
            cls.stack = tuple(traceback.format_stack())


def _report() -> None:
    if "tensorflow" in sys.modules:
        sys.stderr.write(f"{IMPORTED}, first looked up at:\n{''.join(_FirstLookup.stack)}")


if MODE == "block":
    sys.meta_path[:] = [
        _PathFinderWithoutTensorFlow if finder is importlib.machinery.PathFinder else finder
        for finder in sys.meta_path
    ]
elif MODE == "watch":
    sys.meta_path.insert(0, _FirstLookup)
    atexit.register(_report)
