"""The encode stage on Apache Beam (data.runner: beam): the same bytes as the local encoder.

Beam lives in its own environment (requirements/beam.txt: its protobuf < 7 clashes with the
payload's lock), so the pipeline runs in a subprocess with that environment's Python
(PAYLOAD_BEAM_PYTHON, or .venv-beam built by `make venv-beam`), on Beam's local runner with
1, 2 and 4 worker processes, and its shards and manifest are compared byte for byte with
the local encoder's on the same inputs: a mixture of two weighted sources under a token
budget, a held-out split, and files of several groups each (small groups here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from encode_helpers import prepared, status_for

from payload import spec
from payload.core.errors import SpecError
from payload.data import corpus
from payload.data.encode import stage
from payload.schema import manifest as mf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from generate_corpus import write_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GROUP_BYTES = 16_384  # several groups per file, so the side inputs have work to do
TIMEOUT_S = 600

# The stage as `python -m payload encode` runs it, with small groups.
RUN_ENCODE = textwrap.dedent(
    """
    import sys
    from payload.data import corpus
    from payload.data.encode import stage
    from payload.spec import load_job
    from payload.core.status import StatusWriter

    corpus.GROUP_BYTES = int(sys.argv[2])
    job = load_job(sys.argv[1])
    stage.encode(job, StatusWriter(job.paths.status, job.name, min_interval_s=0))
    """
)


def _beam_python() -> Path:
    configured = os.environ.get("PAYLOAD_BEAM_PYTHON")
    python = Path(configured) if configured else REPO / ".venv-beam" / "bin" / "python"
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must run the Beam checks: build .venv-beam with `make venv-beam`")
        pytest.skip("no Apache Beam environment: `make venv-beam` builds .venv-beam")
    return python


def _run_beam(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_beam_python()), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("beam-corpus")
    (root / "web").mkdir()
    (root / "books").mkdir()
    write_corpus(root / "web" / "a.txt", 60_000, seed=1)
    write_corpus(root / "web" / "b.txt", 25_000, seed=2)
    write_corpus(root / "books" / "c.txt", 50_000, seed=3)
    return root


def _job_document(root: Path, corpus_dir: Path, **data: object) -> dict:
    return {
        "name": "beam-enc",
        "output": str(root / "out"),
        "corpus": {
            "sources": [
                {"paths": [str(corpus_dir / "web")], "weight": 1},
                {"paths": [str(corpus_dir / "books")], "weight": 3},
            ]
        },
        "tokenizer": {"kind": "wordpiece", "vocab_size": 1500},
        "data": {
            "objective": "mlm",
            "seq_length": 32,
            "records_per_shard": 20,
            "eval_fraction": 0.05,
            "eval_min_sequences": 4,
            "eval_max_sequences": 60,
            "max_tokens": 8_000,
            **data,
        },
        "model": {"family": "bert"},
        "train": {"steps": 4},
    }


def _write_job(root: Path, document: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def local(
    tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path
) -> tuple[spec.JobSpec, mf.Manifest]:
    """The local encoder's output: the reference."""
    root = tmp_path_factory.mktemp("local")
    job = spec.load_job(str(_write_job(root, _job_document(root, corpus_dir))))
    prepared(job)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpus, "GROUP_BYTES", GROUP_BYTES)
        manifest = stage.encode(job, status_for(job))
    return job, manifest


