"""export/: the trained model for TensorFlow AND PyTorch, the tokenizer and a model card.

transformers 5 is PyTorch-only: it refuses `tf_model.h5` and loads a TF-format
`model.safetensors` silently with random weights. So next to the TF weights the export
holds the weights in the PyTorch layout of the same architecture (BertForMaskedLM,
RobertaForMaskedLM, GPT2LMHeadModel), written with numpy + safetensors: no PyTorch on the
TPU VM. Names come from transformers 4.57's own TF->PT mapping
(`modeling_tf_pytorch_utils.convert_tf_weight_name_to_pt_weight_name`); dense kernels are
transposed ([in, out] -> [out, in]), GPT-2's Conv1D weights are not (PyTorch's Conv1D is
[in, out] too) and its [1, n] biases become [n]. Tied weights are stored once, as
transformers' own `save_pretrained` does: the decoder weight (= the input embeddings) and
the MLM decoder bias (= the head's bias) are left out, and the PyTorch classes tie them
again from `_tied_weights_keys` on load. The file's metadata says `format: pt`.

Why the PyTorch file is `pytorch_model.safetensors`, named by config.json's
`transformers_weights`, and not `model.safetensors` (checked in the installed sources):

* transformers 4.57's TF `from_pretrained` (modeling_tf_utils.py, the local-directory
  branch) takes `model.safetensors` before `tf_model.h5` whenever it exists, and loads a
  `format: pt` file through `load_pytorch_state_dict_in_tf2_model`
  (modeling_tf_pytorch_utils.py), which since 4.55.0 starts with `for key in pt_state_dict:`
  over the `safe_open` handle (4.54.1 and older: `pt_state_dict.keys()`). No safetensors
  release makes `safe_open` iterable (it has `keys()`, no `__iter__`, in every tag from
  v0.2 to v0.8 of bindings/python/src/lib.rs), so no safetensors pin helps: with a
  `model.safetensors` here, `TFAutoModel*.from_pretrained(export)` raises `TypeError:
  'builtins.safe_open' object is not iterable` (huggingface/transformers#40028).
* PyTorch transformers (since 4.52, PR #38152; 5.x in modeling_utils.py
  `_get_resolved_checkpoint_files`) loads the file that config.json's `transformers_weights`
  names, before looking for `model.safetensors`; the TF code never reads that key.

So the plain call loads `tf_model.h5` in TensorFlow and `pytorch_model.safetensors` in
PyTorch, each the trained weights (tests/payload/test_export.py compares logits). No file in
the export is one that a loader would pick up and read with the wrong layout.

For causal LMs the exported tokenizer adds BOS only (see `tokenizer.for_export`), so
`model.generate(**tok(prompt, ...))` continues the prompt instead of a new document.

ELECTRA (`model.family: electra`, JAX backend) has two models, each a complete Hugging Face
directory with its own config, weights, tokenizer and model card: `export/discriminator`
(ElectraForPreTraining, the one to fine-tune) and `export/generator` (ElectraForMaskedLM,
fill-mask). The completion marker stays where it is for every family, `export/` +
EXPORT_MARKER, written after both (infra's watchdog and `is_complete` look only there).

The completion marker is written last; an export without it is replaced, never mixed.

The files are made in a scratch directory of the job's own (`scratch_directory`: one per
job, under the system's temporary directory), removed when the export ends, whatever ends
it: an exception (a stop by signal at one of the export's stop points included), the slice
guard's exit (backends/jax/distributed.py `_leave` calls `remove_scratch`), or, after a
SIGKILL, the next export of the job, which removes what an earlier one left before it
starts. No export leaves a directory behind to fill the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from payload.core import storage
from payload.core.errors import UserError
from payload.data import tokenizer as tokenizer_lib

if TYPE_CHECKING:
    from payload.spec import JobSpec

EXPORT_MARKER = "export_complete.json"
PT_WEIGHTS = "pytorch_model.safetensors"
# What the TF loader of transformers 4.57 would take before tf_model.h5 (see above): never
# written into the export.
TF_PREFERRED_FILES = ("model.safetensors", "model.safetensors.index.json")
MODEL_CARD = "README.md"
# transformers 4.57's PreTrainedTokenizerFast.save_pretrained (no slow tokenizer to save).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The TF backend's save_pretrained: the weights, and the generation config of a model that
# generates (GPT-2); the JAX backend writes neither.
TF_MODEL_FILES = ("tf_model.h5", "generation_config.json")
# Every file a model's directory of the export may hold: write_export refuses to upload
# anything else, and `make smoke` downloads nothing else (infra/jobspec.py keeps a copy,
# tests/test_contract.py compares them).
MODEL_FILES = frozenset({"config.json", PT_WEIGHTS, MODEL_CARD, *TOKENIZER_FILES, *TF_MODEL_FILES})
PYTORCH_CLASSES = {
    "bert": "BertForMaskedLM",
    "roberta": "RobertaForMaskedLM",
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    # ELECTRA's discriminator, the model to fine-tune; both parts: EXPORT_PARTS.
    "electra": "ElectraForPreTraining",
}
# Families whose export is several models, by subdirectory of export/ -> PyTorch class.
EXPORT_PARTS: dict[str, dict[str, str]] = {
    "electra": {"discriminator": "ElectraForPreTraining", "generator": "ElectraForMaskedLM"},
}
# Stored once, tied on load (transformers 5's `_tied_weights_keys` of these classes).
TIED_KEYS = {
    "bert": {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    },
    "roberta": {
        "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    },
    "gpt2": {"lm_head.weight": "transformer.wte.weight"},
    # Only with tie_word_embeddings (the presets' default); untied, lm_head.weight is stored.
    "llama": {"lm_head.weight": "model.embed_tokens.weight"},
    # ElectraForMaskedLM (the generator part); ElectraForPreTraining has no output embedding.
    "electra": {"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"},
}


def pytorch_class(family: str, part: str | None = None) -> str:
    """The PyTorch class of the family's export (of its `part`, for EXPORT_PARTS)."""
    return EXPORT_PARTS[family][part] if part else PYTORCH_CLASSES[family]


