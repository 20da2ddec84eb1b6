"""Job templates (stacks/jobs/*.yaml) rendered into the payload's job spec.

Pure: stdlib + PyYAML only, so the payload's environment can import it in the contract test
(tests/test_contract.py) and validate what infra uploads with the payload's own loader.
A template is a job spec without `output`; its corpus paths are relative to the bucket's
corpus/ folder. Rendering fills in the bucket layout:

    gs://<bucket>/jobs/<job>.json      the rendered spec
    gs://<bucket>/corpus/<path>        the raw text the user uploads
    gs://<bucket>/runs/<job>/...       everything the payload writes
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,61}[a-z0-9]$")


class JobTemplateError(ValueError):
    """The job template cannot be rendered; the message names the key."""


def load_template(path: Path) -> dict[str, Any]:
    """Read and check a job template (the parts infra owns; the payload checks the rest)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise JobTemplateError(f"cannot read job template: {error.strerror}") from None
    try:
        template = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise JobTemplateError(f"not valid YAML: {error}") from None
    if not isinstance(template, dict):
        raise JobTemplateError("a job template must be a mapping")
    name = template.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise JobTemplateError(
            f"name: {name!r} must be 2-63 lowercase letters, digits or '-' (it names "
            "gs://<bucket>/runs/<name>)"
        )
    if "output" in template:
        raise JobTemplateError("output: set by infra (gs://<bucket>/runs/<name>); remove it")
    _check_corpus(template.get("corpus"))
    _check_beam_options(template)
    return template


HUB_PREFIX = "hf://datasets/"


def _check_corpus(corpus: object) -> None:
    """corpus.paths (one source) or corpus.sources (a mixture: each with its own paths); every
    path relative to gs://<bucket>/corpus/, or a Hub dataset (hf://datasets/...: the payload
    checks that its revision is pinned). What else a source says is the payload's to check."""
    if not isinstance(corpus, dict) or ("paths" in corpus) == ("sources" in corpus):
        raise JobTemplateError(
            "corpus: give paths (a non-empty list of paths under gs://<bucket>/corpus/) or "
            "sources (a list of {paths: [...], weight: ...}), not both"
        )
    if "paths" in corpus:
        _check_paths("corpus.paths", corpus["paths"])
        return
    sources = corpus["sources"]
    if not isinstance(sources, list) or not sources:
        raise JobTemplateError("corpus.sources: a non-empty list of {paths: [...]} mappings")
    for i, source in enumerate(sources):
        if not isinstance(source, dict):
            raise JobTemplateError(f"corpus.sources[{i}]: a mapping with paths: [...]")
        _check_paths(f"corpus.sources[{i}].paths", source.get("paths"))


def _check_paths(where: str, paths: object) -> None:
    if not isinstance(paths, list) or not paths:
        raise JobTemplateError(f"{where}: a non-empty list of paths under gs://<bucket>/corpus/")
    for i, item in enumerate(paths):
        if isinstance(item, str) and item.startswith(HUB_PREFIX):
            continue
        if (
            not isinstance(item, str)
            or not item
            or "://" in item
            or item.startswith("/")
            or ".." in item.split("/")
        ):
            raise JobTemplateError(
                f"{where}[{i}]: {item!r} must be relative to gs://<bucket>/corpus/ "
                f"(or a Hub dataset, {HUB_PREFIX}<owner>/<name>@<commit>/<glob>)"
            )


def _in_bucket(bucket: str, path: str) -> str:
    return path if path.startswith(HUB_PREFIX) else f"gs://{bucket}/corpus/{path}"