def _data_files(data_dir: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(data_dir).iterdir() if p.name != "stage.json"}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_beam_writes_the_local_encoders_bytes(tmp_path, corpus_dir, local, workers) -> None:
    job, manifest = local
    document = _job_document(tmp_path, corpus_dir, runner="beam", beam={"workers": workers})
    path = _write_job(tmp_path, document)
    beam_job = spec.load_job(str(path))
    Path(beam_job.paths.tokenizer).mkdir(parents=True)
    for item in Path(job.paths.tokenizer).iterdir():
        (Path(beam_job.paths.tokenizer) / item.name).write_bytes(item.read_bytes())
    result = _run_beam("-c", RUN_ENCODE, str(path), str(GROUP_BYTES))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = _data_files(job.paths.data)
    assert _data_files(beam_job.paths.data) == expected  # every shard and the manifest
    # What the comparison covers: several groups per file, both splits, both budgets used up.
    assert manifest.format_version == mf.FORMAT_VERSION
    assert len(manifest.shards) > 5 and manifest.eval_records > 0
    assert [s["exhausted"] for s in manifest.sources] == [True, True]
    assert [s["budget"] for s in manifest.sources] == [2000, 6000]
    status = json.loads(Path(beam_job.paths.status).read_text())
    metrics = status["stages"]["encode"]["metrics"]
    assert metrics["source1_tokens"] == manifest.sources[1]["tokens"]
    assert metrics["bytes_read"] > 0 and metrics["documents_read"] > 0
    assert metrics["beam_runner"] == "DirectRunner"


