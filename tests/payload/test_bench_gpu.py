"""bench/bench_gpu.py runs where TensorFlow is not installed (a GPU machine's preinstalled
JAX + PyTorch stack): our side of the benchmark, on a tiny Llama for 8 steps, with
`import tensorflow` made to fail in the bench and in its child processes (a sitecustomize
that sets sys.modules["tensorflow"] = None, on PYTHONPATH, which the children inherit).
Our side runs the trainer's own programs: the trainer's functions (train.py _runtime,
_build, _programs), given the job the bench's row records and a manifest of the bench's
data, lower programs of the same fingerprints (sha256 of the lowered text: attention,
donation, shardings, remat, steps per call and loss chunks all in it).
The PyTorch side needs torch and transformers 5, which this environment lacks: it is proven
by `--tiny` in a throwaway environment (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The trainer's own calls for a job (train.py _train: config_for, _runtime, _build, _programs)
# on the bench's data: a manifest of its vocabulary, special ids, sequence and held-out rows.
TRAINER = """
import json, sys
from types import SimpleNamespace
from payload.backends.jax import use_jax
use_jax()
from payload.model import configs
from payload.backends.jax import train as trainer
from payload.spec import parse_job
row = json.loads(sys.argv[1])
job = parse_job(row["job"], source=row["job"]["output"] + ".yaml")
manifest = SimpleNamespace(
    seq_length=job.data.seq_length, vocab_size=job.tokenizer.vocab_size,
    special_ids=json.loads(sys.argv[2]), eval_records=row["held_out_rows"],
)
config = configs.config_for(job, manifest)
rt = trainer._runtime(job, manifest, config)
trainer._build(job, config, manifest, rt)
print(json.dumps(trainer._programs(job, manifest, config, rt).fingerprints()))
"""


def test_our_side_runs_without_tensorflow(tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['tensorflow'] = None  # import tensorflow fails\n"
    )
    rows = tmp_path / "rows.json"
    path = os.pathsep.join([str(blocker), str(ROOT)])
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench/bench_gpu.py"), "--tiny", "--models", "125m",
         "--ours-only", "--steps", "8", "--eval-batches", "1", "--matmul", "256",
         "--json", str(rows)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "3"},
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(rows.read_text())
    assert row["side"] == "jax" and row["platform"] == "cpu" and row["steps"] == 8
    assert row["tokens_per_s"] > 0 and row["peak_memory"] > 0
    assert len(row["losses"]) == 8 and row["held_out"] > 0
    # The row says which attention ran (auto on a CPU: the reference) and what the compiled
    # chunk holds: no cuDNN call, the reference's float32 [B, K, G, S, S] scores.
    assert row["attention"]["implementation"] == "reference", row["attention"]
    assert row["attention"]["reason"].startswith("auto: cpu has no fused attention kernel")
    assert row["hlo"]["cudnn_calls"] == 0 and row["layers"] == 2, row
    assert any(s.endswith(",128,128]") for s in row["hlo"]["square_f32"]), row["hlo"]
    # ... and what else ran: the trainer's policy, remat, steps per call and loss chunk, and
    # the whole state donated to the new one.
    assert (row["policy"], row["remat"], row["steps_per_call"]) == ("mixed_bfloat16", "none", 8)
    assert row["runtime"]["attention"] == row["attention"], row["runtime"]
    assert row["donated"]["inputs"] == row["donated"]["state_arrays"] > 0, row["donated"]
    assert row["loss_chunk"] == {"positions": 128, "of": 128, "budget_bytes": 256 * 2**20}
    # The trainer lowers the very same programs for the job the row records.
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    trainer = subprocess.run(
        [sys.executable, "-c", TRAINER, json.dumps(row), json.dumps(bench_gpu.SPECIAL["llama"])],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    fingerprints = json.loads(trainer.stdout.strip().splitlines()[-1])
    assert set(fingerprints) == {"train_chunk", "eval_step"}
    assert row["fingerprints"] == fingerprints
    # The sitecustomize was in force: the same interpreter cannot import tensorflow.
    check = subprocess.run(
        [sys.executable, "-c", "import tensorflow"],
        capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert check.returncode != 0 and "tensorflow" in check.stderr


def test_hlo_facts_counts_cudnn_calls_and_square_buffers() -> None:
    """bench_gpu.hlo_facts on HLO text as XLA prints it: the cuDNN attention custom calls by
    target, and the arrays whose last two dimensions are the sequence."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    text = "\n".join([
        '%a = (bf16[4,2048,32,64]{3,2,1,0}, f32[4,32,2048]{2,1,0}, u8[0]{0}) custom-call('
        '...), custom_call_target="__cudnn$fmhaSoftmax"',
        '%b = (bf16[4,2048,32,64]{3,2,1,0}, u8[0]{0}) custom-call(...), '
        'custom_call_target="__cudnn$fmhaSoftmaxBackward"',
        '%c = f32[4,8,4,2048,2048]{4,3,2,1,0} dot(...)',
        '%d = bf16[4,1,2048,2048]{3,2,1,0} select(...)',
        '%e = f32[2048]{0} parameter(3)',
    ])  # fmt: skip
    facts = bench_gpu.hlo_facts(text, 2048)
    assert facts["cudnn_calls"] == 2
    assert facts["cudnn_targets"] == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}
    assert facts["square"] == ["bf16[4,1,2048,2048]", "f32[4,8,4,2048,2048]"]
    assert facts["square_f32"] == ["f32[4,8,4,2048,2048]"]
