"""Run in the PyTorch venv (.venv-pt): transformers 5 loads a model directory with the plain
`from_pretrained` and writes its logits.

argv: model_dir input_ids.npy attention_mask.npy logits_out.npy
Prints the class name and the loading report as JSON.
"""

import json
import sys

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

model_dir, ids_path, mask_path, out_path = sys.argv[1:5]
config = AutoConfig.from_pretrained(model_dir)
auto = AutoModelForCausalLM if config.model_type == "gpt2" else AutoModelForMaskedLM
model, info = auto.from_pretrained(model_dir, output_loading_info=True)
model.eval()
with torch.no_grad():
    logits = model(
        input_ids=torch.from_numpy(np.load(ids_path)).long(),
        attention_mask=torch.from_numpy(np.load(mask_path)).long(),
    ).logits
np.save(out_path, logits.float().numpy())
print(
    json.dumps(
        {
            "transformers": transformers.__version__,
            "class": type(model).__name__,
            "missing_keys": sorted(info["missing_keys"]),
            "unexpected_keys": sorted(info["unexpected_keys"]),
            "mismatched_keys": [list(map(str, k)) for k in info["mismatched_keys"]],
        }
    )
)