def test_beam_through_the_cli_and_a_bad_file(tmp_path, corpus_dir, local) -> None:
    """`python -m payload encode` picks Beam from data.runner; a bad input file under
    on_bad_input: fail is one line, exit 2, and leaves no shard behind."""
    job, _ = local
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("ok\n\ncaf\xe9\n".encode("latin-1"))
    document = _job_document(tmp_path, corpus_dir, runner="beam")
    document["corpus"] = {"paths": [str(corpus_dir / "web"), str(bad)], "on_bad_input": "fail"}
    del document["data"]["max_tokens"]
    path = _write_job(tmp_path, document)
    beam_job = spec.load_job(str(path))
    Path(beam_job.paths.tokenizer).mkdir(parents=True)
    for item in Path(job.paths.tokenizer).iterdir():
        (Path(beam_job.paths.tokenizer) / item.name).write_bytes(item.read_bytes())
    result = _run_beam("-m", "payload", "encode", "--job", str(path))
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "latin1.txt: invalid UTF-8" in last and "Traceback" not in result.stderr, last
    assert not list(Path(beam_job.paths.data).glob("*.tfrecord"))
    assert not stage.is_complete(beam_job)

    (bad / "latin1.txt").unlink()
    (bad / "ok.txt").write_text("a short document\n")
    result = _run_beam("-m", "payload", "encode", "--job", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = mf.load_manifest(beam_job.paths.data)
    mf.verify_shards(beam_job.paths.data, manifest)
    assert manifest.sources[0]["budget"] is None and not manifest.sources[0]["exhausted"]


def test_dataflow_options_become_beam_flags(tmp_path, corpus_dir) -> None:
    options = {
        "project": "my-project",
        "region": "europe-west4",
        "temp_location": "gs://my-bucket/dataflow/temp",
        "service_account_email": "dataflow@my-project.iam.gserviceaccount.com",
        "subnetwork": "regions/europe-west4/subnetworks/tpu",
        "no_use_public_ips": True,
        "max_num_workers": 8,
        "sdk_container_image": "europe-west4-docker.pkg.dev/my-project/payload/beam:1",
    }
    document = _job_document(
        tmp_path, corpus_dir, runner="beam", beam={"runner": "DataflowRunner", "options": options}
    )
    path = _write_job(tmp_path, document)
    code = (
        "import sys, json; from payload import spec; from payload.data.encode import beam;"
        "print(json.dumps(beam.pipeline_args(spec.load_job(sys.argv[1]))))"
    )
    result = _run_beam("-c", code, str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [
        "--runner=DataflowRunner",
        "--job_name=tpu-payload-encode-beam-enc",
        "--max_num_workers=8",
        "--no_use_public_ips",
        "--project=my-project",
        "--region=europe-west4",
        "--sdk_container_image=europe-west4-docker.pkg.dev/my-project/payload/beam:1",
        "--service_account_email=dataflow@my-project.iam.gserviceaccount.com",
        "--subnetwork=regions/europe-west4/subnetworks/tpu",
        "--temp_location=gs://my-bucket/dataflow/temp",
    ]
    # and Beam itself parses them as the options they name (apache_beam's PipelineOptions)
    code = (
        "import sys, json; from payload import spec; from payload.data.encode import beam;"
        "from apache_beam.options.pipeline_options import PipelineOptions;"
        "args = beam.pipeline_args(spec.load_job(sys.argv[1]));"
        "o = PipelineOptions(args).get_all_options();"
        "print(json.dumps([o['use_public_ips'], o['max_num_workers'], o['temp_location']]))"
    )
    result = _run_beam("-c", code, str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [
        False,
        8,
        "gs://my-bucket/dataflow/temp",
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"runner": "spark"}, r"data\.runner: 'spark' is not allowed \(allowed: local, beam\)"),
        (
            {"runner": "beam", "beam": {"runner": "FlinkRunner"}},
            r"data\.beam\.runner: 'FlinkRunner' is not allowed \(allowed: DirectRunner, "
            r"DataflowRunner\)",
        ),
        (
            {"runner": "beam", "beam": {"runner": "DataflowRunner", "options": {"zone": "x"}}},
            r"data\.beam\.options\.zone: unknown Beam option \(allowed: dataflow_kms_key, "
            r"disk_size_gb, job_name, machine_type, max_num_workers, network, "
            r"no_use_public_ips, num_workers, project, region, requirements_file, "
            r"sdk_container_image, service_account_email, staging_location, subnetwork, "
            r"temp_location\)",
        ),
        (
            {"runner": "beam", "beam": {"runner": "DataflowRunner", "options": {"project": "p"}}},
            r"data\.beam\.options: DataflowRunner needs region, temp_location, "
            r"sdk_container_image",
        ),
        (
            {"runner": "beam", "beam": {"options": {"project": "p"}}},
            r"data\.beam\.options: options are for DataflowRunner; DirectRunner runs on this",
        ),
        (
            {
                "runner": "beam",
                "beam": {
                    "runner": "DataflowRunner",
                    "options": {
                        "project": "p",
                        "region": "r",
                        "temp_location": "/tmp/x",
                        "sdk_container_image": "i",
                    },
                },
            },
            r"data\.beam\.options\.temp_location: '/tmp/x' must be a gs:// path",
        ),
        (
            {"beam": {"runner": "DataflowRunner", "options": {"no_use_public_ips": "yes"}}},
            r"data\.beam\.options\.no_use_public_ips: expected true or false",
        ),
        ({"beam": {"workers": 0}}, r"data\.beam\.workers: 0 is too small \(minimum 1\)"),
        ({"beam": {"color": "red"}}, r"data\.beam\.color: unknown key \(allowed: options, runner"),
    ],
)
def test_runner_settings_are_checked(tmp_path, corpus_dir, data, message) -> None:
    with pytest.raises(SpecError, match=message):
        spec.load_job(str(_write_job(tmp_path, _job_document(tmp_path, corpus_dir, **data))))


def test_local_environment_without_beam_says_how_to_get_it(tmp_path, corpus_dir, local) -> None:
    """In the payload's own environment (no Apache Beam), data.runner: beam is one line."""
    job, _ = local
    path = _write_job(tmp_path, _job_document(tmp_path, corpus_dir, runner="beam"))
    beam_job = spec.load_job(str(path))
    Path(beam_job.paths.tokenizer).mkdir(parents=True)
    for item in Path(job.paths.tokenizer).iterdir():
        (Path(beam_job.paths.tokenizer) / item.name).write_bytes(item.read_bytes())
    result = subprocess.run(
        [sys.executable, "-m", "payload", "encode", "--job", str(path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2
    assert "data.runner: beam needs Apache Beam" in result.stderr.strip().splitlines()[-1]
