"""The trainer's compiled chunk for a TPU, compiled ahead of time on this machine (no TPU):
per-chip bytes, compile seconds, the scan over layers, weight gathers' dtypes and flops, from
the TPU compiler's own program (libtpu in .venv-tpu-jax).

    .venv-tpu-jax/bin/python bench/bench_tpu_compile.py --accelerator v5litepod-16 \\
        --size 1b --remat full,minimal [--batch-per-chip 2] [--seq 2048] [--vocab 32000] \\
        [--sharding fsdp] [--attention auto] [--hlo-dir DIR] [--json | --markdown]
    .venv-tpu-jax/bin/python bench/bench_tpu_compile.py --markdown --rows ROWS.jsonl

`--json` prints one JSON line per case; `--markdown --rows` turns such lines (one run, or
several appended) into docs/performance.md's table with the plan's columns computed anew
(the compiler's figures are the recorded ones): the table after a change to the plan,
without compiling again.

How: each case is a job (the preset, the vocabulary, the sequence, a global batch of
--batch-per-chip rows per chip, train.sharding / remat / attention, no held-out split) whose
training chunk is built and compiled by the path `tpu-payload compile` takes
(payload/backends/jax/aot.py: the accelerator's topology from payload/plan/accelerators.yaml, its
compile-only chips from libtpu's `jax.experimental.topologies.get_topology_desc`, as MaxText's
train_compile.py gets them; then the trainer's one builder, program.build: the model and
AdamW without values, the state and batches as sharded jax.ShapeDtypeStructs, the trainer's
steps.make_train_chunk lowered for them and compiled for the TPU). Printed per case: the
compiler's memory analysis per chip (arguments, outputs, aliased, temporaries, generated
code; "total" = arguments + outputs - aliased + temporaries, MaxText's
print_compiled_memory_stats), the plan's figure (payload/plan/estimate.py) beside it, compile
seconds (wall and CPU), and from the optimized HLO (payload/backends/jax/hlo.py): the while
loops and their trip counts (None: the chunk's step loop; L: the scanned decoder layers),
Mosaic (Pallas) kernels, the weight all-gathers by dtype, and flops per step counted with
trip counts and the splash kernels' own matmuls, beside the plan's.

Big shapes compile for minutes and take GBs: run one at a time (`flock /work/wt/bigjob.lock
/usr/bin/time -v ...` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--accelerator",
        default="v5litepod-16",
        help="a TPU type `tpu-payload compile` knows, or a comma-separated list with --markdown",
    )
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="1b", help="a preset, or a comma-separated list")
    parser.add_argument("--config", default="{}", help="model.config overrides (JSON)")
    parser.add_argument("--remat", default="full", help="comma-separated train.remat values")
    parser.add_argument("--batch-per-chip", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--sharding", default="fsdp", choices=("data", "fsdp"))
    parser.add_argument("--attention", default="auto")
    parser.add_argument(
        "--loss-chunk-mib",
        type=int,
        help="an experiment: the chunked loss's float32 logits budget per device (default "
        "payload/model/configs.py LOSS_CHUNK_BYTES); the plan keeps its own",
    )
    parser.add_argument("--hlo-dir", help="write each case's optimized HLO text here")
    parser.add_argument(
        "--rows", help="with --markdown: render these --json lines instead of compiling"
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="every size x accelerator x remat: one Markdown table (docs/performance.md's)",
    )
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    # This checkout's payload, not a copy installed in the environment it runs with.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # JAX on this machine's CPU; the TPU is a topology libtpu compiles for (payload/cli.py).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from payload.backends.jax import use_jax  # noqa: E402

use_jax()

import keras  # noqa: E402

from payload.backends.jax import aot, steps  # noqa: E402
from payload.backends.jax import hlo as hlo_lib  # noqa: E402
from payload.core.errors import UserError  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.plan import accelerators, estimate  # noqa: E402
from payload.spec import FAMILIES_FOR_OBJECTIVE, JobSpec, parse_job  # noqa: E402

GIB = 2**30


def job_of(args: argparse.Namespace, remat: str) -> JobSpec:
    """The case as a job, as `tpu-payload compile --job` would read it (nothing is written)."""
    chips = estimate.accelerator(args.accelerator).chips
    nowhere = str(Path(tempfile.gettempdir(), "bench-tpu-compile"))
    (objective,) = [o for o, families in FAMILIES_FOR_OBJECTIVE.items() if args.family in families]
    document = {
        "name": "bench",
        "output": nowhere,
        "corpus": {"paths": [f"{nowhere}.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": args.vocab},
        # The family's own objective (BERT/RoBERTa: MLM, ELECTRA: RTD, decoders: CLM).
        "data": {"objective": objective, "seq_length": args.seq, "eval_fraction": 0},
        "model": {"family": args.family, "size": args.size, "config": json.loads(args.config)},
        "train": {
            "backend": "jax",
            "global_batch_size": args.batch_per_chip * chips,
            "steps": 10,
            "sharding": args.sharding,
            "remat": remat,
            "attention": args.attention,
        },
    }
    return parse_job(document, source=f"{nowhere}.yaml", check_model=False)


def measure(args: argparse.Namespace, remat: str) -> dict[str, Any]:
    """One case: `args.accelerator` and `args.size` name one accelerator and one preset."""
    job = job_of(args, remat)  # first: a job the spec refuses fails before minutes of compiling
    acc = estimate.accelerator(args.accelerator)
    topology = accelerators.topology_of(acc)
    devices = aot.devices_of(topology)
    facts = aot.facts_of(acc, topology, devices)
    data = aot.data_facts(job)
    if args.loss_chunk_mib:
        defaults = steps.chunked_loss_terms.__kwdefaults__
        assert defaults is not None
        defaults["budget"] = args.loss_chunk_mib * 2**20
    start = time.perf_counter()
    programs = aot.build_for(job, facts, devices, data=data)  # program.build, lowered
    lowered_at, cpu_at = time.perf_counter(), time.process_time()
    compiled = programs.train_chunk()
    done, cpu_done = time.perf_counter(), time.process_time()
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if args.hlo_dir:
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        name = f"{args.family}-{args.size}-{args.accelerator}-{remat}.hlo.txt"
        Path(args.hlo_dir, name).write_text(text, encoding="utf-8")
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    shape = estimate.model_shape(args.family, args.size, json.loads(args.config), args.vocab)
    program = hlo_lib.summarize(text, causal=shape.causal)
    rt = programs.rt
    config = data.config
    keras.backend.clear_session()
    return {
        "accelerator": args.accelerator,
        "topology": topology.describe(),
        "family": args.family,
        "size": args.size,
        "remat": remat,
        "attention": rt.attention.implementation if rt.attention else "reference",
        "parameters": int(configs.parameter_count(args.family, config)),
        "layers": int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0)),
        "chips": acc.chips,
        "mesh": rt.mesh_plan.describe(),
        "steps_per_call": rt.steps_per_execution,
        "lower_s": round(lowered_at - start, 1),
        "compile_s": round(done - lowered_at, 1),
        # CPU seconds of every thread of this process: what a loaded machine does not change.
        "compile_cpu_s": round(cpu_done - cpu_at, 1),
        "argument": int(memory.argument_size_in_bytes),
        "output": int(memory.output_size_in_bytes),
        "alias": int(memory.alias_size_in_bytes),
        "temp": int(memory.temp_size_in_bytes),
        "code": int(memory.generated_code_size_in_bytes),
        "total": int(total),
        # One step: the step loop's body once, the rest of the call once.
        "step_flops_per_device": program.total_flops(),
        **program.to_dict(),
        **plan_columns(job, acc, remat),
    }


def plan_columns(job: JobSpec, acc: Any, remat: str) -> dict[str, Any]:
    """The plan's bytes per chip and flops per step for the same job (payload/plan/estimate.py)."""
    plan = estimate.plan_job(job, acc)
    layout = plan.layout(plan.sharding, plan.remat)
    tokens = job.train.global_batch_size * job.data.seq_length
    return {
        "plan_total": int(layout.total),
        "plan_code": int(layout.code),
        "plan_step_flops": float(plan.step_flops),
        "plan_model_flops": float(plan.flops_per_token * tokens),
    }


