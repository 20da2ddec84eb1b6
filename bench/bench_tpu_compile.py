"""The trainer's compiled chunk for a TPU, compiled ahead of time on this machine (no TPU):
per-chip bytes, compile seconds, the scan over layers, weight gathers' dtypes and flops, from
the TPU compiler's own program (libtpu in .venv-tpu-jax).

    .venv-tpu-jax/bin/python bench/bench_tpu_compile.py --accelerator v5litepod-16 \\
        --size 1b --remat full,minimal [--batch-per-chip 2] [--seq 2048] [--vocab 32000] \\
        [--sharding fsdp] [--attention auto] [--hlo-dir DIR] [--json]

How (the way MaxText's train_compile.py does it): `jax.experimental.topologies.
get_topology_desc` gives the accelerator's chips as abstract devices (TOPOLOGIES: MaxText's
accelerator_to_spec_map.py at e591f30); the mesh of train.sharding is laid over them; the
model and AdamW are built in a Keras StatelessScope that never initialises a variable
(nothing of a 3B model is allocated), their variables become jax.ShapeDtypeStructs sharded by
mesh.partition_spec (the trainer's rule), and steps.make_train_chunk (one optimizer step per
call) is lowered with them and a batch [1, B, S] and compiled for the TPU. Printed per case:
the compiler's memory analysis per chip (arguments, outputs, aliased, temporaries, generated
code; "total" = arguments + outputs - aliased + temporaries, MaxText's
print_compiled_memory_stats), the plan's figure (payload/plan.py) beside it, compile
seconds, and from the optimized HLO (payload/backends/jax/hlo.py): the while loops and their
trip counts (one with trip count L: the scanned decoder layer), Mosaic (Pallas) kernels, the
weight all-gathers by dtype, and flops per step counted with trip counts and the splash
kernels' own matmuls, beside the plan's.

Until the trainer's builder takes a mesh of abstract devices (issue 40, items 1-2), this
script builds the chunk itself, as the trainer would: CPU devices stand in for the chips'
count (XLA_FLAGS --xla_force_host_platform_device_count) because the loss sizes its chunks
by jax.device_count(). Big shapes compile for minutes and take GBs: run one at a time
(`flock /work/wt/bigjob.lock /usr/bin/time -v ...` on a shared machine).
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

# MaxText's accelerator_to_spec_map.py (e591f30): accelerator type -> (topology, chip config,
# chips per host bounds, chips).
TOPOLOGIES = {
    "v4-8": ("v4:2x2x1", "megacore", (2, 2, 1), 4),
    "v5litepod-4": ("v5e:2x2", "default", (2, 2, 1), 4),
    "v5litepod-8": ("v5e:2x4", "default", (2, 2, 1), 8),
    "v5litepod-16": ("v5e:4x4", "default", (2, 2, 1), 16),
    "v5p-8": ("v5:2x2x1", "megacore", (2, 2, 1), 4),
    "v6e-4": ("v6e:2x2", "default", (2, 2, 1), 4),
    "v6e-8": ("v6e:2x4", "default", (2, 2, 1), 8),
}
GIB = 2**30


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--accelerator",
        default="v5litepod-16",
        help=f"one of {', '.join(sorted(TOPOLOGIES))}, or a comma-separated list with --markdown",
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
        "payload/model.py LOSS_CHUNK_BYTES); the plan keeps its own",
    )
    parser.add_argument("--hlo-dir", help="write each case's optimized HLO text here")
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="every size x accelerator x remat: one Markdown table (docs/performance.md's)",
    )
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    chips = max(TOPOLOGIES[name][3] for name in ARGS.accelerator.split(","))
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={chips}"
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # libtpu's lock against two processes on one TPU host: there is no TPU here to share.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from payload.backends.jax import use_jax  # noqa: E402

use_jax()

import jax  # noqa: E402
import keras  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from payload import kernels  # noqa: E402
from payload import model as model_lib  # noqa: E402
from payload import plan as plan_lib  # noqa: E402
from payload.backends.jax import attention as attention_lib  # noqa: E402
from payload.backends.jax import hlo as hlo_lib  # noqa: E402
from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax import models, steps  # noqa: E402
from payload.backends.jax.schedule import create_optimizer  # noqa: E402
from payload.spec import TrainSpec  # noqa: E402


def abstract_devices(accelerator: str) -> list[Any]:
    from jax.experimental import topologies

    name, chip_config, bounds, _ = TOPOLOGIES[accelerator]
    return list(
        topologies.get_topology_desc(
            platform="tpu",
            topology_name=name,
            chip_config_name=chip_config,
            chips_per_host_bounds=bounds,
            num_slices=1,
        ).devices
    )


def build(
    *,
    accelerator: str,
    family: str,
    size: str,
    overrides: dict[str, Any],
    vocab: int,
    seq: int,
    batch_per_chip: int,
    sharding: str,
    remat: str,
    attention_setting: str = "auto",
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(the jitted chunk, its abstract arguments, what was built): the trainer's train chunk
    (steps.make_train_chunk, one step per call) over a mesh of `accelerator`'s abstract
    chips under mixed_bfloat16, as train._build and train's loop would build it."""
    devices = abstract_devices(accelerator)
    count = len(devices)
    mesh_plan = mesh_lib.MeshPlan(
        sharding, count if sharding == "data" else 1, count if sharding == "fsdp" else 1, "bench"
    )
    mesh = mesh_lib.build_mesh(mesh_plan, devices)
    special = {"bos": 0, "pad": 1, "eos": 2}
    config = model_lib.build_config(family, size, overrides, vocab_size=vocab, special_ids=special)
    keras.config.set_dtype_policy("mixed_bfloat16")
    attention = attention_lib.choose(
        attention_setting,
        chip=kernels.device_chip("tpu", "", str(devices[0].device_kind), None),
        family=family,
        config=config,
        seq_length=seq,
        compute_dtype="bfloat16",
        mesh=mesh,
    )
    # AdamW's step counter is created from a concrete value (which a StatelessScope refuses):
    # the optimizer object is made outside, its slots inside.
    optimizer = create_optimizer(TrainSpec(steps=10))
    with keras.StatelessScope(initialize_variables=False):
        model = models.create_model(family, config, seq, remat=remat, attention=attention)
        optimizer.build(model.trainable_variables)

    def abstract(variable: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(int(d) for d in variable.shape)
        spec = mesh_lib.partition_spec(shape, mesh_plan.fsdp, path=variable.path, family=family)
        return jax.ShapeDtypeStruct(shape, variable.dtype, sharding=NamedSharding(mesh, spec))

    state = steps.TrainState(
        [abstract(v) for v in model.trainable_variables],
        [abstract(v) for v in model.non_trainable_variables],
        [abstract(v) for v in optimizer.variables],
    )
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    chunk = steps.make_train_chunk(model, optimizer, "clm", state_sharding=state_sharding)
    rows = batch_per_chip * count
    batch_sharding = mesh_lib.batch_sharding(mesh, chunk=True)
    batch = {
        name: jax.ShapeDtypeStruct((1, rows, seq), dtype, sharding=batch_sharding)
        for name, dtype in (
            ("input_ids", "int32"),
            ("attention_mask", "int32"),
            ("labels", "int32"),
            ("label_weights", "float32"),
        )
    }
    built = {
        "parameters": int(model_lib.parameter_count(family, config)),
        "layers": int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0)),
        "attention": attention.implementation,
        "chips": count,
        "mesh": mesh_plan.describe(),
        "replicated_spec": P(),
    }
    return chunk, (state, batch), built


