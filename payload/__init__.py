"""tpu-pretrain payload: corpus -> tokenizer -> TFRecord shards -> Keras pre-training."""

import importlib.metadata
import os
import sys

# transformers' TF models need Keras 2 (tf-keras). The variable must be set before
# TensorFlow is first imported anywhere in the process, so it is set here, once.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# TensorFlow distributions that provide the `tensorflow` package but that transformers 4.57
# does not recognise. transformers/utils/import_utils.py (4.57.6, module level) decides
# "TensorFlow is installed" once, at import: with FORCE_TF_AVAILABLE unset it finds the
# `tensorflow` module, then asks importlib.metadata.version() for each name in a fixed
# `candidates` tuple ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly", ...,
# "tensorflow-aarch64"); `tensorflow-tpu` (the TPU VM's TensorFlow) is not among them, so
# every TF model class then raises "requires the TensorFlow library but it was not found".
# Its only override is FORCE_TF_AVAILABLE in ("1", "ON", "YES", "TRUE"), which it checks
# before USE_TF/USE_TORCH. The trainer unit sets it; this makes the payload itself (the CLI
# run by hand over SSH, or `import payload` in a notebook) see the same TensorFlow.
_TF_DISTRIBUTIONS_TRANSFORMERS_MISSES = ("tensorflow-tpu",)


def _declare_unlisted_tensorflow() -> None:
    """Set FORCE_TF_AVAILABLE=1 when such a distribution is installed, transformers has not
    been imported yet, and the user has neither set FORCE_TF_AVAILABLE nor switched
    TensorFlow off (USE_TF=0 or USE_TORCH=1, transformers' own switches)."""
    if "FORCE_TF_AVAILABLE" in os.environ or "transformers" in sys.modules:
        return
    true = {"1", "ON", "YES", "TRUE"}
    if os.environ.get("USE_TF", "AUTO").upper() not in true | {"AUTO"}:
        return
    if os.environ.get("USE_TORCH", "AUTO").upper() in true:
        return
    for name in _TF_DISTRIBUTIONS_TRANSFORMERS_MISSES:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        os.environ["FORCE_TF_AVAILABLE"] = "1"
        return


_declare_unlisted_tensorflow()

__version__ = "0.8.0"
