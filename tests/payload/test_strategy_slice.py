"""Multi-host TPU slice rules of strategy.py that run without a TPU.

What the environment must say (TPU_NAME, TPU_LOAD_LIBRARY, TPU_ZONE, TPU_PROJECT), the
resolver TensorFlow builds from explicit worker endpoints (no Cloud API call), the
global-batch rule, and the gs:// rule, through the real CLI where a user meets it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
import yaml
from train_helpers import job_document, write_corpus

from payload import strategy
from payload.errors import SpecError

ENDPOINTS = "grpc://10.130.0.2:8470,grpc://10.130.0.3:8470,grpc://10.130.0.4:8470"
API_CLIENT_INSTALLED = all(
    importlib.util.find_spec(m) is not None for m in ("googleapiclient", "oauth2client")
)


@pytest.mark.parametrize("name", [None, "", "local", " local "])
def test_one_host_is_no_slice(name: str | None) -> None:
    environ = {} if name is None else {"TPU_NAME": name}
    assert strategy.slice_target(environ) is None


def test_slice_from_endpoints() -> None:
    target = strategy.slice_target(
        {"TPU_NAME": ENDPOINTS, "TPU_LOAD_LIBRARY": "0", "TPU_ZONE": "us-central2-b"}
    )
    assert target == strategy.SliceTarget(tpu=ENDPOINTS, zone="us-central2-b", project=None)
    assert target.endpoints == tuple(ENDPOINTS.split(","))
    # TensorFlow's own resolver, built for real: explicit endpoints need no API and no
    # metadata server, and become the "worker" job in worker order.
    resolver = strategy.tpu_resolver(target)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["10.130.0.2:8470", "10.130.0.3:8470", "10.130.0.4:8470"]
    }


@pytest.mark.skipif(API_CLIENT_INSTALLED, reason="the Cloud TPU API client is installed")
def test_node_name_without_the_api_client_is_one_line() -> None:
    environ = {"TPU_NAME": "bert-v4-32", "TPU_LOAD_LIBRARY": "0"}
    with pytest.raises(SpecError, match=r"needs googleapiclient, oauth2client .*grpc://IP0:8470"):
        strategy.slice_target(environ)


@pytest.mark.parametrize(
    ("environ", "pattern"),
    [
        ({"TPU_NAME": ENDPOINTS}, r"needs TPU_LOAD_LIBRARY=0, got None"),
        ({"TPU_NAME": ENDPOINTS, "TPU_LOAD_LIBRARY": "1"}, r"needs TPU_LOAD_LIBRARY=0, got '1'"),
        ({"TPU_NAME": "My_Slice", "TPU_LOAD_LIBRARY": "0"}, r"'My_Slice' is not a TPU node name"),
        (
            {"TPU_NAME": "grpc://10.0.0.2:8470,10.0.0.3:8470", "TPU_LOAD_LIBRARY": "0"},
            r"'10.0.0.3:8470' is not a TPU worker endpoint",
        ),
        (
            {
                "TPU_NAME": ENDPOINTS,
                "TPU_LOAD_LIBRARY": "0",
                "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/opt/venv/lib/libtpu/libtpu.so",
            },
            r"needs TF_PLUGGABLE_DEVICE_LIBRARY_PATH unset",
        ),
        (
            {"TPU_NAME": ENDPOINTS, "TPU_LOAD_LIBRARY": "0", "TPU_ZONE": "us-central2"},
            r"TPU_ZONE: 'us-central2' is not a zone",
        ),
        (
            {"TPU_NAME": ENDPOINTS, "TPU_LOAD_LIBRARY": "0", "TPU_PROJECT": "Bad Project"},
            r"TPU_PROJECT: 'Bad Project' is not a project id",
        ),
    ],
)
def test_bad_slice_environment(environ: dict[str, str], pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern) as caught:
        strategy.slice_target(environ)
    assert "\n" not in str(caught.value)


def test_global_batch_must_split_over_replicas() -> None:
    runtime = strategy.Runtime(strategy.decide("cpu", "fp32"), tf.distribute.get_strategy())
    assert (runtime.num_hosts, runtime.num_replicas, runtime.is_chief) == (1, 1, True)
    strategy.check_global_batch(7, runtime)  # anything splits over one replica


def test_slice_paths_must_be_gs() -> None:
    target = strategy.SliceTarget(tpu=ENDPOINTS)
    strategy.require_shared_paths({"output": "/tmp/out"}, None)  # one host: anything goes
    strategy.require_shared_paths({"output": "gs://b/runs/x", "data": "gs://b/d"}, target)
    with pytest.raises(SpecError, match=r"output: '/tmp/out' is a local path.*gs://"):
        strategy.require_shared_paths({"output": "/tmp/out"}, target)


def _cli(job: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payload", "train", "--job", str(job)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
    )


def test_cli_refuses_a_slice_it_cannot_serve(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=20)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_document(tmp_path, corpus)))
    # Without TPU_LOAD_LIBRARY=0 (checked before anything else), then a local output.
    no_flag = _cli(job, TPU_NAME=ENDPOINTS)
    local = _cli(job, TPU_NAME=ENDPOINTS, TPU_LOAD_LIBRARY="0")
    for result, pattern in ((no_flag, "needs TPU_LOAD_LIBRARY=0"), (local, "is a local path")):
        assert result.returncode == 2, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and pattern in last, result.stderr[-2000:]
    assert not (tmp_path / "out" / "checkpoints").exists()
