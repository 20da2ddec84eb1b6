"""The job spec: one YAML/JSON document, read and validated once into a ``JobSpec``.

What a job is (the frozen dataclasses, the closed vocabularies, the special-token styles)
lives in payload/schema/job.py; this module reads a document into it and re-exports those names,
so ``from payload.spec import JobSpec`` keeps working.

Unknown keys and bad values raise :class:`SpecError` naming the dotted key, the value and
what is allowed. Relative local paths (corpus, output) resolve against the directory of
the spec file, so ``examples/tiny.yaml`` can say ``output: ../runs/tiny``.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from payload.core import storage
from payload.core.errors import SpecError
from payload.model.sharding import REMAT_FAMILIES, SHARDINGS
from payload.schema.job import (
    ATTENTIONS,
    BACKENDS,
    BEAM_RUNNERS,
    BERT_STYLE,
    CLM_STYLE,
    DECAYS,
    DEFAULT_MAX_WORD_LENGTH,
    DEFAULT_TEXT_FIELD,
    ELECTRA_SIZES,
    ENCODE_RUNNERS,
    FAMILIES,
    FAMILIES_FOR_OBJECTIVE,
    HF_DATASET_RE,
    HF_SCHEME,
    JAX_ONLY_FAMILIES,
    JAX_ONLY_OBJECTIVES,
    LLAMA_SIZES,
    MASKED_OBJECTIVES,
    OBJECTIVES,
    ON_BAD_INPUT,
    PRECISIONS,
    REMATS,
    ROBERTA_STYLE,
    SIZES,
    SIZES_FOR_FAMILY,
    TOKENIZER_KINDS,
    BeamSpec,
    CorpusSource,
    CorpusSpec,
    DataSpec,
    JobPaths,
    JobSpec,
    ModelSpec,
    TokenizerSpec,
    TrainSpec,
    default_special_tokens,
    special_roles,
)
from payload.schema.observe import TRACKERS, profile_window, tf_profile_refusal

# What a job is comes from payload/schema/job.py (and payload/model/sharding.py); importing it from
# here keeps working.
__all__ = [
    "ATTENTIONS",
    "BACKENDS",
    "BEAM_DATAFLOW_REQUIRED",
    "BEAM_GCS_OPTIONS",
    "BEAM_OPTIONS",
    "BEAM_RUNNERS",
    "BERT_CONFIG_KEYS",
    "BERT_STYLE",
    "CLM_STYLE",
    "CONFIG_KEYS",
    "DECAYS",
    "DEFAULT_MAX_WORD_LENGTH",
    "DEFAULT_TEXT_FIELD",
    "ELECTRA_CONFIG_KEYS",
    "ELECTRA_SIZES",
    "ENCODE_RUNNERS",
    "FAMILIES",
    "FAMILIES_FOR_OBJECTIVE",
    "GPT2_CONFIG_KEYS",
    "HF_COMMIT_RE",
    "HF_DATASET_RE",
    "HF_SCHEME",
    "JAX_ONLY_FAMILIES",
    "JAX_ONLY_OBJECTIVES",
    "LLAMA_CONFIG_KEYS",
    "LLAMA_SIZES",
    "MASKED_OBJECTIVES",
    "MAX_CORPUS_SOURCES",
    "MAX_EVAL_FRACTION",
    "MAX_SEQ_LENGTH",
    "MAX_VOCAB",
    "MAX_WORD_LENGTH",
    "MIN_EXTRA_VOCAB",
    "MIN_SEQ_LENGTH",
    "MIN_WORD_LENGTH",
    "OBJECTIVES",
    "ON_BAD_INPUT",
    "PRECISIONS",
    "REMATS",
    "REMAT_FAMILIES",
    "ROBERTA_STYLE",
    "SHARDINGS",
    "SIZES",
    "SIZES_FOR_FAMILY",
    "TOKENIZER_KINDS",
    "BeamSpec",
    "CorpusSource",
    "CorpusSpec",
    "DataSpec",
    "JobPaths",
    "JobSpec",
    "ModelSpec",
    "TokenizerSpec",
    "TrainSpec",
    "default_special_tokens",
    "load_job",
    "parse_job",
    "special_roles",
    "tf_backend_refusal",
]

# The revision of a Hub dataset path (payload/schema/job.py HF_DATASET_RE): a full commit id.
HF_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
MAX_CORPUS_SOURCES = 1024

# Smallest vocabulary we accept before looking at the corpus: the special tokens plus
# 100 pieces (wordpiece/unigram), or plus the 256 byte symbols of byte-level BPE. After
# training, the tokenizer stage also checks that the corpus alphabet fitted.
MIN_EXTRA_VOCAB = {"wordpiece": 100, "unigram": 100, "bpe": 256}
MAX_VOCAB = 1 << 20
MIN_SEQ_LENGTH = 8
# Bounds of tokenizer.max_word_length (payload/schema/job.py DEFAULT_MAX_WORD_LENGTH says why words
# are cut).
MIN_WORD_LENGTH = 8
MAX_WORD_LENGTH = 1 << 16
MAX_EVAL_FRACTION = 0.5  # the held-out split never takes more than half of the corpus
MAX_SEQ_LENGTH = 1 << 16

BERT_CONFIG_KEYS = {
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "intermediate_size": int,
    "max_position_embeddings": int,
    "hidden_dropout_prob": float,
    "attention_probs_dropout_prob": float,
}
GPT2_CONFIG_KEYS = {
    "n_embd": int,
    "n_layer": int,
    "n_head": int,
    "n_positions": int,
    "resid_pdrop": float,
    "embd_pdrop": float,
    "attn_pdrop": float,
}
# transformers' LlamaConfig names. rope_theta is any positive number; the other floats lie in
# (0, 1) or [0, 1).
LLAMA_CONFIG_KEYS = {
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "max_position_embeddings": int,
    "rope_theta": float,
    "rms_norm_eps": float,
    "initializer_range": float,
    "tie_word_embeddings": bool,
}
# transformers' ElectraConfig names (the discriminator's), plus the generator's width as a
# fraction of the discriminator's (`generator_hidden_size`, the name and meaning of
# google-research/electra configure_pretraining.py), in (0, 1].
ELECTRA_CONFIG_KEYS = {
    "embedding_size": int,
    **BERT_CONFIG_KEYS,
    "generator_hidden_size": float,
}
CONFIG_KEYS = {
    "electra": ELECTRA_CONFIG_KEYS,
    "bert": BERT_CONFIG_KEYS,
    "roberta": BERT_CONFIG_KEYS,
    "gpt2": GPT2_CONFIG_KEYS,
    "llama": LLAMA_CONFIG_KEYS,
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


# Pipeline options passed through to Dataflow (data.beam.options), by Beam's own names
# (apache_beam/options/pipeline_options.py of apache-beam 2.77.0: GoogleCloudOptions,
# WorkerOptions, SetupOptions; checked in that file) and the type each takes. Closed: an
# option not listed here is refused, so nothing the stack did not mean reaches the job.
BEAM_OPTIONS: dict[str, type] = {
    "project": str,
    "region": str,
    "service_account_email": str,
    "network": str,
    "subnetwork": str,
    "temp_location": str,
    "staging_location": str,
    "no_use_public_ips": bool,
    "num_workers": int,
    "max_num_workers": int,
    "machine_type": str,
    "disk_size_gb": int,
    "sdk_container_image": str,
    "requirements_file": str,
    "job_name": str,
    "dataflow_kms_key": str,
}
BEAM_GCS_OPTIONS = ("temp_location", "staging_location")
# sdk_container_image: the workers' environment with tokenizers and the payload itself (the
# payload is not on PyPI, so a job without the image cannot run: docs/encoding-at-scale.md).
BEAM_DATAFLOW_REQUIRED = ("project", "region", "temp_location", "sdk_container_image")


# --------------------------------------------------------------------------- validation


class _Section:
    """Reads keys out of one mapping, remembering which were used."""

    def __init__(self, data: Any, where: str):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SpecError(f"{where or 'job spec'}: expected a mapping, got {_show(data)}")
        self.data = dict(data)
        self.where = where
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def take(self, name: str, check: Callable[[str, Any], Any], default: Any = ...) -> Any:
        self.used.add(name)
        if name not in self.data or (self.data[name] is None and default is not ...):
            if default is ...:
                raise SpecError(f"{self.key(name)} is required")
            return default
        return check(self.key(name), self.data[name])

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used, key=str)
        if unknown:
            allowed = ", ".join(sorted(self.used))
            raise SpecError(f"{self.key(str(unknown[0]))}: unknown key (allowed: {allowed})")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{key}: expected an integer, got {_show(value)}")
        if lo is not None and value < lo:
            raise SpecError(f"{key}: {value} is too small (minimum {lo})")
        if hi is not None and value > hi:
            raise SpecError(f"{key}: {value} is too large (maximum {hi})")
        return value

    return check


def _float(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Callable[[str, Any], float]:
    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{key}: expected a number, got {_show(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(f"{key}: expected a finite number, got {value}")
        if lo is not None and (value < lo or (lo_open and value == lo)):
            raise SpecError(f"{key}: {value} must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and (value > hi or (hi_open and value == hi)):
            raise SpecError(f"{key}: {value} must be {'<' if hi_open else '<='} {hi}")
        return value

    return check


def _choice(options: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in options:
            raise SpecError(f"{key}: {_show(value)} is not allowed (allowed: {', '.join(options)})")
        return str(value)

    return check


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{key}: expected true or false, got {_show(value)}")
    return value


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{key}: expected a non-empty string, got {_show(value)}")
    return value.strip()


def _iso_date(key: str, value: Any) -> str:
    """A calendar date, YYYY-MM-DD (YAML reads an unquoted one as a date)."""
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, str):
        try:
            return datetime.date.fromisoformat(value).isoformat()
        except ValueError:
            pass
    raise SpecError(f"{key}: {_show(value)} is not a date (allowed: YYYY-MM-DD, e.g. 2027-01-31)")


def _str_list(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise SpecError(f"{key}: expected a non-empty list of strings, got {_show(value)}")
    return tuple(_str(f"{key}[{i}]", item) for i, item in enumerate(value))


def _resolve(base_dir: str, path: str) -> str:
    if storage.is_gcs(path):
        return path.rstrip("/") if path.count("/") > 3 else path
    if path.startswith("~"):
        from pathlib import Path  # noqa: PLC0415

        return str(Path(path).expanduser())
    if storage.is_gcs(base_dir):
        return storage.join(base_dir, path) if not path.startswith("/") else path
    import os.path  # noqa: PLC0415

    return os.path.normpath(os.path.join(base_dir, path))  # noqa: PTH118


def _bucket_checked(key: str, path: str) -> str:
    """``path`` unchanged, or SpecError when its gs:// bucket name breaks GCS naming rules."""
    if storage.is_gcs(path):
        bucket = path[len(storage.GCS_SCHEME) :].partition("/")[0]
        problem = storage.bucket_name_problem(bucket)
        if problem:
            raise SpecError(
                f"{key}: {_show(path)}: bucket name {bucket!r} {problem} (Cloud Storage rules)"
            )
    return path


