"""The Keras 3 models, one module per family, computing what transformers' classes compute.

BERT / RoBERTa masked LMs, the GPT-2 and Llama causal LMs and ELECTRA as Keras 3 layers,
written to compute exactly what transformers' PyTorch classes compute, so that one export
serves both backends.

Why our own layers and not keras-hub's: keras-hub's BERT encoder uses the tanh approximation
of GELU and its MLM head another LayerNorm epsilon, so its logits drift from BertForMaskedLM
(the spike of docs/backends.md measured it); keras-hub also needs tensorflow-text, i.e. the
full `tensorflow` wheel beside tensorflow-cpu. What each piece mirrors, in transformers 5's
modeling files (the classes the export names in config.json):
- BERT (modeling_bert.py): embeddings = word + position + token type 0, LayerNorm, dropout;
  post-LayerNorm blocks (self-attention with biases, softmax(QK^T / sqrt(d) + mask), output
  dense + residual + LayerNorm; intermediate dense + GELU ("gelu": the exact erf form) +
  output dense + residual + LayerNorm); the MLM head BertLMPredictionHead: dense, GELU,
  LayerNorm, then the decoder tied to the word embeddings plus its own bias.
- RoBERTa (modeling_roberta.py): BERT's blocks; positions numbered from padding_idx + 1
  over the non-pad tokens (create_position_ids_from_input_ids), one token type; the head
  RobertaLMHead (dense, GELU, layer_norm, tied decoder, bias).
- GPT-2 (modeling_gpt2.py): token + position embeddings; pre-LayerNorm blocks (ln_1,
  c_attn -> q, k, v, causal softmax, c_proj; ln_2, c_fc, "gelu_new" = the tanh GELU,
  c_proj); ln_f; lm_head tied to wte without a bias.
- Llama (modeling_llama.py, LlamaForCausalLM): embed_tokens; pre-norm blocks of LlamaRMSNorm
  (x in float32 times rsqrt(mean(x^2) + eps), cast back, times the weight), attention
  without biases with rotary embeddings (default RoPE: inv_freq = 1 / theta^(2i / D),
  cos/sin of position x inv_freq duplicated over both halves, q * cos + rotate_half(q) * sin,
  positions 0..S-1 whatever the padding) and grouped-query attention (query head h reads
  key/value head h // (A / K), as repeat_kv), softmax in float32, o_proj; the SwiGLU MLP
  down_proj(silu(gate_proj(x)) * up_proj(x)); the final norm; lm_head tied to embed_tokens
  or its own matrix (tie_word_embeddings), no bias. The decoder layers are one Keras layer
  (LlamaLayers) whose weights are stacked over the layers [L, ...] and run as one
  `lax.scan` of one layer body (MaxText's scan_layers): compile time does not grow with L;
  the export slices the stacks per layer into transformers' names.
- ELECTRA (modeling_electra.py, ElectraForPreTraining and ElectraForMaskedLM over one shared
  ElectraEmbeddings): embeddings word + position + token type 0, embedding_size wide,
  LayerNorm, dropout; per network `embeddings_project` (a Linear embedding_size -> width,
  only when they differ) then BERT's blocks; the discriminator's head
  ElectraDiscriminatorPredictions (dense, hidden_act, dense_prediction to one logit per
  token); the generator's ElectraGeneratorPredictions (dense to embedding_size, GELU,
  LayerNorm) then generator_lm_head tied to the word embeddings plus its own bias. As in
  google-research/electra (model/modeling.py: both networks' embeddings live in the one
  "electra/embeddings" scope), word, position and token-type embeddings and their LayerNorm
  are ONE set of weights trained by both; each export holds a copy.
Dense kernels are Keras' [in, out]; `hf_state_dict` (hf_weights.py) maps every weight to the
PyTorch name and shape (nn.Linear [out, in]; GPT-2's Conv1D keeps [in, out]). Attention is
attention.py's (the kernel the runtime chose, or the reference, whose masked scores get
float32's most negative value as transformers' eager attention gives them its dtype's).
On the run's mesh (the attention's), every block boundary holds the activations to the
batch's rows (`through`, mesh.keep_rows): FSDP gathers weights, not activations.
One module per family: bert.py (MaskedLM: BERT and RoBERTa), gpt2.py (CausalLM), llama.py
(LlamaCausalLM), electra.py (Electra); blocks.py holds what more than one of them uses, and
the package itself `Model` and `create_model`.
"""

from __future__ import annotations

from typing import Any

import keras

from payload.backends.jax import attention as attention_lib
from payload.backends.jax.models.bert import MaskedLM
from payload.backends.jax.models.blocks import EncoderBlock, document_ids
from payload.backends.jax.models.electra import Electra
from payload.backends.jax.models.gpt2 import CausalLM
from payload.backends.jax.models.llama import LlamaCausalLM, LlamaLayers, llama_layer

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


Model = MaskedLM | CausalLM | LlamaCausalLM | Electra


def create_model(
    family: str,
    config: Any,
    seq_length: int,
    *,
    remat: str = "none",
    attention: attention_lib.Attention = attention_lib.REFERENCE,
    document_mask: bool = False,
) -> Model:
    """A built model (weights created) for `seq_length`-token inputs; `remat` (train.remat)
    applies to the Llama family's blocks (spec.py refuses it for the other families);
    `attention` computes every attention layer (attention.choose: train.attention);
    `document_mask` (data.document_mask, the causal families): a token attends to its own
    packed document only (document_ids)."""
    # The kernels read the mask as document numbers where the model makes them (cuDNN turns
    # them into a same-document mask, attention.cudnn_arguments).
    attention = attention_lib.with_documents(
        attention, document_mask and family in ("llama", "gpt2")
    )
    # Named by the family: the variables' paths (checkpoints.Layout) do not depend on how
    # many models this process built before.
    model: Model
    if family == "llama":
        model = LlamaCausalLM(
            config, remat=remat, attention=attention, document_mask=document_mask, name=family
        )
    elif family == "electra":
        model = Electra(config, attention, name=family)
    elif family == "gpt2":
        model = CausalLM(config, attention, document_mask=document_mask, name=family)
    else:
        model = MaskedLM(config, family, attention, name=family)
    # A symbolic call builds every weight without computing anything: on a slice the
    # weights are global arrays, and an eager forward pass would be hundreds of small
    # computations every process must run in step (one of them hung two CPU processes here).
    ids = keras.KerasTensor((1, seq_length), dtype="int32")
    model({"input_ids": ids, "attention_mask": ids})
    return model
