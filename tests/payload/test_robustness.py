"""Inputs a user can get wrong or that occur in real dumps: each ends in a clear answer.

Pathological words, corrupt .gz files, bad output paths, bad buckets and credentials,
Ctrl-C, and interrupted checkpoint writes. Real tokenizers, real files, real processes,
and a real fake-gcs-server (or a dead endpoint on 127.0.0.1) for storage.
"""

from __future__ import annotations

import contextlib
import gzip
import http.server
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from train_helpers import PausedCli, assert_user_error
from train_helpers import run_cli as tpu_payload

from payload import spec
from payload.core.errors import TRANSIENT_EXIT, DataError
from payload.core.status import StatusWriter
from payload.data import tokenizer
from payload.data.encode import stage as encode
from payload.schema import manifest as mf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


CLI_TIMEOUT_S = 300


def write_job(tmp_path: Path, paths: list[str], **sections: dict) -> Path:
    doc: dict = {
        "name": "robust",
        "output": str(tmp_path / "out"),
        "corpus": {"paths": paths},
        "tokenizer": {"kind": "wordpiece", "vocab_size": 1200},
        "data": {"objective": "mlm", "seq_length": 32, "records_per_shard": 100},
        "model": {"family": "bert"},
        "train": {"steps": 2},
    }
    for section, values in sections.items():
        if isinstance(doc.get(section), dict):
            doc[section].update(values)
        else:
            doc[section] = values
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path


def job_for(tmp_path: Path, paths: list[str], **sections: dict) -> spec.JobSpec:
    return spec.load_job(str(write_job(tmp_path, paths, **sections)))


def corpus_text() -> str:
    return (EXAMPLES / "corpus" / "mixed.txt").read_text(encoding="utf-8")[:40_000]


# --------------------------------------------------------------------------- long words


def _letters(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", k=n))


@pytest.mark.parametrize(
    ("kind", "family", "expected"),
    # 3 runs of 250 letters are too long for every kind; 40 Hangul syllables are 120 UTF-8
    # bytes, too long only for byte-level BPE, whose limit counts bytes.
    [("wordpiece", "bert", 3), ("bpe", "roberta", 4), ("unigram", "roberta", 3)],
)
def test_long_words_are_cut_in_training_and_encoding(
    tmp_path: Path, kind: str, family: str, expected: int
) -> None:
    text = (EXAMPLES / "corpus" / "mixed.txt").read_text(encoding="utf-8")[:40_000]
    hangul = "".join(chr(0xAC00 + 7 * i) for i in range(40))
    odd = (
        f"{_letters(250, 1)} and {_letters(99, 2)} then {_letters(250, 3)}\n"
        f"{hangul} {_letters(250, 4)}\n"
    )
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(text + "\n\n" + odd + "\n\n" + text[:2000], encoding="utf-8")
    job = job_for(
        tmp_path,
        [str(corpus_file)],
        tokenizer={"kind": kind, "max_word_length": 100},
        model={"family": family},
    )
    status = StatusWriter(job.paths.status, job.name, min_interval_s=0)
    tokenizer.train_tokenizer(job, status)
    stage = json.loads(Path(job.paths.tokenizer, "stage.json").read_text())
    assert stage["corpus"]["long_words"] == expected

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(job.paths.tokenizer, "tokenizer.json")))
    assert tokenizer.max_word_length_of(tok) == 100
    words = tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(odd))
    assert max(len(word) for word, _ in words) <= 100
    limit = tokenizer.WordLimit(tok)
    assert limit.count([odd]) == expected
    # Documents without a long run skip the cut; the ids are the full tokenizer's all the same.
    docs = [*text.split("\n\n"), odd, f"x {hangul}{hangul} y", " " * 300 + "z"]
    encodings, cut = limit.encode(docs)
    full = tok.encode_batch_fast(docs, add_special_tokens=False)
    assert [e.ids for e in encodings] == [e.ids for e in full]
    assert cut == limit.count(docs) >= expected
    if kind == "bpe":  # byte-level: nothing is lost, the cut pieces decode back to the text
        assert tok.decode(tok.encode(odd).ids) == odd

    manifest = encode.encode(job, status)
    assert manifest.corpus["long_words"] == expected
    assert manifest.corpus["max_word_length"] == 100
    assert mf.load_manifest(job.paths.data).corpus["long_words"] == expected


