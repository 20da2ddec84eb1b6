"""Keras -> Hugging Face: the JAX backend's models (models/) as transformers' PyTorch
state dicts (parameter names and shapes, float32) and the files of the Hugging Face layout
PyTorch users load with the plain `from_pretrained`. Dense kernels are Keras' [in, out];
nn.Linear weights are [out, in]; GPT-2's Conv1D keeps [in, out].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from keras import layers

from payload.backends.jax.models import (
    CausalLM,
    Electra,
    EncoderBlock,
    LlamaCausalLM,
    Model,
)

Values = Callable[[Any], np.ndarray]


def _linear(state: dict[str, np.ndarray], name: str, dense: layers.Dense, value: Values) -> None:
    """nn.Linear: weight [out, in] (Keras' kernel transposed), bias [out]."""
    state[f"{name}.weight"] = value(dense.kernel).T
    state[f"{name}.bias"] = value(dense.bias)


def _conv1d(state: dict[str, np.ndarray], name: str, kernel: Any, bias: Any) -> None:
    """GPT-2's Conv1D: weight [in, out], as Keras stores it."""
    state[f"{name}.weight"] = kernel
    state[f"{name}.bias"] = bias


def _norm(
    state: dict[str, np.ndarray], name: str, norm: layers.LayerNormalization, value: Values
) -> None:
    state[f"{name}.weight"] = value(norm.gamma)
    state[f"{name}.bias"] = value(norm.beta)


# models.LlamaLayers' stacked weights -> the suffix of their per-layer name in
# LlamaForCausalLM (model.layers.<i>.<suffix>.weight), and whether it is a Keras kernel
# [in, out] that nn.Linear stores transposed.
LLAMA_LAYER_NAMES = {
    "input_layernorm_gamma": ("input_layernorm", False),
    "q_proj": ("self_attn.q_proj", True),
    "k_proj": ("self_attn.k_proj", True),
    "v_proj": ("self_attn.v_proj", True),
    "o_proj": ("self_attn.o_proj", True),
    "post_attention_layernorm_gamma": ("post_attention_layernorm", False),
    "gate_proj": ("mlp.gate_proj", True),
    "up_proj": ("mlp.up_proj", True),
    "down_proj": ("mlp.down_proj", True),
}


def _llama_state(model: LlamaCausalLM, value: Values) -> dict[str, np.ndarray]:
    """LlamaForCausalLM's names; nn.Linear weights [out, in]; lm_head only when untied. The
    decoder's weights are stacked over the layers [L, ...] (models.LlamaLayers): layer i of
    the export is slice i of each stack."""
    state = {"model.embed_tokens.weight": value(model.embed_tokens.embeddings)}
    stacks = {name: value(variable) for name, variable in model.decoder.stacked.items()}
    for i in range(model.decoder.count):
        for name, (suffix, linear) in LLAMA_LAYER_NAMES.items():
            layer = stacks[name][i]
            state[f"model.layers.{i}.{suffix}.weight"] = layer.T if linear else layer
    state["model.norm.weight"] = value(model.norm.gamma)
    if model.lm_head is not None:
        state["lm_head.weight"] = value(model.lm_head.kernel).T
    return state


def _encoder_layers(
    state: dict[str, np.ndarray], prefix: str, blocks: list[EncoderBlock], value: Values
) -> None:
    """BertEncoder / ElectraEncoder layers under `prefix`."""
    for i, block in enumerate(blocks):
        p = f"{prefix}.layer.{i}"
        for part in ("query", "key", "value"):
            _linear(state, f"{p}.attention.self.{part}", getattr(block.attention, part), value)
        _linear(state, f"{p}.attention.output.dense", block.attention_output, value)
        _norm(state, f"{p}.attention.output.LayerNorm", block.attention_norm, value)
        _linear(state, f"{p}.intermediate.dense", block.intermediate, value)
        _linear(state, f"{p}.output.dense", block.output_dense, value)
        _norm(state, f"{p}.output.LayerNorm", block.output_norm, value)


# The two exports of ELECTRA, by subdirectory of export/ (export.EXPORT_PARTS).
ELECTRA_PARTS = ("discriminator", "generator")


def electra_state_dicts(model: Electra, value: Values) -> dict[str, dict[str, np.ndarray]]:
    """{"discriminator": ElectraForPreTraining's state, "generator": ElectraForMaskedLM's}:
    each with the shared embeddings under electra.embeddings, its own embeddings_project
    (when the widths differ) and encoder, and its head; the generator's generator_lm_head
    weight is the word embeddings (tied on load, export.TIED_KEYS), its bias is stored."""
    shared: dict[str, np.ndarray] = {}
    e = "electra.embeddings"
    shared[f"{e}.word_embeddings.weight"] = value(model.word_embeddings.embeddings)
    shared[f"{e}.position_embeddings.weight"] = value(model.position_embeddings.embeddings)
    shared[f"{e}.token_type_embeddings.weight"] = value(model.token_type_embeddings.embeddings)
    _norm(shared, f"{e}.LayerNorm", model.embedding_norm, value)
    out: dict[str, dict[str, np.ndarray]] = {}
    for network in ELECTRA_PARTS:
        state = dict(shared)
        project = getattr(model, f"{network}_project")
        if project is not None:
            _linear(state, "electra.embeddings_project", project, value)
        _encoder_layers(state, "electra.encoder", getattr(model, f"{network}_blocks"), value)
        if network == "discriminator":
            head = "discriminator_predictions"
            _linear(state, f"{head}.dense", model.discriminator_dense, value)
            _linear(state, f"{head}.dense_prediction", model.discriminator_prediction, value)
        else:
            _linear(state, "generator_predictions.dense", model.generator_dense, value)
            _norm(state, "generator_predictions.LayerNorm", model.generator_norm, value)
            state["generator_lm_head.bias"] = value(model.generator_bias)
        out[network] = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}
    return out


