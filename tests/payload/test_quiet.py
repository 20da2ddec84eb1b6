"""Quiet by default: the real CLI prints only its own lines; --verbose shows the frameworks'.

The CLI runs here with the caller's environment minus every variable that changes the
frameworks' logging (the other CLI tests set TF_CPP_MIN_LOG_LEVEL=3; this one must see the
default a user gets).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import assert_user_error, job_document, run_cli, write_corpus, write_job

from payload.backends import quiet

ROOT = Path(__file__).resolve().parents[2]

# Every line the CLI itself prints, on stdout or stderr (a progress bar's redraws, split at
# "\r", count as lines). The one list of what a user may see from a quiet run.
CLI_LINES = [
    re.compile(pattern)
    for pattern in (
        r"(tokenizer|encode|train|export): (complete \(.*\)|skipped: complete)",  # stage ends
        r"  (tokenizer|data|manifest|checkpoints|tensorboard|export): /\S+.*",  # outputs
        r"status: /\S+",
        r"tokenizer: reading \d+ files: +\d+%\|.*",  # progress bars
        r"encode: +\d+%\|.*",
        r"train: \{.*\}",  # the runtime plan
        r"strategy: .*",
        r"step \d+/\d+  loss \d.*",
        r"eval step \d+/\d+  loss \d.*",
        r"(error|warning): .*",
        r"tpu-pretrain event: \{.*\}",  # the run's events (payload/core/events.py emit)
    )
]
LOGGING_VARIABLES = (
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL",
    "TF_CPP_VMODULE",
    "TRANSFORMERS_VERBOSITY",
    quiet.VERBOSE_ENV,
)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in LOGGING_VARIABLES}
    return subprocess.run(
        [sys.executable, "-m", "payload", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**base, **env},
    )


def _foreign_lines(output: str) -> list[str]:
    lines = (line.strip("\n") for line in re.split(r"[\r\n]", output))
    return [line for line in lines if line and not any(p.fullmatch(line) for p in CLI_LINES)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`tpu-payload run` of a tiny BERT: tokenizer, encode, train (XLA on CPU), eval, export."""
    root = tmp_path_factory.mktemp("quiet")
    corpus = write_corpus(root / "corpus.txt", lines=300)
    document = job_document(root, corpus, steps=4, warmup_steps=1, checkpoint_every=4, log_every=2)
    job = write_job(root, document)
    return Path(job.source), _cli("run", "--job", job.source)


@pytest.mark.slow
def test_a_quiet_run_prints_only_the_clis_own_lines(finished_run):
    _, result = finished_run
    assert result.returncode == 0, result.stderr
    assert "train: complete (" in result.stdout and "eval step 4/4" in result.stderr
    assert _foreign_lines(result.stdout) == []
    assert _foreign_lines(result.stderr) == []


@pytest.mark.slow
def test_verbose_shows_the_frameworks_logs(finished_run):
    """Training again (4 steps): TensorFlow's and XLA's own log lines come through."""
    job, _ = finished_run
    result = _cli("train", "--job", str(job), "--force", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "train: complete (" in result.stdout
    foreign = _foreign_lines(result.stderr)
    assert any(quiet.FRAMEWORK_LINE.match(line) for line in foreign), result.stderr


@pytest.mark.parametrize(
    ("flag", "environ", "verbose"),
    [(True, {}, True), (False, {quiet.VERBOSE_ENV: "1"}, True), (False, {}, False),
     (False, {quiet.VERBOSE_ENV: "0"}, False)],
)  # fmt: skip
def test_the_verbose_variable_is_the_flag(flag, environ, verbose):
    """TPU_PAYLOAD_VERBOSE=1 asks for what --verbose asks for (the CLI reads both through
    quiet.configure, before anything imports TensorFlow): the frameworks' logs, i.e. no quiet
    TF_CPP_MIN_LOG_LEVEL default."""
    environ = dict(environ)
    assert quiet.configure(flag, environ) is verbose
    assert ("TF_CPP_MIN_LOG_LEVEL" in environ) is not verbose


def test_a_bad_verbose_variable_is_a_user_error(tmp_path):
    job = write_job(tmp_path, job_document(tmp_path, write_corpus(tmp_path / "c.txt", 20)))
    result = run_cli("validate", "--job", job.source, env={quiet.VERBOSE_ENV: "yes"})
    assert_user_error(result, r"^error: TPU_PAYLOAD_VERBOSE: 'yes' must be 1 .* or 0 / unset$")


# Lines measured from TensorFlow 2.20 on a CPU-only machine (`make demo`, verbose).
FRAMEWORK_SAMPLES = [
    "2026-11-23 19:24:37.397764: E external/local_xla/xla/stream_executor/cuda/"
    "cuda_platform.cc:51] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: "
    "UNKNOWN ERROR (303)",
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795461877.705283   11436 device_compiler.h:196] Compiled cluster using XLA!  "
    "This line is logged at most once for the lifetime of the process.",
    "2026-11-23 19:25:21.695143: W tensorflow/compiler/tf2xla/kernels/assert_op.cc:39] "
    "Ignoring Assert operator bert/embeddings/assert_less/Assert/Assert",
]
KEPT_SAMPLES = [
    "Traceback (most recent call last):",
    "2026-11-23 19:25:21.695143: F tensorflow/core/framework/tensor.cc:1] Check failed",
    "train: complete (step=10, loss=3.841)",
]


def test_the_framework_line_pattern_drops_logs_and_keeps_everything_else():
    assert all(quiet.FRAMEWORK_LINE.match(line) for line in FRAMEWORK_SAMPLES)
    assert not any(quiet.FRAMEWORK_LINE.match(line) for line in KEPT_SAMPLES)


def test_the_captured_window_writes_back_all_but_framework_lines_also_on_error(capfd):
    with pytest.raises(RuntimeError, match="a bug"), quiet.framework_lines_dropped():
        for line in FRAMEWORK_SAMPLES + KEPT_SAMPLES:
            os.write(2, (line + "\n").encode())
        raise RuntimeError("a bug")
    assert capfd.readouterr().err.splitlines() == KEPT_SAMPLES


def test_the_vms_units_run_the_cli_verbose():
    """The journals keep everything: each systemd unit that runs tpu-payload sets it."""
    units = []
    for template in ("tpu.sh", "controller.sh"):
        text = (ROOT / "infra/render/templates" / template).read_text()
        for unit in re.split(r"\binstall_unit ", text)[1:]:
            if "/bin/tpu-payload " in unit:
                units.append(unit.split("\n", 1)[0])
                assert f"\nEnvironment={quiet.VERBOSE_ENV}=1\n" in unit, unit[:80]
    assert len(units) == 2, units
