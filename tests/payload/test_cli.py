"""The real CLI: bad input gives one line + exit 2 with nothing left as complete; gs:// output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from train_helpers import assert_user_error, tensorflow_env
from train_helpers import run_cli as tpu_payload

from payload import cli
from payload.core import storage
from payload.core.errors import DataError
from payload.schema import manifest as mf

IMPORTED = "no_tensorflow: tensorflow was imported"  # no_tensorflow/sitecustomize.py

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write_job(tmp_path: Path, corpus: list[str] | str, **overrides: object) -> Path:
    doc: dict = {
        "name": "cli",
        "output": str(tmp_path / "out"),
        "corpus": {"paths": corpus},
        "tokenizer": {"kind": "wordpiece", "vocab_size": 1000},
        "data": {"objective": "mlm", "seq_length": 32, "records_per_shard": 100},
        "model": {"family": "bert"},
        "train": {"steps": 2},
    }
    for dotted, value in overrides.items():
        if "__" in dotted:
            section, key = dotted.split("__")
            doc[section][key] = value
        else:
            doc[dotted] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def assert_nothing_complete(out: Path) -> None:
    assert not (out / "tokenizer" / "tokenizer.json").exists()
    assert not (out / "data" / "manifest.json").exists()


@pytest.fixture
def good_corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text((EXAMPLES / "corpus" / "mixed.txt").read_text(encoding="utf-8")[:60_000])
    return str(path)


def test_help_and_usage_errors() -> None:
    result = tpu_payload("--help")
    assert result.returncode == 0
    for command in ("validate", "tokenizer", "encode", "train", "run"):
        assert command in result.stdout
    assert tpu_payload("encode").returncode == 2  # --job is required (argparse)


def test_validate_prints_resolved_spec(tmp_path: Path, good_corpus: str) -> None:
    job = write_job(tmp_path, [good_corpus])
    assert cli.main(["validate", "--job", str(job)]) == 0
    result = tpu_payload("validate", "--job", str(job))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["data"]["max_predictions"] == 8
    assert resolved["output"] == str(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # validate writes nothing


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"bogus": 1}, r"^error: bogus: unknown key"),
        ({"train__steps": -3}, r"^error: train\.steps: -3 is too small \(minimum 1\)$"),
        (
            {"data__seq_length": 1024},
            r"^error: data\.seq_length: 1024 is longer than the bert model",
        ),
        ({"tokenizer__vocab_size": 20}, r"^error: tokenizer\.vocab_size: 20 is too small"),
    ],
)
def test_bad_spec_values(tmp_path: Path, good_corpus: str, overrides, pattern: str) -> None:
    job = write_job(tmp_path, [good_corpus], **overrides)
    assert_user_error(tpu_payload("run", "--job", str(job)), pattern)
    assert not (tmp_path / "out").exists()


def test_missing_job_file(tmp_path: Path) -> None:
    assert_user_error(
        tpu_payload("run", "--job", str(tmp_path / "nope.yaml")), "job spec not found"
    )


@pytest.mark.parametrize(
    ("setup", "pattern"),
    [
        ("empty", r"^error: corpus has no text"),
        ("missing", r"^error: corpus\.paths\[0\]: no such file or directory: .*nope\.txt$"),
        ("unmatched", r"^error: corpus\.paths\[0\]: pattern .*\*\.md matched no files$"),
        ("binary-skip", r"^error: corpus has no text: .*\(1 binary or corrupt \.gz files and 0"),
        ("binary-fail", r"^error: .*blob\.bin looks binary"),
        ("tiny-vocab", r"^error: tokenizer\.vocab_size: 105 is too small for this corpus"),
    ],
)
def test_bad_corpus_through_cli(tmp_path: Path, setup: str, pattern: str) -> None:
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    overrides: dict = {}
    if setup == "empty":
        (corpus_dir / "empty.txt").write_text("\n \n\n")
        paths = [str(corpus_dir / "empty.txt")]
    elif setup == "missing":
        paths = [str(corpus_dir / "nope.txt")]
    elif setup == "unmatched":
        paths = [str(corpus_dir / "*.md")]
    elif setup.startswith("binary"):
        (corpus_dir / "blob.bin").write_bytes(os.urandom(4096) + b"\x00" * 16)
        paths = [str(corpus_dir)]
        if setup == "binary-fail":
            overrides["corpus__on_bad_input"] = "fail"
    else:
        (corpus_dir / "hangul.txt").write_text(
            " ".join(chr(0xAC00 + 5 * i) for i in range(600)), encoding="utf-8"
        )
        paths = [str(corpus_dir / "hangul.txt")]
        overrides["tokenizer__vocab_size"] = 105
    job = write_job(tmp_path, paths, **overrides)
    # `run` stops in the tokenizer stage without importing TensorFlow (seconds of start-up
    # before the error: the once-only log absorption waits for the train stage).
    result = tpu_payload("run", "--job", str(job), env=tensorflow_env("watch"))
    assert IMPORTED not in result.stderr, result.stderr
    line = assert_user_error(result, pattern)
    assert_nothing_complete(tmp_path / "out")
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["stage"] == "tokenizer"
    assert status["last_error"]["error"] == line.removeprefix("error: ")


def test_encode_before_tokenizer_and_stale_data(tmp_path: Path, good_corpus: str) -> None:
    job = write_job(tmp_path, [good_corpus])
    assert_user_error(tpu_payload("encode", "--job", str(job)), r"no tokenizer\.json")
    assert_nothing_complete(tmp_path / "out")


def test_stages_skip_when_complete_and_force_redoes(tmp_path: Path, good_corpus: str) -> None:
    job = write_job(tmp_path, [good_corpus])
    first = tpu_payload("tokenizer", "--job", str(job))
    assert first.returncode == 0, first.stderr
    assert "tokenizer: complete" in first.stdout
    assert str(tmp_path / "out" / "tokenizer") in first.stdout
    second = tpu_payload("tokenizer", "--job", str(job))
    assert "tokenizer: skipped: complete" in second.stdout

    encoded = tpu_payload("encode", "--job", str(job))
    assert encoded.returncode == 0, encoded.stderr
    assert str(tmp_path / "out" / "data" / "manifest.json") in encoded.stdout
    manifest = mf.load_manifest(str(tmp_path / "out" / "data"))
    assert "skipped: complete" in tpu_payload("encode", "--job", str(job)).stdout

    # --force rebuilds the data (a new manifest replaces the old one only through deletion).
    forced = tpu_payload("encode", "--job", str(job), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "encode: complete" in forced.stdout
    assert mf.load_manifest(str(tmp_path / "out" / "data")) == manifest

    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["stages"]["tokenizer"]["state"] in ("complete", "skipped")
    assert status["stages"]["encode"]["state"] == "complete"


@pytest.mark.emulator
def test_end_to_end_encode_to_gcs(gcs_root: str, tmp_path: Path) -> None:
    """`tpu-payload` with corpus, job spec and output all on gs:// (the emulator).

    Training is not part of this test: TensorFlow's own gs:// filesystem cannot be pointed
    at an emulator, so `train` is tested on local paths only.
    """
    storage.upload_file(str(EXAMPLES / "corpus" / "mixed.txt"), f"{gcs_root}/corpus/mixed.txt")
    spec_uri = f"{gcs_root}/jobs/job.yaml"
    local = write_job(tmp_path, [f"{gcs_root}/corpus/*.txt"], output=f"{gcs_root}/runs/cli")
    storage.upload_file(str(local), spec_uri)

    for stage in ("tokenizer", "encode"):
        result = tpu_payload(stage, "--job", spec_uri)
        assert result.returncode == 0, result.stderr
        assert f"{gcs_root}/runs/cli/" in result.stdout

    data_dir = f"{gcs_root}/runs/cli/data"
    manifest = mf.load_manifest(data_dir)
    mf.verify_shards(data_dir, manifest)
    assert manifest.total_records > 50
    assert storage.exists(f"{gcs_root}/runs/cli/tokenizer/tokenizer.json")
    status = json.loads(storage.read_text(f"{gcs_root}/runs/cli/status.json"))
    assert status["stages"]["encode"]["state"] == "complete"

    # A finished manifest in the bucket is never overwritten: the create-only precondition
    # refuses a second writer even if it bypasses the "complete" check.
    with pytest.raises(DataError, match="never overwritten"):
        mf.write_manifest(data_dir, manifest)
    again = tpu_payload("encode", "--job", spec_uri)
    assert "encode: skipped: complete" in again.stdout


def test_the_host_checks_of_the_startup_script_reach_status_json(
    tmp_path: Path, good_corpus: str
) -> None:
    """A VM's startup script writes its mismatches with the catalog to the file named by
    TPU_PRETRAIN_HOST_FACTS (infra/render/templates/facts.sh); a stage run on that VM carries them
    into status.json and its log, and still runs."""
    job = write_job(tmp_path, good_corpus)
    facts = tmp_path / "host-facts.json"
    line = "catalog says python 3.10 on v2-alpha-tpuv6e; this VM has 3.12"
    facts.write_text(json.dumps({"facts": {"python": "3.12"}, "mismatches": [line]}))
    result = tpu_payload(
        "tokenizer", "--job", str(job), env={"TPU_PRETRAIN_HOST_FACTS": str(facts)}
    )
    assert result.returncode == 0, result.stderr
    assert f"host check: {line}" in result.stderr
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["host_checks"] == [line]
    assert status["stages"]["tokenizer"]["state"] == "complete"

    # A host without mismatches clears the note; an unreadable file is reported, not fatal.
    facts.write_text(json.dumps({"mismatches": []}))
    again = tpu_payload("tokenizer", "--job", str(job), env={"TPU_PRETRAIN_HOST_FACTS": str(facts)})
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "out" / "status.json").read_text())["host_checks"] == []
    facts.write_text("{not json")
    broken = tpu_payload(
        "tokenizer", "--job", str(job), env={"TPU_PRETRAIN_HOST_FACTS": str(facts)}
    )
    assert broken.returncode == 0, broken.stderr
    [note] = json.loads((tmp_path / "out" / "status.json").read_text())["host_checks"]
    assert note.startswith(f"the host check's facts {facts} could not be read: ")
