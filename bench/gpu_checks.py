"""Every GPU figure the docs wait for (issue 41, item 5), in one command on one NVIDIA GPU.

    python bench/gpu_checks.py [--out DIR] [--budget-s 560] [--parts bench,attention,...]
    python bench/gpu_checks.py --tiny --parts attention,exact    (proves the script on a CPU)

Run from the repository root, with the GPU machine's own Python (jax[cuda], torch,
transformers; plus keras, namex, optree and google-crc32c, which this script installs from
`.whl/` when they are missing: `python3 -m pip download --no-deps --only-binary=:all:
--python-version 3.12 --platform manylinux_2_17_x86_64 -d .whl keras namex optree
google-crc32c` here first). Every line names the
card. The parts run one after another in child processes, most wanted first, inside one
wall-clock budget (default 560 s: a 10-minute limit with room to spare); a part that would not
fit is skipped with a line saying so, never cut silently:

1. `bench`: bench/bench_gpu.py --models 125m,1b (ours vs transformers + torch.compile, same
   batches, bf16, sequence 2,048, 16 timed steps): tokens/s, MFU, peak memory, compile time,
   the attention each side ran, the compiled chunk's cuDNN calls (layers x forward +
   backward) and float32 [.., S, S] buffers (none with a kernel). The goals (issue 41):
   >= 1.6x at 125m, >= 1.35x at 1b, MFU >= 55 % at 1b, peak memory <= 0.8x PyTorch's.
2. `attention`: our attention alone at the 125m and 1b shapes (forward + backward, bf16,
   causal, S = 2,048), best of 10: the reference, cuDNN CAUSAL (what a Llama runs now),
   cuDNN PADDING_CAUSAL (with lengths: what it ran before), cuDNN with data.document_mask's
   same-document mask (a bias); per variant ms, the cuDNN calls and [.., S, S] buffers of
   its compiled program, and the largest gap to the reference's output.
3. `exact`: tests/payload/test_jax_attention.py's cuDNN tests (skipped on a CPU): cuDNN =
   the reference in bf16, outputs and gradients.
4. `bert`: bench/bench_gpu.py --models bert: BERT-base MLM at its preset's attention
   dropout 0 (cuDNN), ours vs PyTorch.
5. `3b`: ours alone, the 3b preset (Llama 3.2 3B's shape) on a GPU of >= 120 GiB (H200).

Writes `DIR/gpu_checks.json` (every part's figures and its log's tail) and prints a summary.
Nothing is asserted: the figures go into docs/performance.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("bench", "attention", "exact", "bert", "3b")
# What each part needs at least, in seconds on an H100 (our estimates: compiles dominate).
NEEDS = {"bench": 240, "attention": 60, "exact": 60, "bert": 100, "3b": 120}
SHAPES = {  # B, S, query heads, key/value heads, head size (the presets at bench_gpu's batch)
    "125m": (8, 2048, 9, 3, 64),
    "1b": (4, 2048, 32, 8, 64),
}
TINY_SHAPES = {"tiny": (2, 256, 4, 2, 16)}


def environment() -> dict[str, str]:
    """The child processes' environment: the repository on the path, keras from `.whl/`
    when the machine lacks it (installed into a temporary directory)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    paths = [str(ROOT)]
    missing = subprocess.run(
        [sys.executable, "-c", "import keras, namex, optree, google_crc32c"],
        capture_output=True,
        check=False,
    ).returncode
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if missing and wheels:
        site = Path(tempfile.mkdtemp(prefix="gpu-checks-site-"))
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--target", str(site), *map(str, wheels)],
            check=True,
        )  # fmt: skip
        paths.append(str(site))
    elif missing:
        print("keras, namex, optree or google-crc32c missing, no .whl/: JAX parts will fail")
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def device() -> dict[str, Any]:
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    return {
        "device": d.device_kind,
        "platform": d.platform,
        "compute_capability": getattr(d, "compute_capability", None),
        "memory_bytes": stats.get("bytes_limit"),
        "jax": jax.__version__,
    }


