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

import hashlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf
import tf_keras
from tokenizers import Tokenizer
from tqdm import tqdm

from payload import checkpoint as checkpoint_lib
from payload import data as data_lib
from payload import evaluate as evaluate_lib
from payload import export as export_lib
from payload import manifest as manifest_lib
from payload import model as model_lib
from payload import modelcard, schedule, storage
from payload import strategy as strategy_lib
from payload import tokenizer as tokenizer_lib
from payload.errors import DataError, UserError
from payload.status import StatusWriter

if TYPE_CHECKING:
    from payload.manifest import Manifest
    from payload.spec import JobSpec

EXPORT_MARKER = export_lib.EXPORT_MARKER
# float16 only (T4, V100): the dynamic loss scale's start, tf_keras' own default.
LOSS_SCALE_INITIAL = 2.0**15


class TrainingDivergedError(UserError):
    """The loss became NaN or infinite; checkpoints written before it are kept."""


class TrainingInterrupted(SystemExit):
    """SIGTERM/SIGINT during training, after a checkpoint of the current step was saved.

    Exits with 128 + the signal number, as if the signal had killed the process.
    """

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.message = message

    def __str__(self) -> str:
        return self.message


def is_complete(job: JobSpec) -> bool:
    return storage.exists(storage.join(job.paths.export, EXPORT_MARKER))


def check_data(job: JobSpec, manifest: Manifest) -> None:
    """DataError if the encoded data cannot feed this job's model."""
    where = job.paths.data
    if manifest.objective != job.data.objective:
        raise DataError(
            f"data in {where} was encoded for objective {manifest.objective!r} but the job "
            f"says data.objective: {job.data.objective!r}; re-run `tpu-payload encode --force`"
        )
    if manifest.seq_length != job.data.seq_length:
        raise DataError(
            f"data in {where} has seq_length {manifest.seq_length} but the job says "
            f"data.seq_length: {job.data.seq_length}; re-run `tpu-payload encode --force`"
        )
    tokenizer_json = tokenizer_lib.tokenizer_json(job.paths.tokenizer)  # DataError if missing
    actual = hashlib.sha256(tokenizer_json).hexdigest()
    if actual != manifest.tokenizer_sha256:
        raise DataError(
            f"data in {where} was encoded with a different tokenizer (manifest tokenizer_sha256 "
            f"{manifest.tokenizer_sha256[:12]}…, {job.paths.tokenizer} has {actual[:12]}…); "
            "re-run `tpu-payload encode --force`"
        )
    tokenizer_vocab = Tokenizer.from_str(tokenizer_json.decode()).get_vocab_size(
        with_added_tokens=True
    )
    if tokenizer_vocab != manifest.vocab_size:
        raise DataError(
            f"manifest vocab_size {manifest.vocab_size} does not match the tokenizer's "
            f"{tokenizer_vocab} ({job.paths.tokenizer}); re-run `tpu-payload encode --force`"
        )
    special = data_lib.special_ids_of(manifest)
    if any(not 0 <= i < manifest.vocab_size for i in special.values()):
        raise DataError(
            f"manifest special ids {special} fall outside vocab_size {manifest.vocab_size}"
        )
    if job.data.objective == "mlm" and "mask" not in special:
        raise DataError(
            f"data in {where} has no mask token (special ids: {sorted(special)}); MLM needs one"
        )
    family = job.model.family
    if (
        family == "roberta"
        and special.get("pad", model_lib.ROBERTA_PADDING_IDX) != model_lib.ROBERTA_PADDING_IDX
    ):
        raise DataError(
            f"roberta needs the padding token at id {model_lib.ROBERTA_PADDING_IDX} (TF RoBERTa "
            f"numbers positions from it) but the tokenizer has pad={special['pad']}; list "
            "tokenizer.special_tokens with the pad token second"
        )


