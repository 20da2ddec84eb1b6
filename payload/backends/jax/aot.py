"""`tpu-payload compile --job JOB --accelerator TYPE [--json]`: the trainer's programs compiled
for a TPU type's topology on this machine, before the TPU exists.

The `libtpu` wheel of the TPU environment (.venv-tpu-jax) compiles for any TPU topology on a
CPU-only machine: `jax.experimental.topologies.get_topology_desc` gives the topology's
compile-only devices (MaxText's train_compile.py does the same). The mesh over them, the
facts of the type (payload/plan/accelerators.yaml: chips, hosts, HBM per chip; the chip kind from
the topology) and the job go through the trainer's own builder (program.py), so what is
compiled is what the trainer on that type compiles. Reported per chip: XLA's memory analysis
(arguments, outputs, temporaries, generated code, their total against the chip's HBM) beside
the plan's estimate (payload/plan/estimate.py), the attention kernel and why, the Mosaic kernels in
the program, the collectives per step by kind and bytes, the all-gathered bytes by dtype and
the FLOPs per step (hlo.py: read off the optimized HLO with loop trip counts; the Pallas
kernels' FLOPs from the plan's attention term), the compile seconds, and the programs'
fingerprints (the trainer logs the same ones).

Exit 0 when the programs compile; 2 with one line when they do not fit (the compiler's own
message, and the largest global batch that compiles, found by compiling smaller ones:
halving the micro-batch per chip, at most SEARCH_COMPILES compiles), for a GPU type (the GPU
compiler needs a GPU), without libtpu, or on bad input.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402

from payload.backends import quiet  # noqa: E402
from payload.backends.jax import hlo, program  # noqa: E402
from payload.backends.jax import runtime as runtime_lib  # noqa: E402
from payload.core.errors import TRANSIENT_EXIT, SpecError, TransientError, UserError  # noqa: E402
from payload.model import configs, kernels  # noqa: E402
from payload.plan import estimate as plan_lib  # noqa: E402
from payload.plan.accelerators import Topology, topology_of  # noqa: E402

if TYPE_CHECKING:
    from payload.spec import JobSpec

# At most this many extra compiles look for a global batch that fits (module docstring).
SEARCH_COMPILES = 3
# libtpu's start-up notices on a machine without a TPU (it looks for one when the topology
# API first loads it); they say nothing about the compile.
_NO_TPU_NOTICE = re.compile(
    r"WARNING: (could not determine TPU|Logging before InitGoogle)|Failed to find host bounds"
    r"|=== Source Location Trace|learning/\S+\.cc:\d+"
)


class CompileError(UserError):
    """What `compile` cannot do here, or a job that does not fit (one line)."""


def devices_of(topology: Topology, *, verbose: bool = False) -> list[Any]:
    """The topology's compile-only devices (libtpu; nothing is attached). libtpu's notices
    that it found no TPU here are dropped unless `verbose`."""
    from importlib.util import find_spec  # noqa: PLC0415

    if find_spec("libtpu") is None:
        raise CompileError(
            f"compile needs the TPU compiler (the libtpu wheel), which this environment (jax "
            f"{jax.__version__}) lacks: run it from the TPU environment (`make venv-tpu-jax`; "
            ".venv-tpu-jax/bin/tpu-payload compile ...)"
        )
    from jax.experimental import topologies  # noqa: PLC0415

    # libtpu takes /tmp/libtpu_lockfile when it loads, so that one process owns a host's
    # chips; a compile opens no chip, and must not fail (or block a trainer) because another
    # process on this machine loaded libtpu (libtpu's own switch, read when it loads).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    dropped = (
        contextlib.nullcontext() if verbose else quiet.framework_lines_dropped(also=_NO_TPU_NOTICE)
    )
    with dropped:
        description = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology.name,
            chip_config_name=topology.chip_config,
            chips_per_host_bounds=topology.chips_per_host_bounds,
            num_slices=1,
            wrap=topology.wrap,
        )
    return list(description.devices)


def facts_of(acc: plan_lib.Accelerator, topology: Topology, devices: list[Any]) -> Any:
    """The runtime facts of a TPU type (runtime.Facts): its chip kind as the topology names
    it (the kernels table's chip, as the trainer's chip_of reads it from a real TPU), its HBM
    per chip from the catalog, process 0 of its hosts."""
    kind = str(devices[0].device_kind)
    return runtime_lib.Facts(
        platform="tpu",
        device_kind=kind,
        chip=kernels.device_chip("tpu", "", kind, None),
        local_devices=acc.chips // topology.hosts,
        device_memory=acc.memory_bytes,
        memory_source=f"{acc.generation}'s HBM per chip, payload/plan/accelerators.yaml",
        process_index=0,
        process_count=topology.hosts,
    )


@dataclass(frozen=True)
class DataFacts:
    """What the programs need of the data: from the job's manifest when its data is encoded
    here, else from the job (the tokenizer's vocabulary size, no special ids)."""

    config: Any
    seq_length: int
    eval_records: int | None  # None: the job's held-out split, assumed >= a global batch
    source: str


def data_facts(job: JobSpec) -> DataFacts:
    from payload.schema import manifest as manifest_lib  # noqa: PLC0415

    data = job.paths.data
    if "://" not in data and Path(data, manifest_lib.MANIFEST_NAME).is_file():
        manifest = manifest_lib.load_manifest(data)
        return DataFacts(
            configs.config_for(job, manifest),
            int(manifest.seq_length),
            int(manifest.eval_records),
            f"the manifest in {data}",
        )
    config = configs.build_config(
        job.model.family,
        job.model.size,
        job.model.config,
        vocab_size=job.tokenizer.vocab_size,
        special_ids={},
    )
    eval_records = None if job.data.eval_fraction > 0 else 0
    return DataFacts(
        config,
        int(job.data.seq_length),
        eval_records,
        "the job (not encoded here: vocabulary tokenizer.vocab_size, no special ids)",
    )


def build_for(
    job: JobSpec,
    facts: Any,
    devices: list[Any],
    *,
    data: DataFacts | None = None,
    global_batch: int | None = None,
) -> program.Programs:
    """The trainer's programs for `job` on `devices` with `facts` (the compile path: the
    trainer's train._build/_programs do the same with its real devices and manifest)."""
    from payload.training import heldout  # noqa: PLC0415

    data = data or data_facts(job)
    parameters = configs.parameter_count(job.model.family, data.config)
    rt = runtime_lib.runtime_of(
        facts,
        devices,
        precision=job.train.precision,
        sharding=job.train.sharding,
        parameters=parameters,
    )
    rows = int(global_batch or job.train.global_batch_size)
    runtime_lib.check_global_batch(rows, rt, job.train.grad_accum_steps)
    if data.eval_records is None:
        eval_batch: int | None = rows
    elif data.eval_records:
        eval_batch = heldout.eval_batch_size(data.eval_records, rows, rt.num_replicas) or None
    else:
        eval_batch = None
    return program.build(
        job, data.config, rt, seq_length=data.seq_length, eval_batch=eval_batch, global_batch=rows
    )


# ------------------------------------------------------------------------------ compiling


@dataclass
class Compiled:
    """One program compiled: XLA's memory analysis per chip, its HLO's figures, seconds."""

    name: str
    seconds: float
    memory: dict[str, int]
    summary: hlo.Summary

    @property
    def total(self) -> int:
        m = self.memory
        return m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["code"]


def _memory(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    return {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
        "code": int(stats.generated_code_size_in_bytes),
    }


def _compile(name: str, lowered: Any) -> Compiled:
    started = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - started
    return Compiled(name, seconds, _memory(compiled), hlo.summarize(compiled.as_text()))


@dataclass
class Report:
    job: str
    accelerator: str
    topology: str
    chips: int
    hbm_bytes: int
    data_source: str
    runtime: dict[str, Any]
    global_batch: int
    per_chip_batch: int
    programs: list[Compiled] = field(default_factory=list)
    fingerprints: dict[str, str] = field(default_factory=dict)
    plan: dict[str, int] = field(default_factory=dict)
    model_flops_per_step: float = 0.0  # per chip, the plan's formula
    kernel_flops_per_step: float = 0.0  # per chip, the plan's attention term (Pallas kernels)
    fits: bool = True
    refusal: str | None = None
    largest_batch: int | None = None
    tried: list[tuple[int, str]] = field(default_factory=list)
    lowering_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "programs"}
        out["programs"] = {
            p.name: {
                "seconds": round(p.seconds, 1),
                "memory": {**p.memory, "total": p.total},
                **p.summary.to_dict(),
            }
            for p in self.programs
        }
        return out


def _plan_columns(plan: plan_lib.Plan, sharding: str, remat: str, batch_bytes: int) -> dict:
    layout = plan.layout(sharding, remat)
    state = layout.weights + layout.slots
    # The compiler counts its scratch and its heap's slack among the temporaries (plan.py).
    temporaries = layout.gradients + layout.gathered + layout.activations + layout.reserve
    return {
        "arguments": state + batch_bytes,
        "outputs": state,
        "aliased": state,
        "temporaries": temporaries,
        "code": 0,
        "total": state + batch_bytes + temporaries,
    }


def _batch_bytes(specs: dict[str, Any], chips: int) -> int:
    total = sum(s.size * s.dtype.itemsize for s in specs.values())
    return int(total) // chips


def compile_job(job: JobSpec, accelerator: str, *, verbose: bool = False) -> Report:
    """Compile the job's programs for `accelerator` (module docstring)."""
    acc = plan_lib.accelerator(accelerator)
    topology = topology_of(acc)
    devices = devices_of(topology, verbose=verbose)
    facts = facts_of(acc, topology, devices)
    data = data_facts(job)
    started = time.perf_counter()
    programs = build_for(job, facts, devices, data=data)
    lowering = time.perf_counter() - started
    rt = programs.rt
    rows = job.train.global_batch_size
    report = Report(
        job=job.name,
        accelerator=acc.name,
        topology=topology.describe(),
        chips=acc.chips,
        hbm_bytes=acc.memory_bytes,
        data_source=data.source,
        runtime=rt.describe(),
        global_batch=rows,
        per_chip_batch=rows // (acc.chips * job.train.grad_accum_steps),
        fingerprints=programs.fingerprints(),
        lowering_seconds=lowering,
    )
    plan = plan_lib.plan_job(job, acc)
    report.plan = _plan_columns(
        plan,
        rt.mesh_plan.sharding,
        job.train.remat,
        _batch_bytes(programs.train_batches, acc.chips),
    )
    shape = plan_lib.model_shape(
        job.model.family, job.model.size, job.model.config, job.tokenizer.vocab_size
    )
    tokens_per_chip = rows * data.seq_length / acc.chips
    report.model_flops_per_step = plan_lib.flops_per_token(shape, data.seq_length) * tokens_per_chip
    if rt.attention is not None and rt.attention.implementation != "reference":
        attention = plan_lib.attention_flops_per_token(shape, data.seq_length)
        report.kernel_flops_per_step = attention * tokens_per_chip
    try:
        report.programs.append(_compile("training chunk", programs.train_lowered))
        if programs.eval_lowered is not None:
            report.programs.append(_compile("evaluation step", programs.eval_lowered))
    except Exception as exc:  # the compiler's own error: out of memory, or a bug (re-raised)
        message = hlo.out_of_memory(exc)
        if message is None:
            raise
        report.fits = False
        report.refusal = message
        _search_batch(job, facts, devices, data, report)
    return report


def _search_batch(
    job: JobSpec, facts: Any, devices: list[Any], data: DataFacts, report: Report
) -> None:
    """The largest global batch, halving the micro-batch per chip, whose training chunk
    compiles (at most SEARCH_COMPILES compiles)."""
    split = report.chips * job.train.grad_accum_steps
    per_chip = report.per_chip_batch // 2
    for _ in range(SEARCH_COMPILES):
        if per_chip < 1:
            return
        rows = per_chip * split
        programs = build_for(job, facts, devices, data=data, global_batch=rows)
        try:
            programs.train_lowered.compile()
        except Exception as exc:
            message = hlo.out_of_memory(exc)
            if message is None:
                raise
            report.tried.append((rows, "out of memory"))
            per_chip //= 2
            continue
        report.tried.append((rows, "compiles"))
        report.largest_batch = rows
        return


# ------------------------------------------------------------------------------ rendering


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB / KiB below them (a tiny model's figures stay readable)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= size / 10:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n / 1e6:.3f} MFLOP"


def format_report(report: Report) -> str:
    rt = report.runtime
    attention = rt.get("attention", {})
    lines = [
        f"job {report.job} on {report.accelerator}: {report.chips} chips ({report.topology}), "
        f"{_gib(report.hbm_bytes)} HBM per chip; compiled here by libtpu through jax "
        f"{jax.__version__} (lowering {report.lowering_seconds:.0f} s)",
        f"mesh data {rt['mesh']['data']} x fsdp {rt['mesh']['fsdp']} ({rt['sharding_reason']}); "
        f"{rt['policy']}; {rt['steps_per_execution']} steps per call; global batch "
        f"{report.global_batch} ({report.per_chip_batch} per chip per micro-batch); data from "
        f"{report.data_source}",
        f"attention: {attention.get('implementation')} ({attention.get('reason')})",
    ]
    if not report.fits:
        lines.append(f"does NOT fit: {report.refusal}")
        for rows, outcome in report.tried:
            lines.append(f"  global batch {rows}: {outcome}")
        return "\n".join(lines) + "\n"
    keys = ("arguments", "outputs", "aliased", "temporaries", "code")
    names = {"aliased": "aliased (donated)", "code": "generated code"}
    for compiled in report.programs:
        summary = compiled.summary
        lines.append("")
        lines.append(f"{compiled.name}: compiled in {compiled.seconds:.0f} s; per chip")
        plan = report.plan if compiled.name == "training chunk" else {}
        lines.append(f"  {'':<20}{'compiler':>12}{'plan':>12}")
        for key in keys:
            estimate = _gib(plan[key]) if plan.get(key) else "-"
            lines.append(
                f"  {names.get(key, key):<20}{_gib(compiled.memory[key]):>12}{estimate:>12}"
            )
        total_plan = _gib(plan["total"]) if plan else "-"
        lines.append(
            f"  {'total':<20}{_gib(compiled.total):>12}{total_plan:>12}  of "
            f"{_gib(report.hbm_bytes)} HBM ({compiled.total / report.hbm_bytes:.0%})"
        )
        step = summary.step_loop
        per = "step" if step else "call"
        runs = 1 if step else 2  # the kernels' [instances, runs per step, runs per call]
        kernels = "; ".join(
            f"{name} x{row[0]}, run {row[runs]}x per {per}"
            for name, row in sorted(summary.kernels.items())
        )
        lines.append(f"  Mosaic kernels: {sum(r[0] for r in summary.kernels.values())}"
                     + (f" ({kernels})" if kernels else ""))  # fmt: skip
        if summary.relaid_state:
            lines.append(
                f"  step loop: {summary.relaid_state} arrays of the state carried in another "
                "layout than the arguments' (each copied in and out of the loop)"
            )
        table = summary.collectives_per_step if step else summary.collectives_per_call
        collectives = "; ".join(
            f"{kind} x{count} {_gib(size)}" for kind, (count, size) in sorted(table.items())
        )
        lines.append(f"  collectives per {per}: {collectives or 'none'}")
        gathers = summary.all_gathers_per_step if step else summary.all_gathers_per_call
        if gathers:
            by_dtype = ", ".join(f"{dtype} {_gib(size)}" for dtype, size in gathers.items())
            lines.append(f"  all-gathered per {per} by dtype: {by_dtype}")
        matmuls = summary.flops_per_step if step else summary.flops_per_call
        if compiled.name == "training chunk":
            total = matmuls + report.kernel_flops_per_step
            ratio = total / report.model_flops_per_step
            lines.append(
                f"  FLOPs per step per chip: {_flops(total)} = matmuls {_flops(matmuls)} (HLO, "
                f"with trip counts) + Pallas kernels {_flops(report.kernel_flops_per_step)} "
                f"(the plan's attention term); x{ratio:.2f} the plan's model FLOPs "
                f"{_flops(report.model_flops_per_step)} (above: recomputed work; below: MLM's "
                "head at the masked positions only)"
            )
        else:
            lines.append(f"  matmul FLOPs per held-out batch per chip: {_flops(matmuls)}")
    prints = ", ".join(f"{k} {v}" for k, v in report.fingerprints.items())
    lines += ["", f"programs (sha256 of the lowered text, as the trainer logs them): {prints}"]
    return "\n".join(lines) + "\n"


def run(job_path: str, accelerator: str, *, as_json: bool, verbose: bool = False) -> int:
    """`tpu-payload compile`: 0 compiled, 2 does not fit or bad input (one line)."""
    try:
        job = plan_lib.load_job(job_path)  # a job template plans too (output filled in)
        if job.train.backend == "tf":
            raise SpecError(
                "train.backend: tf: compile builds the JAX trainer's programs; the TF backend "
                "compiles its own (set train.backend: jax or auto)"
            )
        report = compile_job(job, accelerator, verbose=verbose)
    except (UserError, TransientError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2 if isinstance(exc, UserError) else TRANSIENT_EXIT
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        sys.stdout.write(format_report(report))
    if not report.fits:
        refusal = (report.refusal or "").rstrip(".")
        largest = (
            f"the largest global batch that compiles: {report.largest_batch}"
            if report.largest_batch
            else "no smaller global batch tried compiles ("
            + ", ".join(str(rows) for rows, _ in report.tried)
            + ")"
        )
        print(
            f"error: {job.name} does not fit {accelerator}: {refusal}; {largest}",
            file=sys.stderr,
        )
        return 2
    return 0
