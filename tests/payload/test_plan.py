"""payload/plan/estimate.py: figures for known cases worked out here, the refusal, the command
line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from payload import spec
from payload.model import configs
from payload.plan import estimate

ROOT = Path(__file__).resolve().parents[2]


def job(size: str, *, sharding: str = "auto", remat: str = "none", **train: Any) -> Any:
    document = {
        "name": "p",
        "output": "/tmp/unused",
        "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": 32000},
        "data": {"objective": "clm", "seq_length": 2048},
        "model": {"family": "llama", "size": size},
        "train": {
            "steps": 1000,
            "global_batch_size": 64,
            "sharding": sharding,
            "remat": remat,
            **train,
        },
    }
    return spec.parse_job(document, source="/tmp/p.yaml")


@pytest.mark.parametrize(
    ("name", "chips", "memory"),
    [
        ("v4-32", 16, 32 * 2**30),  # TensorCores, two per chip
        ("v3-8", 4, 32 * 2**30),
        ("v5p-8", 4, 95 * 10**9),
        ("v5litepod-8", 8, 16 * 10**9),  # chips
        ("v6e-8", 8, 32 * 10**9),
        ("nvidia-l4x2", 2, 24 * 2**30),
        ("nvidia-tesla-a100", 1, 40 * 2**30),
    ],
)
def test_accelerator_types(name: str, chips: int, memory: int) -> None:
    acc = estimate.accelerator(name)
    assert (acc.chips, acc.memory_bytes) == (chips, memory)


@pytest.mark.parametrize("name", ["v9-8", "v4-3", "nvidia-l4x0", "v5litepod", ""])
def test_unknown_accelerator_is_one_line(name: str) -> None:
    with pytest.raises(estimate.AcceleratorError) as error:
        estimate.accelerator(name)
    assert "\n" not in str(error.value) and repr(name) in str(error.value)


def test_the_plan_and_the_trainer_use_the_same_rule() -> None:
    from payload.backends.jax import mesh

    for size in ("125m", "1b", "3b"):
        n = estimate.model_shape("llama", size, {}, 32000).parameters
        for chips in (1, 8):
            memory = 16 * 10**9
            ours, _ = estimate.resolve_sharding("auto", n, chips, memory)
            theirs = mesh.plan("auto", parameters=n, devices=chips, memory=memory)
            assert ours == theirs.sharding, (size, chips)


@pytest.mark.parametrize("family", ["bert", "roberta", "gpt2", "llama"])
def test_parameter_count_is_the_models(family: str) -> None:
    config = configs.build_config(family, "tiny", {}, vocab_size=600, special_ids={})
    assert estimate.model_shape(family, "tiny", {}, 600).parameters == configs.parameter_count(
        family, config
    )


def test_figures_of_llama_1b_on_v5e_8() -> None:
    p = estimate.plan_job(
        job("1b", sharding="fsdp", remat="block", global_batch_size=32),
        estimate.accelerator("v5litepod-8"),
    )
    # Llama 3.2 1B's shape with a 32,000-token vocabulary, tied: 32000 x 2048 embedding;
    # per layer q, o 2048 x 2048, k, v 2048 x 512, gate, up, down 2048 x 8192, 2 norms.
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    n = 32000 * 2048 + 16 * per_layer + 2048
    assert p.parameters == n == 1_038_682_112
    # MaxText: 6 x the matmul weights (norms excluded) + 6 x L x S x A x D (causal half).
    assert p.flops_per_token == 6 * (n - 33 * 2048) + 6 * 16 * 2048 * 32 * 64
    # FSDP over 8 chips: every matrix split 8 ways (2048 divides), norm scales whole.
    held = (n - 33 * 2048) // 8 + 33 * 2048
    layout = p.layout("fsdp", "block")
    assert (layout.weights, layout.slots, layout.gradients) == (4 * held, 8 * held, 4 * held)
    # ...and the largest unit whole: the embedding (65.5M > a layer's 60.8M) gathered in bf16
    # with its bf16 gradient, plus the chip's eighth of the scanned layers' stacked weights
    # cast to bf16 once per step.
    matrices = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192
    assert matrices < 32000 * 2048
    assert layout.gathered == 32000 * 2048 * (2 + 2) + 16 * matrices // 8 * 2
    # Data parallelism: 16 bytes per parameter on every chip, nothing gathered, but the whole
    # layer stacks' bf16 copy.
    data = p.layout("data", "none")
    assert data.weights + data.slots + data.gradients == 16 * n
    assert data.gathered == 16 * matrices * 2
    # Remat keeps one bf16 hidden state per layer and token through the step; the peak is
    # the larger of two phases never alive together. The layers' backward pass: the
    # gradients, the gathered unit and one layer's activations (a TPU: splash, so a float32
    # softmax statistic per head across its 128 lanes, no [S, S] scores). The loss: the
    # head's input and its chunked copy, one chunk's float32 logits (4 sequences x 512
    # positions: 256 MiB / (4 bytes x 32,000 x 4) -> 524 -> 512), the head's kernel whole in
    # bf16 and its float32 gradient's eighth.
    kept = 16 * 2 * 2048 * 2048
    one_layer = (2 * (7 * 2048 + 3 * 512 + 4 * 8192) + 8 * 2048 + 4 * 128 * 32) * 2048
    head = 2 * 2 * 2048 * 2048
    chunk = 4 * 32000 * 4 * 512
    assert (
        estimate.loss_chunk_bytes(estimate.model_shape("llama", "1b", {}, 32000), 4, 2048) == chunk
    )
    unit = 32000 * 2048 * (2 + 2)
    layers = layout.gradients + unit + 4 * one_layer
    loss = 4 * head + chunk + 32000 * 2048 * 2 + 32000 * 2048 * 4 // 8
    assert layers > loss  # 1B's peak is in the layers' backward pass
    assert layout.activations == 4 * kept + layers - layout.gradients - unit
    # The TPU compiler's reserve: its on-chip scratch and a share of the temporaries.
    temporaries = layout.gradients + layout.gathered + layout.activations
    assert layout.reserve == estimate.COMPILER_SCRATCH_BYTES + int(
        estimate.COMPILER_SLACK * temporaries
    )
    assert layout.total == (
        layout.weights + layout.slots + temporaries + estimate.GENERATED_CODE_BYTES + layout.reserve
    )
    assert layout.per_chip_batch == 4
    # 1000 steps x 32 x 2048 tokens at 35% of 8 x 197 TFLOP/s.
    tokens = 1000 * 32 * 2048
    assert p.hours == pytest.approx(tokens * p.flops_per_token / (8 * 197e12 * 0.35) / 3600)
    assert p.fits and p.refusal is None


def test_gradient_accumulation_adds_an_accumulator() -> None:
    acc = estimate.accelerator("v6e-8")
    one = estimate.plan_job(job("125m"), acc).layout("data", "none")
    two = estimate.plan_job(job("125m", grad_accum_steps=2), acc).layout("data", "none")
    assert two.gradients == 2 * one.gradients
    assert two.per_chip_batch == one.per_chip_batch // 2
    # Half the sequences; the loss's one chunk of logits per chip is the same 2,048 tokens
    # (16 x 128 positions, 8 x 256).
    shape = estimate.model_shape("llama", "125m", {}, 32000)
    chunk = estimate.loss_chunk_bytes(shape, 16, 2048)
    assert chunk == estimate.loss_chunk_bytes(shape, 8, 2048) == 4 * 32000 * 2048
    # The accumulator lives through both phases of the step: the peak grows by one set of
    # gradients, whichever phase it is in.
    grown = two.total - two.reserve - (one.total - one.reserve)
    assert two.gradients - one.gradients == one.gradients
    assert grown < one.gradients  # half the sequences' activations fewer


def test_fused_attention_drops_the_scores() -> None:
    """A fused kernel (TPU splash, cuDNN on an Ampere+ GPU computing in bf16) keeps 4 bytes
    of softmax statistics per head and token (splash: across 128 lanes); the reference
    (V100/T4/P100, fp32, attention dropout, train.attention: reference) keeps the [S, S]
    scores and probabilities. The plan says which, by the trainer's table
    (payload/model/kernels.py)."""
    for name in ("v6e-8", "nvidia-tesla-a100", "nvidia-h100-80gb", "nvidia-l4"):
        acc = estimate.accelerator(name)
        assert estimate.attention(job("125m"), acc).implementation != "reference", name
        assert estimate.attention(job("125m", attention="reference"), acc).implementation == (
            "reference"
        )
        assert estimate.attention(job("125m", precision="fp32"), acc).implementation == (
            "splash" if name == "v6e-8" else "reference"
        )
    for name in ("nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100"):
        chosen = estimate.attention(job("125m"), estimate.accelerator(name))
        assert chosen.implementation == "reference", name
        assert "compute capability 8.0 or newer" in chosen.reason and chosen.warning
    p = estimate.plan_job(job("125m"), estimate.accelerator("nvidia-h100-80gb"))
    assert (p.attention, p.to_dict()["attention"]) == ("cudnn", "cudnn")
    assert "attention: cudnn (train.attention: auto on nvidia-h100-80gb" in estimate.format_plan(p)
    shape = estimate.model_shape("llama", "125m", {}, 32000)
    reference = estimate.activation_bytes_per_sequence(shape, 2048, 2048, "none", 2)
    kernel = estimate.activation_bytes_per_sequence(shape, 2048, 2048, "none", 2, fused=True)
    assert reference - kernel == 30 * 2048 * ((4 + 2) * 9 * 2048 - 4 * 9)
    # Splash writes each statistic across its 128 lanes (a TPU's plan counts them so).
    splash = estimate.activation_bytes_per_sequence(
        shape,
        2048,
        2048,
        "none",
        2,
        fused=True,
        stat_lanes=estimate.stat_lanes_of(estimate.accelerator("v6e-8")),
    )
    assert splash - kernel == 30 * 2048 * 4 * 9 * 127
    assert estimate.stat_lanes_of(estimate.accelerator("nvidia-h100-80gb")) == 1


def test_attention_dropout_is_stated_in_the_plan() -> None:
    """A BERT job with the previous recipe's attention dropout (model.config) plans the
    reference attention and says why; the preset plans the kernel."""
    document = {
        "name": "p", "output": "/tmp/unused", "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "wordpiece", "vocab_size": 30522},
        "data": {"objective": "mlm", "seq_length": 512},
        "model": {"family": "bert", "size": "base"},
        "train": {"steps": 100, "global_batch_size": 64, "backend": "jax"},
    }  # fmt: skip
    v6e = estimate.accelerator("v6e-8")
    preset = estimate.plan_job(spec.parse_job(document, source="/tmp/p.yaml"), v6e)
    assert preset.attention == "splash"
    document["model"]["config"] = {"attention_probs_dropout_prob": 0.1}
    old = estimate.plan_job(spec.parse_job(document, source="/tmp/p.yaml"), v6e)
    assert old.attention == "reference"
    assert "attention dropout 0.1 needs the attention probabilities" in estimate.format_plan(old)
    assert old.layout("data", "none").activations > preset.layout("data", "none").activations


def test_the_loss_chunk_follows_the_chip_s_memory() -> None:
    """One chunk of logits takes 1/64 of a chip's memory (256 MiB to 2 GiB): Llama 1b's
    128,256-token vocabulary at 4 sequences per chip, 512 positions on an 80 GB GPU, 128 on
    a 16 GB v5e."""
    shape = estimate.model_shape("llama", "1b", {}, 128256)
    h100 = estimate.accelerator("nvidia-h100-80gb").memory_bytes
    assert estimate.loss_chunk_bytes(shape, 4, 2048, h100, 6) == 6 * 128256 * 4 * 512
    v5e = estimate.accelerator("v5litepod-8").memory_bytes
    assert estimate.loss_chunk_bytes(shape, 4, 2048, v5e) == 4 * 128256 * 4 * 128
    # Per logit: float32 logits; off a TPU also their softmax's gradient in the compute dtype.
    assert estimate.loss_bytes_per_logit(estimate.accelerator("nvidia-h100-80gb")) == 4 + 2
    assert estimate.loss_bytes_per_logit(estimate.accelerator("v5litepod-8")) == 4


def test_auto_follows_the_half_memory_rule() -> None:
    v5e = estimate.accelerator("v5litepod-8")
    assert estimate.plan_job(job("125m"), v5e).sharding == "data"  # 2.1 GB of state < 8 GB
    assert estimate.plan_job(job("1b"), v5e).sharding == "fsdp"  # 16.6 GB > 8 GB


def test_a_batch_that_does_not_split_over_the_chips_is_refused() -> None:
    with pytest.raises(spec.SpecError, match=r"use a multiple of 16$"):
        estimate.plan_job(
            job("125m", global_batch_size=24, grad_accum_steps=2), estimate.accelerator("v6e-8")
        )


def test_a_job_that_does_not_fit_names_what_would() -> None:
    p = estimate.plan_job(
        job("3b", sharding="data", global_batch_size=8), estimate.accelerator("v5litepod-8")
    )
    assert not p.fits
    assert p.refusal is not None and "\n" not in p.refusal
    assert "does not fit v5litepod-8 with train.sharding: data" in p.refusal
    assert "would fit: " in p.refusal and "train.sharding: fsdp" in p.refusal


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "payload", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def write(tmp_path: Path, size: str, **train: Any) -> str:
    path = tmp_path / "job.yaml"
    train_lines = "".join(f"  {k}: {v}\n" for k, v in train.items())
    path.write_text(
        "name: p\noutput: out\ncorpus: {paths: [c.txt]}\ntokenizer: {kind: bpe, vocab_size: "
        f"32000}}\ndata: {{objective: clm, seq_length: 1024}}\nmodel: {{family: llama, size: "
        f"{size}}}\ntrain:\n  steps: 100\n  global_batch_size: 16\n{train_lines}"
    )
    return str(path)


def test_cli_table_and_json(tmp_path: Path) -> None:
    path = write(tmp_path, "125m")
    table = run_cli("--job", path, "--accelerator", "v6e-8")
    assert table.returncode == 0, table.stderr
    assert "max batch/chip" in table.stdout and "fits" in table.stdout
    machine = run_cli("--job", path, "--accelerator", "v6e-8", "--json", "--mfu", "0.5")
    data = json.loads(machine.stdout)
    assert data["fits"] is True and data["mfu"] == 0.5
    assert {x["sharding"] for x in data["layouts"]} == {"data", "fsdp"}


def test_cli_refuses_in_one_line(tmp_path: Path) -> None:
    big = run_cli("--job", write(tmp_path, "3b", sharding="data"), "--accelerator", "v5litepod-8")
    assert big.returncode == 2
    assert "does NOT fit" in big.stdout  # the table is still printed
    lines = big.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: plan: llama 3b")
    unknown = run_cli("--job", write(tmp_path, "125m"), "--accelerator", "tpu-9")
    assert unknown.returncode == 2
    assert unknown.stderr.count("\n") == 1 and "known: v2-<cores>" in unknown.stderr


def test_docs_table_is_the_commands_output() -> None:
    """docs/models.md's table is what the command prints today (it cannot drift)."""
    result = run_cli(
        "--job",
        "examples/llama-plan.yaml",
        "--accelerator",
        "v5litepod-8,v4-32,v6e-8",
        "--sizes",
        "125m,350m,1b,3b",
    )
    assert result.returncode == 0, result.stderr
    docs = (ROOT / "docs" / "models.md").read_text()
    begin, end = "<!-- plan-table:begin -->\n", "<!-- plan-table:end -->"
    assert docs[docs.index(begin) + len(begin) : docs.index(end)] == result.stdout


