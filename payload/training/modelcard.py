"""The model card (`export/README.md`): only figures this run recorded.

Every number comes from the job spec as resolved, the data manifest, the runtime that
trained it, the model config and the metrics the trainer recorded in status.json (train
loss at the last logged step, held-out loss/perplexity/accuracy at the last evaluation).
A figure that was not recorded is written as "not recorded", never estimated.

The card also says which library versions the plain loading calls were checked with: the
environments tests/payload/test_export.py loads exports in, i.e. the pins of
requirements/payload.lock (TensorFlow side) and requirements/pt-check.txt (PyTorch side).
Those files are not installed with the package (pt-check.txt is not even on a TPU VM), so
the versions are written out below; tests/payload/test_modelcard.py reads both pin files
and fails when a version here differs from its pin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec

NOT_RECORDED = "not recorded"
# (distribution, version) as pinned in requirements/payload.lock: TFAutoModel*.from_pretrained.
CHECKED_TENSORFLOW = (
    ("transformers", "4.57.6"),
    ("safetensors", "0.8.0"),
    ("tensorflow", "2.20.0"),
    ("tf-keras", "2.20.1"),
)
# As pinned in requirements/pt-check.txt: AutoModel*.from_pretrained and generate.
CHECKED_PYTORCH = (("transformers", "5.23.0"), ("safetensors", "0.8.0"), ("torch", "2.13.0"))
# The export's writer: what this run's environment had (the TPU build is tensorflow-tpu).
WRITER_DISTRIBUTIONS = (
    "transformers",
    "safetensors",
    ("tensorflow", "tensorflow-tpu", "tensorflow-cpu"),
)


def _versions(pins: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{name} {version}" for name, version in pins)


def _installed(names: tuple[str | tuple[str, ...], ...]) -> str:
    found = []
    for entry in names:
        candidates = (entry,) if isinstance(entry, str) else entry
        for name in candidates:
            try:
                found.append(f"{name} {metadata.version(name)}")
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            found.append(f"{candidates[0]} {NOT_RECORDED}")
    return ", ".join(found)


def _num(value: Any, fmt: str = "{:,}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NOT_RECORDED
    return fmt.format(value)


def _architecture(family: str, config: Mapping[str, Any]) -> list[tuple[str, str]]:
    if family == "llama":
        keys = [
            ("layers", "num_hidden_layers"),
            ("hidden size", "hidden_size"),
            ("attention heads", "num_attention_heads"),
            ("key/value heads (grouped-query attention)", "num_key_value_heads"),
            ("intermediate size (SwiGLU)", "intermediate_size"),
            ("RoPE theta", "rope_theta"),
            ("RMSNorm epsilon", "rms_norm_eps"),
            ("tied input/output embeddings", "tie_word_embeddings"),
            ("positions", "max_position_embeddings"),
        ]
        return [(label, _plain(config.get(key))) for label, key in keys]
    if family == "gpt2":
        keys = [
            ("layers", "n_layer"),
            ("hidden size", "n_embd"),
            ("attention heads", "n_head"),
            ("positions", "n_positions"),
        ]
        dropout = "attn_pdrop"
    else:
        keys = [
            *([("embedding size", "embedding_size")] if family == "electra" else []),
            ("layers", "num_hidden_layers"),
            ("hidden size", "hidden_size"),
            ("attention heads", "num_attention_heads"),
            ("intermediate size", "intermediate_size"),
            ("positions", "max_position_embeddings"),
        ]
        dropout = "attention_probs_dropout_prob"
    rows = [(label, _num(config.get(key))) for label, key in keys]
    # The presets train without it (payload/model/configs.py); 0.1 is the previous recipe.
    return [*rows, ("attention dropout", _plain(config.get(dropout)))]


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return _num(value)


def render(
    *,
    job: JobSpec,
    manifest: Manifest,
    model_config: Mapping[str, Any],
    pytorch_class: str,
    tf_class: str | None,
    parameters: int,
    runtime: Mapping[str, Any],
    metrics: Mapping[str, Any],
    part: str | None = None,
) -> str:
    """The card as Markdown with a YAML header the Hub reads. `part`: which of ELECTRA's
    two exports (discriminator | generator) this card describes; None for other families."""
    objective = job.data.objective
    spec = job.train
    corpus = dict(manifest.corpus)
    pipeline_tag: str | None = "fill-mask" if objective == "mlm" else "text-generation"
    auto = "AutoModelForMaskedLM" if objective == "mlm" else "AutoModelForCausalLM"
    accuracy_name = (
        "MLM accuracy (masked positions)" if objective == "mlm" else ("next-token accuracy")
    )
    if objective == "rtd":
        # AutoModelForPreTraining maps electra to ElectraForPreTraining (transformers 5's
        # models/auto/modeling_auto.py MODEL_FOR_PRETRAINING_MAPPING_NAMES).
        pipeline_tag = "fill-mask" if part == "generator" else None
        auto = "AutoModelForMaskedLM" if part == "generator" else "AutoModelForPreTraining"
        accuracy_name = "generator MLM accuracy (masked positions)"
    tf_auto = "TF" + auto
    roles = job.special_roles
    trained_with = {
        "mlm": "masked language modeling",
        "clm": "causal language modeling",
        "rtd": "replaced-token detection (ELECTRA: a small generator MLM and a discriminator)",
    }[objective]
    schedule = (
        f"AdamW, peak {spec.learning_rate:g}, {spec.warmup_steps:,} warmup steps, "
        f"{spec.decay} decay to {spec.end_learning_rate_ratio:g} x peak, weight decay "
        f"{spec.weight_decay:g}, gradient clipping {spec.clip_norm:g}"
    )
    lines = [
        "---",
        "library_name: transformers",
        *([f"pipeline_tag: {pipeline_tag}"] if pipeline_tag else []),
        "tags: [tpu-pretrain]",
        "---",
        "",
        f"# {job.name}",
        "",
        f"A {job.model.size} {job.model.family} model pre-trained from scratch with "
        f"{trained_with} by tpu-pretrain. "
        "Every figure below was recorded by this run (data manifest, trainer metrics); "
        f'a figure marked "{NOT_RECORDED}" was not measured.',
        "",
        *_electra_part(part),
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| PyTorch class | `{pytorch_class}` (`pytorch_model.safetensors`) |",
        (
            f"| TensorFlow class | `{tf_class}` (`tf_model.h5`) |"
            if tf_class
            else "| TensorFlow class | none: trained on the JAX backend, no `tf_model.h5` |"
        ),
        f"| parameters | {parameters:,} (tied input/output embeddings counted once) |",
        *(
            f"| {label} | {value} |"
            for label, value in _architecture(job.model.family, model_config)
        ),
        f"| vocabulary | {manifest.vocab_size:,} |",
        "",
        "## Tokenizer",
        "",
        f"`{job.tokenizer.kind}` trained on the corpus with `tokenizers`, vocabulary "
        f"{manifest.vocab_size:,}, lowercase: {str(job.tokenizer.lowercase).lower()}, "
        f"special tokens: {', '.join(f'`{t}`' for t in job.tokenizer.special_tokens)}. "
        f"tokenizer.json sha256 `{manifest.tokenizer_sha256}`.",
        "",
        "## Data",
        "",
        "| | |",
        "|---|---|",
        f"| corpus files | {_num(corpus.get('files'))} ({_num(corpus.get('bytes'))} bytes) |",
        f"| documents | {_num(corpus.get('documents'))} |",
        f"| skipped files / documents | {_num(corpus.get('skipped_files'))} / "
        f"{_num(corpus.get('skipped_documents'))} |",
        f"| training sequences / tokens | {manifest.total_records:,} / {manifest.total_tokens:,} |",
        f"| held-out sequences / tokens | {manifest.eval_records:,} / {manifest.eval_tokens:,} "
        f"({_num(corpus.get('eval_documents'))} documents, none of them in training) |",
        f"| sequence length | {manifest.seq_length} |",
        f"| packing | {manifest.packing} |",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {_num(metrics.get('step'))} of {spec.steps:,} |",
        f"| global batch | {spec.global_batch_size:,} sequences "
        f"({spec.global_batch_size * manifest.seq_length:,} tokens) |",
        f"| tokens seen | {_tokens_seen(metrics.get('step'), spec.global_batch_size, manifest)} |",
        *(
            [
                f"| micro-batches per step (gradient accumulation) | {spec.grad_accum_steps} |",
                f"| activation rematerialisation | {spec.remat} |",
            ]
            if runtime.get("backend") == "jax"
            else []
        ),
        f"| learning-rate schedule | {schedule} |",
        f"| backend | {_backend(runtime)} |",
        f"| hardware | {runtime.get('accelerator', NOT_RECORDED)}, "
        f"{_num(runtime.get('replicas'))} replica(s) |",
        f"| precision | {runtime.get('policy', NOT_RECORDED)} (weights exported in float32) |",
        *(
            [f"| attention | {_attention(runtime['attention'])} |"]
            if runtime.get("attention")
            else []
        ),
        f"| seed | {spec.seed} |",
        "",
        "## Results",
        "",
        "| | train (last logged step) | held out |",
        "|---|---|---|",
        f"| step | {_num(metrics.get('step'))} | {_num(metrics.get('eval_step'))} |",
        f"| loss | {_num(metrics.get('loss'), '{:.4f}')} | "
        f"{_num(metrics.get('eval_loss'), '{:.4f}')} |",
        f"| perplexity (exp loss) | {_num(_exp(metrics.get('loss')), '{:.2f}')} | "
        f"{_num(metrics.get('eval_perplexity'), '{:.2f}')} |",
        f"| {accuracy_name} | {_num(metrics.get('accuracy'), '{:.4f}')} | "
        f"{_num(metrics.get('eval_accuracy'), '{:.4f}')} |",
        *(_rtd_results(metrics) if objective == "rtd" else []),
        "",
        (
            "The held-out set is fixed (same sequences and, for MLM, the same masks at every "
            "evaluation), so the numbers compare across evaluations, resumes and runs with the "
            "same data and batch size."
        ),
        "",
        "## Use",
        "",
        "PyTorch (transformers 5.x, or 4.52 and later: they load `pytorch_model.safetensors`, "
        "which config.json's `transformers_weights` names), with `path` this directory or the "
        "Hub repo id:",
        "",
        "```python",
        f"from transformers import AutoTokenizer, {auto}",
        "tokenizer = AutoTokenizer.from_pretrained(path)",
        f"model = {auto}.from_pretrained(path)",
        *(
            [
                "# to fine-tune: a classifier on the discriminator's encoder (new head)",
                "from transformers import AutoModelForSequenceClassification",
                "classifier = AutoModelForSequenceClassification.from_pretrained(",
                "    path, num_labels=2",
                ")",
            ]
            if part == "discriminator"
            else []
        ),
        *(
            [
                'inputs = tokenizer("your prompt", return_tensors="pt")',
                "output = model.generate(**inputs, max_new_tokens=50)",
                "print(tokenizer.decode(output[0], skip_special_tokens=True))",
            ]
            if objective == "clm"
            else []
        ),
        "```",
        "",
        *(
            [
                "TensorFlow (transformers 4.x with tf-keras; it loads `tf_model.h5`):",
                "",
                "```python",
                f"from transformers import AutoTokenizer, {tf_auto}",
                "tokenizer = AutoTokenizer.from_pretrained(path)",
                f"model = {tf_auto}.from_pretrained(path)",
                "```",
                "",
            ]
            if tf_class
            else []
        ),
        *(
            [
                f"The tokenizer adds `{roles.get('bos')}` (beginning of text) in front of a "
                f"prompt and no `{roles.get('eos')}`, so generation continues the prompt; "
                f"training documents were packed as `{roles.get('bos')} document "
                f"{roles.get('eos')}`.",
                "",
            ]
            if objective == "clm"
            else []
        ),
        "## Versions checked",
        "",
        "tpu-pretrain's tests load an export like this one with the calls above (no extra "
        "arguments) and compare its logits with the trained model's (within 1e-4)"
        + (", and generate from a prompt with the recipe above:" if objective == "clm" else ":"),
        "",
        *([f"- TensorFlow: {_versions(CHECKED_TENSORFLOW)}"] if tf_class else []),
        f"- PyTorch: {_versions(CHECKED_PYTORCH)}",
        "",
        f"This export was written with {_installed(WRITER_DISTRIBUTIONS)}.",
        "",
    ]
    return "\n".join(lines)


def _electra_part(part: str | None) -> list[str]:
    """What this directory is among ELECTRA's two exports."""
    if part == "discriminator":
        return [
            "This is the **discriminator** (`ElectraForPreTraining`): the model to fine-tune "
            "for downstream tasks. The generator that trained with it is in `../generator`.",
            "",
        ]
    if part == "generator":
        return [
            "This is the **generator** (`ElectraForMaskedLM`, a masked LM narrower than the "
            "discriminator; it works with the fill-mask pipeline). For downstream tasks "
            "fine-tune the discriminator in `../discriminator`.",
            "",
        ]
    return []