# --- Dataflow (encoding at scale; docs/deploy-gcp.md#dataflow-encoding-at-scale) -----------
# The payload owns `data.runner` / `data.beam` and validates them (its allowlist of Beam
# options); infra fills in the options that name the stack's resources when the job runs on
# Dataflow, so a template never carries a project, an account or a bucket of its own, nor an
# image of its own: `sdk_container_image` names the image built from the very payload archive
# the stack uploads (its digest is the tag), so a template may not override it either.
DATAFLOW_RUNNER = "DataflowRunner"
DATAFLOW_OPTION_KEYS = (
    "project",
    "region",
    "service_account_email",
    "subnetwork",
    "temp_location",
    "staging_location",
    "no_use_public_ips",
    "sdk_container_image",
)


@dataclass(frozen=True)
class DataflowTarget:
    """What a Dataflow job of the stack runs in: the stack's project and region, its worker
    service account, the TPU region's subnet (Private Google Access on, no public IPs) and
    the workers' container image in the stack's Artifact Registry repository."""

    project: str
    region: str
    service_account_email: str
    subnet_name: str
    sdk_container_image: str


def _beam(template: Mapping[str, Any]) -> Mapping[str, Any]:
    data = template.get("data")
    beam = data.get("beam") if isinstance(data, dict) else None
    return beam if isinstance(beam, dict) else {}


def uses_dataflow(template: Mapping[str, Any]) -> bool:
    """Whether the job encodes on Dataflow: data.runner beam with data.beam.runner
    DataflowRunner (the payload's keys; anything else runs on the machine that runs it)."""
    data = template.get("data")
    runner = data.get("runner") if isinstance(data, dict) else None
    return runner == "beam" and _beam(template).get("runner") == DATAFLOW_RUNNER


def _check_beam_options(template: Mapping[str, Any]) -> None:
    options = _beam(template).get("options")
    if not isinstance(options, dict):
        return  # absent, or not a mapping: the payload refuses it with its own message
    for key in DATAFLOW_OPTION_KEYS:
        if key in options:
            raise JobTemplateError(
                f"data.beam.options.{key}: set by infra from the stack (its project, region, "
                "Dataflow worker account, subnet, bucket and worker image); remove it"
            )


def dataflow_options(target: DataflowTarget, bucket: str) -> dict[str, Any]:
    """The Beam pipeline options that put a Dataflow job into the stack: workers run as the
    stack's worker account, in the TPU region's subnet, without public IPs (they reach Cloud
    Storage and Artifact Registry through Private Google Access), staging and temp files in
    the stack's bucket, the workers' image from the stack's repository (the payload requires
    it with DataflowRunner: payload/spec.py BEAM_DATAFLOW_REQUIRED).
    `subnetwork` is the short form Google documents for a subnet of the job's own project
    ("regions/REGION/subnetworks/SUBNETWORK", dataflow/docs/guides/specifying-networks)."""
    return {
        "project": target.project,
        "region": target.region,
        "service_account_email": target.service_account_email,
        "subnetwork": f"regions/{target.region}/subnetworks/{target.subnet_name}",
        "temp_location": f"gs://{bucket}/dataflow/tmp",
        "staging_location": f"gs://{bucket}/dataflow/staging",
        "no_use_public_ips": True,
        "sdk_container_image": target.sdk_container_image,
    }


# The folders of a run that the trainer writes and reads back, on the accelerator VM only
# (payload/schema/job.py JobPaths, payload/backends/jax/train.py COMPILATION_CACHE; the
# contract test checks that they agree). infra/executables.py keeps every other identity off
# them.
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
COMPILATION_CACHE_DIR = "compilation-cache"


def run_prefix(job_name: str) -> str:
    """The object-name prefix of a job's run: everything the payload writes is under it."""
    return f"runs/{job_name}"


def run_root(bucket: str, job_name: str) -> str:
    return f"gs://{bucket}/{run_prefix(job_name)}"


def job_object_name(job_name: str) -> str:
    return f"jobs/{job_name}.json"


def job_uri(bucket: str, job_name: str) -> str:
    return f"gs://{bucket}/{job_object_name(job_name)}"


def manifest_uri(bucket: str, job_name: str) -> str:
    return f"{run_root(bucket, job_name)}/data/manifest.json"


