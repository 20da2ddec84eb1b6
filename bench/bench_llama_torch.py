"""A small Llama trained by our JAX backend vs a plain transformers 5 PyTorch loop, on this CPU.

    .venv/bin/python bench/bench_llama_torch.py [--quick] [--rounds 4] [--steps 8]
        [--torch-python .venv-pt/bin/python] [--no-compile]

What is compared (docs/performance.md has the figures):
- The data: the payload's own shards. A llama job (byte-level BPE, 2,000 tokens, clm,
  sequence 128) runs `tpu-payload tokenizer` and `encode` on the bundled corpus; the training
  and held-out shards are read once, here, with payload/core/records.py's pure TFRecord reader (both
  CRCs checked; .venv-pt has no TensorFlow), and both sides get the same token batches in the
  same order, with the labels and weights of payload/backends/tf/masking.py causal_labels.
- The model: the job's LlamaForCausalLM config (payload/model/configs.py config_for). The JAX side
builds
  it with payload/backends/jax/models/llama.py; its initial weights are written with the
  export's save_pretrained and loaded by `LlamaForCausalLM.from_pretrained` on the PyTorch
  side: both start from the same weights.
- The step: ours is the JAX backend's compiled train chunk (steps.make_train_chunk, 8 steps
  per call as on CPU, runtime.STEPS_PER_CALL) with its AdamW (schedule.create_optimizer: warm-up and
  linear decay, weight decay except the RMSNorm scales, global-norm clipping 1.0). PyTorch's is a
  plain loop: forward, the same token-weighted cross entropy, backward,
  clip_grad_norm_, torch.optim.AdamW with the same hyper-parameters and learning rate per step,
  the RMSNorm weights out of weight decay; eager, and with `torch.compile(model)` unless
  --no-compile. Keras' Adam adds epsilon to sqrt(v) before the bias correction, PyTorch to
  the bias-corrected sqrt(v_hat): the loop sets PyTorch's epsilon to eps / sqrt(1 - beta2^t)
  at step t, which makes the two updates the same formula (the speed is not affected).
- Interleaved rounds (JAX, PyTorch eager, PyTorch compiled, JAX, ...): each trains the next
  --steps batches; compilation happens before the first round on a call that trains nothing
  (JAX: the chunk with n=0 steps; PyTorch: a forward and backward without an optimizer step).
  The table gives tokens/s per round and the ratio JAX / PyTorch within each round.
- MFU: model FLOPs per token as MaxText computes them (AI-Hypercomputer/maxtext e591f30c,
  src/maxtext/utils/maxtext_utils.py calculate_tflops_training_per_device, dense decoder
  branch): 3 x (forward matmul FLOPs: 2 x tokens x (the MLP's H x I x 2 gated inputs + I x H,
  q/k/v H x (A + 2K) x D, the output projection A x D x H) per layer + the unembedding
  2 x H x V), i.e. 6 x the matmul weights + lm_head, plus 3 x the causal attention
  (4 x S x A x D per token per layer, halved for the causal mask): per token
  6 (L (3 H I + H (A + 2K) D + A D H) + H V) + 6 L S A D. The embedding lookup counts nothing.
  The peak is this CPU's, measured in each framework: the best of 5 fp32 matmuls of 2048 x 2048
  (2 x 2048^3 FLOPs), JAX jit and torch.matmul; MFU uses the higher of the two peaks, for both.
- The held-out loss after the same number of steps: the token-weighted mean cross entropy over
  the whole held-out split, each side with its own weights.

The machine is shared (two cores, other work running): the figures vary between runs, which is
why the rounds are interleaved and the ratios taken within a round. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TORCH_PYTHON = ROOT / ".venv-pt/bin/python"
STEPS_PER_CALL = 8
SEQ = 128
PEAK_N = 2048
# The benchmark's model: the llama tiny preset widened (model.config overrides, LlamaConfig
# names); --quick keeps the tiny shape.
MODELS = {
    "small": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "tiny": {},
}


# ---- shared: FLOPs, batches ---------------------------------------------------------------


def flops_per_token(config: dict, seq: int) -> float:
    """MaxText's calculate_tflops_training_per_device for a dense decoder, per token."""
    h, inner, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, vocab = h // heads, config["vocab_size"]
    ffn = 2 * inner * h * 2 + 2 * inner * h  # two gated inputs (silu, linear) + the output
    qkv = 2 * h * (heads + 2 * kv) * head_dim
    projection = 2 * h * heads * head_dim
    embedding = 2 * h * vocab  # the unembedding only
    weights = 3 * (layers * (ffn + qkv + projection) + embedding)
    attention = 3 * layers * (4 * seq * heads * head_dim) / 2
    return float(weights + attention)