def attention_part(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Our attention alone: forward + backward of each variant at each shape."""
    return {name: _attention_at(*shape) for name, shape in shapes.items()}


def _attention_at(b: int, s: int, n: int, k: int, h: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu import hlo_facts

    from payload.backends.jax import attention

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, s, k, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, k, h), jnp.bfloat16)
    weight = jax.random.normal(keys[3], (b, s, n, h), jnp.float32)
    ones = jnp.ones((b, s), jnp.int32)
    documents = jnp.where(jnp.arange(s) < s // 3, 1, 2)[None].repeat(b, 0).astype(jnp.int32)
    lengths = jnp.full((b,), s, jnp.int32)

    def padding_causal(q: Any, k: Any, v: Any) -> Any:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation="cudnn",
        )  # fmt: skip

    variants = {
        "reference": (lambda q, k, v: attention.reference(q, k, v, causal=True, mask=ones), ones),
        "cudnn CAUSAL (now)": (
            lambda q, k, v: attention.cudnn(q, k, v, causal=True, mask=ones),
            ones,
        ),
        "cudnn PADDING_CAUSAL (before)": (padding_causal, ones),
        "cudnn documents (bias)": (
            lambda q, k, v: attention.cudnn(q, k, v, causal=True, mask=documents, documents=True),
            documents,
        ),
    }
    rows: dict[str, Any] = {}
    for label, (fn, mask) in variants.items():
        try:
            rows[label] = _timed_variant(fn, q, kk, v, weight=weight, s=s, hlo_facts=hlo_facts)
            want = attention.reference(q, kk, v, causal=True, mask=mask).astype(jnp.float32)
            got = rows[label].pop("output").astype(jnp.float32)
            rows[label]["max_gap"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        except Exception as exc:  # a figure, not a verdict: the next variant runs
            rows[label] = {"error": " ".join(str(exc).split())[:300]}
    return {"shape": [b, s, n, k, h], "variants": rows}


def _timed_variant(
    fn: Any, q: Any, k: Any, v: Any, *, weight: Any, s: int, hlo_facts: Any
) -> dict[str, Any]:
    """Forward + backward of one attention: best of 10 (ms), XLA's temporaries, the compiled
    program's cuDNN calls and [.., S, S] buffers, and the output."""
    import jax
    import jax.numpy as jnp

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weight), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    compiled = step.lower(q, k, v).compile()
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(10):
        started = time.perf_counter()
        result = jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - started)
    (_, out), _ = result
    memory = compiled.memory_analysis()
    return {
        "ms": 1000 * min(times),
        "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0)),
        **hlo_facts(compiled.as_text(), s),
        "output": out,
    }


def run_part(part: str, args: argparse.Namespace, env: dict[str, str], left: float) -> dict:
    """One part in a child process (its own GPU memory), at most `left` seconds."""
    out = Path(args.out)
    rows = out / f"{part}.rows.json"
    tiny = ["--tiny"] if args.tiny else []
    commands = {
        "bench": [sys.executable, "bench/bench_gpu.py", "--models", "125m,1b", "--steps", "16",
                  "--json", str(rows)],
        "bert": [sys.executable, "bench/bench_gpu.py", "--models", "bert", "--steps", "16",
                 "--json", str(rows)],
        "3b": [sys.executable, "bench/bench_gpu.py", "--models", "3b", "--ours-only",
               "--steps", "8", "--eval-batches", "1", "--json", str(rows)],
        "exact": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                  "tests/payload/test_jax_attention.py", "-k", "cudnn"],
        "attention": [sys.executable, __file__, "--child", "attention", "--out", str(out)],
    }  # fmt: skip
    commands = {name: c + (tiny if name != "exact" else []) for name, c in commands.items()}
    if args.tiny:  # the tiny presets of bench_gpu know 125m and bert only
        commands["bench"][commands["bench"].index("125m,1b")] = "125m"
    started = time.perf_counter()
    try:
        result = subprocess.run(
            commands[part], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=max(1, int(left)), check=False,
        )  # fmt: skip
        code, log = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    record: dict[str, Any] = {
        "exit": code,
        "seconds": round(time.perf_counter() - started, 1),
        "log_tail": log[-4000:],
    }
    if rows.exists():
        record["rows"] = json.loads(rows.read_text())
    child = out / "attention.json"
    if part == "attention" and child.exists():
        record["figures"] = json.loads(child.read_text())
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default="gpu-checks", help="where the JSON goes")
    parser.add_argument("--budget-s", type=float, default=560.0)
    parser.add_argument("--parts", default=",".join(PARTS), help="of " + ",".join(PARTS))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU proof)")
    parser.add_argument("--child", choices=("attention", "device"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.child == "device":
        print(json.dumps(device()))
        return 0
    if args.child:
        figures = attention_part(TINY_SHAPES if args.tiny else SHAPES)
        (Path(args.out) / "attention.json").write_text(json.dumps(figures, indent=1))
        return 0
    started = time.perf_counter()
    env = environment()
    info = json.loads(
        subprocess.run(
            [sys.executable, __file__, "--child", "device", "--out", args.out],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[-1]
    )  # fmt: skip
    card = f"{info['device']} (compute capability {info['compute_capability']}, jax {info['jax']})"
    print(f"card: {card}", flush=True)
    report: dict[str, Any] = {"card": info, "parts": {}}
    for part in args.parts.split(","):
        left = args.budget_s - (time.perf_counter() - started)
        big = (info.get("memory_bytes") or 0) >= 120 * 2**30
        if part == "3b" and not big:
            report["parts"][part] = {"skipped": "needs a GPU of >= 120 GiB"}
        elif left < NEEDS[part]:
            report["parts"][part] = {"skipped": f"{left:.0f} s left of the budget < {NEEDS[part]}"}
        else:
            report["parts"][part] = run_part(part, args, env, left)
        record = report["parts"][part]
        status = record.get("skipped") or f"exit {record['exit']} in {record['seconds']} s"
        print(f"[{card}] {part}: {status}", flush=True)
        if record.get("log_tail") and part in ("bench", "bert", "3b", "exact"):
            print("\n".join(record["log_tail"].splitlines()[-14:]), flush=True)
        for shape, figures in record.get("figures", {}).items():
            for label, row in figures["variants"].items():
                print(f"[{card}] attention {shape} {label}: {json.dumps(row)}", flush=True)
    (Path(args.out) / "gpu_checks.json").write_text(json.dumps(report, indent=1))
    print(f"[{card}] wall {time.perf_counter() - started:.0f} s; {args.out}/gpu_checks.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
