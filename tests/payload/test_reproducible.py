"""The same job gives the same run: tokenizer, shards, manifest and exported weights.

`tokenizers` leaves parts of a trained vocabulary to hash-map order and to the number of
threads (payload/data/tokenizer.py says where); before the stage fixed that, three trainings on
the bundled corpus gave three WordPiece vocabularies and three Unigram files. Each run here
is a fresh process (a new hash seed) with another RAYON_NUM_THREADS, so a machine with
another core count is what the second run stands for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from train_helpers import job_document, write_job

from payload.core.status import StatusWriter
from payload.data import tokenizer
from payload.schema import manifest as manifest_lib
from payload.spec import TOKENIZER_KINDS
from payload.training import export as export_lib

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Trains one tokenizer per kind on the bundled corpus, in one process.
TRAIN_ALL_KINDS = """
import sys, yaml
from payload import spec
from payload.data import tokenizer
from payload.core.status import StatusWriter
root, corpus = sys.argv[1], sys.argv[2]
for kind in spec.TOKENIZER_KINDS:
    doc = {
        "name": "t", "output": f"{root}/{kind}", "corpus": {"paths": [corpus]},
        "tokenizer": {"kind": kind, "vocab_size": 2000, "min_frequency": 2},
        "data": {"objective": "mlm", "seq_length": 64},
        "model": {"family": "bert" if kind == "wordpiece" else "roberta", "size": "tiny"},
        "train": {"steps": 1},
    }
    path = f"{root}/{kind}.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    job = spec.load_job(path)
    tokenizer.train_tokenizer(job, StatusWriter(job.paths.status, job.name, min_interval_s=0))