def test_a_job_template_without_output_is_planned() -> None:
    """stacks/jobs/ templates have no `output` (infra fills it in); the plan writes nothing."""
    job = "stacks/jobs/gpt2-small-clm.yaml"  # the a100x4-usc1 stack's job
    result = run_cli("--job", job, "--accelerator", "nvidia-tesla-a100x4")
    assert result.returncode == 0, result.stderr
    assert "fits" in result.stdout


def test_remat_is_offered_only_where_it_exists() -> None:
    document = {
        "name": "g",
        "output": "/tmp/unused",
        "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": 50000},
        "data": {"objective": "clm", "seq_length": 1024},
        "model": {"family": "gpt2", "size": "base"},
        "train": {"steps": 10, "global_batch_size": 512},
    }
    p = estimate.plan_job(
        spec.parse_job(document, source="/tmp/g.yaml"), estimate.accelerator("nvidia-l4")
    )
    assert {x.remat for x in p.layouts} == {"none"}
    assert p.refusal is not None
    would = p.refusal.split("would fit: ")[1]
    assert "remat" not in would and "train.sharding" not in would  # one GPU: no FSDP either
    assert "train.grad_accum_steps" in would


def test_docs_stop_cost_table_is_the_commands_output() -> None:
    """docs/preemption.md's stop-cost table is what the command prints today."""
    result = run_cli(
        "--job",
        "examples/llama-plan.yaml",
        "--accelerator",
        "v5litepod-8,v5litepod-16,v4-32,v6e-8,nvidia-h100-80gbx8",
        "--sizes",
        "125m,350m,1b,3b",
        "--stop-cost",
    )
    assert result.returncode == 0, result.stderr
    docs = (ROOT / "docs" / "preemption.md").read_text()
    begin, end = "<!-- stop-cost:begin -->\n", "<!-- stop-cost:end -->"
    assert docs[docs.index(begin) + len(begin) : docs.index(end)] == result.stdout
    assert "| 3b | v5litepod-8 | 1 |" in result.stdout and "no: back to the last" in result.stdout


