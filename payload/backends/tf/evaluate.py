"""The TF backend's held-out evaluation (payload/training/heldout.py: the set, the batch and the
report).

Same rules as training (strategy.py): static shapes, the per-replica forward pass compiled
with the runtime's `jit_compile`, a `tf.range` loop of `strategy.run` calls inside one
`tf.function`, sums all-reduced across replicas. Evaluation runs with training=False (no
dropout), touches neither the optimizer nor the training input pipeline, and so cannot
change what a resumed run computes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from payload.backends.tf import input as data_lib
from payload.backends.tf import model as model_lib
from payload.core import storage
from payload.training import tracker
from payload.training.heldout import EVAL_MASK_SEED, checked_eval_batch, report

if TYPE_CHECKING:
    from payload.backends.tf.strategy import Runtime
    from payload.core.status import StatusWriter
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec


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

        # No AutoGraph for the model's call tree (train.py's forward_backward says why).
        @tf.function(jit_compile=runtime.plan.jit_compile, autograph=False)
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
        self.writer = tracker.scalars(
            job, storage.join(job.paths.logs, "eval"), namespace="eval", enabled=True
        )
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
