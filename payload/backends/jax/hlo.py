"""What a compiled program does, read off its optimized HLO text (`compiled.as_text()`): its
matmul FLOPs, collectives, all-gathers by dtype and Mosaic (Pallas) kernels, per training
step and per call, counted with its loops' trip counts. Pure text parsing, no JAX: it reads
the TPU compiler's program on a machine without a TPU (`tpu-payload compile`, aot.py;
bench/bench_tpu_compile.py) as well as the CPU's (tests/payload/test_plan_memory.py).

Why not XLA's `cost_analysis()`: it counts a while loop's body once, whatever its trip count
(the scan over a decoder's L layers is one body), and a custom call (a Pallas kernel: splash
attention) not at all. Here:
- how often each computation runs: a fusion or call runs its computation once, a
  conditional its most expensive branch (one branch runs), a while loop its body trip-count
  times. The trip count is the `known_trip_count` XLA's CPU and GPU pipelines write on a
  loop, else it is read off the loop: a condition `counter < N` with N a constant (how
  `lax.scan` and a `fori_loop` with static bounds lower, counting from 0) and the body's
  constant step on the counter (the TPU compiler's windowed einsums do two steps a trip).
  The TPU compiler writes no `known_trip_count` (libtpu 0.0.42.1): its layer scans are
  counted this second way. A loop with neither is the training chunk's `fori_loop` over
  its traced step count: its body runs once PER STEP, and what it holds is reported "per
  step"; what runs outside it, "per call" (the chunk's few setup instructions, or all of
  an evaluation step, which has no step loop);
- matmul FLOPs: a `dot` is 2 x its output's elements x the contracted size; a
  `convolution` (as which the TPU compiler writes most matmuls) 2 x the multiply-adds that
  read a real input element: per output element the kernel's input features, times, per
  spatial dimension, the (output position, window position) pairs that fall on neither
  padding nor a dilation hole (XLA's HloCostAnalysis counts convolutions the same way). A
  padded window that broadcasts one operand, e.g. size 2 padded 1_1 over one element, is
  2 products, not 4. Elementwise work, reductions and exponentials are not counted (the
  plan's and MaxText's model FLOPs count matmuls only);
- kernel FLOPs, only when the caller says whether the mask is causal (`summarize(causal=)`;
  aot.py uses the plan's attention term instead): a splash-attention kernel
  (`splash_mha_fwd` / `_dq` / `_dkv`, jax's Pallas TPU kernels) counts the matmuls it
  computes, from its query [B, N, T, D] and key [B, K, S, D] operands: the forward QK^T and
  PV (2 x 2BNTSD), dq recomputes QK^T and forms dP and dQ (3 x), dkv recomputes QK^T and
  forms dV, dP and dK (4 x); halved under a causal mask (the masked blocks are skipped);
- a collective (COLLECTIVES, or its async `-start` form) counts once, with the bytes of its
  result on one chip (an all-gather's gathered arrays, a reduce-scatter's piece, an
  all-reduce's arrays). An `all-gather-start` or `collective-permute-start` returns
  (operands, results[, context]): only the results count. The TPU compiler splits an async
  collective into a start fusion, continuation fusions (`async_collective_fusion`: the work
  it overlaps) and a done fusion (rooted at an `AsyncCollectiveDone` custom call), each
  holding a copy of the collective with the same channel_id: it is counted in the done
  fusion only. All-gathered bytes are also kept by dtype (FSDP's weight gathers in bf16
  under mixed precision: the CPU's HLO cannot tell);
- a Mosaic kernel is a custom call to `tpu_custom_call`, named after the Pallas kernel
  (`splash_mha_fwd_segmented_residuals`...): its instances in the program and its runs per
  step and per call;
- relaid state: the arrays the step loop carries in a layout that no result of the
  program of their shape has (the layout in braces, its memory space aside): the state,
  which the chunk takes and returns in one layout. Each is copied into that layout on
  entering the loop and back on leaving it, beside the donated argument: the TPU compiler
  does so unless the chunk holds the carried state in the arguments' layouts
  (steps.carried_layouts).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
MOSAIC_TARGET = "tpu_custom_call"
# jax.experimental.pallas.ops.tpu.splash_attention: each kernel's matmuls per query-key pair
# and head, in units of 2 x D flops (module docstring).
SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dq": 3, "splash_mha_dkv": 4}
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_CALLED_GROUP = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
_DIMS = re.compile(r"(lhs_contracting_dims|rhs_contracting_dims)=\{([\d,]*)\}")
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_LAID_OUT = re.compile(r"\b([a-z]\w*\[[\d,]*\])\{([^}]*)\}")
_MEMORY_SPACE = re.compile(r"S\(\d+\)")
_ENTRY_OUTPUTS = re.compile(r"entry_computation_layout=\{\(.*?\)->")
# The operands' shapes of a custom call (each with its layout in braces).
_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")
# Ops whose to_apply is a scalar reducer or comparator (no matmuls, run per element), and
# the async ops that name the computation their `async-start` already ran.
_NOT_CALLED = ("reduce", "reduce-window", "scatter", "all-reduce", "reduce-scatter", "sort",
               "select-and-scatter", "all-reduce-start", "map",
               "async-update", "async-done")  # fmt: skip
# `-start` forms whose result is (operands, results[, context]).
_RESULT_SECOND = ("all-gather-start", "collective-permute-start")


@dataclass
class Instruction:
    name: str
    opcode: str
    type_text: str  # the result type: f32[8,16]{1,0}, or a tuple (...)
    shapes: list[tuple[str, tuple[int, ...]]]  # the arrays it produces (a tuple's elements)
    operands: list[str]
    text: str  # everything after the opcode's "("


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    root: Instruction | None = None


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


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype in DTYPE_BYTES
    ]


def _elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type (the type itself when it is no tuple)."""
    if not type_text.startswith("("):
        return [type_text]
    parts, depth, start = [], 0, 1
    for i, char in enumerate(type_text):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 1 and char == ",":
            parts.append(type_text[start:i])
            start = i + 1
        elif depth == 0:
            parts.append(type_text[start:i])
            break
    return parts


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
        root, name, rest = match.groups()
        type_text, call = _split_type(rest)
        opcode, _, args = call.partition("(")
        shapes = _arrays(type_text)
        operands = _OPERAND.findall(args.split(")", 1)[0])
        instruction = Instruction(name, opcode, type_text, shapes, operands, args)
        current.instructions.append(instruction)
        if root:
            current.root = instruction
        if len(shapes) == 1:
            current.shapes[name] = shapes[0][1]
    return computations


