"""Load a finished export as its user would, and run it once: `make smoke`'s export check.

    .venv-pt/bin/python tools/load_export.py <export_dir>

Run by infra/commands/smoke.py in the PyTorch environment (.venv-pt, requirements/pt-check.txt:
transformers 5 + torch CPU); it lives outside infra/, which never imports transformers.
The class is the one config.json names (`architectures`), loaded with `from_pretrained`; a
weight the checkpoint lacks, does not use or has in another shape fails the check, because
transformers fills a missing weight with random values and only reports it. The tokenizer
is loaded the same way and encodes one sentence; one forward pass must give finite logits.
Every call takes the directory as it is and runs nothing from it: `local_files_only=True`
(never the Hub), `trust_remote_code=False` (an `auto_map` is refused, not imported, and
not asked about: left unset, transformers prompts when there is no local class) and, for
the weights, `use_safetensors=True` (never a pickle). `make smoke` checks the file names
and config.json before it calls this (infra/commands/untrusted.py).
Prints one JSON line; exit 1 with one line on stderr when something does not hold.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SENTENCE = "The smoke run loads this export."


def main(export_dir: str) -> dict[str, object]:
    if not Path(export_dir, "config.json").is_file():
        # Before importing torch and transformers (~5 s): a wrong path fails at once.
        raise SystemExit(f"{export_dir}: no config.json (not an export directory)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory only, never the Hub
    import torch  # noqa: PLC0415  (after the cheap check)
    import transformers  # noqa: PLC0415

    local = {"local_files_only": True, "trust_remote_code": False}
    config = transformers.AutoConfig.from_pretrained(export_dir, **local)
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise SystemExit(f"config.json: architectures {names!r} names no transformers model")
    model, info = cls.from_pretrained(
        export_dir, output_loading_info=True, use_safetensors=True, **local
    )
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise SystemExit(f"{names[0]}.from_pretrained: {json.dumps(problems or info, default=str)}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir, **local)
    inputs = tokenizer(SENTENCE, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        logits = model(**inputs).logits
    if not torch.isfinite(logits).all():
        raise SystemExit(f"{names[0]}: the forward pass gave non-finite logits")
    return {
        "class": names[0],
        "transformers": transformers.__version__,
        "tokens": int(inputs["input_ids"].shape[1]),
        "logits_shape": list(logits.shape),
    }


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: load_export.py <export_dir>")
    try:
        print(json.dumps(main(sys.argv[1])))
    except (OSError, ValueError) as error:  # a directory transformers cannot read
        raise SystemExit(f"{sys.argv[1]}: {str(error).splitlines()[0]}") from None
