"""The tokenizer tests' job spec (test_tokenizer.py; test_readers.py trains on the bundled
corpus with it): a tokenizer kind and objective over examples/corpus, overridable."""

from __future__ import annotations

from pathlib import Path

import yaml

from payload import spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_job(
    tmp_path: Path,
    *,
    kind: str = "wordpiece",
    objective: str = "mlm",
    vocab_size: int = 1200,
    corpus: list[str] | None = None,
    lowercase: bool = False,
    output: str | None = None,
    **extra: object,
) -> spec.JobSpec:
    family = {"mlm": "bert" if kind == "wordpiece" else "roberta", "clm": "gpt2"}[objective]
    doc = {
        "name": "t",
        "output": output or str(tmp_path / "out"),
        "corpus": {"paths": corpus or [str(EXAMPLES / "corpus" / "*.txt")]},
        "tokenizer": {"kind": kind, "vocab_size": vocab_size, "lowercase": lowercase},
        "data": {"objective": objective, "seq_length": 64, "records_per_shard": 50},
        "model": {"family": family, "size": "tiny"},
        "train": {"steps": 4},
    }
    for dotted, value in extra.items():
        section, key = dotted.split("__")
        doc[section][key] = value
    path = tmp_path / f"job-{kind}-{objective}.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return spec.load_job(str(path))