def _corpus_path(key: str, path: str, base_dir: str) -> str:
    if path.startswith(HF_SCHEME):
        return _hub_path_checked(key, path)
    return _resolve(base_dir, _bucket_checked(key, path))


def _hub_path_checked(key: str, path: str) -> str:
    """``path`` unchanged, or SpecError unless it names a Hub dataset at a full commit id."""
    match = HF_DATASET_RE.match(path)
    if match is None or not match.group("rest") or match.group("rest") == "/":
        raise SpecError(
            f"{key}: {_show(path)} is not a Hub dataset path (allowed: "
            "hf://datasets/<owner>/<name>@<commit>/<file, directory or glob>)"
        )
    revision = match.group("revision")
    if not HF_COMMIT_RE.match(revision):
        raise SpecError(
            f"{key}: revision {revision!r} is not a commit id; pin the dataset to the full "
            "40-character commit (HfApi().dataset_info(repo, revision=...).sha, or the Hub's "
            "'History' page) so the corpus cannot change under the run"
        )
    return path


def _paths(section: _Section, base_dir: str) -> tuple[str, ...]:
    key = section.key("paths")
    return tuple(
        _corpus_path(f"{key}[{i}]", p, base_dir)
        for i, p in enumerate(section.take("paths", _str_list))
    )