def test_encode_refuses_a_tokenizer_trained_with_another_limit(tmp_path: Path) -> None:
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(corpus_text(), encoding="utf-8")
    job = job_for(tmp_path, [str(corpus_file)], tokenizer={"max_word_length": 100})
    status = StatusWriter(job.paths.status, job.name, min_interval_s=0)
    tokenizer.train_tokenizer(job, status)
    other = job_for(tmp_path, [str(corpus_file)], tokenizer={"max_word_length": 50})
    with pytest.raises(
        DataError, match=r"trained with max_word_length 100 \(job: tokenizer\.max_word_length=50\)"
    ):
        encode.encode(other, status)
    assert not Path(job.paths.data, "manifest.json").exists()


# --------------------------------------------------------------------------- corrupt .gz


def _bad_gzips(corpus_dir: Path) -> None:
    whole = gzip.compress(corpus_text().encode("utf-8"))
    (corpus_dir / "truncated.txt.gz").write_bytes(whole[: len(whole) // 2])
    (corpus_dir / "plain.txt.gz").write_text("this was never compressed\n")


def test_corrupt_gzip_is_skipped_and_counted(tmp_path: Path) -> None:
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "good.txt.gz").write_bytes(gzip.compress(corpus_text().encode("utf-8")))
    _bad_gzips(corpus_dir)
    job = write_job(tmp_path, [str(corpus_dir)])
    for stage in ("tokenizer", "encode"):
        result = tpu_payload(stage, "--job", str(job))
        assert result.returncode == 0, result.stderr
    manifest = mf.load_manifest(str(tmp_path / "out" / "data"))
    assert manifest.corpus["skipped_files"] == 2
    assert manifest.corpus["files"] == 1


def test_corrupt_gzip_fails_with_one_line(tmp_path: Path) -> None:
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "a-good.txt").write_text(corpus_text(), encoding="utf-8")
    _bad_gzips(corpus_dir)
    job = write_job(tmp_path, [str(corpus_dir)], corpus={"on_bad_input": "fail"})
    assert_user_error(
        tpu_payload("tokenizer", "--job", str(job)),
        r"^error: .*plain\.txt\.gz is not a readable gzip file \(Not a gzipped file",
    )
    (corpus_dir / "plain.txt.gz").unlink()
    assert_user_error(
        tpu_payload("run", "--job", str(job)),
        r"^error: .*truncated\.txt\.gz is not a readable gzip file \(Compressed file ended",
    )
    assert not (tmp_path / "out" / "tokenizer" / "tokenizer.json").exists()


# --------------------------------------------------------------------------- output paths