def causal_batch(ids: np.ndarray, pad_id: int | None) -> dict[str, np.ndarray]:
    """payload/backends/tf/masking.py causal_labels in numpy."""
    labels = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    weights = np.ones_like(ids, dtype=np.float32)
    weights[:, -1] = 0.0
    mask = np.ones_like(ids)
    if pad_id is not None:
        mask = (ids != pad_id).astype(ids.dtype)
        weights *= (labels != pad_id) & (ids != pad_id)
    return {
        "input_ids": ids.astype(np.int32),
        "attention_mask": mask.astype(np.int32),
        "labels": labels.astype(np.int32),
        "label_weights": weights.astype(np.float32),
    }


# ---- the PyTorch worker (runs in .venv-pt: torch + transformers 5, no TensorFlow, no JAX) ----


class TorchSide:
    """A plain transformers 5 loop: LlamaForCausalLM, token-weighted cross entropy, AdamW."""

    def __init__(self, workdir: Path, compiled: bool):
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        torch.manual_seed(0)
        torch.set_num_threads(os.cpu_count() or 1)
        self.hp = json.loads((workdir / "hparams.json").read_text())
        self.data = np.load(workdir / "batches.npz")
        self.model = LlamaForCausalLM.from_pretrained(workdir / "init", dtype=torch.float32)
        self.model.train()
        named = list(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in named if "norm" not in n],
              "weight_decay": self.hp["weight_decay"]},
             {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}],
            lr=self.hp["learning_rate"], betas=(self.hp["beta1"], self.hp["beta2"]),
            eps=self.hp["epsilon"],
        )  # fmt: skip
        self.forward = torch.compile(self.model) if compiled else self.model
        self.step = 0

    def loss_sums(self, i: int, source: str = "train") -> tuple[Any, Any]:
        torch, data = self.torch, self.data
        ids = torch.from_numpy(data[f"{source}_input_ids"][i].astype(np.int64))
        mask = torch.from_numpy(data[f"{source}_attention_mask"][i].astype(np.int64))
        labels = torch.from_numpy(data[f"{source}_labels"][i].astype(np.int64))
        weights = torch.from_numpy(data[f"{source}_label_weights"][i])
        logits = self.forward(input_ids=ids, attention_mask=mask).logits.float()
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        return (per_token * weights.reshape(-1)).sum(), weights.sum()

    def lr_at(self, step: int) -> float:
        """schedule.WarmupDecay with linear decay to 0."""
        peak, warmup, steps = self.hp["learning_rate"], self.hp["warmup_steps"], self.hp["steps"]
        if warmup > 0 and step < warmup:
            return peak * min((step + 1) / warmup, 1.0)
        progress = min(max((step - warmup) / max(steps - warmup, 1), 0.0), 1.0)
        return peak * (1.0 - progress)

    def warmup(self) -> dict:
        """Compile (torch.compile) or warm up: forward + backward, no optimizer step."""
        started = time.perf_counter()
        total, count = self.loss_sums(0)
        (total / count).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return {"seconds": time.perf_counter() - started}

    def train(self, start: int, stop: int) -> dict:
        losses = []
        started = time.perf_counter()
        for i in range(start, stop):
            total, count = self.loss_sums(i)
            loss = total / self.torch.clamp(count, min=1.0)
            loss.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp["clip_norm"])
            # Keras' Adam (keras/src/optimizers/adam.py update_step) divides by sqrt(v) + eps
            # and scales by sqrt(1 - beta2^t) after; PyTorch divides by sqrt(v_hat) + eps. The
            # same update in PyTorch's form: eps / sqrt(1 - beta2^t) for step t.
            correction = math.sqrt(1.0 - self.hp["beta2"] ** (self.step + 1))
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(self.step)
                group["eps"] = self.hp["epsilon"] / correction
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            self.step += 1
        return {"seconds": time.perf_counter() - started, "losses": losses}

    def evaluate(self) -> dict:
        sums = counts = 0.0
        with self.torch.no_grad():
            for i in range(self.data["eval_input_ids"].shape[0]):
                total, count = self.loss_sums(i, "eval")
                sums, counts = sums + float(total), counts + float(count)
        return {"loss": sums / counts}

    def peak(self) -> dict:
        a = self.torch.randn(PEAK_N, PEAK_N)
        self.torch.matmul(a, a)
        best = min(_timed(lambda: self.torch.matmul(a, a)) for _ in range(5))
        return {"flops": 2 * PEAK_N**3 / best}


