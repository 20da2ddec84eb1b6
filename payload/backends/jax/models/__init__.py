"""The JAX backend's models. This commit only moves models.py to models/llama.py; the next
splits it into one module per family."""

from payload.backends.jax.models.llama import (
    CausalLM,
    Electra,
    EncoderBlock,
    LlamaCausalLM,
    LlamaLayers,
    MaskedLM,
    Model,
    create_model,
    document_ids,
    llama_layer,
)

__all__ = [
    "CausalLM",
    "Electra",
    "EncoderBlock",
    "LlamaCausalLM",
    "LlamaLayers",
    "MaskedLM",
    "Model",
    "create_model",
    "document_ids",
    "llama_layer",
]
