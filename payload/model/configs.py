"""Model presets, configs and compatibility checks of every family, for both backends.

Framework-free (transformers config classes only, imported where a config is built):
`spec.load_job` calls `check_compatible` while validating a job, on machines that may never
import TensorFlow or JAX, and it checks the job's settings without building a config, so
that `validate` and the encode stage do not import transformers (about 2 s of CPU in every
such process; the tokenizer stage still does: it writes transformers' tokenizer files). The
models themselves are the backends' (payload/backends/tf/model.py,
payload/backends/jax/models/).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from payload.core.errors import SpecError
from payload.schema.manifest import special_ids_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from payload.schema.job import JobSpec

# Size presets. bert and roberta share the encoder shapes of the BERT miniatures
# (Turc et al. 2019: tiny = L2/H128, mini = L4/H256, small = L4/H512) and BERT-base.
# gpt2 uses the same widths/depths; its "base" is GPT-2 small (124M with a 50k vocabulary).
_ENCODER_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 512,
    },
    "mini": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
    },
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "intermediate_size": 2048,
    },
    "base": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
}
_GPT2_SIZES: dict[str, dict[str, int]] = {
    size: {
        "n_embd": v["hidden_size"],
        "n_layer": v["num_hidden_layers"],
        "n_head": v["num_attention_heads"],
    }
    for size, v in _ENCODER_SIZES.items()
}

# Llama (LlamaConfig names). Shapes and where they come from (docs/models.md has the counts):
# - tiny: our choice, for tests (grouped-query attention with 2 key/value heads of 4);
# - 125m: SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M: 576 wide, 30 layers,
#   9 heads, 3 key/value heads, intermediate 1536, tied, rope_theta 100000);
# - 350m: SmolLM2-360M's shape (960 wide, 32 layers, 15 heads, 5 key/value heads,
#   intermediate 2560, tied); its rope_theta here is our choice (100000, as the 135M);
# - 1b / 3b: Llama 3.2 1B / 3B's config.json (meta-llama/Llama-3.2-{1B,3B}: 2048 x 16
#   layers, 32 heads / 3072 x 28 layers, 24 heads; 8 key/value heads, intermediate 8192,
#   tied, rope_theta 500000, rms_norm_eps 1e-5) with the default RoPE: their "llama3"
#   scaling of positions past 8192 is for long-context extension, not pre-training, and
#   8192 positions is their original_max_position_embeddings.
# max_position_embeddings costs no parameters with RoPE: it caps data.seq_length only.
_LLAMA_COMMON = {"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "initializer_range": 0.02}
_LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
    },
    "125m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 2048,
        "rope_theta": 100000.0,
    },
    "350m": {
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "max_position_embeddings": 2048,
        "rope_theta": 100000.0,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}

# ELECTRA (ElectraConfig names for the discriminator; `generator_hidden_size` is the
# generator's width as a fraction of the discriminator's). Where the values come from:
# - small / base: google-research/electra at 8a46635 (2021-03-31), whose configure_pretraining.py
#   points to "Table 6 in the paper for the full hyperparameters": util/training_utils.py
#   get_bert_config (small 256 wide, base 768, both 12 layers; heads = hidden / 64,
#   intermediate = 4 x hidden), configure_pretraining.py (small: embedding_size 128 and
#   generator_hidden_size 0.25; base: embedding_size 768 and generator_hidden_size 0.33333,
#   max_seq_length 512) and run_pretraining.py get_generator_config (the generator keeps the
#   layer count, heads = max(1, width / 64), intermediate = 4 x width). We did not read the
#   paper's Table 6 itself; these are the repository's values, which cite it.
# - tiny: our choice, for tests: embedding_size 32 < hidden 64 and a generator 16 wide, so
#   both networks have the embedding projection (ElectraModel.embeddings_project).
# max_position_embeddings 512 as ElectraConfig's default (BERT's).
_ELECTRA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "embedding_size": 32,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 256,
        "generator_hidden_size": 0.25,
    },
    "small": {
        "embedding_size": 128,
        "hidden_size": 256,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "generator_hidden_size": 0.25,
    },
    "base": {
        "embedding_size": 768,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "generator_hidden_size": 0.33333,
    },
}

# Attention dropout 0 in every pre-training preset (transformers' configs default to 0.1):
# today's recipes train without it (ModernBERT's config attention_dropout=0.0; MosaicBERT sets
# attention_probs_dropout_prob 0.0 so that Flash Attention runs; MaxText's base.yml
# dropout_rate: 0.0; nanoGPT's train.py dropout = 0 "for pretraining 0 is good"; sources in
# docs/models.md), and neither fused kernel applies it (payload/model/kernels.py). 0.1 stays one
# model.config key away, on the reference attention.
_NO_ATTENTION_DROPOUT = {"attention_probs_dropout_prob": 0.0}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "bert": {
        size: {**v, "max_position_embeddings": 512, **_NO_ATTENTION_DROPOUT}
        for size, v in _ENCODER_SIZES.items()
    },
    # TF RoBERTa numbers positions from padding_idx + 1 = 2: 512 tokens need 514 positions.
    "roberta": {
        size: {**v, "max_position_embeddings": 514, "type_vocab_size": 1, **_NO_ATTENTION_DROPOUT}
        for size, v in _ENCODER_SIZES.items()
    },
    "gpt2": {
        size: {**v, "n_positions": 1024, "attn_pdrop": 0.0} for size, v in _GPT2_SIZES.items()
    },
    "llama": {size: {**_LLAMA_COMMON, **v} for size, v in _LLAMA_SIZES.items()},
    "electra": {
        size: {**v, "max_position_embeddings": 512, **_NO_ATTENTION_DROPOUT}
        for size, v in _ELECTRA_SIZES.items()
    },
}

# Config keys a job may override, per family. gpt2 also accepts the BERT-style names that
# GPT2Config maps onto its own (hidden_size -> n_embd, ...); they are normalised here.
_ENCODER_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)
_GPT2_KEYS = (
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)
_GPT2_ALIASES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
    "intermediate_size": "n_inner",
    "hidden_dropout_prob": "resid_pdrop",
    "attention_probs_dropout_prob": "attn_pdrop",
}
_LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "initializer_range",
    "tie_word_embeddings",
)
OVERRIDABLE_KEYS: dict[str, tuple[str, ...]] = {
    "bert": _ENCODER_KEYS,
    "roberta": _ENCODER_KEYS,
    "gpt2": _GPT2_KEYS + tuple(_GPT2_ALIASES),
    "llama": _LLAMA_KEYS,
    "electra": ("embedding_size", *_ENCODER_KEYS, "generator_hidden_size"),
}

# TF RoBERTa hard-codes padding_idx = 1 for its position ids (modeling_tf_roberta.py).
ROBERTA_PADDING_IDX = 1


def resolved_settings(family: str, size: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Preset values with the job's overrides applied (canonical key names)."""
    if family not in PRESETS:
        raise SpecError(f"model.family: {family!r} is not supported; allowed: {', '.join(PRESETS)}")
    if size not in PRESETS[family]:
        raise SpecError(
            f"model.size: {size!r} is not a preset; allowed: {', '.join(PRESETS[family])}"
        )
    settings = dict(PRESETS[family][size])
    for key, value in overrides.items():
        if key not in OVERRIDABLE_KEYS[family]:
            raise SpecError(
                f"model.config.{key}: not a {family} setting; allowed: "
                f"{', '.join(OVERRIDABLE_KEYS[family])}"
            )
        settings[_GPT2_ALIASES.get(key, key) if family == "gpt2" else key] = value
    return settings