def _text_field(section: _Section, default: str) -> str:
    return str(section.take("text_field", _str, default))


def _corpus(section: _Section, base_dir: str) -> CorpusSpec:
    on_bad_input = section.take("on_bad_input", _choice(ON_BAD_INPUT), "skip")
    text_field = _text_field(section, DEFAULT_TEXT_FIELD)
    if ("paths" in section.data) == ("sources" in section.data):
        raise SpecError(
            f"{section.where}: give either paths (one source) or sources (a mixture), "
            f"{'not both' if 'paths' in section.data else 'one of them is required'}"
        )
    if "paths" in section.data:
        spec = CorpusSpec(
            paths=_paths(section, base_dir), on_bad_input=on_bad_input, text_field=text_field
        )
    else:
        spec = CorpusSpec(
            on_bad_input=on_bad_input,
            text_field=text_field,
            sources=section.take("sources", lambda k, v: _sources(k, v, base_dir, text_field)),
        )
    section.finish()
    return spec


def _sources(key: str, value: Any, base_dir: str, text_field: str) -> tuple[CorpusSource, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise SpecError(f"{key}: expected a non-empty list of sources, got {_show(value)}")
    if len(value) > MAX_CORPUS_SOURCES:
        raise SpecError(f"{key}: {len(value)} sources (at most {MAX_CORPUS_SOURCES})")
    sources = []
    for i, raw in enumerate(value):
        section = _Section(raw, f"{key}[{i}]")
        sources.append(
            CorpusSource(
                paths=_paths(section, base_dir),
                text_field=_text_field(section, text_field),
                weight=section.take("weight", _float(0.0, None, lo_open=True), None),
            )
        )
        section.finish()
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        missing = weighted.index(False)
        raise SpecError(f"{key}[{missing}].weight is required: give every source a weight, or none")
    return tuple(sources)


def _tokenizer(section: _Section, objective: str, family: str) -> TokenizerSpec:
    kind = section.take("kind", _choice(TOKENIZER_KINDS))
    vocab_size = section.take("vocab_size", _int(1, MAX_VOCAB))
    roles = special_roles(objective, kind, family)
    specials = section.take(
        "special_tokens", _str_list, default_special_tokens(objective, kind, family)
    )
    key = section.key("special_tokens")
    if len(set(specials)) != len(specials):
        raise SpecError(f"{key}: duplicate tokens in {list(specials)}")
    missing = [tok for tok in dict.fromkeys(roles.values()) if tok not in specials]
    if missing:
        raise SpecError(
            f"{key}: {objective} with a {kind} tokenizer needs {missing} "
            f"(roles: {', '.join(f'{r}={t}' for r, t in roles.items())})"
        )
    minimum = len(specials) + MIN_EXTRA_VOCAB[kind]
    if vocab_size < minimum:
        raise SpecError(
            f"{section.key('vocab_size')}: {vocab_size} is too small for a {kind} tokenizer "
            f"(minimum {minimum} = {len(specials)} special tokens + {MIN_EXTRA_VOCAB[kind]})"
        )
    spec = TokenizerSpec(
        kind=kind,
        vocab_size=vocab_size,
        lowercase=section.take("lowercase", _bool, False),
        min_frequency=section.take("min_frequency", _int(1, 1_000_000), 2),
        special_tokens=specials,
        max_word_length=section.take(
            "max_word_length", _int(MIN_WORD_LENGTH, MAX_WORD_LENGTH), DEFAULT_MAX_WORD_LENGTH
        ),
    )
    section.finish()
    return spec


def _data(section: _Section) -> DataSpec:
    spec = DataSpec(
        objective=section.take("objective", _choice(OBJECTIVES)),
        seq_length=section.take("seq_length", _int(MIN_SEQ_LENGTH, MAX_SEQ_LENGTH), 128),
        records_per_shard=section.take("records_per_shard", _int(1, 10_000_000), 10000),
        mask_probability=section.take(
            "mask_probability", _float(0.0, 1.0, lo_open=True, hi_open=True), 0.15
        ),
        workers=section.take("workers", _int(1, 1024), None),
        eval_fraction=section.take("eval_fraction", _float(0.0, MAX_EVAL_FRACTION), 0.01),
        eval_min_sequences=section.take("eval_min_sequences", _int(0, 1 << 30), 32),
        eval_max_sequences=section.take("eval_max_sequences", _int(1, 1 << 30), 2000),
        max_tokens=section.take("max_tokens", _int(1, 1 << 62), None),
        runner=section.take("runner", _choice(ENCODE_RUNNERS), "local"),
        beam=section.take("beam", lambda key, v: _beam(_Section(v, key)), BeamSpec()),
        document_mask=section.take("document_mask", _bool, False),
    )
    if spec.document_mask and spec.objective != "clm":
        raise SpecError(
            f"{section.key('document_mask')}: masks packed documents from each other in "
            f"data.objective: clm; {spec.objective} sequences attend to every token"
        )
    if spec.eval_max_sequences < spec.eval_min_sequences:
        raise SpecError(
            f"{section.key('eval_max_sequences')}: {spec.eval_max_sequences} is below "
            f"{section.key('eval_min_sequences')}: {spec.eval_min_sequences} (the cap must be "
            "at least the floor)"
        )
    section.finish()
    return spec


def _beam(section: _Section) -> BeamSpec:
    runner = section.take("runner", _choice(BEAM_RUNNERS), "DirectRunner")
    workers = section.take("workers", _int(1, 1024), None)
    options = section.take("options", _beam_options, MappingProxyType({}))
    section.finish()
    key = section.key("options")
    if runner == "DataflowRunner":
        missing = [name for name in BEAM_DATAFLOW_REQUIRED if name not in options]
        if missing:
            raise SpecError(f"{key}: DataflowRunner needs {', '.join(missing)}")
    elif options:
        raise SpecError(
            f"{key}: options are for DataflowRunner; {runner} runs on this machine "
            f"(use {section.key('workers')} for its parallelism)"
        )
    return BeamSpec(runner=runner, workers=workers, options=options)


def _beam_options(key: str, value: Any) -> Mapping[str, str | int | bool]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{key}: expected a mapping of Beam pipeline options, got {_show(value)}")
    out: dict[str, str | int | bool] = {}
    for name, option in value.items():
        kind = BEAM_OPTIONS.get(str(name))
        if kind is None:
            raise SpecError(
                f"{key}.{name}: unknown Beam option (allowed: {', '.join(sorted(BEAM_OPTIONS))})"
            )
        where = f"{key}.{name}"
        if kind is bool:
            out[name] = _bool(where, option)
        elif kind is int:
            out[name] = _int(1, 1 << 20)(where, option)
        else:
            text = _str(where, option)
            if name in BEAM_GCS_OPTIONS and not storage.is_gcs(text):
                raise SpecError(f"{where}: {_show(text)} must be a gs:// path")
            out[name] = text
    return MappingProxyType(out)


def _model(section: _Section, objective: str) -> ModelSpec:
    allowed = FAMILIES_FOR_OBJECTIVE[objective]
    family = section.take("family", _choice(FAMILIES))
    if family not in allowed:
        raise SpecError(
            f"{section.key('family')}: {family!r} cannot train objective {objective!r} "
            f"(data.objective={objective} needs model.family in: {', '.join(allowed)})"
        )
    size = section.take("size", _choice(SIZES_FOR_FAMILY[family]), "tiny")
    raw = section.take("config", lambda key, v: _Section(v, key), None)
    config: dict[str, int | float | bool] = {}
    if raw is not None:
        keys = CONFIG_KEYS[family]
        for name, value in raw.data.items():
            key = raw.key(str(name))
            if name not in keys:
                raise SpecError(
                    f"{key}: unknown {family} config key (allowed: {', '.join(sorted(keys))})"
                )
            if keys[name] is bool:
                config[name] = _bool(key, value)
            elif keys[name] is int:
                config[name] = _int(1, 1 << 20)(key, value)
            elif name == "rope_theta":
                config[name] = _float(0.0, 1e12, lo_open=True)(key, value)
            elif name == "generator_hidden_size":
                config[name] = _float(0.0, 1.0, lo_open=True)(key, value)
            elif name in ("rms_norm_eps", "initializer_range"):
                config[name] = _float(0.0, 1.0, lo_open=True, hi_open=True)(key, value)
            else:
                config[name] = _float(0.0, 1.0, hi_open=True)(key, value)
    spec = ModelSpec(
        family=family, size=size, config=MappingProxyType(dict(sorted(config.items())))
    )
    section.finish()
    return spec


def _train(section: _Section) -> TrainSpec:
    steps = section.take("steps", _int(1, 1 << 40))
    spec = TrainSpec(
        steps=steps,
        global_batch_size=section.take("global_batch_size", _int(1, 1 << 20), 32),
        learning_rate=section.take("learning_rate", _float(0.0, 10.0, lo_open=True), 5e-4),
        warmup_steps=section.take("warmup_steps", _int(0, steps), 0),
        decay=section.take("decay", _choice(DECAYS), "linear"),
        end_learning_rate_ratio=section.take("end_learning_rate_ratio", _float(0.0, 1.0), 0.0),
        weight_decay=section.take("weight_decay", _float(0.0, 1.0), 0.01),
        adam_beta1=section.take("adam_beta1", _float(0.0, 1.0, hi_open=True), 0.9),
        adam_beta2=section.take("adam_beta2", _float(0.0, 1.0, hi_open=True), 0.999),
        adam_epsilon=section.take("adam_epsilon", _float(0.0, 1.0, lo_open=True), 1e-6),
        clip_norm=section.take("clip_norm", _float(0.0), 1.0),
        precision=section.take("precision", _choice(PRECISIONS), "auto"),
        backend=section.take("backend", _choice(BACKENDS), "auto"),
        sharding=section.take("sharding", _choice(SHARDINGS), "auto"),
        remat=section.take("remat", _choice(REMATS), "none"),
        attention=section.take("attention", _choice(ATTENTIONS), "auto"),
        grad_accum_steps=section.take("grad_accum_steps", _int(1, 1 << 16), 1),
        checkpoint_every=section.take("checkpoint_every", _int(1, 1 << 40), 100),
        keep_checkpoints=section.take("keep_checkpoints", _int(1, 1000), 3),
        log_every=section.take("log_every", _int(1, 1 << 40), 10),
        eval_every=section.take("eval_every", _int(0, 1 << 40), 500),
        shuffle_buffer=section.take("shuffle_buffer", _int(1, 1 << 24), 10000),
        seed=section.take("seed", _int(0, (1 << 31) - 1), 0),
        tracker=section.take("tracker", _choice(TRACKERS), "tensorboard"),
        profile=section.take("profile", functools.partial(profile_window, steps=steps), None),
    )
    if spec.global_batch_size % spec.grad_accum_steps:
        raise SpecError(
            f"{section.key('grad_accum_steps')}: {spec.grad_accum_steps} does not divide "
            f"{section.key('global_batch_size')}: {spec.global_batch_size} (each optimizer step "
            "splits the global batch into that many equal micro-batches)"
        )
    section.finish()
    return spec


def parse_job(document: Any, *, source: str, check_model: bool = True) -> JobSpec:
    """Validate an already-parsed document; ``source`` is the spec's path (for relative paths).
    ``check_model=False`` skips the model-vs-data check, which needs transformers' config
    classes (payload/plan/estimate.py, in an environment without transformers)."""
    top = _Section(document, "")
    base_dir = storage.dirname(source)
    name = top.take("name", _str, None)
    if name is None:
        name = storage.basename(source).rsplit(".", 1)[0]
    if not _NAME_RE.match(name):
        raise SpecError(
            f"name: {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting alphanumeric"
        )
    output = _resolve(base_dir, _bucket_checked("output", top.take("output", _str)))
    data = top.take("data", lambda key, v: _data(_Section(v, key)))
    model = top.take("model", lambda key, v: _model(_Section(v, key), data.objective))
    job = JobSpec(
        name=name,
        output=output,
        corpus=top.take("corpus", lambda key, v: _corpus(_Section(v, key), base_dir)),
        tokenizer=top.take(
            "tokenizer",
            lambda key, v: _tokenizer(_Section(v, key), data.objective, model.family),
        ),
        data=data,
        model=model,
        train=top.take("train", lambda key, v: _train(_Section(v, key))),
        source=source,
        grant_ends=top.take("grant_ends", _iso_date, None),
    )
    top.finish()
    _check_mixture(job)
    _check_backend(job)
    if check_model:
        _check_model(job)
    return job


def _check_mixture(job: JobSpec) -> None:
    """Weights share out a token budget: without data.max_tokens they would mean nothing."""
    weighted = bool(job.corpus.sources) and job.corpus.sources[0].weight is not None
    if weighted and job.data.max_tokens is None:
        raise SpecError(
            "corpus.sources[0].weight: weights share out data.max_tokens; set "
            "data.max_tokens or remove the weights (then every source is read whole)"
        )


def _check_backend(job: JobSpec) -> None:
    """`train.backend: tf` with what only the JAX backend has, refused before any stage;
    `train.remat` wraps Llama decoder layers only."""
    if job.train.remat != "none" and job.model.family not in REMAT_FAMILIES:
        raise SpecError(
            f"train.remat: {job.train.remat} applies to the decoder layers of model.family "
            f"{', '.join(REMAT_FAMILIES)}; model.family {job.model.family} trains with "
            "train.remat: none"
        )
    if job.train.backend == "tf" and (refusal := tf_backend_refusal(job)):
        raise SpecError(refusal)


def tf_backend_refusal(job: JobSpec) -> str | None:
    """Why the TF backend cannot train `job` (the first setting only the JAX backend has),
    or None. Checked here for `train.backend: tf` and by the TF backend itself, which `auto`
    can also pick (the VM's TPU_PAYLOAD_BACKEND)."""
    spec = job.train
    if refusal := tf_profile_refusal(spec.profile):
        return refusal
    if job.data.objective in JAX_ONLY_OBJECTIVES:
        return (
            f"data.objective: {job.data.objective} trains on the JAX backend only, not with "
            "train.backend: tf; use train.backend: jax (or auto, which picks it)"
        )
    if job.model.family in JAX_ONLY_FAMILIES:
        return (
            f"model.family: {job.model.family} trains on the JAX backend only, not with "
            "train.backend: tf; use train.backend: jax (or auto, which picks it)"
        )
    if spec.sharding == "fsdp":
        return (
            "train.sharding: fsdp shards the training state over the devices, which only the "
            "JAX backend does, not train.backend: tf; use train.backend: jax, or "
            "train.sharding: data (or auto)"
        )
    # Settings only the JAX backend has, with the value the TF backend computes anyway.
    for name, value, tf_value in (
        ("train.remat", spec.remat, "none"),
        ("train.attention", spec.attention, "auto"),
        ("train.grad_accum_steps", spec.grad_accum_steps, 1),
        ("data.document_mask", job.data.document_mask, False),
    ):
        if value != tf_value and not (name == "train.attention" and value == "reference"):
            shown = str(value).lower() if isinstance(value, bool) else value
            return (
                f"{name}: {shown} is a JAX backend setting, not one of "
                f"train.backend: tf; use train.backend: jax, or {name}: "
                f"{str(tf_value).lower() if isinstance(tf_value, bool) else tf_value}"
            )
    return None


def _check_model(job: JobSpec) -> None:
    """Model-side checks that need a built config (e.g. seq_length vs positions); TF-free."""
    from payload.model import configs as model  # noqa: PLC0415  (transformers config classes only)

    model.check_compatible(job)


# PyYAML (YAML 1.1) reads a number with an exponent and no dot, `1e-08`, as a string: the form
# json.dumps gives small floats (infra renders every job spec the VMs read as JSON: an
# adam_epsilon of 1.0e-8 arrived as '1e-08') and the form people write (`1e-4`). JSON and
# YAML 1.2 read it as a number, and so does the payload.
_EXPONENT_WITHOUT_DOT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


@functools.cache
def _job_loader() -> type:
    import yaml  # noqa: PLC0415

    class JobLoader(yaml.SafeLoader):
        """yaml.SafeLoader that also reads 1e-08 as a float."""

    JobLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", _EXPONENT_WITHOUT_DOT, list("-+0123456789")
    )
    return JobLoader


