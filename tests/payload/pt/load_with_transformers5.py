"""Run by the export tests in the PyTorch venv (.venv-pt): transformers 5 loads the export.

argv: export_dir input_ids.npy attention_mask.npy logits_out.npy
Writes the logits as float32 .npy and prints the class name, the loading report and the
first/last token of `tok("hello world")` (last: None when it is not a special token; the
whole "tokens" entry is None for a directory without a tokenizer) as JSON.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

export_dir, ids_path, mask_path, out_path = sys.argv[1:5]
config = AutoConfig.from_pretrained(export_dir)
causal = config.model_type in ("gpt2", "llama")
auto = AutoModelForCausalLM if causal else AutoModelForMaskedLM
model, info = auto.from_pretrained(export_dir, output_loading_info=True)
model.eval()
with torch.no_grad():
    logits = model(
        input_ids=torch.from_numpy(np.load(ids_path)).long(),
        attention_mask=torch.from_numpy(np.load(mask_path)).long(),
    ).logits
np.save(out_path, logits.float().numpy())
tokens = None
if Path(export_dir, "tokenizer.json").exists():
    tok = AutoTokenizer.from_pretrained(export_dir)
    ids = tok("hello world")["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    last = pieces[-1] if ids[-1] in tok.all_special_ids else None
    tokens = {"first": pieces[0], "last": last}
print(
    json.dumps(
        {
            "transformers": transformers.__version__,
            "class": type(model).__name__,
            "missing_keys": sorted(info["missing_keys"]),
            "unexpected_keys": sorted(info["unexpected_keys"]),
            "mismatched_keys": [list(map(str, k)) for k in info["mismatched_keys"]],
            "tokens": tokens,
        }
    )
)
