"""The JAX backend's held-out evaluation (payload/evaluate.py: the set, the batch and the
report): the same fixed set and masks as the TF backend (payload/backends/tf/evaluate.py),
read once and kept on the host, summed by one compiled forward pass per batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from payload import evaluate as evaluate_lib
from payload import storage
from payload.backends.jax import steps
from payload.tensorboard import Scalars

if TYPE_CHECKING:
    from payload.backends.jax.batches import Pipelines
    from payload.backends.jax.runtime import Runtime
    from payload.manifest import Manifest
    from payload.spec import JobSpec
    from payload.status import StatusWriter


class Evaluator:
    """evaluate.py's held-out evaluation on this backend: the same fixed set and masks
    (evaluate.EVAL_MASK_SEED), the same sums and metrics, status and TensorBoard."""

    def __init__(
        self,
        job: JobSpec,
        manifest: Manifest,
        rt: Runtime,
        *,
        model: Any,
        pipelines: Pipelines,
        status: StatusWriter,
    ):
        self.job, self.status, self.pipelines = job, status, pipelines
        replicas = rt.num_replicas
        self.global_batch = evaluate_lib.checked_eval_batch(job, manifest, replicas)
        # Every pipeline must give the same number of batches: the smallest share decides.
        self.batches = min(
            plan.batches_per_epoch
            for plan in pipelines.plans(job, manifest, self.global_batch, split="eval")
        )
        self.sequences = self.batches * self.global_batch
        iterators = pipelines.datasets(
            job,
            manifest,
            self.global_batch,
            seed=evaluate_lib.EVAL_MASK_SEED,
            training=False,
            repeat=False,
            split="eval",
        )
        # Read, masked and kept on the host once: the same batches at every evaluation.
        self.host_batches = [pipelines.next_host_batch(iterators) for _ in range(self.batches)]
        objective = job.data.objective

        @jax.jit
        def sums(trainable: Any, non_trainable: Any, batch: dict[str, Any], index: Any) -> Any:
            if objective == "rtd":
                # The generator's samples of batch `index` are the same at every evaluation.
                key = steps.sample_key(evaluate_lib.EVAL_MASK_SEED, index)
                outputs, _ = model.stateless_call(
                    trainable, non_trainable, steps.rtd_inputs(batch, key), training=False
                )
                return steps.rtd_terms(outputs, batch)
            inputs, labels, weights = steps.model_inputs(objective, batch)
            terms, _ = steps.lm_loss_terms(
                model,
                trainable,
                non_trainable,
                inputs,
                labels=labels,
                weights=weights,
                training=False,
            )
            return terms

        self._sums = sums
        self.terms = len(steps.RTD_TERMS) if objective == "rtd" else 3
        self.writer = Scalars(storage.join(job.paths.logs, "eval"), enabled=rt.is_chief)

    def evaluate(self, step: int, state: steps.TrainState) -> dict[str, float]:
        started = time.perf_counter()
        totals = jnp.zeros([self.terms], jnp.float32)
        for index, batch in enumerate(self.host_batches):
            arrays = self.pipelines.to_devices(batch, chunk=False)
            totals = totals + self._sums(
                state.trainable, state.non_trainable, arrays, np.int32(index)
            )
        seconds = time.perf_counter() - started  # the first call includes compiling
        return evaluate_lib.report(
            self.job,
            self.status,
            self.writer,
            step,
            np.asarray(totals),
            sequences=self.sequences,
            seconds=seconds,
        )

    def close(self) -> None:
        self.writer.close()
