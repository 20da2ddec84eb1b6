"""What a compiled program does, read from its optimized HLO text (`compiled.as_text()`): its
while loops and their trip counts, its Pallas (Mosaic) kernels, its all-gathers by dtype and
its matmul flops counted with the loops' trip counts. Pure text parsing, no JAX: it reads the
TPU compiler's program on a machine without a TPU (bench/bench_tpu_compile.py) as well as
the CPU's.

Why not XLA's `cost_analysis()`: it counts a while loop's body once, whatever its trip count
(the scan over a decoder's L layers is one body), and a Pallas kernel (a custom call) not at
all. Here:
- a computation's flops are those of its matmuls: `dot` (2 x the output's elements x the
  contracted size) and `convolution`, as which the TPU compiler writes most matmuls (2 x the
  output's elements x the kernel's elements per output feature); elementwise work, reductions
  and the softmax's exponentials are not counted (MaxText's and the plan's model flops count
  matmuls only);
- a fusion or call adds its computation's flops, a conditional its most expensive branch, a
  while loop its trip count x its body's: the trip count of a loop whose condition compares
  its counter with a constant (`compare(i, N), direction=LT`, how `lax.scan` and
  `lax.fori_loop` with static bounds lower, counting from 0, by the body's constant step),
  or the `known_trip_count` XLA's CPU and GPU pipelines write on the loop;
- a splash-attention kernel (`splash_mha_fwd` / `_dq` / `_dkv`, jax's Pallas TPU kernel)
  adds the matmuls it computes, from its query [B, N, T, D] and key [B, K, S, D] operands:
  the forward QK^T and PV (2 x 2BNTSD), dq recomputes QK^T and forms dP and dQ (3 x), dkv
  recomputes QK^T and forms dV, dP and dK (4 x); halved under a causal mask (the masked
  half's blocks are skipped; the diagonal blocks' masked entries are counted as skipped too).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
_DIMS = re.compile(r"(lhs_contracting_dims|rhs_contracting_dims)=\{([\d,]*)\}")
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# The operands' shapes of a custom call (each with its layout in braces).
_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")
# jax.experimental.pallas.ops.tpu.splash_attention: each kernel's matmuls per query-key pair
# and head, in units of 2 x D flops (module docstring).
SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dq": 3, "splash_mha_dkv": 4}


@dataclass
class Instruction:
    name: str
    opcode: str
    shapes: list[tuple[str, tuple[int, ...]]]  # the arrays it produces (a tuple's elements)
    operands: list[str]
    text: str  # everything after the opcode's "("


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _split_type(rest: str) -> tuple[str, str]:
    """('type', 'opcode(...'): a tuple type is parenthesised and may hold spaces."""
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += char == "("
            depth -= char == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def parse(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name (the entry's under "ENTRY" too)."""
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            match = _HEADER.match(line)
            if match:
                current = Computation(match.group(1))
                computations[current.name] = current
                if line.startswith("ENTRY"):
                    computations["ENTRY"] = current
            continue
        if line.rstrip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            # An attribute continued over lines (a kernel's metadata): the last instruction's.
            if current.instructions:
                current.instructions[-1].text += "\n" + line
            continue
        name, rest = match.groups()
        type_text, call = _split_type(rest)
        opcode, _, args = call.partition("(")
        shapes = [
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(type_text)
        ]
        operand_text = args.split(")", 1)[0]
        instruction = Instruction(name, opcode, shapes, _OPERAND.findall(operand_text), args)
        current.instructions.append(instruction)
        if len(shapes) == 1:
            current.shapes[name] = shapes[0][1]
    return computations


def _called(instruction: Instruction) -> list[tuple[str, str]]:
    found = _CALLED.findall(instruction.text)
    branches = _BRANCHES.search(instruction.text)
    if branches:
        found += [("branch", b.strip().lstrip("%")) for b in branches.group(1).split(",")]
    return found


def _constants(comp: Computation) -> dict[str, int]:
    """The integer scalar constants of a computation, by instruction name."""
    found = {}
    for inst in comp.instructions:
        scalar = len(inst.shapes) == 1 and not inst.shapes[0][1]
        if inst.opcode == "constant" and scalar and inst.shapes[0][0][0] in "su":
            found[inst.name] = int(inst.text.split(")", 1)[0])
    return found


def _tuple_index(comp: Computation, name: str) -> int | None:
    """k when instruction `name` is get-tuple-element(<the parameter>), index=k."""
    inst = next((i for i in comp.instructions if i.name == name), None)
    if inst is None or inst.opcode != "get-tuple-element":
        return None
    match = re.search(r"index=(\d+)", inst.text)
    return int(match.group(1)) if match else None


def _bound(computations: dict[str, Computation], condition: str) -> tuple[int, int] | None:
    """(the counter's tuple index, N) of a loop condition `counter < N`, N a constant."""
    comp = computations.get(condition)
    if comp is None:
        return None
    constants = _constants(comp)
    for inst in comp.instructions:
        if inst.opcode != "compare" or "direction=LT" not in inst.text:
            continue
        if len(inst.operands) == 2 and inst.operands[1] in constants:
            index = _tuple_index(comp, inst.operands[0])
            if index is not None:
                return index, constants[inst.operands[1]]
    return None


