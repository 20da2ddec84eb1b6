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
    corpus = template.get("corpus")
    paths = corpus.get("paths") if isinstance(corpus, dict) else None
    if not isinstance(paths, list) or not paths:
        raise JobTemplateError(
            "corpus.paths: a non-empty list of paths under gs://<bucket>/corpus/"
        )
    for i, item in enumerate(paths):
        if (
            not isinstance(item, str)
            or not item
            or "://" in item
            or item.startswith("/")
            or ".." in item.split("/")
        ):
            raise JobTemplateError(
                f"corpus.paths[{i}]: {item!r} must be relative to gs://<bucket>/corpus/"
            )
    return template


def run_root(bucket: str, job_name: str) -> str:
    return f"gs://{bucket}/runs/{job_name}"


def job_object_name(job_name: str) -> str:
    return f"jobs/{job_name}.json"


def job_uri(bucket: str, job_name: str) -> str:
    return f"gs://{bucket}/{job_object_name(job_name)}"


def manifest_uri(bucket: str, job_name: str) -> str:
    return f"{run_root(bucket, job_name)}/data/manifest.json"


def status_uri(bucket: str, job_name: str) -> str:
    return f"{run_root(bucket, job_name)}/status.json"


# Written last by the payload's export (payload/training.py EXPORT_MARKER; the contract test
# checks that the two agree): once it exists the job is finished.
EXPORT_MARKER = "export_complete.json"


# Families only the payload's JAX backend trains (payload/spec.py JAX_ONLY_FAMILIES; the
# contract test checks that the two agree): for them `train.backend: auto` is jax, so the
# accelerator VM installs the JAX environment (infra/config.py resolve_backend).
JAX_ONLY_FAMILIES = ("llama",)


def model_family(template: Mapping[str, Any]) -> str | None:
    """The template's model.family (None when it names none: the payload refuses that)."""
    model = template.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    return family if isinstance(family, str) else None


def export_marker_uri(bucket: str, job_name: str) -> str:
    return f"{run_root(bucket, job_name)}/export/{EXPORT_MARKER}"


def watch_lease_object_name(job_name: str) -> str:
    """The TPU watchdog acts only while this object exists: Pulumi creates it after the
    controller and, on destroy, deletes it before the controller and the TPU VM."""
    return f"runs/{job_name}/bootstrap/tpu-watch-lease"


def render_job_spec(template: Mapping[str, Any], bucket: str) -> dict[str, Any]:
    """The job spec the payload runs on GCP: gs:// output and corpus in the bucket."""
    spec = copy.deepcopy(dict(template))
    spec["output"] = run_root(bucket, spec["name"])
    spec["corpus"]["paths"] = [f"gs://{bucket}/corpus/{p}" for p in spec["corpus"]["paths"]]
    return spec


def to_json(spec: Mapping[str, Any]) -> str:
    """Stable JSON text (the uploaded object's content)."""
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"
