"""Held-out evaluation during training: loss, perplexity and accuracy on a FIXED set.

The held-out shards (encode.py) are read in order, batched with drop_remainder and, for
MLM, masked with a constant seed (not the job's): the same sequences with the same masked
positions at every evaluation, in every run and after every resume, so the numbers compare.
The masked/parsed batches are cached after the first pass. Reported: mean loss over the
predicted tokens, perplexity = exp(loss), and accuracy at the masked positions (MLM) or of
the next token (CLM).

Same rules as training (strategy.py): static shapes, the per-replica forward pass compiled
with the runtime's `jit_compile`, a `tf.range` loop of `strategy.run` calls inside one
`tf.function`, sums all-reduced across replicas. Evaluation runs with training=False (no
dropout), touches neither the optimizer nor the training input pipeline, and so cannot
change what a resumed run computes.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf
from tqdm import tqdm

from payload import data as data_lib
from payload import model as model_lib
from payload import storage
from payload.errors import DataError

if TYPE_CHECKING:
    from payload.manifest import Manifest
    from payload.spec import JobSpec
    from payload.status import StatusWriter
    from payload.strategy import Runtime

# Fixed for every run: held-out masks must not depend on train.seed.
EVAL_MASK_SEED = 1_234_567


def eval_batch_size(eval_records: int, global_batch_size: int, replicas: int) -> int:
    """The training batch, or the largest multiple of the replica count that fits the set."""
    if eval_records >= global_batch_size:
        return global_batch_size
    return eval_records // replicas * replicas


def checked_eval_batch(job: JobSpec, manifest: Manifest, replicas: int) -> int:
    """eval_batch_size, or DataError when the held-out split cannot give every replica a row."""
    batch = eval_batch_size(manifest.eval_records, job.train.global_batch_size, replicas)
    if batch == 0:
        raise DataError(
            f"the held-out split in {job.paths.data} has {manifest.eval_records} sequences, "
            f"fewer than the {replicas} replicas; raise data.eval_min_sequences and re-run "
            "`tpu-payload encode --force`, or set data.eval_fraction: 0"
        )
    return batch


class Evaluator:
    def __init__(
        self,
        job: JobSpec,
        manifest: Manifest,
        runtime: Runtime,
        model: Any,
        status: StatusWriter,
    ):
        self.job, self.status = job, status
        replicas = runtime.num_replicas
        self.global_batch = checked_eval_batch(job, manifest, replicas)
        self.batches = manifest.eval_records // self.global_batch
        self.sequences = self.batches * self.global_batch
        global_batch = self.global_batch

        def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            per_replica = ctx.get_per_replica_batch_size(global_batch)
            return data_lib.make_dataset(
                job,
                manifest,
                batch_size=per_replica,
                seed=EVAL_MASK_SEED,
                training=False,
                repeat=False,
                replicas_per_pipeline=ctx.num_replicas_in_sync // ctx.num_input_pipelines,
                input_context=ctx,
                split="eval",
            ).cache()

        strategy = runtime.strategy
        self.dataset = strategy.distribute_datasets_from_function(dataset_fn)
        family, objective = job.model.family, job.data.objective

        @tf.function(jit_compile=runtime.plan.jit_compile)
        def forward(batch: dict[str, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            return model_lib.loss_terms(model, family, objective, batch, training=False)

        def replica_step(batch: dict[str, tf.Tensor]) -> Any:
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce("sum", list(forward(batch)))

        @tf.function
        def run_all(iterator: Any, num_batches: tf.Tensor) -> tf.Tensor:
            totals = tf.zeros([3], tf.float32)
            for _ in tf.range(num_batches):
                sums = strategy.run(replica_step, args=(next(iterator),))
                totals += tf.stack([strategy.experimental_local_results(s)[0] for s in sums])
            return totals

        self._run_all = run_all
        self.writer = tf.summary.create_file_writer(storage.join(job.paths.logs, "eval"))
        self.last_step: int | None = None

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate now; report to the log, TensorBoard (logs/eval) and status.json."""
        started = time.perf_counter()
        totals = self._run_all(iter(self.dataset), tf.constant(self.batches)).numpy()
        seconds = time.perf_counter() - started  # the first call includes tracing/compiling
        metrics = report(
            self.job,
            self.status,
            self.writer,
            step,
            totals,
            sequences=self.sequences,
            seconds=seconds,
        )
        self.last_step = step
        return metrics

    def close(self) -> None:
        self.writer.close()


def report(
    job: JobSpec,
    status: StatusWriter,
    writer: Any,
    step: int,
    totals: Any,
    *,
    sequences: int,
    seconds: float,
) -> dict[str, float]:
    """The metrics of one evaluation from its sums (loss, weight, correct), to the log,
    TensorBoard (`writer`: logs/eval) and status.json; both backends report through it."""
    loss_sum, weight_sum, correct = (float(x) for x in totals)
    loss = loss_sum / max(weight_sum, 1.0)
    metrics = {
        "eval_step": step,
        "eval_loss": round(loss, 6),
        "eval_perplexity": round(math.exp(min(loss, 700.0)), 4),
        "eval_accuracy": round(correct / max(weight_sum, 1.0), 6),
        "eval_sequences": sequences,
        "eval_predictions": int(weight_sum),
        "eval_seconds": round(seconds, 3),
    }
    with writer.as_default(step=step):
        tf.summary.scalar("loss", loss)
        tf.summary.scalar("perplexity", metrics["eval_perplexity"])
        tf.summary.scalar("accuracy", metrics["eval_accuracy"])
    writer.flush()
    name = "masked acc" if job.data.objective == "mlm" else "next-token acc"
    tqdm.write(
        f"eval step {step}/{job.train.steps}  loss {loss:.4f}  "
        f"ppl {metrics['eval_perplexity']:.2f}  {name} {metrics['eval_accuracy']:.3f}  "
        f"({sequences} held-out sequences)",
        file=sys.stderr,
    )
    status.update(stage="train", progress=step / job.train.steps, step=step, **metrics)
    return metrics