def _rtd_results(metrics: Mapping[str, Any]) -> list[str]:
    """The discriminator's rows (held out only: training logs the total loss)."""
    rows = [
        ("discriminator loss", "eval_discriminator_loss"),
        ("discriminator accuracy (every real token)", "eval_discriminator_accuracy"),
        ("replaced-token precision", "eval_replaced_precision"),
        ("replaced-token recall", "eval_replaced_recall"),
        ("replaced-token F1", "eval_replaced_f1"),
        ("generator + 50 x discriminator loss", "eval_rtd_loss"),
    ]
    return [f"| {label} | | {_num(metrics.get(key), '{:.4f}')} |" for label, key in rows]


def _tokens_seen(step: Any, global_batch: int, manifest: Manifest) -> str:
    """Sequence positions trained on (steps x global batch x sequence length; a packed
    sequence's padding, if any, included)."""
    if not isinstance(step, int):
        return NOT_RECORDED
    return f"{step * global_batch * manifest.seq_length:,} (steps x global batch x sequence length)"


def _attention(attention: Mapping[str, Any]) -> str:
    """The JAX backend's attention implementation (backends/jax/attention.py) and why."""
    names = {"cudnn": "cuDNN flash attention", "splash": "Pallas splash attention (TPU)"}
    name = names.get(attention.get("implementation", ""), "XLA reference (einsum)")
    return f"{name}: {attention.get('reason', NOT_RECORDED)}"


def _backend(runtime: Mapping[str, Any]) -> str:
    """Which trainer wrote the weights: the TF backend (TensorFlow + tf_keras) or the JAX
    backend (Keras 3 on JAX, `runtime["backend"] == "jax"`)."""
    if runtime.get("backend") == "jax":
        return f"Keras 3 on JAX {runtime.get('jax', '')} (`train.backend: jax`)".replace("  ", " ")
    return "TensorFlow + tf_keras (`train.backend: tf`)"


def _exp(loss: Any) -> float | None:
    if loss is None or not isinstance(loss, int | float) or not math.isfinite(loss):
        return None
    return math.exp(min(float(loss), 700.0))