def status_uri(bucket: str, job_name: str) -> str:
    return f"{run_root(bucket, job_name)}/status.json"


# Written last by the payload's export (payload/training/shared.py EXPORT_MARKER; the contract
# test checks that the two agree): once it exists the job is finished.
EXPORT_MARKER = "export_complete.json"
# What the rest of export/ may hold, as the payload's exporter writes it
# (payload/training/export.py MODEL_FILES, PT_WEIGHTS, PYTORCH_CLASSES, EXPORT_PARTS; the
# contract test checks that the copies agree): the files of a model's directory, the weights
# config.json names, the PyTorch class of each family, and the families whose export is one
# directory per part. The smoke run's download accepts nothing else.
EXPORT_MODEL_FILES = frozenset(
    {
        "README.md",
        "config.json",
        "generation_config.json",
        "pytorch_model.safetensors",
        "special_tokens_map.json",
        "tf_model.h5",
        "tokenizer.json",
        "tokenizer_config.json",
    }
)
EXPORT_WEIGHTS = "pytorch_model.safetensors"
EXPORT_CLASSES = {
    "bert": "BertForMaskedLM",
    "roberta": "RobertaForMaskedLM",
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "electra": "ElectraForPreTraining",
}
EXPORT_PARTS = {
    "electra": {"discriminator": "ElectraForPreTraining", "generator": "ElectraForMaskedLM"},
}


# Families only the payload's JAX backend trains (payload/schema/job.py JAX_ONLY_FAMILIES; the
# contract test checks that the two agree): for them `train.backend: auto` is jax, so the
# accelerator VM installs the JAX environment (infra/config/job.py resolve_backend).
JAX_ONLY_FAMILIES = ("llama", "electra")


def model_family(template: Mapping[str, Any]) -> str | None:
    """The template's model.family (None when it names none: the payload refuses that)."""
    model = template.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    return family if isinstance(family, str) else None


def export_marker_uri(bucket: str, job_name: str) -> str:
    return f"{run_root(bucket, job_name)}/{EXPORT_DIR}/{EXPORT_MARKER}"


def watch_lease_object_name(job_name: str) -> str:
    """The TPU watchdog acts only while this object exists: Pulumi creates it after the
    controller and, on destroy, deletes it before the controller and the TPU VM."""
    return f"{run_prefix(job_name)}/bootstrap/tpu-watch-lease"


def render_job_spec(
    template: Mapping[str, Any],
    bucket: str,
    dataflow: DataflowTarget | None = None,
    grant_ends: str | None = None,
) -> dict[str, Any]:
    """The job spec the payload runs on GCP: gs:// output and corpus in the bucket; for a
    job that encodes on Dataflow, the Beam options that name the stack's resources
    (`dataflow`: the stack's Dataflow target, None when the stack has no Dataflow access);
    the stack's grant end as `grant_ends` when it sets one (tpu-pretrain:grantEnds,
    YYYY-MM-DD; the payload checks the run's ETA against it)."""
    spec = copy.deepcopy(dict(template))
    spec["output"] = run_root(bucket, spec["name"])
    if grant_ends is not None:  # infra/config/config.py refuses a template that has its own
        spec["grant_ends"] = grant_ends
    corpus = spec["corpus"]
    for source in corpus.get("sources", [corpus]):
        source["paths"] = [_in_bucket(bucket, p) for p in source["paths"]]
    if uses_dataflow(template):
        if dataflow is None:
            raise JobTemplateError(
                f"data.beam.runner: {DATAFLOW_RUNNER} needs a stack with Dataflow access "
                "(tpu-pretrain:dataflow true)"
            )
        beam = spec["data"]["beam"]
        beam["options"] = {**(beam.get("options") or {}), **dataflow_options(dataflow, bucket)}
    return spec


def to_json(spec: Mapping[str, Any]) -> str:
    """Stable JSON text (the uploaded object's content)."""
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"
