"""Run by test_electra.py in the PyTorch venv (.venv-pt): transformers 5 uses ELECTRA's two
exports the way their users do.

argv: export_dir input_ids.npy attention_mask.npy out_dir
- export_dir/discriminator with AutoModelForPreTraining.from_pretrained (ElectraForPreTraining):
  its logits [B, S] to out_dir/discriminator.npy;
- export_dir/generator with AutoModelForMaskedLM.from_pretrained (ElectraForMaskedLM): its
  logits [B, S, V] to out_dir/generator.npy, and the fill-mask pipeline on it;
- AutoModelForSequenceClassification.from_pretrained on the discriminator, fine-tuned for a
  few full-batch steps on a task built here (label 1: the sentence carries a marker word),
  its losses reported.
Prints one JSON object.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    pipeline,
)

export_dir, ids_path, mask_path, out_dir = sys.argv[1:5]
discriminator_dir = str(Path(export_dir, "discriminator"))
generator_dir = str(Path(export_dir, "generator"))
ids = torch.from_numpy(np.load(ids_path)).long()
mask = torch.from_numpy(np.load(mask_path)).long()
report = {"transformers": transformers.__version__}

for name, auto, directory in (
    ("discriminator", AutoModelForPreTraining, discriminator_dir),
    ("generator", AutoModelForMaskedLM, generator_dir),
):
    model, info = auto.from_pretrained(directory, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    np.save(str(Path(out_dir, f"{name}.npy")), logits.float().numpy())
    report[name] = {
        "class": type(model).__name__,
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": [list(map(str, k)) for k in info["mismatched_keys"]],
    }

tokenizer = AutoTokenizer.from_pretrained(generator_dir)
fill = pipeline("fill-mask", model=generator_dir, tokenizer=generator_dir)
predictions = fill(f"the {tokenizer.mask_token} of the", top_k=3)
report["fill_mask"] = [
    {"token_str": p["token_str"], "score": float(p["score"])} for p in predictions
]

# Fine-tuning: 16 sentences of ids drawn from the vocabulary, half of them with one fixed
# word at position 1 (label 1). Deterministic: a seeded generator, full batch.
torch.manual_seed(0)
classifier, info = AutoModelForSequenceClassification.from_pretrained(
    discriminator_dir, num_labels=2, output_loading_info=True
)
report["classifier"] = {
    "class": type(classifier).__name__,
    "missing_keys": sorted(info["missing_keys"]),
}
vocab = classifier.config.vocab_size
rows = torch.randint(5, vocab, (16, 12), generator=torch.Generator().manual_seed(0))
labels = torch.arange(16) % 2
rows[labels == 1, 1] = vocab - 1
rows[labels == 0, 1] = torch.where(rows[labels == 0, 1] == vocab - 1, 5, rows[labels == 0, 1])
optimizer = torch.optim.AdamW(classifier.parameters(), lr=2e-3)
classifier.train()
losses = []
for _ in range(25):
    loss = classifier(input_ids=rows, attention_mask=torch.ones_like(rows), labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
report["fine_tune_losses"] = losses
print(json.dumps(report))
