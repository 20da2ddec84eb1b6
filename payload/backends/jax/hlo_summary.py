"""What a compiled program does per training step, read off its optimized HLO text
(`compiled.as_text()`): matmul FLOPs and collectives counted with loop trip counts, and the
Mosaic (Pallas) kernels it calls. Text only (no JAX): tested on recorded HLO.

Why not XLA's `cost_analysis()`: it counts a while loop's body once, whatever its trip
count, and a custom call (a Pallas kernel: splash attention) not at all. Here:
- every computation's multiplicity is the number of times one call of the program runs it:
  a while loop with a known trip count (XLA's `known_trip_count` in its backend_config: a
  `lax.scan`, a `fori_loop` with static bounds) multiplies its body by it; a loop without
  one is the training chunk's `fori_loop` over its traced step count `n`: its body runs once
  PER STEP, which is what is reported ("per step"); what runs outside it runs once per
  call ("per call": the chunk's few setup instructions);
- a matmul is a `dot` (lhs_contracting_dims) or a `convolution` (the TPU compiler writes
  dots as convolutions: dim_labels name the kernel's output-feature dimension `o`):
  2 x (output elements) x (products summed per output element), wherever it is, fused or
  not (instruction names are unique in a module, so operand shapes come from their
  definitions);
- a collective (mesh.COLLECTIVES, or its async `-start` form) counts the bytes of its
  result on one chip (an all-gather's gathered array, a reduce-scatter's piece, an
  all-reduce's array);
- a Mosaic kernel is a custom call to `tpu_custom_call` (its instruction is named after the
  Pallas kernel, e.g. splash_mha_fwd...); its FLOPs are invisible here and are added by the
  caller from the plan's attention formula (aot.py).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
MOSAIC_TARGET = "tpu_custom_call"
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclass
class Instruction:
    name: str
    type_text: str  # the result type: f32[8,16]{1,0} or a tuple (...)
    op: str
    rest: str  # operands and attributes

    def operands(self) -> list[str]:
        head = self.rest.split(")", 1)[0]
        return re.findall(r"%([\w.\-]+)", head)

    def attribute(self, name: str) -> str | None:
        match = re.search(rf"\b{name}=([^ ,]+(?:\{{[^}}]*\}})?)", self.rest)
        return match.group(1) if match else None


@dataclass
class Module:
    computations: dict[str, list[Instruction]] = field(default_factory=dict)
    entry: str = ""
    types: dict[str, str] = field(default_factory=dict)  # instruction name -> result type


def parse(text: str) -> Module:
    """The computations of an HLO module's text, their instructions, and every
    instruction's result type by name."""
    module = Module()
    current: list[Instruction] | None = None
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match and not line.lstrip().startswith("HloModule"):
                current = module.computations.setdefault(match.group(2), [])
                if match.group(1):
                    module.entry = match.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, type_text, op, rest = match.groups()
        instruction = Instruction(name, type_text, op, rest)
        current.append(instruction)
        module.types[name] = type_text
    return module


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(dtype, shape), ...] of a result type (one array, or a tuple's arrays)."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype in DTYPE_BYTES
    ]


