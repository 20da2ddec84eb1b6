"""tpu-pretrain payload: corpus -> tokenizer -> TFRecord shards -> Keras pre-training."""

import os

# transformers' TF models need Keras 2 (tf-keras). The variable must be set before
# TensorFlow is first imported anywhere in the process, so it is set here, once.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

__version__ = "0.1.0"