HUB_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


class HubError(UserError):
    """The upload to the Hugging Face Hub failed (or cannot start)."""


def pytorch_state_dict(model: Any) -> dict[str, np.ndarray]:
    """PyTorch parameter name -> float32 array in PyTorch's shape, from a TF model."""
    from transformers.modeling_tf_pytorch_utils import (  # noqa: PLC0415 (no torch needed)
        TransposeType,
        convert_tf_weight_name_to_pt_weight_name,
    )

    state: dict[str, np.ndarray] = {}
    for weight in model.weights:
        name, transpose = convert_tf_weight_name_to_pt_weight_name(
            weight.name, tf_weight_shape=weight.shape
        )
        array = np.asarray(weight.numpy(), dtype=np.float32)
        if transpose is TransposeType.SIMPLE:
            array = array.T
        elif transpose is not TransposeType.NO:
            raise ValueError(f"{weight.name}: {transpose} weights are not expected in this model")
        if name.endswith(".bias") and array.ndim == 2 and array.shape[0] == 1:
            array = array[0]  # GPT-2 Conv1D bias: TF [1, n], PyTorch [n]
        if name in state:
            raise ValueError(f"two TF weights map to the PyTorch name {name}")
        state[name] = np.ascontiguousarray(array)
    return state


def write_pytorch_weights(model: Any, directory: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import save_file  # noqa: PLC0415

    state = pytorch_state_dict(model)
    save_file(state, str(Path(directory, PT_WEIGHTS)), metadata={"format": "pt"})
    return state


def set_pytorch_config(directory: str, family: str, part: str | None = None) -> None:
    """config.json names the PyTorch class (`architectures`) and the PyTorch weights file
    (`transformers_weights`), both read by PyTorch transformers only."""
    path = Path(directory, "config.json")
    config = json.loads(path.read_text())
    config["architectures"] = [pytorch_class(family, part)]
    config["transformers_weights"] = PT_WEIGHTS
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def parameter_count(state: dict[str, np.ndarray]) -> int:
    return int(sum(a.size for a in state.values()))


def save_tf_model(model: Any, family: str) -> Callable[[str], dict[str, np.ndarray]]:
    """The TF backend's model files: save_pretrained (TF) + PyTorch safetensors + config."""

    def save(directory: str) -> dict[str, np.ndarray]:
        model.save_pretrained(directory)
        state = write_pytorch_weights(model, directory)
        set_pytorch_config(directory, family)
        return state

    return save


SCRATCH_PREFIX = "tpu-payload-export-"
_SCRATCH: set[Path] = set()


def scratch_path(job: JobSpec) -> Path:
    """The job's export scratch directory: the same at every start, so the next export
    removes what one cut short by SIGKILL left."""
    digest = hashlib.sha256(job.paths.export.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir(), f"{SCRATCH_PREFIX}{digest}")


@contextlib.contextmanager
def scratch_directory(job: JobSpec) -> Iterator[str]:
    """A fresh, empty scratch directory for the export of `job`, removed afterwards."""
    path = scratch_path(job)
    shutil.rmtree(path, ignore_errors=True)  # an export cut short by SIGKILL
    path.mkdir(parents=True)
    _SCRATCH.add(path)
    try:
        yield str(path)
    finally:
        _SCRATCH.discard(path)
        shutil.rmtree(path, ignore_errors=True)


def remove_scratch() -> None:
    """Remove the scratch directory of an export in progress (a process that ends now, from
    another thread, without unwinding the export)."""
    for path in list(_SCRATCH):
        shutil.rmtree(path, ignore_errors=True)


def write_export(
    job: JobSpec,
    save_model: Callable[[str], Any],
    tokenizer: Any,
    *,
    card: Any,
    summary: dict[str, Any],
    stop_point: Callable[[], None] = lambda: None,
) -> None:
    """The model files (`save_model(directory)` writes them and returns the PyTorch state:
    `save_tf_model` on the TF backend, backends/jax/hf_weights.save_pretrained on JAX; for a
    family of EXPORT_PARTS, one subdirectory per part and {part: state}), the tokenizer and
    the model card in each model's directory, uploaded to `export/`, then the completion
    marker last, at `export/` itself. `card(parameters, part) -> str` renders a model card
    once the parameter count is known (`part` None for a one-model family). `stop_point()`
    runs between the steps (the training's: a stop by signal raises there, and the scratch
    directory goes with it); the marker is never written after one."""
    family = job.model.family
    marker = storage.join(job.paths.export, EXPORT_MARKER)
    storage.remove_tree(job.paths.export)
    with scratch_directory(job) as tmp:
        saved = save_model(tmp)
        stop_point()
        states: dict[str | None, dict[str, np.ndarray]] = (
            dict(saved) if family in EXPORT_PARTS else {None: saved}
        )
        exported_tokenizer = tokenizer_lib.for_export(tokenizer, job)
        for part, state in states.items():
            target = Path(tmp, part) if part else Path(tmp)
            exported_tokenizer.save_pretrained(str(target))
            preferred = [name for name in TF_PREFERRED_FILES if Path(target, name).exists()]
            if preferred:  # a bug: TF would take it before tf_model.h5 (module docstring)
                raise RuntimeError(f"export would hold {preferred}: TensorFlow would load it")
            text = card(parameter_count(state), part)
            Path(target, MODEL_CARD).write_text(text, encoding="utf-8")
            unexpected = sorted({p.name for p in target.iterdir()} - MODEL_FILES)
            if unexpected:  # a bug: a loader (or the smoke run) would read or refuse it
                raise RuntimeError(f"export would hold {unexpected}, not in MODEL_FILES")
        parts = {str(part) for part in states if part}
        beside = sorted({p.name for p in Path(tmp).iterdir()} - parts) if parts else []
        if beside:
            raise RuntimeError(f"export would hold {beside} beside its parts {sorted(parts)}")
        stop_point()
        storage.upload_tree(tmp, job.paths.export)
        stop_point()
    first = next(iter(states.values()))
    summary = {
        **summary,
        "pytorch_class": PYTORCH_CLASSES[family],
        "parameters": parameter_count(first),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if family in EXPORT_PARTS:
        summary["parts"] = {
            str(part): {
                "directory": str(part),
                "pytorch_class": pytorch_class(family, part),
                "parameters": parameter_count(state),
            }
            for part, state in states.items()
        }
    storage.write_text(marker, json.dumps(summary, indent=2) + "\n")


def is_complete(job: JobSpec) -> bool:
    return storage.exists(storage.join(job.paths.export, EXPORT_MARKER))


# ------------------------------------------------------------------ Hugging Face Hub


def hub_token(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The Hub token from the environment (never from the job spec, never printed)."""
    for name in HUB_TOKEN_VARIABLES:
        if environ.get(name):
            return environ[name]
    raise HubError(
        "--push-to-hub needs a Hugging Face token in the environment "
        f"({' or '.join(HUB_TOKEN_VARIABLES)}); create a write token at https://huggingface.co/settings/tokens"
    )


def push_to_hub(job: JobSpec, repo_id: str, *, private: bool = True) -> str:
    """Upload the finished export to a Hub model repository (created private if missing).

    huggingface_hub reads HF_ENDPOINT for the server; the token is passed through and never
    logged (errors are reported without the request headers). Returns the commit URL.
    """
    from huggingface_hub import HfApi  # noqa: PLC0415
    from huggingface_hub.errors import HfHubHTTPError  # noqa: PLC0415
    from huggingface_hub.utils import validate_repo_id  # noqa: PLC0415

    try:
        validate_repo_id(repo_id)
    except ValueError as exc:
        raise HubError(
            f"--push-to-hub: {repo_id!r} is not a Hub repo id (owner/name): {exc}"
        ) from None
    if "/" not in repo_id:
        raise HubError(f"--push-to-hub: {repo_id!r} must be owner/name")
    if not is_complete(job):
        raise HubError(
            f"no finished export in {job.paths.export}: run `tpu-payload train --job ...` first"
        )
    token = hub_token()
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="tpu-payload-push-") as tmp:
        if storage.is_gcs(job.paths.export):
            storage.download_tree(job.paths.export, tmp)
            folder = tmp
        else:
            folder = job.paths.export
        try:
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_id,
                repo_type="model",
                folder_path=folder,
                commit_message=f"tpu-pretrain export of job {job.name}",
                ignore_patterns=[EXPORT_MARKER],
            )
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else "no response"
            raise HubError(f"upload to {repo_id} failed: HTTP {status}") from None
        except OSError as exc:  # connection refused, DNS, TLS
            raise HubError(f"upload to {repo_id} failed: {type(exc).__name__}: {exc}") from None
    url = str(getattr(commit, "commit_url", commit))
    print(f"export: pushed {job.paths.export} to {repo_id} ({url})", file=sys.stderr)
    return url
