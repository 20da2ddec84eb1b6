"""The JAX backend's held-out evaluation (payload/training/heldout.py: the set, the batch and the
report): the same fixed set and masks as the TF backend (payload/backends/tf/evaluate.py),
read once and kept on the host, summed by one compiled forward pass per batch, in
micro-batches no larger than training's (train.grad_accum_steps), the sums kept on the devices.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from payload.backends.jax import steps
from payload.core import storage
from payload.training import heldout, tracker

if TYPE_CHECKING:
    from payload.backends.jax.batches import Pipelines
    from payload.backends.jax.runtime import Runtime
    from payload.core.status import StatusWriter
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec


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
        sums: Any = None,
    ):
        """`sums`: the compiled evaluation step (program.Programs.eval_sums, built for this
        job's held-out batch); default: make_eval_sums, compiled at the first call."""
        self.job, self.status, self.pipelines = job, status, pipelines
        replicas = rt.num_replicas
        self.global_batch = heldout.checked_eval_batch(job, manifest, replicas)
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
            seed=heldout.EVAL_MASK_SEED,
            training=False,
            repeat=False,
            split="eval",
        )
        # Read, masked and kept on the host once: the same batches at every evaluation.
        self.host_batches = [pipelines.next_host_batch(iterators) for _ in range(self.batches)]
        pipelines.close(iterators)
        objective = job.data.objective
        # Split like training: a device never holds more rows at once than it trains on
        # (train.grad_accum_steps' micro-batch), so an evaluation fits wherever a step does.
        self.micro_batches = micro_batches_of(job, self.global_batch, replicas)
        count = self.micro_batches

        self._sums = sums if sums is not None else make_eval_sums(model, objective, count)
        self.terms = len(steps.RTD_TERMS) if objective == "rtd" else 3
        self.writer = tracker.scalars(
            job, storage.join(job.paths.logs, "eval"), namespace="eval", enabled=rt.is_chief
        )
        self._replicated = NamedSharding(rt.mesh, P())

    def evaluate(
        self,
        step: int,
        state: steps.TrainState,
        *,
        group: int = 0,
        stop: Callable[[int], bool] | None = None,
    ) -> dict[str, float] | None:
        """The held-out metrics of `state` at `step`. With `stop` (the training loop's), the
        batches go to the devices in groups of `group`, at most one group ahead of the
        devices, and after each group `stop(batches done)` (a question every process of a
        slice asks at the same batch) may end the evaluation: None then, nothing reported."""
        started = time.perf_counter()
        totals = jax.device_put(np.zeros([self.terms], np.float32), self._replicated)
        previous = None  # the totals after the group before the last one dispatched
        for index, batch in enumerate(self.host_batches):
            arrays = self.pipelines.to_devices(batch, chunk=False)
            totals = self._sums(
                state.trainable, state.non_trainable, arrays, np.int32(index), totals
            )
            done = index + 1
            if stop is None or group < 1 or done % group or done == len(self.host_batches):
                continue
            if previous is not None:
                previous.block_until_ready()  # one group runs while the next is queued
            previous = totals
            if stop(done):
                return None
        seconds = time.perf_counter() - started  # the first call includes compiling
        return heldout.report(
            self.job,
            self.status,
            self.writer,
            step,
            np.asarray(jax.device_get(totals)),
            sequences=self.sequences,
            seconds=seconds,
        )

    def close(self) -> None:
        self.writer.close()


def micro_batches_of(job: JobSpec, eval_batch: int, replicas: int) -> int:
    """How many micro-batches a held-out batch of `eval_batch` rows runs in over `replicas`
    devices: a device never holds more rows at once than it trains on (train.
    grad_accum_steps' micro-batch), so an evaluation fits wherever a step does."""
    train_rows = job.train.global_batch_size // (replicas * job.train.grad_accum_steps)
    return heldout.micro_batch_count(eval_batch // replicas, train_rows)


def make_eval_sums(
    model: Any,
    objective: str,
    count: int,
    *,
    out_sharding: Any = None,
    memory_bytes: int | None = None,
) -> Any:
    """A compiled (trainable, non_trainable, batch, index, totals) -> totals + the held-out
    sums of batch `index`, one micro-batch of `count` at a time (a `lax.scan`: activations of
    one micro-batch at a time); the totals stay on the devices between batches, in
    `out_sharding` when given (the totals' input sharding: the next call takes them back).
    `memory_bytes`: one device's memory, which sizes the loss's chunks (steps.lm_loss_terms)."""

    def terms_of(trainable: Any, non_trainable: Any, batch: Any, key: Any) -> Any:
        if objective == "rtd":
            outputs, _ = model.stateless_call(
                trainable, non_trainable, steps.rtd_inputs(batch, key), training=False
            )
            return steps.rtd_terms(outputs, batch)
        inputs, labels, weights = steps.model_inputs(objective, batch)
        terms, _ = steps.lm_loss_terms(
            model, trainable, non_trainable, inputs, labels=labels, weights=weights,
            training=False, memory_bytes=memory_bytes,
        )  # fmt: skip
        return terms

    def sums(
        trainable: Any, non_trainable: Any, batch: dict[str, Any], index: Any, totals: Any
    ) -> Any:
        # The generator's samples of batch `index` (and micro-batch i) are the same at every
        # evaluation.
        if count == 1:
            key = steps.sample_key(heldout.EVAL_MASK_SEED, index)
            return totals + terms_of(trainable, non_trainable, batch, key)

        def body(carry: Any, indexed: tuple[Any, Any]) -> tuple[Any, None]:
            i, micro = indexed
            key = steps.sample_key(heldout.EVAL_MASK_SEED, index, i)
            return carry + terms_of(trainable, non_trainable, micro, key), None

        totals, _ = jax.lax.scan(
            body, totals, (jnp.arange(count), split_micro_batches(batch, count))
        )
        return totals

    if out_sharding is None:
        return jax.jit(sums)
    return jax.jit(sums, out_shardings=out_sharding)


def split_micro_batches(batch: dict[str, Any], count: int) -> dict[str, Any]:
    """[B, ...] -> [count, B / count, ...]; rows i, i + count, i + 2 count, ... form
    micro-batch i, so every device keeps its own rows (steps.make_train_chunk's rule)."""

    def split(x: Any) -> Any:
        parts = x.reshape(x.shape[0] // count, count, *x.shape[1:])
        return jnp.swapaxes(parts, 0, 1)

    return {name: split(x) for name, x in batch.items()}