"""


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# The two runs: one CPU (taskset, where this machine has more) and one Rayon thread; then
# every CPU and three Rayon threads (the tokenizers trainers' parallelism; XLA's CPU thread
# pool follows the CPUs the process may use).
ONE_CPU = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if shutil.which("taskset") else []
RUNS = ((ONE_CPU, "1"), ([], "3"))


def _twice(tmp_path: Path, run: Callable[[Path, list[str], dict[str, str]], None]) -> list[Path]:
    """``run(root, prefix, env)`` twice at the same path (job paths are recorded), kept apart."""
    kept = []
    for prefix, threads in RUNS:
        root = tmp_path / "work"
        root.mkdir()
        run(root, prefix, {**os.environ, "RAYON_NUM_THREADS": threads, "TF_CPP_MIN_LOG_LEVEL": "3"})
        kept.append(root.rename(tmp_path / f"threads-{threads}"))
    return kept


def _child(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_tokenizer_is_a_function_of_the_job(tmp_path: Path) -> None:
    def train(root: Path, prefix: list[str], env: dict[str, str]) -> None:
        corpus = str(EXAMPLES / "corpus" / "*.txt")
        _child([*prefix, sys.executable, "-c", TRAIN_ALL_KINDS, str(root), corpus], env)

    runs = _twice(tmp_path, train)
    for kind in TOKENIZER_KINDS:
        first, second = (_files(root / kind / "tokenizer") for root in runs)
        assert "tokenizer.json" in first and first.keys() == second.keys(), kind
        assert sorted(name for name in first if first[name] != second[name]) == [], kind
        digest = json.loads(first["stage.json"])["tokenizer_sha256"]
        assert digest == hashlib.sha256(first["tokenizer.json"]).hexdigest()
        status = json.loads((runs[0] / kind / "status.json").read_text())
        assert status["stages"]["tokenizer"]["metrics"]["tokenizer_sha256"] == digest


# XLA:CPU splits reductions and dots by the size of its thread pool, which is the number of
# CPUs the process may use unless PJRT_NPROC (or NPROC) says otherwise (DefaultThreadPoolSize
# in openxla/xla xla/pjrt/utils.cc). Measured with jax 0.10.2: x.T @ g (K=256) and g.sum(0)
# differ in their last bits between 1 and 2 CPUs, and agree with PJRT_NPROC fixed; so do the
# exported weights of the run below (without it, 2 CPUs twice agree, 1 CPU and 2 CPUs do not).
XLA_CPU_THREADS = "2"


@pytest.mark.slow
def test_jax_pipeline_is_a_function_of_the_job(tmp_path: Path) -> None:
    """tokenizer -> encode -> train (JAX on CPU) -> export twice: the same bytes throughout.

    The weights are compared with XLA's CPU thread pool fixed (XLA_CPU_THREADS); the
    tokenizer, shards and manifest with nothing fixed.
    """
    doc = job_document(tmp_path, EXAMPLES / "corpus" / "*.txt", "mlm", "bert", backend="jax")
    doc["tokenizer"]["vocab_size"] = 2000
    doc["train"].update(
        steps=4, warmup_steps=1, checkpoint_every=4, log_every=2, global_batch_size=8
    )

    def pipeline(root: Path, prefix: list[str], env: dict[str, str]) -> None:
        write_job(root, {**doc, "output": str(root / "out")})
        command = [*prefix, sys.executable, "-m", "payload", "run", "--job", str(root / "job.yaml")]
        _child(command, {**env, "PJRT_NPROC": XLA_CPU_THREADS})

    runs = _twice(tmp_path, pipeline)
    first, second = (root / "out" for root in runs)
    for part in ("tokenizer", "data"):
        a, b = _files(first / part), _files(second / part)
        assert a.keys() == b.keys() and a, part
        assert sorted(name for name in a if a[name] != b[name]) == [], part
    manifest = manifest_lib.Manifest.from_json(
        (first / "data" / manifest_lib.MANIFEST_NAME).read_text()
    )
    tokenizer_json = (first / "tokenizer" / "tokenizer.json").read_bytes()
    assert manifest.tokenizer_sha256 == hashlib.sha256(tokenizer_json).hexdigest()
    weights = [(root / "out" / "export" / export_lib.PT_WEIGHTS).read_bytes() for root in runs]
    assert weights[0] == weights[1]


def _finalize_ladder(lowest: float, n: int) -> list[float]:
    """The scores UnigramTrainer::finalize gives n missing characters (same float steps)."""
    scores, penalty = [], 0.0
    for _ in range(n):
        scores.append(lowest + penalty)
        penalty += 0.0001
    return scores


def test_canonical_unigram_removes_hash_order_and_float_noise() -> None:
    head = [["<s>", 0.0], ["<unk>", 0.0]]
    ladder = _finalize_ladder(-12.5, 3)
    one = [["▁the", -2.0], ["ab", -4.25], ["ba", -4.25], *zip("zaq", ladder, strict=True)]
    # Another run: the last bits of an EM score, hash order of the ladder, order of a tie.
    two = [["▁the", -2.0000000000000004], ["ba", -4.25], ["ab", -4.25]]
    two += [*zip("qza", ladder, strict=True)]
    results = [
        tokenizer._canonical_unigram(head + [list(pair) for pair in body], len(head))
        for body in (one, two)
    ]
    assert results[0] == results[1]
    assert results[0] == [
        *head,
        ["▁the", -2.0],
        ["ab", -4.25],
        ["ba", -4.25],
        ["z", round(ladder[2], 6)],
        ["q", round(ladder[1], 6)],
        ["a", -12.5],
    ]


def test_wordpiece_continuation_tokens_are_vocabulary_not_special(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("오늘 아침 tokenizer tokens token ## a##b\n" * 20, encoding="utf-8")
    doc = job_document(tmp_path, corpus, "mlm", "bert")
    doc["tokenizer"]["vocab_size"] = 200
    job = write_job(tmp_path, doc)
    out = tokenizer.train_tokenizer(job, StatusWriter(job.paths.status, job.name))
    data = json.loads(Path(out, tokenizer.TOKENIZER_FILE).read_text())
    assert [t["content"] for t in data["added_tokens"]] == list(job.tokenizer.special_tokens)
    vocab = data["model"]["vocab"]
    assert {"##늘", "##침", "##o", "##k"} <= vocab.keys()
    specials = len(job.tokenizer.special_tokens)
    singles = sorted((i, t) for t, i in vocab.items() if len(t) == 3 and t.startswith("##"))
    assert [i for i, _ in singles] == list(range(specials, specials + len(singles)))
    assert [t for _, t in singles] == sorted(t for _, t in singles)  # code-point order
    loaded = tokenizer.load_tokenizer(out)
    assert loaded.tokenize("a##b") == ["a", "#", "#", "b"]  # `##b` is no special token
