"""What a job is: the frozen dataclasses of a validated job spec and the closed vocabularies
their settings take. payload/spec.py reads a YAML/JSON document into a ``JobSpec`` (and
re-exports these names); everything else reads the job from here. No I/O, no framework.

Special tokens. Each (objective, tokenizer kind) has a style whose role tokens must all be
present in ``tokenizer.special_tokens`` (extra tokens are allowed; the list order is the id
order, so the defaults get ids 0..n-1):

==========  ===========  ================================================  =============
objective   kind         default special_tokens                             roles
==========  ===========  ================================================  =============
mlm         wordpiece    [PAD] [UNK] [CLS] [SEP] [MASK]                     BERT
mlm         bpe/unigram  <s> <pad> </s> <unk> <mask>                        RoBERTa
rtd         wordpiece    [PAD] [UNK] [CLS] [SEP] [MASK]                     BERT (ELECTRA)
rtd         bpe/unigram  <s> <pad> </s> <unk> <mask>                        RoBERTa
clm         any          <s> <pad> </s> <unk>                               bos/eos
==========  ===========  ================================================  =============
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from payload.core import storage
from payload.schema.observe import ProfileSpec

# rtd: ELECTRA's replaced-token detection (a generator MLM + a discriminator; docs/payload.md).
OBJECTIVES = ("mlm", "clm", "rtd")
# Objectives whose data is packed and dynamically masked as for MLM (encode_rules.py, data.py).
MASKED_OBJECTIVES = ("mlm", "rtd")
TOKENIZER_KINDS = ("wordpiece", "bpe", "unigram")
FAMILIES = ("bert", "roberta", "gpt2", "llama", "electra")
SIZES = ("tiny", "mini", "small", "base")
# Llama's presets are named by their size (payload/model/configs.py, docs/models.md).
LLAMA_SIZES = ("tiny", "125m", "350m", "1b", "3b")
# ELECTRA's: the paper's small and base (payload/model/configs.py says where each value comes from).
ELECTRA_SIZES = ("tiny", "small", "base")
SIZES_FOR_FAMILY = {
    "bert": SIZES,
    "roberta": SIZES,
    "gpt2": SIZES,
    "llama": LLAMA_SIZES,
    "electra": ELECTRA_SIZES,
}
FAMILIES_FOR_OBJECTIVE = {
    "mlm": ("bert", "roberta"),
    "clm": ("gpt2", "llama"),
    "rtd": ("electra",),
}
# Families and objectives only the JAX backend has: `train.backend: auto` picks jax for them.
JAX_ONLY_FAMILIES = ("llama", "electra")
JAX_ONLY_OBJECTIVES = ("rtd",)
DECAYS = ("linear", "cosine", "constant")
PRECISIONS = ("auto", "bf16", "fp32")
# auto: jax for a family only the JAX backend has (JAX_ONLY_FAMILIES), else the VM unit's
# TPU_PAYLOAD_BACKEND, else tf (payload/training/shared.py resolve_backend).
BACKENDS = ("auto", "tf", "jax")
# Activation rematerialisation (JAX backend): what each decoder layer keeps for the backward
# pass, MaxText's remat_policy names (payload/model/sharding.py REMAT_SAVES says what each keeps;
# docs/models.md): none (everything), minimal, save_dot_except_mlp, save_qkv_proj,
# save_out_proj, full (only the layer's input); block = full (its earlier name).
REMATS = (
    "none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "full", "block",
)  # fmt: skip
# Attention on the JAX backend (payload/backends/jax/attention.py): auto = the platform's
# fused kernel where it is exact for the job (cuDNN on NVIDIA GPUs, splash on TPUs), else
# XLA's reference; fused = the kernel or a one-line error; reference = XLA's einsums.
ATTENTIONS = ("auto", "fused", "reference")
# train.sharding's values (SHARDINGS) and the families train.remat applies to
# (REMAT_FAMILIES): payload/model/sharding.py, with the rest of the sharding rules.
ON_BAD_INPUT = ("skip", "fail")
# The JSON field / Parquet column that holds a record's text (corpus.text_field).
DEFAULT_TEXT_FIELD = "text"
# A Hub dataset path: hf://datasets/<owner>/<name>@<revision>/<path or glob>; the revision
# must be a full commit id (payload/spec.py HF_COMMIT_RE checks it) so that a corpus read
# twice is the same corpus (payload/data/corpus.py).
HF_SCHEME = "hf://"
HF_DATASET_RE = re.compile(
    r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)@(?P<revision>[^/]+)(?P<rest>/.*)?$"
)
# Words (what the tokenizer's pre-tokenizer yields) longer than this are cut into pieces of
# at most this many characters, in training and encoding alike: the trainers' cost grows
# with the square of a word's length, so one whitespace-free line of a few hundred KB
# (base64, minified code) would stall the stage. 100 is transformers' WordPiece default
# (max_input_chars_per_word); google-research/bert uses 200.
DEFAULT_MAX_WORD_LENGTH = 100

BERT_STYLE = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ROBERTA_STYLE = {
    "cls": "<s>",
    "pad": "<pad>",
    "sep": "</s>",
    "unk": "<unk>",
    "mask": "<mask>",
    "bos": "<s>",
    "eos": "</s>",
}
CLM_STYLE = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>"}


def special_roles(objective: str, kind: str, family: str) -> dict[str, str]:
    """Role -> token of the default special-token style for this objective, kind and model.

    BERT style only for a WordPiece BERT or ELECTRA (ELECTRA's own vocabulary is BERT's);
    RoBERTa numbers positions from its pad id, which TF RoBERTa fixes at 1, so a RoBERTa gets
    the RoBERTa layout whatever the tokenizer kind.
    """
    if objective == "clm":
        return dict(CLM_STYLE)
    bert_like = kind == "wordpiece" and family in ("bert", "electra")
    return dict(BERT_STYLE if bert_like else ROBERTA_STYLE)


def default_special_tokens(objective: str, kind: str, family: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(special_roles(objective, kind, family).values()))


@dataclass(frozen=True, kw_only=True)
class CorpusSource:
    """One member of a corpus: its paths, the field its records keep their text in, and its
    share of ``data.max_tokens`` (``weight / sum of weights``; None without weights)."""

    paths: tuple[str, ...]
    text_field: str = DEFAULT_TEXT_FIELD
    weight: float | None = None


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """``paths`` (one source) or ``sources`` (a mixture), never both: see ``sources_of``."""

    paths: tuple[str, ...] = ()
    on_bad_input: str = "skip"
    text_field: str = DEFAULT_TEXT_FIELD
    sources: tuple[CorpusSource, ...] = ()

    @property
    def members(self) -> tuple[CorpusSource, ...]:
        """The corpus as a list of sources: ``corpus.paths`` is one source of weight None."""
        if self.sources:
            return self.sources
        return (CorpusSource(paths=self.paths, text_field=self.text_field),)

    @property
    def all_paths(self) -> tuple[str, ...]:
        return tuple(p for source in self.members for p in source.paths)


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    kind: str
    vocab_size: int
    lowercase: bool = False
    min_frequency: int = 2
    special_tokens: tuple[str, ...] = ()
    max_word_length: int = DEFAULT_MAX_WORD_LENGTH


# How the encode stage runs (payload/data/encode/stage.py; payload/data/encode/beam.py;
# docs/payload.md):
# `local`: worker processes on this machine; `beam`: an Apache Beam pipeline with the same
# functions and the same output, on a local Beam runner or on Dataflow.
ENCODE_RUNNERS = ("local", "beam")
# Beam runners we accept (Beam's names): DirectRunner runs here (payload/data/encode/beam.py: its
# FnApiRunner, never Prism, which downloads a binary at first use), DataflowRunner on GCP.
BEAM_RUNNERS = ("DirectRunner", "DataflowRunner")


@dataclass(frozen=True, kw_only=True)
class BeamSpec:
    runner: str = "DirectRunner"
    workers: int | None = None  # parallelism of a local Beam runner (None: one per CPU core)
    options: Mapping[str, str | int | bool] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    objective: str
    seq_length: int = 128
    records_per_shard: int = 10000
    mask_probability: float = 0.15
    workers: int | None = None
    # Held-out split, chosen per document from a hash of its text (see encode_rules.py): a share
    # of the corpus (raised toward eval_min_sequences on a small corpus), capped at
    # eval_max_sequences; 0 turns it off.
    eval_fraction: float = 0.01
    eval_min_sequences: int = 32
    eval_max_sequences: int = 2000
    # Token budget: encoding stops when it is reached (split over corpus.sources by weight;
    # the rule: payload/data/encode/rules.py).
    max_tokens: int | None = None
    runner: str = "local"  # local | beam (payload/data/encode/beam.py)
    beam: BeamSpec = field(default_factory=BeamSpec)
    # clm on the JAX backend: a token attends to its own packed document only (each document
    # starts with BOS; payload/backends/jax/models/blocks.py document_ids).
    document_mask: bool = False

    @property
    def max_predictions(self) -> int:
        """Static number of masked slots per MLM sequence.

        ``ceil(seq_length * mask_probability)`` rounded up to a multiple of 8 (TPU-friendly
        shapes), capped at ``seq_length``: 24 for 128 tokens at 15%.
        """
        raw = math.ceil(self.seq_length * self.mask_probability)
        return min(self.seq_length, max(8, math.ceil(raw / 8) * 8))


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    family: str
    size: str = "tiny"
    config: Mapping[str, int | float | str | bool] = field(
        default_factory=lambda: MappingProxyType({})
    )


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    steps: int
    global_batch_size: int = 32
    learning_rate: float = 5e-4
    warmup_steps: int = 0
    decay: str = "linear"
    end_learning_rate_ratio: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-6
    clip_norm: float = 1.0  # 0 disables global-norm clipping
    precision: str = "auto"
    backend: str = "auto"  # tf (TensorFlow + tf_keras) | jax (Keras 3 on JAX): docs/backends.md
    sharding: str = "auto"  # auto | data | fsdp (JAX backend): docs/backends.md "The mesh"
    remat: str = "none"  # REMATS (JAX backend): docs/models.md
    attention: str = "auto"  # auto | fused | reference (JAX backend): ATTENTIONS
    # Micro-batches per optimizer step (JAX backend): the global batch is split into this many
    # parts whose gradients are summed before the one update (docs/models.md).
    grad_accum_steps: int = 1
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_every: int = 500  # 0: evaluate on the held-out split only at the end
    shuffle_buffer: int = 10000
    seed: int = 0
    tracker: str = "tensorboard"  # observe.TRACKERS: docs/operating.md "Tracker"
    profile: ProfileSpec | None = None  # JAX profiler window: docs/operating.md "Profile"


@dataclass(frozen=True, kw_only=True)
class JobPaths:
    root: str
    tokenizer: str
    data: str
    checkpoints: str
    logs: str
    export: str
    status: str


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str
    output: str
    corpus: CorpusSpec
    tokenizer: TokenizerSpec
    data: DataSpec
    model: ModelSpec
    train: TrainSpec
    source: str
    # The grant's last day (ISO date, UTC; the stack's `grantEnds`): the ETA is checked
    # against its end (docs/operating.md).
    grant_ends: str | None = None

    @property
    def paths(self) -> JobPaths:
        root = self.output
        return JobPaths(
            root=root,
            tokenizer=storage.join(root, "tokenizer"),
            data=storage.join(root, "data"),
            checkpoints=storage.join(root, "checkpoints"),
            logs=storage.join(root, "logs"),
            export=storage.join(root, "export"),
            status=storage.join(root, "status.json"),
        )

    @property
    def special_roles(self) -> dict[str, str]:
        """Role (pad, unk, cls, sep, mask, bos, eos) -> token for this job."""
        return special_roles(self.data.objective, self.tokenizer.kind, self.model.family)

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec (defaults filled in, paths absolute) as plain JSON data."""

        def plain(value: Any) -> Any:
            if isinstance(value, Mapping):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, tuple | list):
                return [plain(v) for v in value]
            if hasattr(value, "__dataclass_fields__"):
                return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
            return value

        out = plain(self)
        out["data"]["max_predictions"] = self.data.max_predictions
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
