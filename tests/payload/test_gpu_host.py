"""The GPU VM rules of payload/backends/tf/strategy.py that a CPU machine can check for real: a
host the trainer unit declares a GPU VM (infra/render/templates/gpu.sh) without a GPU fails
with one line and exit 2 instead of training on its CPU, and precision `auto` follows the
GPU's catalog policy (the multi-replica GPU plan itself runs in test_train_replicas.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import (
    assert_user_error,
    job_document,
    prepare_data,
    run_cli,
    write_corpus,
    write_job,
)

from payload.backends.tf import strategy as strategy_lib
from payload.core.errors import UserError


@pytest.mark.parametrize(
    ("precision", "gpu_policy", "policy"),
    [
        ("auto", "mixed_bfloat16", "mixed_bfloat16"),  # A100, L4, H100
        ("auto", "mixed_float16", "mixed_float16"),  # T4, V100: float16 + loss scaling
        ("auto", "float32", "float32"),  # P100, P4: no Tensor Cores
        ("auto", "", "float32"),  # a GPU nobody declared
        ("fp32", "mixed_bfloat16", "float32"),
        ("bf16", "mixed_float16", "mixed_bfloat16"),  # asked for explicitly
    ],
)
def test_gpu_precision_follows_the_catalog(precision, gpu_policy, policy):
    plan = strategy_lib.decide("gpu", precision, gpu_policy=gpu_policy)
    assert plan.policy == policy
    assert plan.loss_scaling == (policy == "mixed_float16")
    assert plan.jit_compile  # XLA on GPU
    # The policy is only for GPUs: a TPU and a CPU keep their rules.
    assert strategy_lib.decide("cpu", "auto", gpu_policy=gpu_policy).policy == "float32"
    assert strategy_lib.decide("tpu", "auto", gpu_policy=gpu_policy).policy == "mixed_bfloat16"


def test_a_declared_gpu_vm_without_a_gpu_refuses_to_train_on_the_cpu():
    strategy_lib.expect_gpu(strategy_lib.GpuHost("T4", 1, "mixed_float16", "dlvm-image"))
    try:
        with pytest.raises(strategy_lib.GpuNotFoundError) as caught:
            strategy_lib.setup("auto")
    finally:
        strategy_lib.expect_gpu(None)
    assert isinstance(caught.value, UserError)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "GPU not found: this VM should have 1 × T4 (image dlvm-image) but TensorFlow "
    )
    assert "not training on the host CPU" in message
    assert strategy_lib.detect() == "cpu"


GPU_ENV = {
    "TPU_PRETRAIN_GPU": "L4",
    "TPU_PRETRAIN_GPU_COUNT": "2",
    "TPU_PRETRAIN_GPU_PRECISION": "mixed_bfloat16",
    "TPU_PRETRAIN_RUNTIME_VERSION": "common-cu128-ubuntu-2204-nvidia-570",
}


def test_the_cli_on_a_gpu_vm_without_gpus_exits_2_and_says_so_in_the_status(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=200)
    job = write_job(tmp_path, job_document(tmp_path, corpus, "mlm", steps=2, warmup_steps=1))
    prepare_data(job)
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env=GPU_ENV)
    line = assert_user_error(result, r"^error: GPU not found: this VM should have 2 × L4 ")
    status = json.loads(Path(job.paths.status).read_text())
    assert status["last_error"]["error"] == line.removeprefix("error: ")


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"TPU_PRETRAIN_GPU_COUNT": "two"}, r"TPU_PRETRAIN_GPU_COUNT: 'two' must be a positive"),
        (
            {"TPU_PRETRAIN_GPU_PRECISION": "fp8"},
            r"TPU_PRETRAIN_GPU_PRECISION: 'fp8' must be mixed_bfloat16, mixed_float16 or float32",
        ),
    ],
)
def test_a_bad_gpu_unit_environment_is_a_user_error(tmp_path: Path, env, pattern):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    write_job(tmp_path, job_document(tmp_path, corpus, "mlm", steps=2, warmup_steps=1))
    result = run_cli("train", "--job", str(tmp_path / "job.yaml"), env=GPU_ENV | env)
    assert_user_error(result, pattern)