def torch_worker(workdir: Path, compiled: bool) -> None:
    """Answers one JSON command per stdin line with one JSON line (Worker below)."""
    side = TorchSide(workdir, compiled)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            return
        reply = {"warmup": side.warmup, "train": side.train, "eval": side.evaluate,
                 "peak": side.peak}[op](**command)  # fmt: skip
        print(json.dumps(reply), flush=True)


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Worker:
    def __init__(self, python: str, workdir: Path, compiled: bool):
        args = [python, __file__, "--torch-worker", str(workdir)]
        self.proc = subprocess.Popen(
            args + (["--compiled"] if compiled else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
        )

    def ask(self, **command) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


# ---- the data: the payload's shards -----------------------------------------------------


def make_data(workdir: Path, overrides: dict, steps: int, batch: int) -> Path:
    """The payload's tokenizer and encode stages for a llama job: its shards."""
    job = {
        "name": "bench-llama",
        "output": str(workdir / "run"),
        "corpus": {"paths": [str(ROOT / "examples/corpus/*.txt")]},
        "tokenizer": {"kind": "bpe", "vocab_size": 2000},
        "data": {"objective": "clm", "seq_length": SEQ, "records_per_shard": 200,
                 "eval_fraction": 0.1},
        "model": {"family": "llama", "size": "tiny", "config": overrides},
        "train": {"backend": "jax", "steps": steps, "global_batch_size": batch,
                  "learning_rate": 2e-3, "warmup_steps": max(steps // 10, 1),
                  "weight_decay": 0.1, "adam_beta2": 0.95, "seed": 0},
    }  # fmt: skip
    path = workdir / "job.json"
    path.write_text(json.dumps(job))
    for stage in ("tokenizer", "encode"):
        subprocess.run(
            [sys.executable, "-m", "payload", stage, "--job", str(path)],
            check=True,
            cwd=workdir,
            stdout=subprocess.DEVNULL,
        )
    return path


def read_split(manifest: Any, data_dir: str, split: str) -> np.ndarray:
    """Every record of a split's shards, through payload/core/records.py's pure reader (CRCs
    checked)."""
    from payload.core import records
    from payload.schema.manifest import shard_paths

    rows = []
    for path in shard_paths(data_dir, manifest, split=split):
        with Path(path).open("rb") as file:
            rows += [records.decode_record(r, manifest.token_dtype)
                     for r in records.iter_records(file)]  # fmt: skip
    return np.stack(rows)


def write_batches(workdir: Path, job: Any, total_steps: int, batch: int) -> dict[str, Any]:
    """The same batches for both sides (batches.npz): training batches in a seeded order,
    epoch after epoch, and the whole held-out split in batches."""
    from payload.schema.manifest import load_manifest, special_ids_of

    manifest = load_manifest(job.paths.data)
    pad_id = special_ids_of(manifest).get("pad")
    train_ids, eval_ids = (read_split(manifest, job.paths.data, s) for s in ("train", "eval"))
    epochs = -(-total_steps * batch // len(train_ids))
    order = np.concatenate(
        [np.random.default_rng(e).permutation(len(train_ids)) for e in range(epochs)]
    )[: total_steps * batch]
    train = causal_batch(train_ids[order], pad_id)
    train = {k: v.reshape(total_steps, batch, SEQ) for k, v in train.items()}
    usable = len(eval_ids) // batch * batch
    held_out = causal_batch(eval_ids[:usable], pad_id)
    held_out = {k: v.reshape(-1, batch, SEQ) for k, v in held_out.items()}
    np.savez(
        workdir / "batches.npz",
        **{f"train_{k}": v for k, v in train.items()},
        **{f"eval_{k}": v for k, v in held_out.items()},
    )
    return {"manifest": manifest, "train": train, "eval": held_out,
            "sequences": (len(train_ids), usable)}  # fmt: skip


# ---- the JAX side: our backend's model, AdamW and compiled train chunk -------------------


class JaxSide:
    def __init__(self, workdir: Path, job: Any, data: dict[str, Any]):
        from payload.backends import jax as jax_backend

        jax_backend.use_jax()
        import jax
        import jax.numpy as jnp

        from payload.backends.jax import hf_weights, models, schedule, steps
        from payload.backends.jax.program import seed_keras
        from payload.model import configs

        self.jax, self.jnp, self.steps = jax, jnp, steps
        self.data = data
        spec = job.train
        if spec.decay != "linear" or spec.end_learning_rate_ratio != 0.0:
            raise SystemExit("the PyTorch loop's schedule is linear decay to 0")
        self.config = configs.config_for(job, data["manifest"])
        self.parameters = configs.parameter_count("llama", self.config)
        seed_keras(spec.seed)
        self.model = models.create_model("llama", self.config, SEQ)
        optimizer = schedule.create_optimizer(spec)
        optimizer.build(self.model.trainable_variables)
        hf_weights.save_pretrained(self.model, str(workdir / "init"))  # PyTorch starts from these
        (workdir / "hparams.json").write_text(json.dumps({
            "learning_rate": spec.learning_rate, "warmup_steps": spec.warmup_steps,
            "steps": spec.steps, "weight_decay": spec.weight_decay, "beta1": spec.adam_beta1,
            "beta2": spec.adam_beta2, "epsilon": spec.adam_epsilon, "clip_norm": spec.clip_norm,
        }))  # fmt: skip
        self.chunk = steps.make_train_chunk(self.model, optimizer, "clm")
        self.state = steps.TrainState.of(self.model, optimizer)

    def _call(self, start: int, n: int) -> Any:
        batches = {k: self.jnp.asarray(v[start : start + STEPS_PER_CALL])
                   for k, v in self.data["train"].items()}  # fmt: skip
        state, metrics = self.chunk(self.state, batches, self.jnp.int32(n))
        self.jax.block_until_ready(metrics["loss"])
        return state, metrics

    def warmup(self) -> dict:
        """Compiles the chunk: a call with n = 0 steps (the state is left as it was)."""
        started = time.perf_counter()
        self._call(0, 0)
        return {"seconds": time.perf_counter() - started}

    def train(self, start: int, stop: int) -> dict:
        losses: list[float] = []
        started = time.perf_counter()
        for i in range(start, stop, STEPS_PER_CALL):
            self.state, metrics = self._call(i, STEPS_PER_CALL)
            losses += [float(x) for x in np.asarray(metrics["loss"])]
        return {"seconds": time.perf_counter() - started, "losses": losses}

    def evaluate(self) -> dict:
        jax, steps, model = self.jax, self.steps, self.model

        @jax.jit
        def sums(trainable: Any, non_trainable: Any, batch: Any) -> Any:
            inputs, labels, weights = steps.model_inputs("clm", batch)
            logits, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
            total, count, _ = steps.loss_terms(logits, labels, weights)
            return total, count

        total = count = 0.0
        held_out = self.data["eval"]
        for i in range(held_out["input_ids"].shape[0]):
            batch = {k: v[i] for k, v in held_out.items()}
            t, c = sums(self.state.trainable, self.state.non_trainable, batch)
            total, count = total + float(t), count + float(c)
        return {"loss": total / count}

    def peak(self) -> dict:
        jax, jnp = self.jax, self.jnp
        a = jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), jnp.float32)
        matmul = jax.jit(lambda x: x @ x)
        jax.block_until_ready(matmul(a))
        best = min(_timed(lambda: jax.block_until_ready(matmul(a))) for _ in range(5))
        return {"flops": 2 * PEAK_N**3 / best}


# ---- the run -----------------------------------------------------------------------------


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds of 8 steps")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps per round (multiple of 8)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--torch-python", default=str(DEFAULT_TORCH_PYTHON))
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--torch-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 8
    if args.steps % STEPS_PER_CALL:
        parser.error(f"--steps must be a multiple of {STEPS_PER_CALL}")
    if not args.torch_worker and not Path(args.torch_python).is_file():
        parser.error(f"--torch-python {args.torch_python}: not found (make venv-pt builds it)")
    return args