def nbytes(type_text: str) -> int:
    return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in arrays(type_text))


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
    """[(role, computation), ...] that an instruction calls."""
    found = [(role, name) for role, name in _CALLEE.findall(instruction.rest)]
    for group in _CALLEES.findall(instruction.rest):
        found += [("call", name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
    return found


def trip_count(instruction: Instruction) -> int | None:
    match = _TRIP.search(instruction.rest)
    return int(match.group(1)) if match else None


def multiplicities(module: Module) -> dict[str, tuple[int, int]]:
    """computation -> (runs per call of the program outside the step loop, runs per step):
    module docstring."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:  # post-order over the call graph (a DAG)
        stack = [(name, iter(_callee_names(module, name)))]
        seen.add(name)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                order.append(node)
                stack.pop()
            elif child not in seen and child in module.computations:
                seen.add(child)
                stack.append((child, iter(_callee_names(module, child))))

    visit(module.entry)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    counts[module.entry] = [1, 0]
    for name in reversed(order):  # callers before their callees
        call, step = counts[name]
        for instruction in module.computations.get(name, []):
            trips = trip_count(instruction) if instruction.op == "while" else None
            for role, callee in _callees(instruction):
                add = (call, step)
                if instruction.op == "while" and role in ("body", "condition"):
                    # No trip count: the step loop, whose body runs once per step.
                    add = (0, call + step) if trips is None else (call * trips, step * trips)
                counts[callee][0] += add[0]
                counts[callee][1] += add[1]
    return {name: (c[0], c[1]) for name, c in counts.items()}


def _callee_names(module: Module, name: str) -> list[str]:
    return [c for i in module.computations.get(name, []) for _, c in _callees(i)]


def matmul_flops(instruction: Instruction, types: dict[str, str]) -> int:
    """2 x output elements x products per output element of a dot or convolution (0 for
    any other instruction, or one whose operand shapes are not in `types`)."""
    out = arrays(instruction.type_text)
    operands = instruction.operands()
    if instruction.op == "dot" and out and operands:
        lhs = arrays(types.get(operands[0], ""))
        dims = instruction.attribute("lhs_contracting_dims") or "{}"
        contracted = [int(d) for d in re.findall(r"\d+", dims)]
        if lhs:
            return 2 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in contracted)
    if instruction.op == "convolution" and out and len(operands) > 1:
        rhs = arrays(types.get(operands[1], ""))
        labels = (instruction.attribute("dim_labels") or "").split("_")
        kernel_labels = labels[1].split("->")[0] if len(labels) > 1 else ""
        if rhs and len(kernel_labels) == len(rhs[0][1]) and "o" in kernel_labels:
            kernel = rhs[0][1]
            per_output = math.prod(kernel) // max(kernel[kernel_labels.index("o")], 1)
            return 2 * math.prod(out[0][1]) * per_output
    return 0


@dataclass
class Summary:
    """A program's per-step and per-call figures (module docstring)."""

    flops_per_step: int = 0
    flops_per_call: int = 0
    # kind -> [count, bytes] per step / per call
    collectives_per_step: dict[str, list[int]] = field(default_factory=dict)
    collectives_per_call: dict[str, list[int]] = field(default_factory=dict)
    # kernel name -> [instructions, runs per step]
    kernels: dict[str, list[int]] = field(default_factory=dict)
    step_loop: bool = False  # whether a loop without a trip count (the step loop) was found

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.__dict__))


def _kernel_name(instruction: Instruction) -> str:
    return re.sub(r"(\.\d+)+$", "", instruction.name)


def summarize(text: str) -> Summary:
    """The per-step matmul FLOPs, collectives and Mosaic kernels of an optimized HLO module."""
    module = parse(text)
    counts = multiplicities(module)
    summary = Summary()
    for name, instructions in module.computations.items():
        call, step = counts.get(name, (0, 0))
        if not (call or step):
            continue
        for instruction in instructions:
            if instruction.op == "while" and trip_count(instruction) is None:
                summary.step_loop = True
            flops = matmul_flops(instruction, module.types)
            summary.flops_per_step += flops * step
            summary.flops_per_call += flops * call
            kind = instruction.op.removesuffix("-start")
            if kind in COLLECTIVES and not instruction.op.endswith("-done"):
                found = arrays(instruction.type_text)
                if instruction.op == "all-gather-start" and len(found) > 1:
                    found = found[len(found) // 2 :]  # (operands, results)
                size = sum(DTYPE_BYTES[d] * math.prod(s) for d, s in found)
                for table, times in (
                    (summary.collectives_per_step, step),
                    (summary.collectives_per_call, call),
                ):
                    if times:
                        row = table.setdefault(kind, [0, 0])
                        row[0] += times
                        row[1] += size * times
            if instruction.op == "custom-call" and f'"{MOSAIC_TARGET}"' in instruction.rest:
                row = summary.kernels.setdefault(_kernel_name(instruction), [0, 0])
                row[0] += 1
                row[1] += step
    return summary