def test_stop_cost_without_sizes_is_one_row(tmp_path: Path) -> None:
    """--stop-cost on one job and accelerator: the table's row for it; with --json, one line."""
    args = ("--job", "examples/llama-plan.yaml", "--accelerator", "v5litepod-8")
    one = run_cli(*args, "--stop-cost")
    assert one.returncode == 0, one.stderr
    table = run_cli(*args, "--sizes", "125m", "--stop-cost")
    assert one.stdout == table.stdout and one.stdout.count("\n") == 3
    refused = run_cli(*args, "--stop-cost", "--json")
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == "error: --stop-cost prints a Markdown table: drop --json\n"


def test_stop_cost_uses_the_trainers_chunk_rules() -> None:
    """stop_cost.py restates two rules of backends/jax/runtime.py (which imports JAX, and the
    plan must not) and training.FIRST_CHUNK_STEPS: the same values."""
    import ast

    from payload.plan import stopping

    tree = ast.parse((ROOT / "payload" / "backends" / "jax" / "runtime.py").read_text())
    values = {
        target.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets)
        if isinstance(target, ast.Name) and target.id in ("CHUNK_SECONDS", "STEPS_PER_CALL")
    }
    assert values["CHUNK_SECONDS"]["tpu"] == values["CHUNK_SECONDS"]["gpu"]
    assert values["CHUNK_SECONDS"]["tpu"] == stopping.CHUNK_SECONDS
    for kind, steps in stopping.STEPS_PER_CALL.items():
        assert values["STEPS_PER_CALL"][kind] == steps
    from payload.training import shared

    assert stopping.FIRST_CHUNK_STEPS == shared.FIRST_CHUNK_STEPS


