"""The `train` stage: verified shards -> (resumable) pre-training -> exported HF model.

Order of work:
 1. load the manifest, check it against the job and the tokenizer (DataError), verify every
    shard's size and sha256 (DataError naming the shard);
 2. pick the accelerator and strategy (strategy.py), build model and AdamW in its scope;
 3. restore the newest checkpoint if there is one (the step counter continues; run.json
    must match) and start the input pipeline at that step's batch;
 4. train in chunks of up to `steps_per_execution` steps per call, stopping exactly at
    log / checkpoint / eval / final step boundaries; TensorBoard scalars, progress,
    status.json; every `eval_every` steps and at the end, evaluate on the fixed held-out
    split (evaluate.py);
 5. save a final checkpoint, then export (export.py): TF and PyTorch weights, tokenizer and
    model card to a local temp dir, uploaded to `export/`, the completion marker last.
A kill at any time loses at most `checkpoint_every` steps.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf
import tf_keras
from tqdm import tqdm

from payload.backends.tf import checkpoint as checkpoint_lib
from payload.backends.tf import evaluate as evaluate_lib
from payload.backends.tf import input as data_lib
from payload.backends.tf import model as tf_model
from payload.backends.tf import schedule
from payload.backends.tf import strategy as strategy_lib
from payload.core import storage
from payload.core.errors import SpecError
from payload.core.status import StatusWriter
from payload.model import configs
from payload.schema import manifest as manifest_lib
from payload.spec import tf_backend_refusal
from payload.training import export as export_lib
from payload.training import identity as identity_lib
from payload.training import shared as training
from payload.training.report import RunReport

if TYPE_CHECKING:
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec

EXPORT_MARKER = training.EXPORT_MARKER
# float16 only (T4, V100): the dynamic loss scale's start, tf_keras' own default.
LOSS_SCALE_INITIAL = 2.0**15
BACKEND = "tf"

# Shared with the JAX backend (payload/training/shared.py); the names stay importable from here.
TrainingDivergedError = training.TrainingDivergedError
TrainingInterrupted = training.TrainingInterrupted
is_complete = training.is_complete
check_data = training.check_data
_chunk_length = training.chunk_length
_log = training.log
_UnwrittenStatus = training.UnwrittenStatus
_StopRequest = training.StopRequest


def refuse_jax_only(job: JobSpec) -> None:
    """One line for what only the JAX backend has: the llama family, train.remat and
    train.grad_accum_steps (spec.py refuses them with `train.backend: tf`; this catches
    `auto` resolved to tf by the VM unit's TPU_PAYLOAD_BACKEND), and train.sharding: fsdp."""
    if refusal := tf_backend_refusal(job):
        raise SpecError(refusal)


def train(
    job: JobSpec,
    status: StatusWriter,
    *,
    runtime: strategy_lib.Runtime | None = None,
) -> dict[str, Any]:
    """Train (or resume) and export on this host (slices run the JAX backend).

    `runtime` defaults to the detected accelerator. Only the chief writes (checkpoints,
    run.json, TensorBoard, status, export): in a multi-client run every other worker
    computes and reads only.
    """
    refuse_jax_only(job)
    if runtime is not None and not runtime.is_chief:
        status = _UnwrittenStatus(status.path, status.job_name)
    report = RunReport(job, status, chief=runtime is None or runtime.is_chief)
    try:
        return _train(job, status, runtime, report)
    except BaseException as exc:
        report.ended_by(exc)  # how this start ended, in the goodput ledger
        raise


def _train(
    job: JobSpec, status: StatusWriter, runtime: strategy_lib.Runtime | None, report: RunReport
) -> dict[str, Any]:
    status.update(stage="train", message="verifying data")
    manifest = manifest_lib.load_manifest(job.paths.data)
    check_data(job, manifest)
    manifest_lib.verify_shards(job.paths.data, manifest, checksums=True)

    family, spec = job.model.family, job.train
    config = configs.config_for(job, manifest)
    runtime = runtime or strategy_lib.setup(spec.precision)
    strategy_lib.check_global_batch(spec.global_batch_size, runtime)
    chief = runtime.is_chief
    described = strategy_lib.describe(runtime)
    _log(f"train: {json.dumps(described)}")
    status.note_runtime(described)  # the devices the backend sees, beside the host checks

    strategy = runtime.strategy
    # Seeded initial weights. The global seed is cleared again afterwards: everything random
    # in the input pipeline has explicit per-epoch seeds (data.py), and tf.data mishandles
    # tensor-valued seeds under a global seed of 0.
    tf_keras.utils.set_random_seed(spec.seed)
    try:
        with strategy.scope():
            model = tf_model.create_model(family, config, manifest.seq_length)
            optimizer = schedule.create_optimizer(spec, jit_compile=runtime.plan.jit_compile)
            if runtime.plan.loss_scaling:
                # Dynamic loss scaling (tf_keras' LossScaleOptimizer: starts at 2**15, halves
                # and skips the step on inf/NaN gradients, doubles after 2,000 good steps).
                # It is checkpointed with the optimizer; a skipped step still counts.
                optimizer = tf_keras.mixed_precision.LossScaleOptimizer(
                    optimizer, initial_scale=LOSS_SCALE_INITIAL
                )
            optimizer.build(model.trainable_variables)
    finally:
        tf.random.set_seed(None)
    with report.during("restore"):
        manager, restored, step = _restore_or_start(
            job, manifest, config, model, optimizer, chief=chief
        )
    report.restored(step if restored is not None else None)

    stats: dict[str, Any] = {"step": step}
    if restored is not None:
        stats["resumed_from"] = restored
    evaluator = (
        evaluate_lib.Evaluator(job, manifest, runtime, model, status)
        if manifest.eval_records
        else None
    )
    try:
        if step < spec.steps:
            loop = _TrainLoop(job, manifest, runtime, model, optimizer, evaluator=evaluator)
            stats.update(loop.run(manager, status, step, report))
        stats["step"] = int(optimizer.iterations.numpy())
        if evaluator is not None:
            with report.during("evaluation"):
                stats.update(evaluator.evaluate(stats["step"]))  # the final evaluation
    finally:
        if evaluator is not None:
            evaluator.close()

    if not chief:
        return stats
    status.update(stage="train", progress=1.0, step=stats["step"], message="exporting")
    with report.during("export"):
        export(job, model, stats, manifest=manifest, runtime=runtime, status=status)
    stats["export"] = job.paths.export
    status.update(stage="train", progress=1.0, step=stats["step"], message="exported")
    report.finished(stats["step"])
    return stats


def _restore_or_start(
    job: JobSpec, manifest: Manifest, config: Any, model: Any, optimizer: Any, *, chief: bool
) -> tuple[Any, Any, int]:
    """The checkpoint manager, the checkpoint restored (None: a fresh start) and the step.
    The chief refuses checkpoints of another run (run.json) before anything is restored."""
    spec = job.train
    ckpt, manager = checkpoint_lib.make_manager(
        model, optimizer, job.paths.checkpoints, keep=spec.keep_checkpoints
    )
    run_identity = identity_lib.identity(job, manifest, config.to_dict(), backend=BACKEND)
    if chief:
        storage.makedirs(job.paths.checkpoints)
        identity_lib.check_identity(
            job.paths.checkpoints,
            run_identity,
            has_checkpoint=manager.latest_checkpoint is not None,
        )
    restored = checkpoint_lib.restore_latest(ckpt, manager)
    step = int(optimizer.iterations.numpy())
    if restored is not None:
        _log(f"train: resumed from {manager.latest_checkpoint} at step {step}")
    return manager, restored, step


class _TrainLoop:
    """The compiled step functions and the host-side loop around them."""

    def __init__(
        self,
        job: JobSpec,
        manifest: Manifest,
        runtime: strategy_lib.Runtime,
        model: Any,
        optimizer: Any,
        *,
        evaluator: evaluate_lib.Evaluator | None = None,
    ):
        self.job, self.manifest, self.runtime = job, manifest, runtime
        self.model, self.optimizer = model, optimizer
        self.evaluator = evaluator
        self.spec = job.train

    def dataset(self, start_step: int) -> Any:
        return self.runtime.strategy.distribute_datasets_from_function(
            input_fn(self.job, self.manifest, start_step)
        )

    def make_train_chunk(self, iterator: Any) -> Any:
        strategy, model, optimizer = self.runtime.strategy, self.model, self.optimizer
        family, objective = self.job.model.family, self.job.data.objective
        variables = model.trainable_variables
        clip_norm = float(self.spec.clip_norm)
        scaling = self.runtime.plan.loss_scaling

        # autograph=False: nothing here branches on a tensor, and AutoGraph would rewrite the
        # model's whole call tree (transformers' and tf_keras' layers) from source in every
        # process: a tiny 16-step MLM run took 27.4 s, 16.1 s without (same eval loss). The
        # chunk's `for ... in tf.range` below keeps AutoGraph (it becomes a while loop).
        @tf.function(jit_compile=self.runtime.plan.jit_compile, autograph=False)
        def forward_backward(batch: dict[str, tf.Tensor]) -> tuple[Any, ...]:
            with tf.GradientTape() as tape:
                loss_sum, weight_sum, correct = tf_model.loss_terms(
                    model, family, objective, batch, training=True
                )
                scaled = optimizer.get_scaled_loss(loss_sum) if scaling else loss_sum
            grads = tape.gradient(scaled, variables)
            return loss_sum, weight_sum, correct, [tf.convert_to_tensor(g) for g in grads]

        def replica_step(batch: dict[str, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            ctx = tf.distribute.get_replica_context()
            loss_sum, weight_sum, correct, grads = forward_backward(batch)
            # Mean over every predicted token of the GLOBAL batch, whatever the replica count:
            # sum the unnormalised losses and gradients, then divide by the global weight.
            loss_sum, weight_sum, correct = ctx.all_reduce("sum", [loss_sum, weight_sum, correct])
            denominator = tf.maximum(weight_sum, 1.0)
            grads = [g / denominator for g in ctx.all_reduce("sum", grads)]
            if scaling:
                # Unscaled after the all-reduce: every replica holds the same gradients, so
                # every replica finds the same inf/NaN and skips the same step.
                grads = optimizer.get_unscaled_gradients(grads)
            if clip_norm > 0:
                grads, norm = tf.clip_by_global_norm(grads, clip_norm)
            else:
                norm = tf.linalg.global_norm(grads)
            optimizer.apply_gradients(
                zip(grads, variables, strict=True), skip_gradients_aggregation=True
            )
            return loss_sum / denominator, correct / denominator, norm

        @tf.function
        def train_chunk(num_steps: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            loss_total = tf.constant(0.0)
            accuracy_total = tf.constant(0.0)
            norm = tf.constant(0.0)
            for _ in tf.range(num_steps):
                loss, accuracy, norm = strategy.run(replica_step, args=(next(iterator),))
                # Every replica holds the same all-reduced values; take the first.
                loss_total += strategy.experimental_local_results(loss)[0]
                accuracy_total += strategy.experimental_local_results(accuracy)[0]
                norm = strategy.experimental_local_results(norm)[0]
            count = tf.cast(num_steps, tf.float32)
            return loss_total / count, accuracy_total / count, norm

        return train_chunk

    def run(
        self,
        manager: tf.train.CheckpointManager,
        status: StatusWriter,
        start_step: int,
        report: RunReport,
    ) -> dict[str, Any]:
        spec, plan = self.spec, self.runtime.plan
        report.enter("compile")  # tracing and compiling, up to the first finished chunk
        train_chunk = self.make_train_chunk(iter(self.dataset(start_step)))
        chief = self.runtime.is_chief
        lr_schedule = schedule.learning_rate_schedule(spec)
        meter = training.Meter(
            self.job,
            self.manifest,
            status,
            chief=chief,
            learning_rate=lambda step: float(lr_schedule(step).numpy()),
            report=report,
        )
        step, total = start_step, spec.steps
        bar = tqdm(
            total=total, initial=step, unit="step", file=sys.stderr, disable=not sys.stderr.isatty()
        )
        stop = _StopRequest()
        try:
            while step < total:
                eval_every = spec.eval_every if self.evaluator is not None else 0
                n = _chunk_length(
                    step,
                    total,
                    plan.steps_per_execution,
                    spec.log_every,
                    spec.checkpoint_every,
                    eval_every=eval_every,
                )
                loss, accuracy, norm = train_chunk(tf.constant(n))
                step += n
                bar.update(n)
                meter.record(step, n, float(loss.numpy()), float(accuracy.numpy()))
                if not math.isfinite(meter.loss):
                    raise training.diverged(meter.loss, step, n, spec, manager.latest_checkpoint)
                saved = chief and (step % spec.checkpoint_every == 0 or step == total)
                if saved:
                    with report.during("checkpoint"):
                        manager.save(checkpoint_number=step)
                if step % spec.log_every == 0 or step == total:
                    meter.log(step, float(norm.numpy()))
                    bar.set_postfix(loss=f"{meter.loss:.4f}")
                if saved:
                    status.flush(milestone=True)  # the status page (page.py) at a checkpoint
                # The final evaluation follows the loop.
                if (
                    self.evaluator is not None
                    and eval_every
                    and step % eval_every == 0
                    and step < total
                ):
                    with report.during("evaluation"):
                        self.evaluator.evaluate(step)
                    meter.exclude_pause()
                if stop.signal is not None:
                    # Preemption/shutdown: keep this step's work, then exit like the signal.
                    with report.during("checkpoint"):
                        path = manager.save(checkpoint_number=step) if chief else "(the chief's)"
                    raise training.interrupted(stop.signal, step, path, status)
        finally:
            stop.restore()
            bar.close()
            meter.close()
        return {
            "first_loss": meter.first_loss,
            "loss": meter.loss,
            "accuracy": meter.accuracy,
            "steps_per_second": meter.mean_steps_per_second(),
        }


def input_fn(
    job: JobSpec, manifest: Manifest, start_step: int
) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """The per-host dataset function for `distribute_datasets_from_function`.

    The strategy calls it once per input pipeline: once on one host; on a multi-host slice
    once per host, on that host (`ctx.input_pipeline_id` = the host's index), and data.py
    gives each pipeline its own shards. Every pipeline feeds its own replicas.
    """
    global_batch, seed = job.train.global_batch_size, job.train.seed

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        replicas_per_pipeline = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return data_lib.make_dataset(
            job,
            manifest,
            batch_size=per_replica,
            seed=seed,
            start_batch=start_step,
            replicas_per_pipeline=replicas_per_pipeline,
            input_context=ctx,
        )

    return dataset_fn


def export(
    job: JobSpec,
    model: Any,
    stats: dict[str, Any],
    *,
    manifest: Manifest,
    runtime: strategy_lib.Runtime,
    status: StatusWriter,
) -> None:
    """TF + PyTorch weights, tokenizer and model card to `export/` (export.py)."""
    training.export_model(
        job,
        export_lib.save_tf_model(model, job.model.family),
        manifest=manifest,
        model_config=model.config.to_dict(),
        tf_class=type(model).__name__,
        runtime=strategy_lib.describe(runtime),
        status=status,
        stats=stats,
    )
