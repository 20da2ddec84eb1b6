"""Sharded training state on the JAX backend (payload/backends/jax/mesh.py), on this machine's
CPU as 8 virtual devices (`--xla_force_host_platform_device_count=8`).

It shows: the rule that lays each weight out over `fsdp` and the plan that picks the mesh
(`train.sharding: auto | data | fsdp`); that the parameter count the plan uses equals the
built models' for every family; that the model's weights and the optimizer's slots are
CREATED sharded (every device holds its slice only); that an FSDP run and a data-parallel
run of the same job through the real CLI give the same losses and exported weights within
1e-5, each recording its mesh in status.json and run.json; and that the TF backend refuses
`fsdp` in one line. Two processes x 4 devices against one process x 8: test_jax_multihost.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from train_helpers import (
    assert_user_error,
    copy_prepared,
    cpu_devices,
    job_document,
    prepare_data,
    run_cli,
    write_corpus,
    write_job,
)

from payload.backends.jax import mesh as mesh_lib
from payload.training import export as export_lib

DRIVER = Path(__file__).parent / "drivers" / "jax_sharding_driver.py"
COLLECTIVES_DRIVER = Path(__file__).parent / "drivers" / "jax_collectives_driver.py"
PROGRAM_DRIVER = Path(__file__).parent / "drivers" / "jax_program_driver.py"
EIGHT = cpu_devices(8)
TOLERANCE = 1e-5
GIB = 2**30


@pytest.mark.parametrize(
    ("shape", "fsdp", "spec"),
    [
        ((400, 128), 8, ("fsdp", None)),  # the larger dimension
        ((128, 512), 8, (None, "fsdp")),
        ((128, 128), 8, ("fsdp", None)),  # ties: the first
        ((514, 128), 8, (None, "fsdp")),  # 514 is not divisible by 8: the other one
        ((3, 5), 8, ()),  # nothing divides: replicated
        ((512,), 8, ()),  # vectors stay replicated
        ((), 8, ()),  # the step counter
        ((400, 128), 1, ()),  # no fsdp axis
    ],
)
def test_partition_rule(shape: tuple[int, ...], fsdp: int, spec: tuple) -> None:
    assert tuple(mesh_lib.partition_spec(shape, fsdp)) == spec


@pytest.mark.parametrize(
    ("shape", "path", "spec"),
    [
        ((600, 64), "llama/embed_tokens/embeddings", (None, "fsdp")),  # generic: 600
        ((64, 600), "llama/lm_head/kernel", ("fsdp", None)),
        # The decoder's stacks [L, ...]: split on H (the generic rule would pick 176).
        ((2, 64, 176), "llama/layers/up_proj", (None, "fsdp", None)),
        ((2, 176, 64), "llama/layers/down_proj", (None, None, "fsdp")),
        ((2, 64, 32), "adamw/llama_layers_k_proj_momentum", (None, "fsdp", None)),
        ((601, 64), "llama/embed_tokens/embeddings", (None, "fsdp")),
        ((600, 60), "llama/embed_tokens/embeddings", ("fsdp", None)),  # 60: the generic rule
        # The stacked norm scales stay whole, though 8 divides both axes.
        ((8, 64), "llama/layers/input_layernorm_gamma", ()),
        ((8, 64), "adamw/llama_layers_post_attention_layernorm_gamma_velocity", ()),
        # H = 60: the generic rule, which never splits the layer axis (8 divides L).
        ((8, 60, 176), "llama/layers/gate_proj", (None, None, "fsdp")),
        ((8, 60, 60), "llama/layers/q_proj", ()),
        ((64,), "llama/norm/gamma", ()),
    ],
)
def test_llama_table_takes_precedence(shape: tuple[int, ...], path: str, spec: tuple) -> None:
    assert tuple(mesh_lib.partition_spec(shape, 8, path=path, family="llama")) == spec


def test_plan_picks_the_mesh() -> None:
    small, large = 100_000_000, 1_000_000_000  # 1.5 GiB and 14.9 GiB of state
    v5e = 16 * 10**9
    assert mesh_lib.plan("auto", parameters=small, devices=8, memory=v5e).sharding == "data"
    fsdp = mesh_lib.plan("auto", parameters=large, devices=8, memory=v5e)
    assert (fsdp.sharding, fsdp.data, fsdp.fsdp) == ("fsdp", 1, 8)
    assert "exceeds 50% of a device's 14.9 GiB" in fsdp.reason
    # Unknown memory (CPU): data parallelism, and the reason says why.
    cpu = mesh_lib.plan("auto", parameters=large, devices=8, memory=None)
    assert (cpu.sharding, cpu.data, cpu.fsdp) == ("data", 8, 1)
    assert "memory unknown" in cpu.reason
    # One device has nothing to shard over, whatever the size.
    assert mesh_lib.plan("auto", parameters=large, devices=1, memory=v5e).devices == 1
    # Explicit settings win.
    assert mesh_lib.plan("fsdp", parameters=small, devices=4, memory=v5e).fsdp == 4
    assert mesh_lib.plan("data", parameters=large, devices=4, memory=v5e).data == 4
    assert mesh_lib.state_bytes(large) / GIB == pytest.approx(14.9, abs=0.05)


def _driver_reports(driver: Path) -> list[dict]:
    """The JSON lines a driver prints, run on 8 virtual CPU devices in a fresh process."""
    result = subprocess.run(
        [sys.executable, str(driver)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **EIGHT},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_variables_are_created_sharded_and_counted() -> None:
    reports = _driver_reports(DRIVER)
    assert [r["family"] for r in reports] == ["bert", "roberta", "gpt2", "llama", "electra"]
    for report in reports:
        # The plan's parameter count is the built model's, exactly.
        assert report["parameters"] == report["formula"], report["family"]
        variables = report["variables"]
        for v in variables:
            expected = list(v["expected"]) + [None] * (len(v["shape"]) - len(v["expected"]))
            assert v["spec"] == expected or (not v["expected"] and not any(v["spec"])), v
        sharded = [v for v in variables if "fsdp" in v["spec"]]
        # Every matrix (weights and both Adam slots of each) is split 8 ways on creation
        # (Llama's 2 layers: 7 stacks [L, ...] and the embedding, x 3).
        assert len(sharded) >= (24 if report["family"] == "llama" else 40), report["family"]
        for v in sharded:
            assert v["device_bytes"] * 8 == v["bytes"], v
        if report["family"] == "llama":  # its table (mesh.FAMILY_RULES): the hidden axis
            by_path = {v["path"]: v["spec"] for v in variables}
            assert by_path["llama/embed_tokens/embeddings"] == [None, "fsdp"], by_path
            assert by_path["llama/layers/q_proj"] == [None, "fsdp", None], by_path
            assert by_path["llama/layers/down_proj"] == [None, None, "fsdp"], by_path
            assert not any(by_path["llama/layers/input_layernorm_gamma"]), by_path
            slots = [p for p in by_path if "embed_tokens_embeddings" in p]
            assert len(slots) == 2 and all(by_path[p] == [None, "fsdp"] for p in slots), slots
        if report["family"] == "electra":  # its table: the shared embeddings' width
            by_path = {v["path"]: v["spec"] for v in variables}
            assert by_path["electra/word/embeddings"] == [None, "fsdp"], by_path
            assert by_path["electra/type/embeddings"] == [None, "fsdp"], by_path
            assert by_path["electra/discriminator_prediction/kernel"] == ["fsdp", None]
        per_device = sum(v["device_bytes"] for v in variables)
        total = sum(v["bytes"] for v in variables)
        assert per_device < total / 5, (report["family"], per_device, total)


@pytest.fixture(scope="module")
def compiled_steps() -> list[dict]:
    """jax_collectives_driver.py's reports (one process for the module's two tests)."""
    return _driver_reports(COLLECTIVES_DRIVER)


def test_fsdp_gathers_weights_not_activations(compiled_steps: list[dict]) -> None:
    """FSDP as it is meant (MaxText's activation_batch rule): the compiled training chunk
    gathers weights and reduces gradients, while activations keep their rows on their
    devices (mesh.keep_rows at every block boundary and on the head's logits). Without those
    constraints XLA followed the hidden-split weights and all-gathered and all-reduced the
    whole batch's activations in every layer (27 such collectives for this 2-layer Llama on
    1 x 8; every MLM step gathered the masked positions' features)."""
    reports = [r for r in compiled_steps if r["kind"] == "collectives"]
    assert [(r["family"], r["mesh"]) for r in reports] == [
        ("llama", [1, 8]), ("llama", [2, 4]), ("bert", [1, 8])
    ]  # fmt: skip
    for report in reports:
        weights = {tuple(shape) for shape in report["weights"]}
        ops = report["collectives"]
        case = (report["family"], report["mesh"])
        # The weights are gathered: every float all-gather yields a whole weight matrix.
        floats = [(op, tuple(a[1])) for op, arrays in ops for a in arrays if a[0][0] in "fb"]
        gathers = [shape for op, shape in floats if op == "all-gather"]
        # Llama's layer stacks [L, in, out] are gathered one layer's slice at a time; its
        # norm scales stacked [L, H] stay whole (replicated).
        layers = {s[0] for s in weights if len(s) == 3}
        matrices = {s[1:] for s in weights if len(s) == 3}
        matrices |= {s for s in weights if len(s) == 2 and s[0] not in layers}
        assert sum(s in matrices for s in gathers) >= len(matrices), (case, gathers)
        # No activation crosses devices: a float array of rank >= 3 led by the batch's rows
        # (all of them, or a data shard's), bar one: Llama's embedding lookup on a data x
        # fsdp mesh (the table is split on its hidden axis, so its rows are computed split
        # that way before the first constraint).
        rows = {report["batch"], report["batch"] // report["mesh"][0]}
        moved = [(op, shape) for op, shape in floats if len(shape) >= 3 and shape[0] in rows]
        allowed = 1 if case == ("llama", [2, 4]) else 0
        assert len(moved) <= allowed, (case, moved)
        # The collectives overall: nothing but gathers and reductions, plus the embedding's
        # reshard (all-to-all) into the batch layout.
        assert {op for op, _ in ops} <= {"all-gather", "all-reduce", "reduce-scatter", "all-to-all"}
        assert sum(op == "all-to-all" for op, _ in ops) <= 2, case


def test_fsdp_and_data_parallel_steps_alike(compiled_steps: list[dict]) -> None:
    """The trainer's compiled chunk, two optimizer steps of the same batches from the same
    initial weights: on the FSDP mesh (Llama: its family table, train.remat block and 2
    accumulated micro-batches; ELECTRA: its table, generator samples and discriminator) and
    on the data-parallel mesh, the same losses and trained weights. (BERT through the real
    CLI: test_fsdp_and_data_parallel_train_alike.)"""
    reports = {r["family"]: r for r in compiled_steps if r["kind"] == "equivalence"}
    assert sorted(reports) == ["electra", "llama"]
    assert reports["llama"]["fsdp"] == {"remat": "block", "accum_steps": 2}
    for family, report in reports.items():
        fsdp, data = report["losses"]
        assert len(fsdp) == 2 and np.allclose(fsdp, data, atol=TOLERANCE), (family, report)
        assert report["weight_gap"] <= TOLERANCE, (family, report)
        assert report["moved"] > 10 * TOLERANCE, (family, report)  # they trained


def _job(tmp_path: Path, sharding: str) -> tuple[Path, dict]:
    tmp_path.mkdir(parents=True)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    doc = job_document(
        tmp_path, corpus, "mlm", "bert", steps=6, warmup_steps=2, checkpoint_every=3,
        log_every=3, eval_every=0, backend="jax", sharding=sharding,
    )  # fmt: skip
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    return tmp_path, doc


def _status(job) -> dict:
    return json.loads(Path(job.paths.status).read_text())


def test_fsdp_and_data_parallel_train_alike(tmp_path: Path) -> None:
    root, doc = _job(tmp_path / "fsdp", "fsdp")
    fsdp = write_job(root, doc)
    prepare_data(fsdp)
    data = copy_prepared(
        fsdp, tmp_path / "data", {**doc, "train": {**doc["train"], "sharding": "data"}}
    )
    runs = {}
    for name, job in (("fsdp", fsdp), ("data", data)):
        result = run_cli(
            "train", "--job", str(Path(job.paths.root).parent / "job.yaml"), env=EIGHT, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (job, result.stderr)
    meshes = {
        "fsdp": {"sharding": "fsdp", "data": 1, "fsdp": 8},
        "data": {"sharding": "data", "data": 8, "fsdp": 1},
    }
    losses = {}
    for name, (job, stderr) in runs.items():
        status = _status(job)
        assert status["runtime"]["mesh"] == meshes[name], status["runtime"]
        assert f"train.sharding: {name};" in status["runtime"]["sharding_reason"]
        run_json = json.loads(Path(job.paths.checkpoints, "run.json").read_text())
        assert run_json["mesh"] == meshes[name]
        losses[name] = [
            line.split("loss ")[1].split()[0]
            for line in stderr.splitlines()
            if line.startswith("step ")
        ]
    assert len(losses["fsdp"]) == 2
    assert np.allclose(np.float64(losses["fsdp"]), np.float64(losses["data"]), atol=TOLERANCE)
    a = load_file(str(Path(fsdp.paths.export, export_lib.PT_WEIGHTS)))
    b = load_file(str(Path(data.paths.export, export_lib.PT_WEIGHTS)))
    assert sorted(a) == sorted(b)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= TOLERANCE, worst
    # ... and they trained: the weights moved from their initial values.
    assert max(float(np.abs(a[k]).max()) for k in a) > 0
    # Each run compiled exactly what `tpu-payload compile`'s path (aot.build_for, with the
    # device facts stated instead of read) compiles for its job on these 8 devices: the
    # lowered programs' fingerprints (sha256 of their text) that the run logged.
    jobs = [str(Path(job.paths.root).parent / "job.yaml") for job, _ in runs.values()]
    built = subprocess.run(
        [sys.executable, str(PROGRAM_DRIVER), *jobs],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **EIGHT},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    compiled = [json.loads(line) for line in built.stdout.splitlines() if line.startswith("{")]
    for (_, stderr), row in zip(runs.values(), compiled, strict=True):
        (logged,) = [line for line in stderr.splitlines() if line.startswith("train: programs")]
        prints = row["fingerprints"]
        assert set(prints) == {"train_chunk", "eval_step"}, prints
        assert logged.endswith(f"train_chunk {prints['train_chunk']}, eval_step "
                               f"{prints['eval_step']}"), (logged, prints)  # fmt: skip
    # A resume on the other mesh shape is allowed: run.json's mesh is a record, not identity.
    shutil.rmtree(data.paths.export)
    longer = {
        **doc,
        "output": str(tmp_path / "data" / "out"),
        "train": {**doc["train"], "steps": 9, "sharding": "fsdp"},
    }
    write_job(tmp_path / "data", longer)
    result = run_cli("train", "--job", str(tmp_path / "data" / "job.yaml"), env=EIGHT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "at step 6" in result.stderr
    assert json.loads(Path(data.paths.checkpoints, "run.json").read_text())["mesh"]["fsdp"] == 8


@pytest.mark.parametrize(
    ("backend", "env"),
    [("tf", {}), ("auto", {"TPU_PAYLOAD_BACKEND": "tf"})],  # refused by the spec; by the trainer
)
def test_the_tf_backend_refuses_fsdp(tmp_path: Path, backend: str, env: dict[str, str]) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=60)
    doc = job_document(
        tmp_path, corpus, "mlm", "bert", steps=2, warmup_steps=0, backend=backend,
        sharding="fsdp",
    )  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    result = run_cli("run", "--job", str(tmp_path / "job.yaml"), env=env)
    line = assert_user_error(result, "train.sharding: fsdp")
    assert "train.backend: jax" in line
    assert not Path(tmp_path, "out", "checkpoints").exists()
