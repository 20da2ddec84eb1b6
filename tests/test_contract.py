"""The contract between infra/ and payload/: the job spec infra uploads for every stack is
one the payload accepts, and both agree on the bucket layout.

Runs in the payload environment (.venv): infra.jobspec is pure (stdlib + PyYAML) on purpose,
so this test renders exactly what the Pulumi program uploads, without Pulumi."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from infra import jobspec
from payload import spec
from payload.core.errors import SpecError
from payload.schema import manifest

ROOT = Path(__file__).resolve().parent.parent
STACKS = sorted(ROOT.glob("stacks/Pulumi.*.yaml"))
BUCKET = "contract-test-bucket"


def rendered_text(stack_file: Path) -> str:
    config = yaml.safe_load(stack_file.read_text())["config"]
    template = jobspec.load_template(ROOT / config["tpu-pretrain:job"])
    # Exactly the text infra uploads as gs://<bucket>/jobs/<job>.json.
    return jobspec.to_json(jobspec.render_job_spec(template, BUCKET))


def rendered(stack_file: Path) -> dict:
    return json.loads(rendered_text(stack_file))


def test_there_are_stacks():
    assert len(STACKS) >= 4


@pytest.mark.parametrize("stack_file", STACKS, ids=[p.name for p in STACKS])
def test_every_stack_job_spec_is_valid_for_the_payload(stack_file):
    # Read as the VM's payload reads the uploaded text (spec.load_job's loader): json.dumps
    # writes 1.0e-8 as 1e-08, which YAML 1.1 alone reads as a string.
    document = spec.parse_document(rendered_text(stack_file))
    assert document == rendered(stack_file)
    name = document["name"]
    source = jobspec.job_uri(BUCKET, name)
    job = spec.parse_job(document, source=source)  # raises SpecError when invalid
    assert job.name == name
    assert job.source == source
    assert job.paths.root == jobspec.run_root(BUCKET, name)
    assert job.paths.status == jobspec.status_uri(BUCKET, name)
    assert manifest.manifest_path(job.paths.data) == jobspec.manifest_uri(BUCKET, name)
    assert all(p.startswith(f"gs://{BUCKET}/corpus/") for p in job.corpus.paths)


def test_the_stacks_grant_end_is_one_the_payload_reads():
    """tpu-pretrain:grantEnds (validated YYYY-MM-DD by infra/config/config.py) rendered into
    the job spec as grant_ends: the payload accepts and keeps it."""
    config = yaml.safe_load(STACKS[0].read_text())["config"]
    template = jobspec.load_template(ROOT / config["tpu-pretrain:job"])
    text = jobspec.to_json(jobspec.render_job_spec(template, BUCKET, grant_ends="2027-01-31"))
    document = spec.parse_document(text)
    job = spec.parse_job(document, source=jobspec.job_uri(BUCKET, document["name"]))
    assert job.grant_ends == "2027-01-31"
    without = spec.parse_job(rendered(STACKS[0]), source=jobspec.job_uri(BUCKET, job.name))
    assert without.grant_ends is None


def test_the_payload_rejects_what_infra_must_not_produce():
    document = rendered(STACKS[0])
    document["train"]["steps"] = 0
    with pytest.raises(SpecError, match=r"train\.steps"):
        spec.parse_job(document, source=jobspec.job_uri(BUCKET, document["name"]))


def test_infra_knows_the_payloads_export_marker():
    """The TPU watchdog stops recreating the TPU VM once this marker exists."""
    from payload.backends.tf import train

    assert jobspec.EXPORT_MARKER == train.EXPORT_MARKER
    assert jobspec.export_marker_uri(BUCKET, "j") == f"gs://{BUCKET}/runs/j/export/" + (
        train.EXPORT_MARKER
    )


def test_infra_knows_where_the_trainer_keeps_what_it_reads_back():
    """infra/executables.py keeps every identity but the accelerator VM's off these folders
    of every job (runs/<job>/...): the payload's trainer writes and reads them there. The
    JAX trainer's folder name is read from its source: importing the JAX backend in a
    process that imported Keras on TensorFlow is refused (payload/backends/jax/__init__.py)."""
    trainer = ast.parse((ROOT / "payload/backends/jax/train.py").read_text(encoding="utf-8"))
    (cache,) = [
        ast.literal_eval(node.value)
        for node in trainer.body
        if isinstance(node, ast.Assign)
        and [getattr(target, "id", None) for target in node.targets] == ["COMPILATION_CACHE"]
    ]
    document = rendered(STACKS[0])
    name = document["name"]
    job = spec.parse_job(document, source=jobspec.job_uri(BUCKET, name))
    root = jobspec.run_root(BUCKET, name)
    assert root == f"gs://{BUCKET}/{jobspec.run_prefix(name)}"
    assert job.paths.checkpoints == f"{root}/{jobspec.CHECKPOINTS_DIR}"
    assert job.paths.export == f"{root}/{jobspec.EXPORT_DIR}"
    assert cache == jobspec.COMPILATION_CACHE_DIR


def test_infra_knows_what_the_payloads_export_holds():
    """`make smoke` downloads only these names and classes; tests/payload/test_export.py
    checks that a real export holds exactly MODEL_FILES."""
    from payload.training import export

    assert jobspec.EXPORT_MODEL_FILES == export.MODEL_FILES
    assert jobspec.EXPORT_WEIGHTS == export.PT_WEIGHTS
    assert jobspec.EXPORT_CLASSES == export.PYTORCH_CLASSES
    assert jobspec.EXPORT_PARTS == export.EXPORT_PARTS


def test_infra_resolves_auto_to_jax_for_the_payloads_jax_only_families():
    """A stack installs the JAX environment for `train.backend: auto` when the payload will
    pick jax (infra/config/job.py resolve_backend): the same families, read the same way."""
    assert jobspec.JAX_ONLY_FAMILIES == spec.JAX_ONLY_FAMILIES
    document = rendered(STACKS[0])
    for family in spec.FAMILIES:
        document["model"] = {"family": family}
        assert jobspec.model_family(document) == family
    assert jobspec.model_family({"model": {}}) is None


def _dataflow_target() -> jobspec.DataflowTarget:
    return jobspec.DataflowTarget(
        project="tpu-pretrain-test",
        region="europe-west4",
        service_account_email="tp-x-dataflow@tpu-pretrain-test.iam.gserviceaccount.com",
        subnet_name="tp-x-vpc-europe-west4",
        sdk_container_image="europe-west4-docker.pkg.dev/tpu-pretrain-test/tp-x-dataflow/"
        "encode:0123456789abcdef",
    )


def _dataflow_template(stack_file: Path) -> dict:
    config = yaml.safe_load(stack_file.read_text())["config"]
    template = jobspec.load_template(ROOT / config["tpu-pretrain:job"])
    template.setdefault("data", {}).update(
        runner="beam", beam={"runner": "DataflowRunner", "options": {"max_num_workers": 8}}
    )
    return template


@pytest.mark.parametrize("stack_file", STACKS, ids=[p.name for p in STACKS])
def test_every_stack_dataflow_job_spec_is_valid_for_the_payload(stack_file):
    """tpu-pretrain:dataflow: the Beam options infra renders for a job on DataflowRunner
    (infra.jobspec.dataflow_options, the worker image included) pass the payload's allowlist
    and its required options, and arrive unchanged."""
    target = _dataflow_target()
    rendered = jobspec.render_job_spec(_dataflow_template(stack_file), BUCKET, target)
    document = json.loads(jobspec.to_json(rendered))
    job = spec.parse_job(document, source=jobspec.job_uri(BUCKET, document["name"]))
    assert (job.data.runner, job.data.beam.runner) == ("beam", "DataflowRunner")
    assert dict(job.data.beam.options) == {
        **jobspec.dataflow_options(target, BUCKET),
        "max_num_workers": 8,
    }
    assert job.data.beam.options["sdk_container_image"] == target.sdk_container_image


def test_infra_renders_every_option_the_payload_requires_for_dataflow():
    """Every option the payload requires with DataflowRunner is one infra renders (and a
    template may not set); so a rendered spec missing one is refused by the payload."""
    rendered_keys = set(jobspec.dataflow_options(_dataflow_target(), BUCKET))
    assert set(spec.BEAM_DATAFLOW_REQUIRED) <= rendered_keys
    assert rendered_keys == set(jobspec.DATAFLOW_OPTION_KEYS)
    assert rendered_keys <= set(spec.BEAM_OPTIONS)
    # The payload refuses the same spec with any one of them left out.
    rendered = jobspec.render_job_spec(_dataflow_template(STACKS[0]), BUCKET, _dataflow_target())
    for key in spec.BEAM_DATAFLOW_REQUIRED:
        document = json.loads(jobspec.to_json(rendered))
        del document["data"]["beam"]["options"][key]
        with pytest.raises(SpecError, match=rf"DataflowRunner needs {key}"):
            spec.parse_job(document, source=jobspec.job_uri(BUCKET, document["name"]))