def parse_document(text: str) -> Any:
    """A job document's YAML or JSON text as data (yaml.YAMLError when it is neither)."""
    import yaml  # noqa: PLC0415

    return yaml.load(text, Loader=_job_loader())  # noqa: S506  (a SafeLoader subclass)


def load_job(path: str, *, check_model: bool = True) -> JobSpec:
    """Read, parse and validate a job spec (YAML or JSON; local path or gs:// URI)."""
    import os.path  # noqa: PLC0415

    import yaml  # noqa: PLC0415

    source = path if storage.is_gcs(path) else os.path.abspath(path)  # noqa: PTH100
    _bucket_checked("--job", source)
    try:
        text = storage.read_text(source)
    except FileNotFoundError:
        raise SpecError(f"job spec not found: {path}") from None
    except IsADirectoryError:
        raise SpecError(f"job spec is a directory, not a file: {path}") from None
    except UnicodeDecodeError:
        raise SpecError(f"job spec {path} is not UTF-8 text") from None
    except OSError as exc:  # e.g. permission denied
        raise SpecError(f"cannot read job spec {path}: {exc.strerror or exc}") from None
    try:
        document = parse_document(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise SpecError(f"job spec {path}{where}: invalid YAML/JSON: {problem}") from None
    return parse_job(document, source=source, check_model=check_model)