def main() -> None:
    args = _arguments()
    if args.torch_worker:
        torch_worker(args.torch_worker, args.compiled)
        return
    from payload.spec import load_job

    total_steps = args.rounds * args.steps
    workdir = Path(tempfile.mkdtemp(prefix="bench-llama-"))
    overrides = MODELS["tiny" if args.quick else "small"]
    job = load_job(str(make_data(workdir, overrides, total_steps, args.batch)))
    data = write_batches(workdir, job, total_steps, args.batch)
    ours = JaxSide(workdir, job, data)
    sides: dict[str, Any] = {"jax": ours, "torch": Worker(args.torch_python, workdir, False)}
    if not args.no_compile:
        sides["torch.compile"] = Worker(args.torch_python, workdir, True)

    def ask(name: str, op: str, **command: Any) -> dict:
        side = sides[name]
        if isinstance(side, Worker):
            return side.ask(op=op, **command)
        return {"warmup": side.warmup, "train": side.train, "eval": side.evaluate,
                "peak": side.peak}[op](**command)  # fmt: skip

    compile_s = {name: ask(name, "warmup")["seconds"] for name in sides}
    # The peak: the best of every measurement, before and after each round (the machine is
    # shared: a measurement at a busy moment reads low).
    peaks = {name: [ask(name, "peak")["flops"]] for name in ("jax", "torch")}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}
    tokens_per_round = args.steps * args.batch * SEQ
    for r in range(args.rounds):  # interleaved: jax, torch, torch.compile, jax, ...
        for name in sides:
            reply = ask(name, "train", start=r * args.steps, stop=(r + 1) * args.steps)
            rates[name].append(tokens_per_round / reply["seconds"])
            losses[name] += reply["losses"]
        for name, measured in peaks.items():
            measured.append(ask(name, "peak")["flops"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    held_out = {name: ask(name, "eval")["loss"] for name in sides}
    for side in sides.values():
        if isinstance(side, Worker):
            side.close()
    shutil.rmtree(workdir)
    report(args, ours, data=data, compile_s=compile_s, peaks=peaks, rates=rates,
           losses=losses, held_out=held_out)  # fmt: skip


def report(
    args: argparse.Namespace,
    ours: JaxSide,
    *,
    data: dict[str, Any],
    compile_s: dict[str, float],
    peaks: dict[str, list[float]],
    rates: dict[str, list[float]],
    losses: dict[str, list[float]],
    held_out: dict[str, float],
) -> None:
    config, names = ours.config, list(rates)
    per_token = flops_per_token(config.to_dict(), SEQ)
    best = {name: max(values) for name, values in peaks.items()}
    peak = max(best.values())
    print(
        f"Llama {config.hidden_size} wide x {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} key-value heads, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}: "
        f"{ours.parameters:,} parameters; batch {args.batch} x {SEQ}, {args.rounds} rounds x "
        f"{args.steps} steps; {data['sequences'][0]} training / {data['sequences'][1]} "
        f"held-out sequences; {os.cpu_count()} CPUs"
    )
    print(
        f"model FLOPs per token (MaxText's formula): {per_token / 1e6:.2f} M; 6N alone "
        f"{6 * ours.parameters / 1e6:.2f} M (N counts the tied embedding once)"
    )
    print(
        f"peak fp32 matmul {PEAK_N}x{PEAK_N}, best of {len(peaks['jax'])} measurements: jax "
        f"{best['jax'] / 1e9:.1f} GFLOP/s (lowest {min(peaks['jax']) / 1e9:.1f}), torch "
        f"{best['torch'] / 1e9:.1f} (lowest {min(peaks['torch']) / 1e9:.1f}); MFU below uses "
        f"{peak / 1e9:.1f}"
    )
    print("compile / warm-up s: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()))
    head = f"{'round':>6}" + "".join(f"  {n + ' tok/s':>20}" for n in names)
    print(head + "".join(f"  {'jax / ' + n:>20}" for n in names[1:]))
    for r in range(args.rounds):
        row = f"{r + 1:>6}" + "".join(f"  {rates[n][r]:>20.0f}" for n in names)
        print(row + "".join(f"  {rates['jax'][r] / rates[n][r]:>20.3f}" for n in names[1:]))
    median = {n: statistics.median(rates[n]) for n in names}
    ratios = {
        n: statistics.median(a / b for a, b in zip(rates["jax"], rates[n], strict=True))
        for n in names[1:]
    }
    row = f"{'median':>6}" + "".join(f"  {median[n]:>20.0f}" for n in names)
    print(row + "".join(f"  {ratios[n]:>20.3f}" for n in names[1:]))
    print(
        "MFU (median tokens/s x FLOPs per token / peak): "
        + ", ".join(f"{n} {median[n] * per_token / peak:.1%}" for n in names)
    )
    steps_run = len(losses["jax"])
    print(
        f"training loss, first -> last of {steps_run} steps: "
        + ", ".join(f"{n} {losses[n][0]:.4f} -> {losses[n][-1]:.4f}" for n in names)
    )
    print("held-out loss after the same steps: " + ", ".join(
        f"{n} {held_out[n]:.4f}" for n in names))  # fmt: skip
    for n in names[1:]:
        gaps = [abs(a - b) for a, b in zip(losses["jax"], losses[n], strict=True)]
        print(
            f"training-loss gap jax vs {n}: largest {max(gaps):.4f} (step "
            f"{gaps.index(max(gaps)) + 1}), per round (mean |gap|): "
            + ", ".join(
                f"{statistics.mean(gaps[r * args.steps : (r + 1) * args.steps]):.4f}"
                for r in range(args.rounds)
            )
        )


if __name__ == "__main__":
    main()