def _chunk_length(
    step: int, total: int, plan_spe: int, log_every: int, ckpt_every: int, *, eval_every: int = 0
) -> int:
    """Steps until the next log/checkpoint/eval/final boundary, at most steps_per_execution."""
    boundary = total
    for every in (log_every, ckpt_every, eval_every):
        if every > 0:
            boundary = min(boundary, (step // every + 1) * every)
    return max(1, min(plan_spe, boundary - step))


def _log(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def train(
    job: JobSpec,
    status: StatusWriter,
    *,
    runtime: strategy_lib.Runtime | None = None,
    target: strategy_lib.SliceTarget | None = None,
) -> dict[str, Any]:
    """Train (or resume) and export.

    `runtime` defaults to the detected accelerator, or to the multi-host TPU slice `target`
    (strategy.slice_target). Only the chief writes (checkpoints, run.json, TensorBoard,
    status, export): on a slice that is this one client on worker 0; in a multi-client
    run (the tests' loopback cluster) every other worker computes and reads only.
    """
    strategy_lib.require_shared_paths({"output": job.paths.root, "data": job.paths.data}, target)
    if runtime is not None and not runtime.is_chief:
        status = _UnwrittenStatus(status.path, status.job_name)
    status.update(stage="train", message="verifying data")
    manifest = manifest_lib.load_manifest(job.paths.data)
    check_data(job, manifest)
    manifest_lib.verify_shards(job.paths.data, manifest, checksums=True)

    family, spec = job.model.family, job.train
    config = model_lib.build_config(
        family,
        job.model.size,
        job.model.config,
        vocab_size=manifest.vocab_size,
        special_ids=data_lib.special_ids_of(manifest),
    )
    runtime = runtime or strategy_lib.setup(spec.precision, target=target)
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
            model = model_lib.create_model(family, config, manifest.seq_length)
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
    manager, restored, step = _restore_or_start(
        job, manifest, config, model, optimizer, chief=chief
    )

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
            stats.update(loop.run(manager, status, step))
        stats["step"] = int(optimizer.iterations.numpy())
        if evaluator is not None:
            stats.update(evaluator.evaluate(stats["step"]))  # the final evaluation
    finally:
        if evaluator is not None:
            evaluator.close()

    if not chief:
        return stats
    status.update(stage="train", progress=1.0, step=stats["step"], message="exporting")
    export(job, model, stats, manifest=manifest, runtime=runtime, status=status)
    stats["export"] = job.paths.export
    status.update(stage="train", progress=1.0, step=stats["step"], message="exported")
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
    run_identity = checkpoint_lib.identity(
        model_config=config.to_dict(),
        family=job.model.family,
        objective=job.data.objective,
        seq_length=manifest.seq_length,
        tokenizer_sha256=manifest.tokenizer_sha256,
        global_batch_size=spec.global_batch_size,
        seed=spec.seed,
    )
    if chief:
        storage.makedirs(job.paths.checkpoints)
        checkpoint_lib.check_identity(
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

        @tf.function(jit_compile=self.runtime.plan.jit_compile)
        def forward_backward(batch: dict[str, tf.Tensor]) -> tuple[Any, ...]:
            with tf.GradientTape() as tape:
                loss_sum, weight_sum, correct = model_lib.loss_terms(
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
        self, manager: tf.train.CheckpointManager, status: StatusWriter, start_step: int
    ) -> dict[str, Any]:
        spec, plan = self.spec, self.runtime.plan
        train_chunk = self.make_train_chunk(iter(self.dataset(start_step)))
        chief = self.runtime.is_chief
        meter = _Meter(self.job, self.manifest, status, chief=chief)
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
                    raise TrainingDivergedError(
                        f"loss became {meter.loss} between steps {step - n} and {step} "
                        f"(train.learning_rate={spec.learning_rate}); the last good checkpoint "
                        f"is kept ({manager.latest_checkpoint or 'none yet'}): lower "
                        "train.learning_rate or raise train.warmup_steps"
                    )
                if chief and (step % spec.checkpoint_every == 0 or step == total):
                    manager.save(checkpoint_number=step)
                if step % spec.log_every == 0 or step == total:
                    meter.log(step, float(norm.numpy()))
                    bar.set_postfix(loss=f"{meter.loss:.4f}")
                # The final evaluation follows the loop.
                if (
                    self.evaluator is not None
                    and eval_every
                    and step % eval_every == 0
                    and step < total
                ):
                    self.evaluator.evaluate(step)
                    meter.exclude_pause()
                if stop.signal is not None:
                    # Preemption/shutdown: keep this step's work, then exit like the signal.
                    path = manager.save(checkpoint_number=step) if chief else "(the chief's)"
                    message = (
                        f"stopped by signal {stop.signal} at step {step}; checkpoint {path} "
                        "saved: rerun to resume"
                    )
                    _log(f"train: {message}")
                    status.fail(stage="train", error=message)
                    raise TrainingInterrupted(stop.signal, message)
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


class _UnwrittenStatus(StatusWriter):
    """status.json as a worker that is not the chief sees it: kept in memory, never written."""

    def flush(self) -> None:
        self._dirty = False


class _StopRequest:
    """SIGTERM/SIGINT while training: finish the running chunk, checkpoint, then exit.

    A spot/preemptible VM shutting down sends SIGTERM; without this, up to
    `checkpoint_every` steps would be lost instead of at most one chunk.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._request)

    def _request(self, signum: int, frame: object) -> None:
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class _Meter:
    """Loss, learning rate and throughput to the log, TensorBoard and status.json."""

    def __init__(self, job: JobSpec, manifest: Manifest, status: StatusWriter, *, chief: bool):
        self.total = job.train.steps
        self.sequences_per_step = job.train.global_batch_size
        self.tokens_per_step = job.train.global_batch_size * manifest.seq_length
        self.schedule = schedule.learning_rate_schedule(job.train)
        self.status = status
        # One event file per run, the chief's: other workers' would duplicate every scalar.
        self.writer = (
            tf.summary.create_file_writer(job.paths.logs)
            if chief
            else tf.summary.create_noop_writer()
        )
        self.loss = self.accuracy = float("nan")
        self.first_loss: float | None = None
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.run_start, self.run_steps = self.window_start, 0
        self.warm = False
        self._last_record = self.window_start

    def record(self, step: int, n: int, loss: float, accuracy: float) -> None:
        self._last_record = time.perf_counter()
        self.loss, self.accuracy = loss, accuracy
        if self.first_loss is None:
            self.first_loss = loss
        if not self.warm:
            # The first chunk includes tracing and compilation: keep it out of throughput.
            self.warm, self.window_start, self.window_steps = True, time.perf_counter(), 0
            self.run_start, self.run_steps = self.window_start, 0
        else:
            self.window_steps += n
            self.run_steps += n

    def exclude_pause(self) -> None:
        """Restart the throughput window after an evaluation: steps/s counts training only."""
        now = time.perf_counter()
        paused = now - self._last_record
        self.window_start += paused
        self.run_start += paused

    def mean_steps_per_second(self) -> float:
        elapsed = time.perf_counter() - self.run_start
        return self.run_steps / elapsed if self.run_steps and elapsed > 0 else 0.0

    def log(self, step: int, grad_norm: float) -> None:
        elapsed = time.perf_counter() - self.window_start
        steps_per_s = self.window_steps / elapsed if self.window_steps and elapsed > 0 else 0.0
        lr = float(self.schedule(step - 1).numpy())  # the rate of the step just taken
        with self.writer.as_default(step=step):
            tf.summary.scalar("loss", self.loss)
            tf.summary.scalar("accuracy", self.accuracy)
            tf.summary.scalar("learning_rate", lr)
            tf.summary.scalar("grad_norm", grad_norm)
            if steps_per_s:
                tf.summary.scalar("steps_per_second", steps_per_s)
                tf.summary.scalar("sequences_per_second", steps_per_s * self.sequences_per_step)
                tf.summary.scalar("tokens_per_second", steps_per_s * self.tokens_per_step)
        self.writer.flush()
        _log(
            f"step {step}/{self.total}  loss {self.loss:.4f}  acc {self.accuracy:.3f}  "
            f"lr {lr:.2e}  {steps_per_s:.2f} steps/s  "
            f"{steps_per_s * self.sequences_per_step:.0f} seq/s"
        )
        self.status.update(
            stage="train",
            progress=step / self.total,
            step=step,
            loss=round(self.loss, 6),
            accuracy=round(self.accuracy, 6),
            learning_rate=lr,
            steps_per_second=round(steps_per_s, 4),
        )
        self.window_start, self.window_steps = time.perf_counter(), 0

    def close(self) -> None:
        self.writer.close()


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
    # The metrics this run recorded (kept in status.json across reruns), this process's last.
    recorded = dict(status.document.get("stages", {}).get("train", {}).get("metrics", {}))
    recorded.update({k: v for k, v in stats.items() if k in ("step", "loss", "accuracy")})
    recorded.update({k: v for k, v in stats.items() if k.startswith("eval_")})

    def card(parameters: int) -> str:
        return modelcard.render(
            job=job,
            manifest=manifest,
            model_config=model.config.to_dict(),
            pytorch_class=export_lib.PYTORCH_CLASSES[job.model.family],
            tf_class=type(model).__name__,
            parameters=parameters,
            runtime=strategy_lib.describe(runtime),
            metrics=recorded,
        )

    summary = {
        "job": job.name,
        "family": job.model.family,
        "objective": job.data.objective,
        "step": stats.get("step"),
        "loss": stats.get("loss"),
        "first_loss": stats.get("first_loss"),
        **{k: v for k, v in stats.items() if k.startswith("eval_")},
    }
    export_lib.write_export(
        job,
        model,
        tokenizer_lib.load_tokenizer(job.paths.tokenizer),
        card=card,
        summary=summary,
    )