MARKDOWN_HEAD = (
    "| preset | accelerator | train.remat | compiler: total + code per chip | plan "
    "| plan / compiler | generated code | compile s (CPU s) | flops: compiler / plan |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def markdown_row(row: dict[str, Any]) -> str:
    flops = row["step_flops_per_device"] * row["chips"] / row["plan_step_flops"]
    return (
        f"| `{row['size']}` | `{row['accelerator']}` | {row['remat']} | "
        f"{(row['total'] + row['code']) / GIB:.2f} GiB | {row['plan_total'] / GIB:.2f} GiB | "
        f"{row['plan_total'] / (row['total'] + row['code']):.2f} | {row['code'] / 2**20:.1f} MiB | "
        f"{row['compile_s']:.0f} ({row['compile_cpu_s']:.0f}) | {flops:.3f} |"
    )


def main() -> int:
    args = ARGS
    assert args is not None
    try:
        return _main(args)
    except UserError as exc:  # an unknown accelerator, a job the spec refuses: one line
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.markdown and args.rows:
        print(MARKDOWN_HEAD)
        for line in Path(args.rows).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            case = argparse.Namespace(**{**vars(args), "size": row["size"]})
            case.accelerator = row["accelerator"]
            case.family = row["family"]
            acc = estimate.accelerator(row["accelerator"])
            replanned = plan_columns(job_of(case, row["remat"]), acc, row["remat"])
            print(markdown_row({**row, **replanned}))
        return 0
    if args.markdown:
        print(MARKDOWN_HEAD, flush=True)
        for size in args.size.split(","):
            for accelerator in args.accelerator.split(","):
                for remat in args.remat.split(","):
                    case = argparse.Namespace(**{**vars(args), "size": size})
                    case.accelerator = accelerator
                    print(markdown_row(measure(case, remat)), flush=True)
        return 0
    for remat in args.remat.split(","):
        row = measure(args, remat)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        per_chip = row["step_flops_per_device"]
        step = per_chip * row["chips"]
        print(
            f"{row['family']} {row['size']} on {row['accelerator']} ({row['topology']}, "
            f"{row['chips']} chips, {row['mesh']}; {row['steps_per_call']} steps per call), "
            f"train.remat {remat}, {row['attention']}: compile {row['compile_s']} s "
            f"({row['compile_cpu_s']} s of CPU; lowering {row['lower_s']} s)\n"
            f"  per chip: arguments {row['argument'] / GIB:.2f} GiB, outputs "
            f"{row['output'] / GIB:.2f}, aliased {row['alias'] / GIB:.2f}, temporaries "
            f"{row['temp'] / GIB:.2f}, total {row['total'] / GIB:.2f} GiB; generated code "
            f"{row['code'] / 2**20:.1f} MiB (plan {row['plan_code'] / 2**20:.1f}); total + code "
            f"{(row['total'] + row['code']) / GIB:.2f} GiB (plan {row['plan_total'] / GIB:.2f})\n"
            f"  while loops (trip counts; None: the step loop): {row['loops']}; Mosaic "
            f"kernels [instances, runs per step, per call]: {row['kernels']}\n"
            f"  all-gathered bytes per chip by dtype, per step: {row['all_gathers_per_step']}, "
            f"per call: {row['all_gathers_per_call']}\n"
            f"  flops per step: {step / 1e12:.2f} T ({per_chip / 1e12:.3f} T per "
            f"chip), plan {row['plan_step_flops'] / 1e12:.2f} T (model flops "
            f"{row['plan_model_flops'] / 1e12:.2f} T)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
