"""Which attention every family's `train.attention: auto` gets at its presets on common
accelerators: the tables of docs/models.md ("Attention kernels"), computed from the one table
that the JAX trainer and the plan both read (payload/model/kernels.py) with the plan's case
(payload/plan/estimate.py attention_case: the preset's head sizes and attention dropout,
`train.precision: auto` on the chip, the family's usual sequence length).

    python -m payload.plan.attention_table      prints the Markdown that docs/models.md holds

tests/payload/test_jax_attention.py regenerates it, compares it with the docs, and checks
that the trainer's own `attention.choose` (on the transformers configs the trainer builds)
picks the same implementation in every cell. Framework-free, like the plan.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from payload.model import kernels
from payload.model.configs import PRESETS
from payload.plan import estimate

# The columns: GPUs of each compute capability the kernels table tells apart, and TPUs.
ACCELERATORS = (
    "nvidia-h100-80gb",
    "nvidia-a100-80gb",
    "nvidia-l4",
    "nvidia-tesla-t4",
    "v5litepod-8",
    "v6e-8",
)
# Each family's usual sequence: BERT's and ELECTRA's 512 positions, GPT-2's 1,024, the Llama
# presets' 2,048 (examples/llama-plan.yaml).
SEQUENCES = {"bert": 512, "roberta": 512, "electra": 512, "gpt2": 1024, "llama": 2048}
# data.document_mask applies to the causal families (data.objective: clm).
DOCUMENT_FAMILIES = ("gpt2", "llama")
NAMES = {"cudnn": "cuDNN", "splash": "splash", "reference": "reference"}


@dataclass(frozen=True)
class Cell:
    accelerator: str
    choice: kernels.Choice
    short: str  # the requirement the case misses ("" where a kernel runs)


@dataclass(frozen=True)
class Row:
    family: str
    size: str
    documents: bool
    seq_length: int
    head_sizes: tuple[int, ...]
    cells: tuple[Cell, ...]


def rows() -> list[Row]:
    """Every family's every preset, `auto` on each accelerator; the causal families also
    with data.document_mask."""
    accelerators = [estimate.accelerator(name) for name in ACCELERATORS]
    out = []
    for family, sizes in PRESETS.items():
        for documents in (False, True) if family in DOCUMENT_FAMILIES else (False,):
            for size in sizes:
                cases = [
                    estimate.attention_case(
                        acc, family, size, {}, precision="auto",
                        seq_length=SEQUENCES[family], documents=documents,
                    )
                    for acc in accelerators
                ]  # fmt: skip
                cells = tuple(
                    Cell(acc.name, kernels.select("auto", case), kernels.obstacle(case)[2])
                    for acc, case in zip(accelerators, cases, strict=True)
                )
                head_sizes = cases[0].head_sizes
                out.append(Row(family, size, documents, SEQUENCES[family], head_sizes, cells))
    return out


def _text(cell: Cell) -> str:
    name = NAMES[cell.choice.implementation]
    return f"{name} ({cell.short})" if cell.short else name


def markdown() -> str:
    """The families table (presets whose cells agree share a row) and the requirements
    table (what each kernel needs, with sources)."""
    head = ["family", "presets", "sequence", "head sizes", *(f"`{a}`" for a in ACCELERATORS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    grouped: dict[tuple[str, bool, int, tuple[int, ...], tuple[str, ...]], list[str]] = {}
    for row in rows():
        key = (row.family, row.documents, row.seq_length, row.head_sizes,
               tuple(_text(c) for c in row.cells))  # fmt: skip
        grouped.setdefault(key, []).append(row.size)
    for (family, documents, seq, heads, texts), sizes in grouped.items():
        name = f"`{family}` + `data.document_mask`" if documents else f"`{family}`"
        presets = ", ".join(f"`{s}`" for s in sizes)
        cells = [name, presets, f"{seq:,}", ", ".join(str(h) for h in heads), *texts]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| kernel | needs | in the table above | source |", "|---|---|---|---|"]
    for req in kernels.REQUIREMENTS:
        kernel = "both" if req.kernel == "any" else NAMES[req.kernel]
        lines.append(f"| {kernel} | {req.needs} | {req.short} | {req.source} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
