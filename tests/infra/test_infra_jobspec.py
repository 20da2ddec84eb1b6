"""Job templates: what infra owns in a job spec (name, output, corpus location)."""

from __future__ import annotations

import pytest

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