def _as_unprivileged() -> list[str]:
    """A command prefix under which permission bits apply (root ignores them otherwise)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: permission bits cannot be tested")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("case", ["below-file", "is-file", "unwritable"])
def test_bad_output_path_is_one_line_before_any_stage(tmp_path: Path, case: str) -> None:
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(corpus_text(), encoding="utf-8")
    blocker = tmp_path / "blocker"
    prefix: list[str] = []
    if case == "below-file":
        blocker.write_text("a regular file\n")
        output, pattern = blocker / "runs" / "x", r"is below .*blocker, which is a file"
    elif case == "is-file":
        blocker.write_text("a regular file\n")
        output, pattern = blocker, r"blocker is a file; output must be a directory"
    else:
        blocker.mkdir()
        blocker.chmod(0o555)
        output, pattern = blocker / "run", r"cannot write to .*blocker/run \(Permission denied\)"
        prefix = _as_unprivileged()
    job = write_job(tmp_path, [str(corpus_file)], output=str(output))
    result = subprocess.run(
        [*prefix, sys.executable, "-m", "payload", "run", "--job", str(job)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert_user_error(result, rf"^error: output: .*{pattern}")
    assert "status" not in result.stdout
    if case == "unwritable":
        assert list(blocker.iterdir()) == []


# --------------------------------------------------------------------------- bucket names


@pytest.mark.parametrize(
    ("bucket", "problem"),
    [
        ("ab", "must be 3-63 characters"),
        ("a" * 64, "must be 3-63 characters"),
        ("My-Bucket", "may hold only a-z"),
        ("bucket-", "must start and end"),
        ("b..c", r"may not contain '\.\.'"),
        ("192.168.5.4", "may not be an IP address"),
        ("goog-data", "may not start with 'goog'"),
        ("my-g00gle-data", "may not contain 'google'"),
        ("a." + "b" * 64, "each dot-separated part"),
    ],
)
def test_bad_bucket_names_are_refused_by_validate(
    tmp_path: Path, bucket: str, problem: str
) -> None:
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output=f"gs://{bucket}/runs/x")
    with pytest.raises(spec.SpecError, match=rf"^output: .*{problem}"):
        spec.load_job(str(job))
    job = write_job(tmp_path, [f"gs://{bucket}/corpus/*.txt"])
    with pytest.raises(spec.SpecError, match=rf"^corpus\.paths\[0\]: .*{problem}"):
        spec.load_job(str(job))


def test_bad_bucket_name_through_cli(tmp_path: Path) -> None:
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output="gs://Bad_Bucket/runs/x")
    assert_user_error(
        tpu_payload("validate", "--job", str(job)),
        r"^error: output: 'gs://Bad_Bucket/runs/x': bucket name 'Bad_Bucket' may hold only",
    )


def test_good_bucket_names_pass() -> None:
    from payload.core import storage

    for name in ("tpu-pretrain_data-1", "a.b.c", "x" * 63, ".".join(["y" * 63] * 3)):
        assert storage.bucket_name_problem(name) is None, name


# --------------------------------------------------------------------------- buckets, credentials


class _FixedReply(http.server.BaseHTTPRequestHandler):
    """Answers every request with one status and JSON body, like a refusing Google endpoint."""

    status = 403
    body: ClassVar[dict] = {}

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        payload = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _reply  # noqa: N815  (http.server's names)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def fixed_reply_server(status: int, body: dict) -> Iterator[str]:
    handler = type("Handler", (_FixedReply,), {"status": status, "body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _without_emulator() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}


def _run_bounded(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payload", *args],
        capture_output=True,
        text=True,
        timeout=120,  # the stage must give up on its own well before this
        check=False,
        env={**env, "TF_CPP_MIN_LOG_LEVEL": "3", "TPU_PAYLOAD_GCS_RETRY_S": "2"},
    )


@pytest.mark.emulator
def test_missing_bucket_is_one_line(gcs_emulator: str, tmp_path: Path) -> None:
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(corpus_text(), encoding="utf-8")
    missing = f"no-such-bucket-{os.getpid()}"
    job = write_job(tmp_path, [str(corpus_file)], output=f"gs://{missing}/runs/x")
    assert_user_error(
        tpu_payload("tokenizer", "--job", str(job)),
        rf"^error: gs://{missing}: the bucket does not exist: check its name and project$",
    )
    job = write_job(tmp_path, [f"gs://{missing}/corpus/"])
    assert_user_error(
        tpu_payload("tokenizer", "--job", str(job)), rf"^error: gs://{missing}: the bucket does not"
    )
    assert not (tmp_path / "out" / "tokenizer" / "tokenizer.json").exists()
    assert_user_error(
        tpu_payload("validate", "--job", f"gs://{missing}/jobs/job.yaml"),
        rf"^error: gs://{missing}: the bucket does not exist",
    )


def _assert_transient(result: subprocess.CompletedProcess[str], pattern: str) -> str:
    """A transient failure: exit 75 (errors.TRANSIENT_EXIT, which the units restart; 2 would
    stop them for good), no traceback, exactly one `error:` line matching `pattern`."""
    assert result.returncode == TRANSIENT_EXIT, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), result.stderr
    return lines[0]


def test_unreachable_endpoint_gives_up_with_one_line(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output="gs://some-bucket/runs/x")
    result = _run_bounded(
        ["tokenizer", "--job", str(job)], {**os.environ, "STORAGE_EMULATOR_HOST": endpoint}
    )
    _assert_transient(
        result,
        rf"^error: gs://some-bucket: cannot reach Cloud Storage at {endpoint} "
        r"\(after retrying for 2s\)",
    )


def test_cloud_storage_still_failing_after_its_retries_is_restarted_not_stopped(
    tmp_path: Path,
) -> None:
    """503 on every request: not the user's to fix (exit 2 would stop the unit for good)."""
    unavailable = {"error": {"code": 503, "message": "Backend Error"}}
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output="gs://busy-bucket/runs/x")
    with fixed_reply_server(503, unavailable) as endpoint:
        result = _run_bounded(
            ["encode", "--job", str(job)], {**os.environ, "STORAGE_EMULATOR_HOST": endpoint}
        )
    _assert_transient(
        result,
        rf"^error: gs://busy-bucket: cannot reach Cloud Storage at {endpoint} "
        r"\(after retrying for 2s\): .*Backend Error",
    )