def hf_state_dict(
    model: Model, values: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """transformers' PyTorch parameter names and shapes, float32; tied weights once (the
    decoder / lm_head is the word embedding matrix, export.TIED_KEYS). `values` (by variable
    path) replaces the variables' own values: the trainer's gathered weights of a sharded,
    multi-process state, which no single process can read from the variables."""

    def value(variable: Any) -> np.ndarray:
        if values is not None:
            return np.asarray(values[variable.path])
        return np.asarray(variable)

    state: dict[str, np.ndarray] = {}
    if isinstance(model, Electra):
        raise TypeError("ELECTRA has two exports: electra_state_dicts")
    if isinstance(model, LlamaCausalLM):
        state = _llama_state(model, value)
    elif isinstance(model, CausalLM):
        state["transformer.wte.weight"] = value(model.wte.embeddings)
        state["transformer.wpe.weight"] = value(model.wpe.embeddings)
        for i, block in enumerate(model.blocks):
            p = f"transformer.h.{i}"
            _norm(state, f"{p}.ln_1", block.ln_1, value)
            a = block.attention
            kernel = np.concatenate([value(d.kernel) for d in (a.query, a.key, a.value)], 1)
            bias = np.concatenate([value(d.bias) for d in (a.query, a.key, a.value)])
            _conv1d(state, f"{p}.attn.c_attn", kernel, bias)
            c_proj = block.c_proj
            _conv1d(state, f"{p}.attn.c_proj", value(c_proj.kernel), value(c_proj.bias))
            _norm(state, f"{p}.ln_2", block.ln_2, value)
            _conv1d(state, f"{p}.mlp.c_fc", value(block.c_fc.kernel), value(block.c_fc.bias))
            mlp = block.mlp_proj
            _conv1d(state, f"{p}.mlp.c_proj", value(mlp.kernel), value(mlp.bias))
        _norm(state, "transformer.ln_f", model.ln_f, value)
    else:
        base = model.family  # bert. / roberta.
        e = f"{base}.embeddings"
        state[f"{e}.word_embeddings.weight"] = value(model.word_embeddings.embeddings)
        state[f"{e}.position_embeddings.weight"] = value(model.position_embeddings.embeddings)
        state[f"{e}.token_type_embeddings.weight"] = value(model.token_type_embeddings.embeddings)
        _norm(state, f"{e}.LayerNorm", model.embedding_norm, value)
        _encoder_layers(state, f"{base}.encoder", model.blocks, value)
        if model.family == "bert":
            _linear(state, "cls.predictions.transform.dense", model.head_dense, value)
            _norm(state, "cls.predictions.transform.LayerNorm", model.head_norm, value)
            state["cls.predictions.bias"] = value(model.head_bias)
        else:
            _linear(state, "lm_head.dense", model.head_dense, value)
            _norm(state, "lm_head.layer_norm", model.head_norm, value)
            state["lm_head.bias"] = value(model.head_bias)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


def save_pretrained(
    model: Model, directory: str, values: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """The Hugging Face layout the TF backend's export writes for PyTorch users: config.json
    naming the PyTorch class and `transformers_weights`, and pytorch_model.safetensors
    (export.py explains the file name). No TF weights: none can be produced from here."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    from payload.training import export as export_lib  # noqa: PLC0415

    if isinstance(model, Electra):
        raise TypeError("ELECTRA has two exports: save_electra")
    model.config.save_pretrained(directory)
    state = hf_state_dict(model, values)
    save_file(state, f"{directory}/{export_lib.PT_WEIGHTS}", metadata={"format": "pt"})
    export_lib.set_pytorch_config(directory, model.family)
    return state


def save_electra(
    model: Electra, directory: str, values: Mapping[str, np.ndarray] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """ELECTRA's two Hugging Face layouts, `<directory>/discriminator` (ElectraForPreTraining,
    the discriminator's ElectraConfig) and `<directory>/generator` (ElectraForMaskedLM, the
    generator's: model.generator_config), each as save_pretrained writes the other families;
    returns the state of each by part."""
    from pathlib import Path  # noqa: PLC0415

    from safetensors.numpy import save_file  # noqa: PLC0415

    from payload.model import configs as model_lib  # noqa: PLC0415
    from payload.training import export as export_lib  # noqa: PLC0415

    def value(variable: Any) -> np.ndarray:
        if values is not None:
            return np.asarray(values[variable.path])
        return np.asarray(variable)

    states = electra_state_dicts(model, value)
    configs = {
        "discriminator": model_lib.discriminator_config(model.config),
        "generator": model.generator_config,
    }
    for part, state in states.items():
        target = str(Path(directory, part))
        Path(target).mkdir(parents=True, exist_ok=True)
        configs[part].save_pretrained(target)
        save_file(state, f"{target}/{export_lib.PT_WEIGHTS}", metadata={"format": "pt"})
        export_lib.set_pytorch_config(target, model.family, part=part)
    return states
