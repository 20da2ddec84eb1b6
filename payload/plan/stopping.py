"""What a stop by SIGTERM costs on the JAX backend (docs/preemption.md), from the plan's figures:
`tpu-payload plan --job JOB --accelerator A,B --sizes S,T --stop-cost` prints the table.

A stop, as the trainer does it (backends/jax/train.py, runtime.py): the signal is agreed
after the chunk that was dispatched when it arrived, so the devices finish at most two chunks
(the running one and the one queued behind it); a chunk holds as many steps as fit
CHUNK_SECONDS (at least one step), and FIRST_CHUNK_STEPS until a step has been timed (the
first chunks after a start); then every process writes its shards of the checkpoint (Orbax)
and exits 143. A stop can need two checkpoint writes (WRITES_AT_A_STOP): Orbax starts a save
only once the one before it is written, so a stop that comes while a periodic checkpoint is
still being written waits for that write, then writes its own. Compute Engine sends the
preemption notice about 30 s before it stops a spot or preemptible VM (Compute Engine's
"Preemption process" pages: "30 seconds"), then systemd's SIGKILL ends whatever is left.
Within the notice, no step is lost; a stop that does not finish in it loses what was trained
since the last periodic checkpoint (train.checkpoint_every).

The figures are estimates, not measurements: the step time is the plan's at its MFU, and the
checkpoint write speed per host (WRITE_BYTES_PER_S_PER_HOST) is an assumption this project has
not measured on a slice; only a real slice shows both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# runtime.CHUNK_SECONDS on TPUs and GPUs (kept equal by tests/payload/test_plan.py).
CHUNK_SECONDS = 5.0
# runtime.STEPS_PER_CALL: the most steps a chunk holds.
STEPS_PER_CALL = {"tpu": 64, "gpu": 8}
# training.FIRST_CHUNK_STEPS: a chunk's steps until one has been timed.
FIRST_CHUNK_STEPS = 1
NOTICE_S = 30.0
# The writes a stop may wait for: a periodic checkpoint's still in flight, then its own
# (backends/jax/checkpoint.py: `save` waits for the save before it).
WRITES_AT_A_STOP = 2
# ASSUMED, not measured: what one host writes to Cloud Storage per second through Orbax
# (tensorstore, many parallel requests). Only a real slice tells.
WRITE_BYTES_PER_S_PER_HOST = 1e9
# What a checkpoint holds per parameter: fp32 weights and AdamW's two fp32 slots.
CHECKPOINT_BYTES_PER_PARAMETER = 12
# Chips per host: a TPU slice of more chips than one host holds has 4 chips per host (v4,
# v5p: 4 chips a host; v5e/v6e multi-host slices use the 4-chip machine types
# ct5lp-hightpu-4t / ct6e-standard-4t, single-host 8-chip types hold 8). Google's TPU
# pages, not re-read this session. A GPU stack is one VM.
SINGLE_HOST_CHIPS = {"v5e": 8, "v6e": 8}
CHIPS_PER_HOST = 4


@dataclass(frozen=True)
class StopCost:
    size: str
    accelerator: str
    step_s: float
    steps_per_chunk: int
    chunks_s: float  # the at most two chunks that finish after the signal
    write_s: float  # one checkpoint write
    hosts: int

    @property
    def writes_s(self) -> float:
        """The writes a stop may wait for (WRITES_AT_A_STOP)."""
        return WRITES_AT_A_STOP * self.write_s

    @property
    def total_s(self) -> float:
        return self.chunks_s + self.writes_s

    @property
    def fits(self) -> bool:
        return self.total_s <= NOTICE_S

    @property
    def first_s(self) -> float:
        """A stop while the first chunks after a start are timed (FIRST_CHUNK_STEPS each)."""
        return 2 * FIRST_CHUNK_STEPS * self.step_s + self.writes_s


def hosts_of(kind: str, generation: str, chips: int) -> int:
    if kind != "tpu":
        return 1
    if chips <= SINGLE_HOST_CHIPS.get(generation, CHIPS_PER_HOST):
        return 1
    return math.ceil(chips / CHIPS_PER_HOST)


def stop_cost(plan: Any) -> StopCost:
    """The cost of a stop for a payload.plan.estimate.Plan."""
    acc = plan.accelerator
    step_s = plan.hours * 3600 / max(plan.steps, 1)
    steps_per_chunk = max(1, min(STEPS_PER_CALL[acc.kind], int(CHUNK_SECONDS // step_s)))
    hosts = hosts_of(acc.kind, acc.generation, acc.chips)
    write_s = (
        plan.parameters * CHECKPOINT_BYTES_PER_PARAMETER / (hosts * WRITE_BYTES_PER_S_PER_HOST)
    )
    return StopCost(
        size=plan.size,
        accelerator=acc.name,
        step_s=step_s,
        steps_per_chunk=steps_per_chunk,
        chunks_s=2 * steps_per_chunk * step_s,
        write_s=write_s,
        hosts=hosts,
    )


def markdown(plans: Sequence[Any]) -> str:
    rows = [
        "| size | accelerator | hosts | step (s) | steps a chunk | 2 chunks (s) | "
        f"checkpoint write (s) | {WRITES_AT_A_STOP} writes (s) | stop (s) | "
        f"within {NOTICE_S:.0f} s | stop in the first chunks (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for plan in plans:
        cost = stop_cost(plan)
        lost = "yes: no step lost" if cost.fits else "no: back to the last checkpoint"
        rows.append(
            f"| {cost.size} | {cost.accelerator} | {cost.hosts} | {cost.step_s:.2f} | "
            f"{cost.steps_per_chunk} | {cost.chunks_s:.1f} | {cost.write_s:.1f} | "
            f"{cost.writes_s:.1f} | {cost.total_s:.1f} | {lost} | {cost.first_s:.1f} |"
        )
    return "\n".join(rows) + "\n"
