"""Job templates: what infra owns in a job spec (name, output, corpus location, the grant's
end)."""

from __future__ import annotations

import json

import pytest
from harness import by_name, config_error, run_offline

from infra import jobspec


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a list\n", "a job template must be a mapping"),
        ("name: [unclosed\n", "not valid YAML"),
        (
            "name: Big_Name\ncorpus: {paths: [a]}\n",
            "name: 'Big_Name' must be 2-63 lowercase letters, digits or '-' "
            "(it names gs://<bucket>/runs/<name>)",
        ),
        (
            "name: ok\ncorpus: {paths: []}\n",
            "corpus.paths: a non-empty list of paths under gs://<bucket>/corpus/",
        ),
        (
            "name: ok\ncorpus: {paths: [a], sources: [{paths: [b]}]}\n",
            "corpus: give paths (a non-empty list of paths under gs://<bucket>/corpus/) or sources",
        ),
        ("name: ok\ncorpus: {}\n", "corpus: give paths"),
        (
            "name: ok\ncorpus: {sources: []}\n",
            "corpus.sources: a non-empty list of {paths: [...]} mappings",
        ),
        (
            "name: ok\ncorpus: {sources: [{paths: [a]}, {paths: [hf://x/y]}]}\n",
            "corpus.sources[1].paths[0]: 'hf://x/y' must be relative to gs://<bucket>/corpus/ "
            "(or a Hub dataset, hf://datasets/<owner>/<name>@<commit>/<glob>)",
        ),
        (
            "name: ok\ncorpus: {paths: [gs://other/x]}\n",
            "corpus.paths[0]: 'gs://other/x' must be relative to gs://<bucket>/corpus/",
        ),
        (
            "name: ok\ncorpus: {paths: [a, ../escape]}\n",
            "corpus.paths[1]: '../escape' must be relative to gs://<bucket>/corpus/",
        ),
        (
            "name: ok\ncorpus: {paths: [/abs]}\n",
            "corpus.paths[0]: '/abs' must be relative to gs://<bucket>/corpus/",
        ),
    ],
)
def test_bad_templates(tmp_path, text, message):
    with pytest.raises(jobspec.JobTemplateError) as caught:
        jobspec.load_template(write(tmp_path, text))
    assert str(caught.value).startswith(message)


def test_a_mixture_and_hub_paths_are_rendered_source_by_source(tmp_path):
    commit = "0" * 40
    hub = f"hf://datasets/acme/web@{commit}/data/*.parquet"
    template = jobspec.load_template(
        write(
            tmp_path,
            "name: mix\ncorpus:\n  text_field: body\n  sources:\n"
            "    - {paths: [books/], weight: 0.25}\n"
            f"    - {{paths: ['{hub}', extra.jsonl.zst], weight: 0.75}}\n",
        )
    )
    spec = jobspec.render_job_spec(template, "bkt")
    assert spec["corpus"] == {
        "text_field": "body",
        "sources": [
            {"paths": ["gs://bkt/corpus/books/"], "weight": 0.25},
            {"paths": [hub, "gs://bkt/corpus/extra.jsonl.zst"], "weight": 0.75},
        ],
    }
    assert template["corpus"]["sources"][0]["paths"] == ["books/"]


def test_rendering_fills_in_the_bucket_layout_and_leaves_the_template_alone(tmp_path):
    template = jobspec.load_template(
        write(tmp_path, "name: demo\ncorpus: {paths: [wiki/, extra.txt]}\ntrain: {steps: 5}\n")
    )
    spec = jobspec.render_job_spec(template, "bkt")
    assert spec == {
        "name": "demo",
        "output": "gs://bkt/runs/demo",
        "corpus": {"paths": ["gs://bkt/corpus/wiki/", "gs://bkt/corpus/extra.txt"]},
        "train": {"steps": 5},
    }
    assert template["corpus"]["paths"] == ["wiki/", "extra.txt"]
    assert jobspec.to_json(spec) == jobspec.to_json(dict(reversed(list(spec.items()))))
    assert jobspec.job_uri("bkt", "demo") == "gs://bkt/jobs/demo.json"
    assert jobspec.manifest_uri("bkt", "demo") == "gs://bkt/runs/demo/data/manifest.json"
    assert jobspec.status_uri("bkt", "demo") == "gs://bkt/runs/demo/status.json"


# --- tpu-pretrain:grantEnds: the grant's last day, in the job spec the payload reads ----------
def _uploaded_spec(overrides: dict) -> dict:
    run = run_offline("v3-euw4", overrides)
    return json.loads(by_name(run, "payload-job-spec").inputs["content"])


def test_grant_ends_goes_into_the_uploaded_job_spec_only_when_set():
    assert _uploaded_spec({"tpu-pretrain:grantEnds": "2027-01-31"})["grant_ends"] == "2027-01-31"
    assert "grant_ends" not in _uploaded_spec({})
    assert "grant_ends" not in _uploaded_spec({"tpu-pretrain:grantEnds": ""})


@pytest.mark.parametrize("value", ["2027-02-30", "31.01.2027", "20270131", "2027-1-31", "soon"])
def test_grant_ends_is_a_date(value):
    assert config_error("v3-euw4", {"tpu-pretrain:grantEnds": value}) == (
        f"tpu-pretrain:grantEnds: {value!r} is not a date (allowed: YYYY-MM-DD, e.g. "
        "2027-01-31; unset: no grant end)"
    )


def test_a_template_with_its_own_grant_end_is_refused_when_the_stack_sets_one(tmp_path):
    template = tmp_path / "job.yaml"
    template.write_text("name: x1\ngrant_ends: 2027-03-01\ncorpus: {paths: [a]}\n")
    message = config_error(
        "v3-euw4", {"tpu-pretrain:job": str(template), "tpu-pretrain:grantEnds": "2027-01-31"}
    )
    assert message == (
        f"tpu-pretrain:job: {str(template)!r}: grant_ends is set by the stack's "
        "tpu-pretrain:grantEnds (2027-01-31); remove it from the template"
    )