def test_forbidden_bucket_names_the_role(tmp_path: Path) -> None:
    refusal = {
        "error": {
            "code": 403,
            "message": "tpu@p.iam.gserviceaccount.com does not have storage.objects.create "
            "access to the Google Cloud Storage object.",
        }
    }
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output="gs://locked-bucket/runs/x")
    with fixed_reply_server(403, refusal) as endpoint:
        result = _run_bounded(
            ["encode", "--job", str(job)], {**os.environ, "STORAGE_EMULATOR_HOST": endpoint}
        )
    assert_user_error(
        result,
        r"^error: gs://locked-bucket: permission denied \(after retrying for 2s\) "
        r"\(.*does not have storage\.objects\.create access.*\): the stack's accounts hold "
        r"roles/storage\.objectViewer and roles/storage\.objectUser on its bucket, .*: run "
        r"`pulumi up` to restore a missing grant; your own account needs "
        r"roles/storage\.objectUser on the bucket",
    )


def test_missing_credentials_say_how_to_log_in(tmp_path: Path) -> None:
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output="gs://some-bucket/runs/x")
    env = {**_without_emulator(), "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "nope.json")}
    assert_user_error(
        _run_bounded(["run", "--job", str(job)], env),
        r"^error: gs://some-bucket: no Google credentials found \(.*nope\.json.*\): "
        r"run `gcloud auth application-default login`",
    )


def _service_account_key(token_uri: str) -> dict[str, str]:
    """A well-formed key file for a service account that the token endpoint will refuse."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return {
        "type": "service_account",
        "project_id": "p",
        "private_key_id": "0" * 40,
        "private_key": pem,
        "client_email": "deleted@p.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }


def test_refused_credentials_say_how_to_log_in(tmp_path: Path) -> None:
    job = write_job(tmp_path, [str(tmp_path / "c.txt")], output="gs://some-bucket/runs/x")
    refusal = {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
    with fixed_reply_server(400, refusal) as token_endpoint:
        key = tmp_path / "key.json"
        key.write_text(json.dumps(_service_account_key(f"{token_endpoint}/token")))
        env = {**_without_emulator(), "GOOGLE_APPLICATION_CREDENTIALS": str(key)}
        result = _run_bounded(["run", "--job", str(job)], env)
    assert_user_error(
        result,
        r"^error: gs://some-bucket: the Google credentials were refused \(.*invalid_grant.*\): "
        r"run `gcloud auth application-default login`",
    )


# --------------------------------------------------------------------------- Ctrl-C


def _big_corpus(tmp_path: Path) -> Path:
    """About 3.5 MB: more than three of the reader's 1 MiB blocks."""
    corpus_file = tmp_path / "corpus.txt"
    text = (EXAMPLES / "corpus" / "mixed.txt").read_text(encoding="utf-8")
    corpus_file.write_text("\n\n".join([text] * 14), encoding="utf-8")
    return corpus_file


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _no_staging_left(out: Path) -> bool:
    return not (out / "data").exists() or not list((out / "data").glob(".staging-*"))


# Where each stage waits while the test interrupts it: before a later block of the corpus
# is read. The encoder has by then handed two 1 MiB chunks to its two workers.
MID_STAGE = {
    "tokenizer": "before:payload.data.readers:_read:2",
    "encode": "before:payload.data.readers:_read:3",
}


@pytest.mark.parametrize("stage", ["tokenizer", "encode"])
def test_ctrl_c_says_where_it_stopped_and_rerun_continues(tmp_path: Path, stage: str) -> None:
    job = write_job(tmp_path, [str(_big_corpus(tmp_path))], data={"workers": 2})
    if stage == "encode":
        assert tpu_payload("tokenizer", "--job", str(job)).returncode == 0
    with PausedCli(tmp_path / "logs", MID_STAGE[stage], stage, "--job", str(job)) as cli:
        cli.wait_paused()  # mid-read: the stage has read part of the corpus, not all of it
        cli.signal(signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        code, _, stderr = cli.finish()
    assert code == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert re.search(
        rf"^interrupted during {stage}( at \d+%)?; .*rerun `tpu-payload {stage} --job .*` to "
        "continue",
        stderr,
        re.MULTILINE,
    ), stderr
    out = tmp_path / "out"
    status = _status(out)
    assert status["state"] == "failed"
    assert status["last_error"]["error"].startswith(f"interrupted during {stage}")
    marker = out / ("tokenizer/tokenizer.json" if stage == "tokenizer" else "data/manifest.json")
    assert not marker.exists()
    assert _no_staging_left(out)

    again = tpu_payload(stage, "--job", str(job))
    assert again.returncode == 0, again.stderr
    assert marker.exists()


@pytest.mark.parametrize("command", ["tokenizer", "encode"])
def test_ctrl_c_while_the_process_exits_changes_nothing(tmp_path: Path, command: str) -> None:
    """The window that used to kill the process (exit -2): after main returned, while the
    interpreter unloads its modules with SIGINT back at its default action."""
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(corpus_text(), encoding="utf-8")
    job = write_job(tmp_path, [str(corpus_file)], data={"workers": 2})
    if command == "encode":
        assert tpu_payload("tokenizer", "--job", str(job)).returncode == 0
    with PausedCli(tmp_path / "logs", "exit", command, "--job", str(job)) as cli:
        cli.wait_paused()
        cli.signal(signal.SIGINT)
        code, stdout, stderr = cli.finish()
    assert code == 0, (code, stderr)  # -2 was death by SIGINT
    assert "interrupted" not in stderr and "Traceback" not in stderr, stderr
    assert f"{command}: complete" in stdout
    out = tmp_path / "out"
    status = _status(out)
    assert (status["stage"], status["state"], status["last_error"]) == (command, "complete", None)
    marker = out / ("tokenizer/tokenizer.json" if command == "tokenizer" else "data/manifest.json")
    assert marker.exists()
    assert _no_staging_left(out)


@pytest.mark.parametrize(
    ("command", "point", "expected_exit"),
    [
        ("tokenizer", "after:payload.data.tokenizer:_save:1", 0),
        ("encode", "after:payload.data.encode.local:_publish:1", 0),
        ("run", "after:payload.data.tokenizer:_save:1", 130),
    ],
)
def test_ctrl_c_after_the_output_is_complete(
    tmp_path: Path, command: str, point: str, expected_exit: int
) -> None:
    """Interrupted after the stage wrote its completion marker, before it returned: the
    stage is recorded complete (a single stage ends normally, `run` stops before the next)."""
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(corpus_text(), encoding="utf-8")
    job = write_job(tmp_path, [str(corpus_file)], data={"workers": 2})
    stage = "tokenizer" if command == "run" else command
    if stage == "encode":
        assert tpu_payload("tokenizer", "--job", str(job)).returncode == 0
    with PausedCli(tmp_path / "logs", point, command, "--job", str(job)) as cli:
        cli.wait_paused()
        cli.signal(signal.SIGINT)
        code, stdout, stderr = cli.finish()
    assert code == expected_exit, (code, stderr)
    assert "Traceback" not in stderr, stderr
    out = tmp_path / "out"
    status = _status(out)
    assert status["stages"][stage]["state"] == "complete"
    marker = out / ("tokenizer/tokenizer.json" if stage == "tokenizer" else "data/manifest.json")
    assert marker.exists()
    assert _no_staging_left(out)
    if command == "run":
        assert re.search(
            r"^interrupted during run after tokenizer completed; rerun `tpu-payload run --job "
            r".*` to continue",
            stderr,
            re.MULTILINE,
        ), stderr
        assert (status["stage"], status["state"]) == ("run", "failed")
        assert status["last_error"]["error"].startswith("interrupted during run after tokenizer")
        assert "encode" not in status["stages"]
        assert not (out / "data").exists()
    else:
        assert "interrupted" not in stderr, stderr
        assert f"{stage}: complete" in stdout
        assert (status["stage"], status["state"], status["last_error"]) == (
            stage,
            "complete",
            None,
        )


# --------------------------------------------------------------------------- checkpoint writes


def _interrupted_checkpoints(write: Callable[[str, bytes], None], root: str) -> None:
    write(f"{root}/checkpoint", b'model_checkpoint_path: "ckpt-2"\n')
    write(f"{root}/ckpt-2.index", b"index")
    write(f"{root}/ckpt-2.data-00000-of-00001", b"data")
    write(f"{root}/ckpt-3_temp/part-00000-of-00001.index", b"half")
    write(f"{root}/ckpt-3_temp/part-00000-of-00001.data-00000-of-00001", b"half")
    write(f"{root}/ckpt-4_temp/part-00000-of-00001.index", b"half")


def test_interrupted_checkpoint_writes_are_removed_locally(tmp_path: Path) -> None:
    import tensorflow as tf

    from payload.backends.tf import checkpoint
    from payload.core import storage

    root = str(tmp_path / "checkpoints")
    _interrupted_checkpoints(storage.write_bytes, root)
    model, optimizer = tf.Module(), tf.Module()
    model.w = tf.Variable([1.0, 2.0])
    optimizer.iterations = tf.Variable(2, dtype=tf.int64)
    _, manager = checkpoint.make_manager(model, optimizer, root, keep=3)  # cleans up first
    assert storage.listdir(root) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    assert manager.latest_checkpoint == str(Path(root, "ckpt-2"))


@pytest.mark.emulator
def test_interrupted_checkpoint_writes_are_removed_in_the_bucket(gcs_root: str) -> None:
    from payload.backends.tf import checkpoint
    from payload.core import storage

    root = f"{gcs_root}/runs/x/checkpoints"
    _interrupted_checkpoints(storage.write_bytes, root)
    removed = checkpoint.remove_interrupted_writes(root)
    assert removed == [f"{root}/ckpt-3_temp", f"{root}/ckpt-4_temp"]
    assert storage.listdir(root) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    assert checkpoint.remove_interrupted_writes(root) == []


# --------------------------------------------------------------------------- similar inputs


def test_unreadable_corpus_file_is_one_line(tmp_path: Path) -> None:
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(corpus_text(), encoding="utf-8")
    corpus_file.chmod(0o000)
    out = tmp_path / "out"
    out.mkdir()
    job = write_job(tmp_path, [str(corpus_file)])
    result = subprocess.run(
        [*_as_unprivileged(), sys.executable, "-m", "payload", "tokenizer", "--job", str(job)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert_user_error(result, r"^error: cannot read .*corpus\.txt: Permission denied$")
    assert not (out / "tokenizer" / "tokenizer.json").exists()


def test_unreadable_job_spec_is_one_line(tmp_path: Path) -> None:
    job = write_job(tmp_path, [str(tmp_path / "c.txt")])
    job.chmod(0o000)
    result = subprocess.run(
        [*_as_unprivileged(), sys.executable, "-m", "payload", "validate", "--job", str(job)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert_user_error(result, r"^error: cannot read job spec .*job\.yaml: Permission denied$")


def test_job_spec_uri_with_a_bad_bucket_name(tmp_path: Path) -> None:
    assert_user_error(
        tpu_payload("validate", "--job", "gs://Jobs_Bucket/jobs/x.yaml"),
        r"^error: --job: 'gs://Jobs_Bucket/jobs/x\.yaml': bucket name 'Jobs_Bucket' may hold",
    )
    assert_user_error(
        tpu_payload("validate", "--job", "gs:///x.yaml"),
        r"^error: --job: .*bucket name '' must be 3-63 characters",
    )
