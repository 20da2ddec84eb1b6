"""JAX backend: the training stall per checkpoint, the earlier npz format vs Orbax (async).

    .venv/bin/python bench/bench_checkpoint.py [--params 110e6 220e6] [--saves 3] [--dir /tmp]

A training state of BERT-base's shapes (a 30,522 x 768 embedding and 768-wide transformer
layers, as many layers as the parameter count asks) times three (the weights and AdamW's
two slots, float32) on the default JAX device; each size runs in its own process, one per
format, so that neither format's memory adds to the other's. Per save:
 - npz (the format of 966f34a, payload/backends/jax/checkpoint.py): `jax.device_get` of the
   state, `np.savez` into memory, `storage.write_bytes` (a local file renamed into place).
   All of it happens while the devices wait: the stall is the whole time.
 - Orbax (payload/backends/jax/checkpoint.py now): `Checkpoints.save` returns once the state
   is in host memory (the stall); `wait` is the write that goes on in the background while
   training continues (overlapped, not a stall unless the next checkpoint comes first).
Local paths only; figures are printed, not asserted. The npz path holds the state about four
times at its peak (device arrays, their host copy, the npz in memory, its bytes), Orbax
about twice: a size is skipped with a note when MemAvailable is below what it needs.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, FFN, VOCAB = 768, 3072, 30522
# Weights of one layer: QKV, attention output, FFN in and out (biases and norms are <1 %).
LAYER = HIDDEN * 3 * HIDDEN + HIDDEN * HIDDEN + 2 * HIDDEN * FFN
PEAK_COPIES = {"npz": 4.2, "orbax": 2.5}  # state sizes held at the peak, with a margin


def shapes(params: float) -> list[tuple[int, ...]]:
    layers = max(round((params - VOCAB * HIDDEN) / LAYER), 1)
    one = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, FFN), (FFN, HIDDEN)]
    return [(VOCAB, HIDDEN)] + one * layers


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(fmt: str, params: float, saves: int, directory: str) -> dict:
    """In this process: `saves` checkpoints of one state in one format."""
    from payload.backends import jax as jax_backend

    jax_backend.use_jax()
    import jax
    import numpy as np

    from payload.backends.jax import checkpoint as checkpoints
    from payload.backends.jax import steps
    from payload.core import storage

    weights = [
        jax.random.normal(jax.random.key(i), s, "float32") for i, s in enumerate(shapes(params))
    ]
    slots = [jax.numpy.zeros_like(w) + 1e-3 for w in weights] + [
        jax.numpy.ones_like(w) for w in weights
    ]
    state = steps.TrainState(weights, [], [jax.numpy.zeros((), "int32"), *slots])
    jax.block_until_ready(state)
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(state))
    rows = []
    if fmt == "npz":
        for step in range(1, saves + 1):
            started = time.perf_counter()
            host = jax.device_get(state)
            copied = time.perf_counter()
            buffer = io.BytesIO()
            groups = {"trainable": host.trainable, "optimizer": host.optimizer}
            np.savez(
                buffer,
                **{f"{g}/{i}": np.asarray(v) for g, vs in groups.items() for i, v in enumerate(vs)},
            )
            serialised = time.perf_counter()
            storage.write_bytes(storage.join(directory, f"ckpt-{step}.npz"), buffer.getvalue())
            done = time.perf_counter()
            del host, buffer
            rows.append(
                {"stall": done - started, "device_get": copied - started,
                 "savez": serialised - copied, "write": done - serialised, "background": 0.0}
            )  # fmt: skip
    else:
        layout = checkpoints.Layout(
            {
                "trainable": [(f"w{i}", tuple(w.shape)) for i, w in enumerate(weights)],
                "non_trainable": [],
                "optimizer": [("iterations", ())]
                + [(f"s{i}", tuple(s.shape)) for i, s in enumerate(slots)],
            }
        )
        store = checkpoints.Checkpoints(directory, layout, keep=2)
        for step in range(1, saves + 1):
            started = time.perf_counter()
            store.save(step, state)
            returned = time.perf_counter()
            store.wait()
            done = time.perf_counter()
            rows.append({"stall": returned - started, "background": done - returned})
        store.close()
    return {
        "format": fmt,
        "params": sum(int(np.prod(s)) for s in shapes(params)),
        "bytes": nbytes,
        "saves": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[110e6, 220e6])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--one", nargs=2, metavar=("FORMAT", "PARAMS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        fmt, params = args.one[0], float(args.one[1])
        print(json.dumps(measure(fmt, params, args.saves, args.dir)))
        return
    print(f"checkpoint stall per save, local path under {args.dir}, {args.saves} saves each")
    print(
        f"{'state':>28} {'format':>6} {'stall s (per save)':>28} {'median':>7} {'background s':>14}"
    )
    for params in args.params:
        need_one = 3 * 4 * sum(int(a * b) for a, b in shapes(params))
        for fmt in ("npz", "orbax"):
            need = int(PEAK_COPIES[fmt] * need_one)
            if mem_available() < need:
                print(f"{params / 1e6:>6.0f}M x 3: {fmt} skipped: needs ~{need / 2**30:.1f} GiB, "
                      f"{mem_available() / 2**30:.1f} GiB available")  # fmt: skip
                continue
            work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
            try:
                command = [sys.executable, __file__, "--one", fmt, str(params)]
                command += ["--saves", str(args.saves), "--dir", work]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            stalls = [r["stall"] for r in result["saves"]]
            background = [r["background"] for r in result["saves"]]
            state = f"{result['params'] / 1e6:.0f}M x 3 ({result['bytes'] / 2**30:.2f} GiB)"
            detail = ""
            if fmt == "npz":
                last = result["saves"][-1]
                detail = (
                    "  (last: "
                    + ", ".join(f"{k} {last[k]:.2f}" for k in ("device_get", "savez", "write"))
                    + ")"
                )
            per_save = ", ".join(f"{s:.2f}" for s in stalls)
            behind = ", ".join(f"{b:.2f}" for b in background)
            median = statistics.median(stalls)
            print(f"{state:>28} {fmt:>6} {per_save:>28} {median:>7.2f} {behind:>14}{detail}")


if __name__ == "__main__":
    main()