def attention_dropout(family: str, settings: Mapping[str, Any]) -> float:
    """The attention dropout of a model's settings (resolved_settings, or a transformers
    config's to_dict()): Llama has none."""
    key = {"gpt2": "attn_pdrop", "llama": "attention_dropout"}.get(
        family, "attention_probs_dropout_prob"
    )
    return float(settings.get(key) or 0.0)


def attention_head_sizes(family: str, settings: Mapping[str, Any]) -> tuple[int, ...]:
    """The head sizes of a model's attention layers (resolved_settings, or a transformers
    config's to_dict()): ELECTRA's generator has its own (generator_config's width and
    width // 64 heads)."""
    if family == "gpt2":
        width, heads = int(settings["n_embd"]), int(settings["n_head"])
    else:
        width, heads = int(settings["hidden_size"]), int(settings["num_attention_heads"])
    sizes = [width // max(heads, 1)]
    if family == "electra":
        generator = round(width * float(settings[GENERATOR_FRACTION_KEY]))
        sizes.append(generator // max(1, generator // 64))
    return tuple(sizes)


def config_for(job: JobSpec, manifest: Any) -> PretrainedConfig:
    """The job's model config for the encoded data (`manifest`: vocabulary, special ids):
    what both training backends build their model from."""
    return build_config(
        job.model.family,
        job.model.size,
        job.model.config,
        vocab_size=manifest.vocab_size,
        special_ids=special_ids_of(manifest),
    )


def build_config(
    family: str,
    size: str,
    overrides: Mapping[str, Any],
    *,
    vocab_size: int,
    special_ids: Mapping[str, int],
) -> PretrainedConfig:
    """A transformers config (TF-free) for the family, size preset and overrides."""
    from transformers import BertConfig, GPT2Config, RobertaConfig  # noqa: PLC0415

    settings = resolved_settings(family, size, overrides)
    check_shapes(family, settings)
    ids: dict[str, Any] = {
        f"{name}_token_id": special_ids[name]
        for name in ("pad", "bos", "eos")
        if name in special_ids
    }
    if family == "llama":
        return _llama_config(settings, vocab_size=int(vocab_size), ids=ids)
    if family == "electra":
        _bert_ids(ids, special_ids)
        return _electra_config(settings, vocab_size=int(vocab_size), ids=ids)
    if family == "gpt2":
        config_cls: type[PretrainedConfig] = GPT2Config
    else:
        config_cls = BertConfig if family == "bert" else RobertaConfig
        if family == "bert":
            _bert_ids(ids, special_ids)
    return config_cls(vocab_size=int(vocab_size), **settings, **ids)


def check_shapes(family: str, settings: Mapping[str, Any]) -> None:
    """SpecError if the resolved settings give shapes the family's model cannot have (heads
    that do not divide the width, ...): what building the config would refuse, without
    transformers."""
    if family == "llama":
        width, heads = int(settings["hidden_size"]), int(settings["num_attention_heads"])
        groups = int(settings["num_key_value_heads"])
        if width % heads:
            raise SpecError(
                f"model.config: hidden_size={width} must be a multiple of "
                f"num_attention_heads={heads}"
            )
        if heads % groups:
            raise SpecError(
                f"model.config: num_attention_heads={heads} must be a multiple of "
                f"num_key_value_heads={groups} (grouped-query attention)"
            )
        if (width // heads) % 2:
            raise SpecError(
                f"model.config: the head size hidden_size / num_attention_heads = "
                f"{width // heads} must be even (rotary embeddings rotate pairs of dimensions)"
            )
        return
    width_key, heads_key = (
        ("n_embd", "n_head") if family == "gpt2" else ("hidden_size", "num_attention_heads")
    )
    width, heads = int(settings[width_key]), int(settings[heads_key])
    if heads <= 0 or width % heads:
        raise SpecError(
            f"model.config: {width_key}={width} must be a positive multiple of {heads_key}={heads}"
        )
    if family == "electra":
        generator_shape(width, float(settings[GENERATOR_FRACTION_KEY]))


def _bert_ids(ids: dict[str, Any], special_ids: Mapping[str, int]) -> None:
    """BERT-style vocabularies have no bos/eos: [CLS] and [SEP] stand for them."""
    if "cls" in special_ids and "bos_token_id" not in ids:
        ids["bos_token_id"] = special_ids["cls"]
    if "sep" in special_ids and "eos_token_id" not in ids:
        ids["eos_token_id"] = special_ids["sep"]


# The JAX backend's loss (backends/jax/steps.py chunked_loss_terms) computes the logits a
# chunk of tokens at a time; the plan (payload/plan/estimate.py) counts one chunk. A chunk's float32
# logits stay under loss_chunk_budget(device memory): LOSS_CHUNK_SHARE of a device's memory,
# at least LOSS_CHUNK_BYTES, at most LOSS_CHUNK_MAX_BYTES. Large enough that its matmul
# (>= ~500 tokens x hidden x vocabulary at the presets' vocabularies) keeps an accelerator's
# matrix units busy and the scan takes few steps (2-4 for a sequence of 2,048 on an 80 GB
# GPU, 8-16 on a 16 GB v5e), small enough that the three logits-sized buffers of a chunk's
# backward pass (the float32 logits, their softmax and its gradient) take under 5 % of the
# device. Our choice, not a measured optimum (MaxText's num_vocab_tiling is a tile count the
# user sets, src/maxtext/configs/base.yml).
LOSS_CHUNK_BYTES = 256 * 2**20
LOSS_CHUNK_MAX_BYTES = 2 * 2**30
LOSS_CHUNK_SHARE = 1 / 64


def loss_chunk_budget(memory_bytes: int | None) -> int:
    """The bytes of one chunk's float32 logits on a device of `memory_bytes` (None: not
    known, e.g. CPU devices: LOSS_CHUNK_BYTES)."""
    if not memory_bytes:
        return LOSS_CHUNK_BYTES
    share = int(memory_bytes * LOSS_CHUNK_SHARE)
    return min(LOSS_CHUNK_MAX_BYTES, max(LOSS_CHUNK_BYTES, share))


def loss_chunk_length(rows: int, length: int, vocab: int, budget: int = LOSS_CHUNK_BYTES) -> int:
    """Positions per chunk of the chunked loss over [rows, length] tokens (rows: what one
    device holds): the largest divisor of `length` whose rows x positions x vocab float32
    logits stay under `budget` (at least 1: a chunk is never smaller than one position)."""
    most = max(1, budget // (4 * vocab * max(rows, 1)))
    return max(d for d in range(1, length + 1) if length % d == 0 and d <= most)


# ELECTRA's recipe (google-research/electra configure_pretraining.py, run_pretraining.py):
# total loss = gen_weight (1.0) x generator MLM loss + disc_weight (50.0) x discriminator
# loss; samples drawn from softmax(logits / temperature) with Gumbel noise, temperature 1.0;
# pretrain_helpers.mask: 85% of the chosen positions become [MASK], 15% stay (no random
# token). The backends read them from here.
ELECTRA_DISC_WEIGHT = 50.0
ELECTRA_GEN_WEIGHT = 1.0
ELECTRA_TEMPERATURE = 1.0
ELECTRA_MASK_TOKEN_RATIO = 0.85
ELECTRA_RANDOM_TOKEN_RATIO = 0.0
# The generator's config key: run identity and checkpoints see it; the discriminator's
# export leaves it out (export_config).
GENERATOR_FRACTION_KEY = "generator_hidden_size"


def _electra_config(
    settings: Mapping[str, Any], *, vocab_size: int, ids: Mapping[str, Any]
) -> PretrainedConfig:
    """The discriminator's ElectraConfig, carrying the generator's width fraction
    (`generator_hidden_size`); `generator_config` derives the generator's."""
    from transformers import ElectraConfig  # noqa: PLC0415

    settings = dict(settings)
    fraction = float(settings.pop(GENERATOR_FRACTION_KEY))
    config = ElectraConfig(vocab_size=vocab_size, hidden_act="gelu", **settings, **ids)
    setattr(config, GENERATOR_FRACTION_KEY, fraction)
    return config


def generator_config(config: PretrainedConfig) -> PretrainedConfig:
    """The generator's ElectraConfig from the discriminator's, as google-research/electra's
    run_pretraining.py get_generator_config: width = round(hidden x generator_hidden_size),
    the same number of layers, heads = max(1, width // 64), intermediate = 4 x width; the
    embeddings (embedding_size wide) are the discriminator's."""
    from transformers import ElectraConfig  # noqa: PLC0415

    width, heads = generator_shape(
        config.hidden_size, float(getattr(config, GENERATOR_FRACTION_KEY))
    )
    settings = export_config(config)
    settings.update(hidden_size=width, num_attention_heads=heads, intermediate_size=4 * width)
    return ElectraConfig(**settings)


def generator_shape(hidden_size: int, fraction: float) -> tuple[int, int]:
    """The generator's (width, heads) for a discriminator `hidden_size` wide (SpecError when
    the fraction gives no valid generator)."""
    width = round(hidden_size * fraction)
    heads = max(1, width // 64)
    if width < 1 or width % heads:
        raise SpecError(
            f"model.config.{GENERATOR_FRACTION_KEY}: {fraction:g} x hidden_size "
            f"{hidden_size} gives a generator {width} wide, which must be at least 1 and "
            f"a multiple of its {heads} heads (width // 64)"
        )
    return width, heads


def discriminator_config(config: PretrainedConfig) -> PretrainedConfig:
    """The discriminator's ElectraConfig as exported (no generator fraction)."""
    from transformers import ElectraConfig  # noqa: PLC0415

    return ElectraConfig(**export_config(config))


def export_config(config: PretrainedConfig) -> dict[str, Any]:
    """An ElectraConfig's dict without the generator fraction (what transformers reads)."""
    settings = config.to_dict()
    settings.pop(GENERATOR_FRACTION_KEY, None)
    for key in ("architectures", "transformers_version", "model_type"):
        settings.pop(key, None)
    return settings


def _llama_config(
    settings: Mapping[str, Any], *, vocab_size: int, ids: Mapping[str, Any]
) -> PretrainedConfig:
    """LlamaConfig without biases, with SiLU and the default RoPE (what LlamaForCausalLM
    computes from it is what backends/jax/models/llama.py computes)."""
    from transformers import LlamaConfig  # noqa: PLC0415

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        **settings,
        **ids,
    )


def max_sequence_length(family: str, config: PretrainedConfig) -> int:
    """The longest input the model's position embeddings can hold."""
    return _positions_hold(family, int(getattr(config, _position_key(family))))


def _positions_hold(family: str, positions: int) -> int:
    """The longest input `positions` position embeddings hold (RoBERTa numbers from 2)."""
    return positions - ROBERTA_PADDING_IDX - 1 if family == "roberta" else positions


def _position_key(family: str) -> str:
    return "n_positions" if family == "gpt2" else "max_position_embeddings"


def check_compatible(job: JobSpec) -> None:
    """SpecError if the job's model cannot take the job's data (TF-free)."""
    family = job.model.family
    settings = resolved_settings(family, job.model.size, job.model.config)
    check_shapes(family, settings)
    if family == "roberta":
        pad = job.special_roles.get("pad")
        tokens = list(job.tokenizer.special_tokens)
        if pad in tokens and tokens.index(pad) != ROBERTA_PADDING_IDX:
            raise SpecError(
                f"tokenizer.special_tokens: roberta needs the pad token {pad!r} at id "
                f"{ROBERTA_PADDING_IDX} (TF RoBERTa numbers positions from it), i.e. second in "
                f"the list; got {tokens}"
            )
    key = _position_key(family)
    limit = _positions_hold(family, int(settings[key]))
    if job.data.seq_length > limit:
        extra = " + 2 (RoBERTa numbers positions from 2)" if family == "roberta" else ""
        raise SpecError(
            f"data.seq_length: {job.data.seq_length} is longer than the {family} model holds "
            f"(model.config.{key}={settings[key]} allows at most {limit}); lower "
            f"data.seq_length or set model.config.{key} >= {job.data.seq_length}{extra}"
        )


def parameter_count(family: str, config: PretrainedConfig) -> int:
    """The trainable parameters of the family's model for `config`, from its shapes alone
    (no framework): what the JAX backend's sharding choice and a plan need before any
    weight exists. tests/payload/test_jax_sharding.py checks it against the built models.

    BERT / RoBERTa (MaskedLM, decoder tied to the word embeddings, no pooler): embeddings
    (V + P + T) x H and their LayerNorm; per layer 4 attention projections H x H + H, two
    LayerNorms, the MLP H x I + I and I x H + H; the head's dense H x H + H, its LayerNorm
    and the decoder bias V. GPT-2 (tied lm_head, no bias): wte V x H, wpe P x H; per layer
    ln_1, c_attn H x 3H + 3H, c_proj H x H + H, ln_2, c_fc H x I + I, c_proj I x H + H; ln_f.
    """
    if family == "llama":
        return _llama_parameters(config)
    if family == "electra":
        embeddings, discriminator, generator = electra_parameters(config)
        return embeddings + discriminator + generator
    if family == "gpt2":
        h, v, p = config.n_embd, config.vocab_size, config.n_positions
        inner = config.n_inner or 4 * h
        per_layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h
        per_layer += (h * inner + inner) + (inner * h + h)
        return v * h + p * h + config.n_layer * per_layer + 2 * h
    h, v = config.hidden_size, config.vocab_size
    p, t, inner = config.max_position_embeddings, config.type_vocab_size, config.intermediate_size
    embeddings = (v + p + t) * h + 2 * h
    per_layer = 4 * (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h) + 2 * h
    head = (h * h + h) + 2 * h + v
    return embeddings + config.num_hidden_layers * per_layer + head


def _encoder_layer_parameters(h: int, inner: int) -> int:
    """One BERT/ELECTRA layer: 4 attention projections, 2 LayerNorms, the MLP."""
    return 4 * (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h) + 2 * h


def electra_parameters(config: PretrainedConfig) -> tuple[int, int, int]:
    """(shared embeddings, discriminator, generator) parameters of ELECTRA, from shapes:
    the embeddings (V + P + T) x E and their LayerNorm, shared by both networks; each
    network's embeddings_project E x W + W when E != its width W, its layers, and its head:
    the discriminator's dense H x H + H and dense_prediction H + 1; the generator's dense
    G x E + E, LayerNorm 2E and output bias V (its output matrix is the word embeddings).
    The discriminator's export has embeddings + discriminator, the generator's embeddings +
    generator."""
    e, v = config.embedding_size, config.vocab_size
    p, t = config.max_position_embeddings, config.type_vocab_size
    embeddings = (v + p + t) * e + 2 * e
    # The generator's shape as generator_config gives it, from the shapes alone: the plan
    # calls this with a plain namespace of the preset's settings (no transformers there).
    g, _ = generator_shape(config.hidden_size, float(getattr(config, GENERATOR_FRACTION_KEY)))

    def encoder(w: int, inner: int) -> int:
        project = e * w + w if e != w else 0
        return project + config.num_hidden_layers * _encoder_layer_parameters(w, inner)

    h = config.hidden_size
    discriminator = encoder(h, config.intermediate_size) + (h * h + h) + (h + 1)
    generator = encoder(g, 4 * g) + (g * e + e) + 2 * e + v
    return embeddings, discriminator, generator


def electra_matrices(config: PretrainedConfig, vocab: int) -> list[tuple[int, int]]:
    """ELECTRA's matrices, for the plan (electra_parameters counts the same weights): the
    shared embeddings embedding_size (E) wide; per network (the discriminator H wide, the
    generator G wide) its projection from E when E differs, its encoder layers and its head's
    dense."""
    e, h, i = config.embedding_size, config.hidden_size, config.intermediate_size
    g, _ = generator_shape(h, float(getattr(config, GENERATOR_FRACTION_KEY)))
    mats = [(vocab, e), (config.max_position_embeddings, e), (config.type_vocab_size, e)]
    for width, inner, head in ((h, i, (h, h)), (g, 4 * g, (g, e))):
        if e != width:
            mats.append((e, width))
        mats += [(width, width)] * (4 * config.num_hidden_layers)
        mats += [(width, inner), (inner, width)] * config.num_hidden_layers
        mats.append(head)
    return mats


def _llama_parameters(config: PretrainedConfig) -> int:
    """LlamaForCausalLM (no biases): embed_tokens V x H; per layer q_proj H x (A x D),
    k_proj and v_proj H x (K x D), o_proj (A x D) x H, gate_proj and up_proj H x I,
    down_proj I x H and two RMSNorm scales H; the final norm H; lm_head H x V unless tied
    (A heads of size D = H / A, K key/value heads, I the intermediate size)."""
    h, v, inner = config.hidden_size, config.vocab_size, config.intermediate_size
    head = h // config.num_attention_heads
    attention = 2 * h * config.num_attention_heads * head
    attention += 2 * h * config.num_key_value_heads * head
    per_layer = attention + 3 * h * inner + 2 * h
    lm_head = 0 if config.tie_word_embeddings else v * h
    return v * h + config.num_hidden_layers * per_layer + h + lm_head