FAMILY_OBJECTIVES = [
    (family, objective)
    for objective, families in spec.FAMILIES_FOR_OBJECTIVE.items()
    for family in families
]


def family_job(family: str, objective: str, size: str) -> Any:
    document = {
        "name": f"{family}-{size}",
        "output": "/tmp/unused",
        "corpus": {"paths": ["/tmp/unused.txt"]},
        "tokenizer": {"kind": "wordpiece" if objective != "clm" else "bpe", "vocab_size": 32000},
        "data": {"objective": objective, "seq_length": 512},
        "model": {"family": family, "size": size},
        "train": {"steps": 1000, "global_batch_size": 64},
    }
    return spec.parse_job(document, source="/tmp/p.yaml")


@pytest.mark.parametrize(("family", "objective"), FAMILY_OBJECTIVES)
def test_every_family_plans_at_every_preset(family: str, objective: str) -> None:
    """Every family x objective at each preset: the plan counts the model's own weights
    (its matrices never outnumber its parameters) and no layout holds negative bytes (ELECTRA
    was planned as a BERT of its hidden width: -4.3 MB of weights a chip under FSDP)."""
    acc = estimate.accelerator("v5litepod-8")
    for size in configs.PRESETS[family]:
        shape = estimate.model_shape(family, size, {}, 32000)
        matrices = sum(m[0] * m[1] for m in shape.matrices)
        assert 0 < matrices <= shape.parameters, (family, size)
        plan = estimate.plan_job(family_job(family, objective, size), acc)
        for layout in plan.layouts:
            assert min(layout.weights, layout.slots, layout.gradients, layout.gathered) >= 0
            assert layout.total > 0, (family, size, layout)


@pytest.mark.parametrize(("family", "objective"), FAMILY_OBJECTIVES)
def test_every_family_plans_on_the_command_line(
    tmp_path: Path, family: str, objective: str
) -> None:
    size = next(iter(configs.PRESETS[family]))
    path = tmp_path / "job.yaml"
    path.write_text(
        json.dumps(
            {
                "name": family,
                "output": str(tmp_path / "out"),
                "corpus": {"paths": [str(tmp_path / "c.txt")]},
                "tokenizer": {"kind": "wordpiece", "vocab_size": 30522},
                "data": {"objective": objective, "seq_length": 512},
                "model": {"family": family, "size": size},
                "train": {"steps": 100, "global_batch_size": 128},
            }
        )
    )
    result = run_cli("--job", str(path), "--accelerator", "v5litepod-8", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["family"] == family and data["parameters"] > 0 and data["fits"] is True
