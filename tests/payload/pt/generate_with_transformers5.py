"""Run by the export tests in the PyTorch venv (.venv-pt): transformers 5 generates.

argv: export_dir prompts.json
The plain recipe of a model card: `model.generate(**tok(prompt, return_tensors="pt"),
max_new_tokens=...)`, greedy. Prints the input ids and the continuation per prompt as JSON.
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

export_dir, prompts_path = sys.argv[1:3]
tok = AutoTokenizer.from_pretrained(export_dir)
model = AutoModelForCausalLM.from_pretrained(export_dir)
model.eval()
results = []
for prompt in json.loads(Path(prompts_path).read_text(encoding="utf-8")):
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    width = inputs["input_ids"].shape[1]
    results.append(
        {
            "prompt": prompt,
            "inputs": sorted(inputs),
            "input_ids": inputs["input_ids"][0].tolist(),
            "continuation": tok.decode(output[0][width:], skip_special_tokens=True),
        }
    )
print(
    json.dumps(
        {
            "transformers": transformers.__version__,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "results": results,
        }
    )
)
