"""Run by test_jax_models.py in a fresh process (Keras 3 picks its backend at import):
build a JAX-backend model with random weights from our presets, save it in the Hugging Face
layout and write its logits for the given inputs.

argv: family size vocab_size seq_length model_dir input_ids.npy attention_mask.npy logits.npy
[overrides.json: model.config overrides]
"""

import json
import sys

from payload.backends import jax as jax_backend

jax_backend.use_jax()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from payload.backends.jax import hf_weights, models  # noqa: E402
from payload.backends.jax.program import seed_keras  # noqa: E402
from payload.model import configs  # noqa: E402

family, size, vocab, seq, out_dir, ids_path, mask_path, logits_path = sys.argv[1:9]
special = {"pad": 1, "bos": 0, "eos": 2} if family != "bert" else {"pad": 0, "cls": 2, "sep": 3}
overrides = json.loads(sys.argv[9]) if len(sys.argv) > 9 else {}
config = configs.build_config(family, size, overrides, vocab_size=int(vocab), special_ids=special)
seed_keras(7)
model = models.create_model(family, config, int(seq))
# Random, non-trivial values everywhere (biases and LayerNorms too), so that no mapping
# mistake can hide behind zeros and ones.
rng = np.random.default_rng(11)
for weight in model.weights:
    weight.assign(
        rng.normal(0.0, 0.05, weight.shape).astype("float32")
        + (1.0 if weight.path.endswith("gamma") else 0.0)
    )
hf_weights.save_pretrained(model, out_dir)
ids, mask = np.load(ids_path), np.load(mask_path)
logits = model({"input_ids": ids, "attention_mask": mask}, training=False)
np.save(logits_path, np.asarray(logits, dtype="float32"))
print(keras.backend.backend())