def _step(computations: dict[str, Computation], body: str, index: int) -> int:
    """How much the loop's `body` adds to its counter (tuple element `index`) per trip: 1
    unless the body's result holds `add(counter, constant)` there (the TPU compiler's
    windowed einsums, which do two steps a trip)."""
    comp = computations.get(body)
    root = (
        next((i for i in reversed(comp.instructions) if i.opcode == "tuple"), None)
        if comp
        else None
    )
    if comp is None or root is None or index >= len(root.operands):
        return 1
    update = next((i for i in comp.instructions if i.name == root.operands[index]), None)
    constants = _constants(comp)
    if update is not None and update.opcode == "add" and len(update.operands) == 2:
        counter, step = update.operands
        if step in constants and _tuple_index(comp, counter) == index:
            return max(constants[step], 1)
    return 1


def loop_trips(computations: dict[str, Computation], inst: Instruction) -> int | None:
    """The trip count of a while instruction: the compiler's own `known_trip_count` where it
    writes one (XLA's CPU and GPU pipelines), else read off its condition and body."""
    known = _KNOWN_TRIPS.search(inst.text)
    if known:
        return int(known.group(1))
    called = dict(_called(inst))
    return trip_count(computations, called.get("condition", ""), called.get("body", ""))


def trip_count(computations: dict[str, Computation], condition: str, body: str = "") -> int | None:
    """The trip count of a while loop whose `condition` is `counter < N` for a constant N,
    the counter starting at 0 (how lax.scan, lax.fori_loop with static bounds and the TPU
    compiler's windowed einsums lower) and moving by the body's constant step."""
    bound = _bound(computations, condition)
    if bound is None:
        return None
    index, limit = bound
    step = _step(computations, body, index) if body else 1
    return -(-limit // step)


def _dot_flops(comp: Computation, inst: Instruction) -> float:
    if not inst.shapes or len(inst.operands) < 2:
        return 0.0
    lhs = comp.shapes.get(inst.operands[0])
    dims = dict(_DIMS.findall(inst.text))
    contracted = [int(d) for d in dims.get("lhs_contracting_dims", "").split(",") if d]
    if lhs is None:
        return 0.0
    size = math.prod(lhs[d] for d in contracted) if contracted else 1
    return 2.0 * math.prod(inst.shapes[0][1]) * size


def _window(text: str) -> dict[str, list[Any]]:
    """A convolution's window attribute: size, pad, stride, lhs_dilate, rhs_dilate per spatial
    dimension (`window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}`)."""
    match = _WINDOW.search(text)
    out: dict[str, list[Any]] = {}
    for item in match.group(1).split() if match else []:
        key, _, value = item.partition("=")
        parts = value.split("x")
        out[key] = [tuple(int(v) for v in p.split("_")) if "_" in p else int(p) for p in parts]
    return out


def _taps(n_out: int, n_in: int, size: int, window: dict[str, list[Any]], d: int) -> int:
    """How many (output position, window position) pairs of spatial dimension `d` read a
    real input element (not padding, not a dilation hole)."""
    low = window.get("pad", [(0, 0)] * (d + 1))[d][0]
    stride = window.get("stride", [1] * (d + 1))[d]
    lhs_dilate = window.get("lhs_dilate", [1] * (d + 1))[d]
    rhs_dilate = window.get("rhs_dilate", [1] * (d + 1))[d]
    count = 0
    for o in range(n_out):
        for k in range(size):
            p = o * stride + k * rhs_dilate - low
            if p >= 0 and p % lhs_dilate == 0 and p // lhs_dilate < n_in:
                count += 1
    return count


def _convolution_flops(comp: Computation, inst: Instruction) -> float:
    """2 x the multiply-adds that read real inputs: the TPU compiler writes matmuls as
    convolutions, some with padded windows that broadcast one operand (a window of size 4
    padded by 3 on both sides over one input element is 4 multiplies, not 16)."""
    if not inst.shapes or len(inst.operands) < 2:
        return 0.0
    lhs = comp.shapes.get(inst.operands[0])
    rhs = comp.shapes.get(inst.operands[1])
    labels = _LABELS.search(inst.text)
    if lhs is None or rhs is None or labels is None:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out = inst.shapes[0][1]
    window = _window(inst.text)
    macs = float(rhs[rhs_labels.index("i")]) if "i" in rhs_labels else 1.0
    for axis, label in enumerate(out_labels):
        if not label.isdigit():
            macs *= out[axis]
            continue
        size = rhs[rhs_labels.index(label)]
        macs *= _taps(out[axis], lhs[lhs_labels.index(label)], size, window, int(label))
    return 2.0 * macs


def _kernel_flops(inst: Instruction, causal: bool) -> tuple[str | None, float]:
    kind = next((k for k in SPLASH_MATMULS if inst.name.startswith(k)), None)
    if kind is None:
        return None, 0.0
    match = _CONSTRAINTS.search(inst.text)
    constraints = match.group(1) if match else ""
    arrays = [
        tuple(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(constraints)
        if dtype in ("bf16", "f16", "f32")
    ]
    arrays = [a for a in arrays if len(a) == 4]
    if len(arrays) < 2:
        return kind, 0.0
    (batch, heads, queries, size), keys = arrays[0], arrays[1][2]
    flops = SPLASH_MATMULS[kind] * 2.0 * batch * heads * queries * keys * size
    return kind, flops / 2 if causal else flops


@dataclass
class Analysis:
    flops: float = 0.0  # per device, one run of the program
    loops: list[tuple[str, int | None]] = field(default_factory=list)  # (body, trip count)
    kernels: dict[str, int] = field(default_factory=dict)  # kernel kind -> instances in text
    all_gathers: dict[str, int] = field(default_factory=dict)  # dtype -> bytes gathered/run


def _own_flops(comp: Computation, inst: Instruction, causal: bool) -> float:
    """The flops of one instruction itself (not of the computations it calls)."""
    if inst.opcode == "dot":
        return _dot_flops(comp, inst)
    if inst.opcode == "convolution":
        return _convolution_flops(comp, inst)
    if inst.opcode == "custom-call":
        return _kernel_flops(inst, causal)[1]
    return 0.0


class _Walker:
    """(flops, all-gathered bytes by dtype) of one run of each computation, memoised."""

    def __init__(self, computations: dict[str, Computation], causal: bool):
        self.computations, self.causal = computations, causal
        self.cache: dict[str, tuple[float, dict[str, float]]] = {}

    def callees(self, inst: Instruction) -> list[tuple[tuple[float, dict[str, float]], float]]:
        """(cost, times) of the computations one instruction runs."""
        called = _called(inst)
        if inst.opcode == "while":
            body = next((n for k, n in called if k == "body"), None)
            trips = loop_trips(self.computations, inst)
            return [(self.walk(body), trips if trips is not None else 1)] if body else []
        if inst.opcode == "conditional":
            branches = [self.walk(n) for k, n in called if k == "branch"]
            return [(max(branches, key=lambda b: b[0]), 1)] if branches else []
        if inst.opcode in _REDUCERS:
            return []
        return [(self.walk(n), 1) for k, n in called if k in ("calls", "to_apply")]

    def walk(self, name: str) -> tuple[float, dict[str, float]]:
        if name in self.cache:
            return self.cache[name]
        flops, gathered = 0.0, dict[str, float]()
        comp = self.computations.get(name)
        for inst in comp.instructions if comp else []:
            flops += _own_flops(comp, inst, self.causal) if comp else 0.0
            if inst.opcode in ("all-gather", "all-gather-start"):
                for dtype, shape in inst.shapes[-1:]:
                    nbytes = float(math.prod(shape) * _itemsize(dtype))
                    gathered[dtype] = gathered.get(dtype, 0.0) + nbytes
            for (part_flops, part_gathered), times in self.callees(inst):
                flops += part_flops * times
                for dtype, part in part_gathered.items():
                    gathered[dtype] = gathered.get(dtype, 0.0) + part * times
        self.cache[name] = (flops, gathered)
        return self.cache[name]


def analyse_program(text: str, *, causal: bool = True) -> Analysis:
    """Flops (per device), loops, kernels and all-gathered bytes by dtype of one run of the
    program (module docstring: how each is counted)."""
    computations = parse(text)
    result = Analysis()
    for name, comp in computations.items():
        if name == "ENTRY":
            continue  # (the entry again, under its own name too)
        for inst in comp.instructions:
            if inst.opcode == "while":
                body = dict(_called(inst)).get("body", "?")
                result.loops.append((body, loop_trips(computations, inst)))
            kind = _kernel_flops(inst, causal)[0] if inst.opcode == "custom-call" else None
            if kind is not None:
                result.kernels[kind] = result.kernels.get(kind, 0) + 1
    if "ENTRY" in computations:
        flops, gathered = _Walker(computations, causal).walk(computations["ENTRY"].name)
        result.flops = flops
        result.all_gathers = {k: int(v) for k, v in sorted(gathered.items())}
    return result


# Ops whose to_apply is a scalar reducer (no matmuls, run per element).
_REDUCERS = ("reduce", "reduce-window", "scatter", "all-reduce", "reduce-scatter", "sort",
             "select-and-scatter", "all-reduce-start", "map")  # fmt: skip
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def analyse(text: str, *, causal: bool = True) -> dict[str, Any]:
    """analyse_program as plain data (bench/bench_tpu_compile.py's JSON)."""
    found = analyse_program(text, causal=causal)
    return {
        "step_flops_per_device": found.flops,
        "loops": [trips for _, trips in found.loops],
        "kernels": found.kernels,
        "all_gathers": found.all_gathers,
    }