def measure(args: argparse.Namespace, remat: str) -> dict[str, Any]:
    """One case: `args.accelerator` and `args.size` name one accelerator and one preset."""
    job = plan_job(args, remat)  # first: a job the spec refuses fails before minutes of compiling
    if args.loss_chunk_mib:
        defaults = steps.chunked_loss_terms.__kwdefaults__
        assert defaults is not None
        defaults["budget"] = args.loss_chunk_mib * 2**20
    overrides = json.loads(args.config)
    chunk, arguments, built = build(
        accelerator=args.accelerator,
        family=args.family,
        size=args.size,
        overrides=overrides,
        vocab=args.vocab,
        seq=args.seq,
        batch_per_chip=args.batch_per_chip,
        sharding=args.sharding,
        remat=remat,
        attention_setting=args.attention,
    )
    start = time.perf_counter()
    lowered = chunk.lower(*arguments)
    lowered_at, cpu_at = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
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
    shape = plan_lib.model_shape(args.family, args.size, json.loads(args.config), args.vocab)
    program = hlo_lib.summarize(text, causal=shape.causal)
    keras.backend.clear_session()
    return {
        "accelerator": args.accelerator,
        "family": args.family,
        "size": args.size,
        "remat": remat,
        "attention": built["attention"],
        "parameters": built["parameters"],
        "layers": built["layers"],
        "chips": built["chips"],
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
        # One call of the chunk runs one step: the step loop's body once, the rest once.
        "step_flops_per_device": program.total_flops(),
        **program.to_dict(),
        **job,
    }


def plan_job(args: argparse.Namespace, remat: str) -> dict[str, Any]:
    """The plan's bytes per chip and flops per step for the same job (payload/plan.py)."""
    from payload.spec import parse_job

    chips = TOPOLOGIES[args.accelerator][3]
    nowhere = str(Path(tempfile.gettempdir(), "bench-tpu-compile"))  # the plan writes nothing
    document = {
        "name": "bench",
        "output": nowhere,
        "corpus": {"paths": [f"{nowhere}.txt"]},
        "tokenizer": {"kind": "bpe", "vocab_size": args.vocab},
        "data": {"objective": "clm", "seq_length": args.seq},
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
    job = parse_job(document, source=f"{nowhere}.yaml", check_model=False)
    acc = plan_lib.accelerator(args.accelerator)
    plan = plan_lib.plan_job(job, acc)
    layout = plan.layout(plan.sharding, plan.remat)
    return {
        "plan_total": int(layout.total),
        "plan_code": int(layout.code),
        "plan_step_flops": float(plan.step_flops),
        "plan_model_flops": float(plan.flops_per_token * args.seq * args.batch_per_chip * chips),
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
            f"{row['family']} {row['size']} on {row['accelerator']} ({row['chips']} chips), "
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