def _called(instruction: Instruction) -> list[tuple[str, str]]:
    """[(role, computation), ...] that an instruction names; a conditional's are "branch"."""
    found = _CALLED.findall(instruction.text)
    for role, group in _CALLED_GROUP.findall(instruction.text):
        kind = "branch" if role == "branch_computations" else "calls"
        found += [(kind, name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
    return [("branch" if r.endswith("_computation") else r, n) for r, n in found]


# ---- loops' trip counts ---------------------------------------------------------------


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


def _bound(comp: Computation | None) -> tuple[int, int] | None:
    """(the counter's tuple index, N) of a loop condition `counter < N`, N a constant."""
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


def _step(comp: Computation | None, index: int) -> int:
    """How much a loop body adds to its counter (tuple element `index`) per trip: 1 unless
    the body's result holds `add(counter, constant)` there."""
    root = comp.root if comp else None
    if comp is None or root is None or root.opcode != "tuple" or index >= len(root.operands):
        return 1
    update = next((i for i in comp.instructions if i.name == root.operands[index]), None)
    constants = _constants(comp)
    if update is not None and update.opcode == "add" and len(update.operands) == 2:
        counter, step = update.operands
        if step in constants and _tuple_index(comp, counter) == index:
            return max(constants[step], 1)
    return 1


def loop_trips(computations: dict[str, Computation], inst: Instruction) -> int | None:
    """The trip count of a while instruction (module docstring), None when the text does
    not give one (the step loop)."""
    known = _KNOWN_TRIPS.search(inst.text)
    if known:
        return int(known.group(1))
    called = dict(_called(inst))
    bound = _bound(computations.get(called.get("condition", "")))
    if bound is None:
        return None
    index, limit = bound
    return -(-limit // _step(computations.get(called.get("body", "")), index))


def relaid_state(text: str, computations: dict[str, Computation]) -> int:
    """How many arrays the step loop carries in a layout that no result of the program of
    their shape has (module docstring): the state, which the chunk takes and returns in one
    layout (its batches, which it does not return, may be re-laid: a copy of the batches);
    0 without a step loop or an entry layout in the text."""
    header = _ENTRY_OUTPUTS.search(text)
    entry = computations.get("ENTRY")
    if header is None or entry is None:
        return 0
    results, _ = _split_type(text[header.end() :])

    def laid_out(type_text: str) -> list[tuple[str, str]]:
        found = _LAID_OUT.findall(type_text)
        return [(shape, _MEMORY_SPACE.sub("", layout)) for shape, layout in found]

    returned: dict[str, set[str]] = {}
    for shape, layout in laid_out(results):
        returned.setdefault(shape, set()).add(layout)
    return sum(
        shape in returned and layout not in returned[shape]
        for inst in entry.instructions
        if inst.opcode == "while" and loop_trips(computations, inst) is None
        for shape, layout in laid_out(inst.type_text)
    )


# ---- what one instruction computes --------------------------------------------------------


def _dot_flops(comp: Computation, inst: Instruction) -> int:
    lhs = comp.shapes.get(inst.operands[0]) if inst.operands else None
    if not inst.shapes or lhs is None:
        return 0
    dims = dict(_DIMS.findall(inst.text))
    contracted = [int(d) for d in dims.get("lhs_contracting_dims", "").split(",") if d]
    return 2 * math.prod(inst.shapes[0][1]) * math.prod(lhs[d] for d in contracted)


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


def _convolution_flops(comp: Computation, inst: Instruction) -> int:
    """2 x the multiply-adds that read real inputs (module docstring)."""
    if not inst.shapes or len(inst.operands) < 2:
        return 0
    lhs = comp.shapes.get(inst.operands[0])
    rhs = comp.shapes.get(inst.operands[1])
    labels = _LABELS.search(inst.text)
    if lhs is None or rhs is None or labels is None:
        return 0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out = inst.shapes[0][1]
    window = _window(inst.text)
    macs = rhs[rhs_labels.index("i")] if "i" in rhs_labels else 1
    for axis, label in enumerate(out_labels):
        if not label.isdigit():
            macs *= out[axis]
            continue
        size = rhs[rhs_labels.index(label)]
        macs *= _taps(out[axis], lhs[lhs_labels.index(label)], size, window, int(label))
    return 2 * macs


def _kernel_flops(inst: Instruction, causal: bool) -> int:
    """A splash kernel's matmul FLOPs from its query and key operands (0 for another)."""
    kind = next((k for k in SPLASH_MATMULS if inst.name.startswith(k)), None)
    match = _CONSTRAINTS.search(inst.text)
    if kind is None or match is None:
        return 0
    floats = ("bf16", "f16", "f32")
    arrays = [s for d, s in _arrays(match.group(1)) if d in floats and len(s) == 4]
    if len(arrays) < 2:
        return 0
    (batch, heads, queries, size), keys = arrays[0], arrays[1][2]
    flops = SPLASH_MATMULS[kind] * 2 * batch * heads * queries * keys * size
    return flops // 2 if causal else flops


def _kernel_name(inst: Instruction) -> str:
    return re.sub(r"(\.\d+)+$", "", inst.name)


def _is_async_done(comp: Computation) -> bool:
    root = comp.root
    return bool(root and root.opcode == "custom-call" and '"AsyncCollectiveDone"' in root.text)


# ---- one run of each computation ----------------------------------------------------------

# Counts by key: ("flops",), ("kernel_flops",), ("count", kind), ("bytes", kind),
# ("gathered", dtype), ("runs", kernel).
Tally = dict[tuple[str, ...], int]


def _add(into: Tally, part: Tally, times: int = 1) -> None:
    for key, value in part.items():
        into[key] = into.get(key, 0) + value * times


def _flops_of(parts: tuple[Tally, Tally]) -> int:
    return sum(p.get(k, 0) for p in parts for k in (("flops",), ("kernel_flops",)))


class _Walker:
    """(per call, per step) tallies of one run of each computation, memoised; the loops'
    trip counts and the kernels' instances of every computation it reaches."""

    def __init__(self, computations: dict[str, Computation], causal: bool | None):
        self.computations, self.causal = computations, causal
        self.cache: dict[str, tuple[Tally, Tally]] = {}
        self.loops: list[int | None] = []
        self.instances: dict[str, int] = {}
        # The channels of collectives that an async done fusion completes (module docstring).
        self.done_channels = {
            channel
            for comp in computations.values()
            if _is_async_done(comp)
            for inst in comp.instructions
            for channel in _CHANNEL.findall(inst.text)
        }

    def walk(self, name: str) -> tuple[Tally, Tally]:
        if name in self.cache:
            return self.cache[name]
        call: Tally = {}
        step: Tally = {}
        self.cache[name] = (call, step)
        comp = self.computations.get(name)
        for inst in comp.instructions if comp else []:
            self.own(comp, inst, call)
            called = [] if inst.opcode in _NOT_CALLED else _called(inst)
            if inst.opcode == "while":
                trips = loop_trips(self.computations, inst)
                self.loops.append(trips)
                body_call, body_step = self.walk(dict(called).get("body", ""))
                if trips is None:  # the step loop: its body runs once per step
                    _add(step, body_call)
                    _add(step, body_step)
                else:
                    _add(call, body_call, trips)
                    _add(step, body_step, trips)
                continue
            branches = [self.walk(n) for role, n in called if role == "branch"]
            if branches:  # one branch runs: count the most expensive
                parts = max(branches, key=_flops_of)
                _add(call, parts[0])
                _add(step, parts[1])
            for role, callee in called:
                if role in ("calls", "to_apply"):
                    part_call, part_step = self.walk(callee)
                    _add(call, part_call)
                    _add(step, part_step)
        return call, step

    def own(self, comp: Computation | None, inst: Instruction, tally: Tally) -> None:
        """What one instruction itself computes (not the computations it calls)."""
        if comp is None:
            return
        if inst.opcode == "dot":
            _add(tally, {("flops",): _dot_flops(comp, inst)})
        elif inst.opcode == "convolution":
            _add(tally, {("flops",): _convolution_flops(comp, inst)})
        elif inst.opcode == "custom-call" and f'_target="{MOSAIC_TARGET}"' in inst.text:
            name = _kernel_name(inst)
            self.instances[name] = self.instances.get(name, 0) + 1
            _add(tally, {("runs", name): 1})
            if self.causal is not None:
                _add(tally, {("kernel_flops",): _kernel_flops(inst, self.causal)})
        kind = inst.opcode.removesuffix("-start")
        if kind not in COLLECTIVES:
            return
        channel = _CHANNEL.search(inst.text)
        if channel and channel.group(1) in self.done_channels and not _is_async_done(comp):
            return  # a start or continuation copy: counted in the done fusion
        elements = _elements(inst.type_text)
        result = elements[1] if inst.opcode in _RESULT_SECOND and len(elements) > 1 else None
        arrays = _arrays(result if result is not None else inst.type_text)
        sizes = [(dtype, DTYPE_BYTES[dtype] * math.prod(shape)) for dtype, shape in arrays]
        _add(tally, {("count", kind): 1, ("bytes", kind): sum(size for _, size in sizes)})
        for dtype, size in sizes if kind == "all-gather" else []:
            _add(tally, {("gathered", dtype): size})


# ---- the summary --------------------------------------------------------------------------


@dataclass
class Summary:
    """A program's figures per training step and per call (module docstring)."""

    flops_per_step: int = 0  # matmuls (dot, convolution), per chip
    flops_per_call: int = 0
    # splash kernels' matmuls, per chip; None: not counted (summarize without `causal`)
    kernel_flops_per_step: int | None = None
    kernel_flops_per_call: int | None = None
    # kind -> [count, bytes on one chip]
    collectives_per_step: dict[str, list[int]] = field(default_factory=dict)
    collectives_per_call: dict[str, list[int]] = field(default_factory=dict)
    # dtype -> all-gathered bytes on one chip
    all_gathers_per_step: dict[str, int] = field(default_factory=dict)
    all_gathers_per_call: dict[str, int] = field(default_factory=dict)
    # Mosaic kernel -> [instances in the program, runs per step, runs per call]
    kernels: dict[str, list[int]] = field(default_factory=dict)
    loops: list[int | None] = field(default_factory=list)  # trip counts; None: step loop
    step_loop: bool = False  # whether a loop without a trip count (the step loop) was found
    relaid_state: int = 0  # arrays the step loop carries in another layout than the arguments

    def total_flops(self, steps: int = 1) -> int:
        """Matmul and (where counted) kernel FLOPs of one call that runs `steps` steps."""
        kernels = (self.kernel_flops_per_call or 0) + steps * (self.kernel_flops_per_step or 0)
        return self.flops_per_call + steps * self.flops_per_step + kernels

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None or not k.startswith("kernel_")}


def _collectives(tally: Tally) -> dict[str, list[int]]:
    return {k[1]: [v, tally.get(("bytes", k[1]), 0)] for k, v in sorted(tally.items())
            if k[0] == "count"}  # fmt: skip


def summarize(text: str, *, causal: bool | None = None) -> Summary:
    """The figures of an optimized HLO module (module docstring); the splash kernels' FLOPs
    are counted when `causal` says whether their mask is causal."""
    computations = parse(text)
    walker = _Walker(computations, causal)
    entry = computations.get("ENTRY")
    call, step = walker.walk(entry.name) if entry else ({}, {})
    summary = Summary(
        flops_per_step=step.get(("flops",), 0),
        flops_per_call=call.get(("flops",), 0),
        collectives_per_step=_collectives(step),
        collectives_per_call=_collectives(call),
        all_gathers_per_step={k[1]: v for k, v in sorted(step.items()) if k[0] == "gathered"},
        all_gathers_per_call={k[1]: v for k, v in sorted(call.items()) if k[0] == "gathered"},
        kernels={
            name: [n, step.get(("runs", name), 0), call.get(("runs", name), 0)]
            for name, n in sorted(walker.instances.items())
        },
        loops=walker.loops,
        step_loop=None in walker.loops,
        relaid_state=relaid_state(text, computations),
    )
    if causal is not None:
        summary.kernel_flops_per_step = step.get(("kernel_flops",), 0)
        summary.kernel_flops_per_call = call.get(("kernel_flops",), 0)
    return summary


def out_of_memory(error: BaseException) -> str | None:
    """The compiler's out-of-memory message (a program that does not fit) in one line, or
    None for another error (aot.py reports it)."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if re.search(r"RESOURCE_EXHAUSTED|memory|[Uu]sed|xceeded", line)]
    return "; ".join(keep[:3] or lines[:1])[:500]
