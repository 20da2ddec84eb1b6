"""The `train` stage on the Keras 3 / JAX backend (`train.backend: jax`).

The same job, shards, checks, status, checkpoint cadence, signals and export as the TF
backend (payload/backends/tf/train.py; the shared parts are payload/training/shared.py), in this
order:
 1. load the manifest, check it against the job and the tokenizer, verify the shard files
    this process reads (checksums on a fresh start, sizes on a resume); every process
    checks, and a user error on one is the same one-line error on all (distributed.py);
 2. the devices JAX sees (runtime.py): one data-parallel mesh over every device of every
    process; the precision (bfloat16 on TPU); the model (models/) and AdamW (schedule.py);
 3. restore the newest checkpoint (checkpoint.py: Orbax, onto this run's shardings; run.json
    must match, on every process) and start the input pipeline at that step's batch;
 4. train in chunks of up to `steps_per_execution` optimizer steps per compiled call
    (steps.py: a `lax.fori_loop` inside one `jax.jit`), stopping exactly at checkpoint /
    eval / final step boundaries; log lines come from the chunks' per-step metrics. JAX
    dispatch is asynchronous: the next chunk is dispatched before the host logs the
    previous one and reads, masks and transfers the following chunk's batches. After each
    chunk the processes agree whether a signal stops the run (all save that step, all exit
    128 + the signal);
 5. a final checkpoint, the held-out evaluation (evaluate.py), then the export on process 0:
    the Hugging Face layout PyTorch users load with the plain `from_pretrained`
    (hf_weights.py), the tokenizer and the model card, the completion marker last; the other
    processes wait for it (bounded) rather than exit into JAX's shutdown barrier.

Data parallelism: the state is replicated, every batch is split over the mesh's `data`
axis, and XLA's SPMD partitioner inserts the gradient all-reduce: the loss is the mean over
the predicted tokens of the GLOBAL batch, as on the TF backend. Each process (a host of a
slice) reads its own shard files (`input.make_batches` with that process's input pipeline
id: Grain, no TensorFlow; batches.py) and contributes its rows of each global batch; every
process writes its shards of each checkpoint (Orbax), only process 0 writes run.json,
TensorBoard, status.json and the export.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from payload.backends.jax import use_jax

use_jax()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

from payload.backends.jax import (  # noqa: E402
    agreement,
    compile_cache,
    distributed,
    finish,
    hf_weights,
    models,
    progress,
    steps,
)
from payload.backends.jax import batches as batches_lib  # noqa: E402
from payload.backends.jax import checkpoint as checkpoints  # noqa: E402
from payload.backends.jax import mesh as mesh_lib  # noqa: E402
from payload.backends.jax import program as program_lib  # noqa: E402
from payload.backends.jax import runtime as runtime_lib  # noqa: E402
from payload.backends.jax.batches import Pipelines  # noqa: E402
from payload.backends.jax.evaluate import Evaluator  # noqa: E402
from payload.backends.jax.profile import ProfileWindow  # noqa: E402
from payload.backends.jax.runtime import Runtime  # noqa: E402
from payload.core import storage  # noqa: E402
from payload.core.errors import SpecError  # noqa: E402
from payload.core.status import StatusWriter  # noqa: E402
from payload.model import configs  # noqa: E402
from payload.schema import manifest as manifest_lib  # noqa: E402
from payload.training import heldout  # noqa: E402
from payload.training import identity as run_identity_lib  # noqa: E402
from payload.training import shared as training  # noqa: E402
from payload.training.report import RunReport  # noqa: E402

if TYPE_CHECKING:
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec

BACKEND = runtime_lib.BACKEND
EXPORT_MARKER = training.EXPORT_MARKER
# JAX's persistent compilation cache, in the job's output (gs:// on a VM): a restart after a
# preemption loads the train and evaluation programs instead of compiling them again
# (compile_cache.py). `--force` keeps it: the programs of the same job are still valid.
COMPILATION_CACHE = "compilation-cache"
is_complete = training.is_complete


def train(
    job: JobSpec, status: StatusWriter, *, input_pipelines: int | None = None
) -> dict[str, Any]:
    """Train (or resume) and export on the JAX backend; on a slice every host runs this same
    program. `input_pipelines`: see batches.Pipelines (default: one per process).

    From the moment this process joins the slice, SIGTERM stops it at once outside the
    training loop (training.stop_at_once_on_sigterm; JAX's preemption service would swallow
    it; taken back again once the backend is up: libtpu installs its own handlers), and
    whatever ends one process (a user error, a bug, a stop) ends every process with the same
    class of exit code and the same one line (distributed.leave_with, SliceGuard): no host
    is left waiting, restarting and failing again."""
    distributed.initialize_from_env()
    training.stop_at_once_on_sigterm()
    guard = distributed.SliceGuard.start()
    report: RunReport | None = None
    try:
        status = _join(status)
        training.keep_sigterm("as the backend started")
        written = status  # the chief's status.json (the others' is never written)
        report = RunReport(job, written, chief=jax.process_index() == 0)
        guard.on_exit = lambda line: written.fail(stage="train", error=line)
        guard.on_hang = lambda phase, line: _hung(written, report, phase, line)
        # The progress watchdog (progress.py), read by the guard: bounds for a state of no
        # size until the model is known (_train sets them).
        guard.watch = watch = progress.Watch(progress.Bounds.of(0, 1))
        watch.on_phase = report.follow  # the goodput ledger's clock follows its phases
        agreement.check_shared_output(job)
        cache = compile_cache.enable(storage.join(job.output, COMPILATION_CACHE))
        report.cache_counts = cache[1]
        stats = _train(job, status, input_pipelines, cache, watch, report=report)
    except BaseException as exc:
        # A full disk is the user's to fix on this host as on every other (not a bug first,
        # relabelled later), and the slice leaves with the class of the first abort.
        full = storage.as_disk_full(exc, job.paths.checkpoints)
        if report is not None:
            report.ended_by(full or exc)  # how this start ended, in the goodput ledger
        leaving = distributed.leave_with(full or exc)
        if leaving is exc:
            raise
        raise leaving from (exc if leaving is full else leaving.__cause__)
    guard.close()
    return stats


def _hung(status: StatusWriter, report: RunReport, phase: str, line: str) -> None:
    status.hung(stage="train", phase=phase, error=line)
    report.hung(phase, line)


def _train(
    job: JobSpec,
    status: StatusWriter,
    input_pipelines: int | None,
    cache: tuple[str, compile_cache.CacheCounts],
    watch: progress.Watch,
    *,
    report: RunReport,
) -> dict[str, Any]:
    status.update(stage="train", message="verifying data")
    spec = job.train
    manifest = _loaded_manifest(job)
    digest = agreement.agree_on_start(job, manifest)  # one payload, job, data, checkpoint
    config = configs.config_for(job, manifest)
    rt = _runtime(job, manifest, config)
    pipelines = Pipelines(rt, input_pipelines)
    _checked_data(job, manifest, pipelines)
    _describe(rt, status)

    training.stop_point()
    model, optimizer = _build(job, config, manifest, rt)
    training.stop_point()
    layout = checkpoints.Layout.of(model, optimizer)
    distributed.agree_on_checks(
        "run checks", lambda: _check_run(job, manifest, config, layout=layout, rt=rt)
    )
    watch.bounds = _bounds(layout, rt)

    with watch.during("restore"):
        step, restored = _restore_or_start(
            job, manifest, config, model=model, optimizer=optimizer, layout=layout, rt=rt
        )
    report.restored(restored)
    files = pipelines.files(job, manifest, spec.global_batch_size)
    training.log(
        f"train: process {rt.process_index} of {rt.process_count} reads {len(files)} of "
        f"{len(manifest.shards)} training shards: {', '.join(files)}"
    )
    training.stop_point()
    watch.enter("compile")  # tracing and compiling, up to the first finished chunk
    programs = _programs(job, manifest, config, rt)
    agreement.agree_on_programs(digest, programs.fingerprints(), restored)
    # Created sharded (mesh.sharded_distribution) as the programs expect; a value Keras left
    # uncommitted (on one device) goes where the programs take it.
    state = jax.device_put(steps.TrainState.of(model, optimizer), programs.state_shardings)
    stats: dict[str, Any] = {"step": step}
    if restored is not None:
        stats["resumed_from"] = restored
    evaluator = (
        Evaluator(
            job,
            manifest,
            rt,
            model=model,
            pipelines=pipelines,
            status=status,
            sums=programs.eval_sums(),
        )
        if manifest.eval_records
        else None
    )
    group = None  # the length of the loop's last chunk: the final evaluation's groups
    try:
        if step < spec.steps:
            loop = _TrainLoop(
                job, manifest, rt, model=model, optimizer=optimizer, layout=layout,
                pipelines=pipelines, evaluator=evaluator, programs=programs, watch=watch,
                report=report,
            )  # fmt: skip
            training.keep_sigterm("during the compile")
            with loop:  # waits for the last checkpoint's write, also on SIGTERM or an error
                state, results = loop.run(state, status, step)
            stats.update(results)
            group = loop.group
        stats["step"] = int(np.asarray(state.optimizer[0]))  # iterations, the step counter
        training.stop_point()  # a signal after the loop's last agreement
        if evaluator is not None:  # the final evaluation: a stop point that resumes
            stats.update(
                finish.final_evaluation(
                    evaluator, stats["step"], state, group=group or rt.steps_per_execution,
                    checkpoint=storage.join(job.paths.checkpoints, str(stats["step"])),
                    status=status, watch=watch,
                ) or {}
            )  # fmt: skip
    finally:
        if evaluator is not None:
            evaluator.close()

    _log_cache(*cache, uncached=programs.train_options is not None)
    # Every process: the weights the export writes, gathered one at a time (with sharded
    # state a gather is a collective every process joins before the chief writes).
    with watch.during("export"):  # the gathers, the chief's write and upload, the others' wait
        weights = _gathered_weights(model, state)
        _export_together(
            job, model, stats, weights=weights, manifest=manifest, rt=rt, status=status,
            report=report,
        )  # fmt: skip
    return stats


def _describe(rt: Runtime, status: StatusWriter) -> None:
    """The runtime in the log and in status.json (the devices JAX sees, beside the host
    checks), and its attention warning."""
    described = rt.describe()
    training.log(f"train: {json.dumps(described)}")
    if rt.attention is not None and rt.attention.warning:
        training.log(f"warning: {rt.attention.warning}")  # also in status.json's runtime
    status.note_runtime(described)


def _bounds(layout: checkpoints.Layout, rt: Runtime) -> progress.Bounds:
    """The progress watchdog's bounds for this run's state (logged)."""
    bounds = progress.Bounds.of(layout.nbytes(), rt.process_count)
    training.log(f"train: progress bounds (progress.py): {json.dumps(bounds.describe())}")
    return bounds


def _log_cache(directory: str, counts: compile_cache.CacheCounts, *, uncached: bool) -> None:
    described = counts.describe()
    training.log(
        f"train: compilation cache {directory}: {described['loaded']} programs loaded, "
        f"{described['compiled']} compiled (JAX's persistent cache; "
        f"{described['saved_s']} s of compiling saved)"
        + (
            f"; the training chunk is not cached: XLA cannot serialize its CPU oneDNN "
            f"matmuls ({program_lib.CPU_ONEDNN_ENV}=0 compiles it without them)"
            if uncached
            else ""
        )
    )


def _join(status: StatusWriter) -> StatusWriter:
    """Join the slice's other processes (if any) and check this one's place: the status
    this process writes (only process 0 writes status.json)."""
    runtime_lib.checked_devices()  # a missing TPU is one line before anything else
    process, processes = jax.process_index(), jax.process_count()
    worker = os.environ.get(training.WORKER_ENV, "")
    if worker and int(worker) != process:
        raise SpecError(
            f"{training.WORKER_ENV}={worker} but JAX made this process {process} of "
            f"{processes}: worker 0 holds the output's lease and must be process 0"
        )
    if process != 0:
        return training.UnwrittenStatus(status.path, status.job_name)
    return status


def _gathered_weights(model: Any, state: steps.TrainState) -> dict[str, np.ndarray]:
    """The trained weights on this host by variable path, gathered one weight at a time (a
    sharded weight of a multi-process mesh is readable by no single process: every process
    joins each gather; the chief exports them)."""
    return {
        variable.path: mesh_lib.gather(value)
        for variable, value in zip(model.trainable_variables, state.trainable, strict=True)
    }


def _export_together(
    job: JobSpec,
    model: Any,
    stats: dict[str, Any],
    *,
    weights: dict[str, np.ndarray],
    manifest: Manifest,
    rt: Runtime,
    status: StatusWriter,
    report: RunReport,
) -> None:
    """The chief exports while the others wait for it (bounded), so none exits into JAX's
    shutdown barrier while the chief still exports; they fail if its export fails. Then
    the `finished` event and the start's end (report.py)."""

    def export_on_chief() -> None:
        status.update(stage="train", progress=1.0, step=stats["step"], message="exporting")
        export(job, model, stats, weights=weights, manifest=manifest, rt=rt, status=status)
        status.update(stage="train", progress=1.0, step=stats["step"], message="exported")
        stats["export"] = job.paths.export

    if not rt.is_chief:
        training.log("train: waiting for process 0's export")
    distributed.after_chief(
        "export", rt.is_chief, export_on_chief, timeout_s=distributed.EXPORT_TIMEOUT_S
    )
    report.finished(stats["step"])


def _loaded_manifest(job: JobSpec) -> Manifest:
    """The data's manifest, loaded on every process; a user error (no data yet, a corrupt
    manifest) is the same one-line error on all (distributed.agree_on_checks)."""
    loaded: list[Manifest] = []
    distributed.agree_on_checks(
        "manifest", lambda: loaded.append(manifest_lib.load_manifest(job.paths.data))
    )
    return loaded[0]


def _checked_data(job: JobSpec, manifest: Manifest, pipelines: Pipelines) -> None:
    """The manifest checked against the job and the tokenizer, the global batch against
    the devices, and the shard files this process reads. Every process checks; a user error
    on any is the same one-line error on all (distributed.agree_on_checks): no host is left
    waiting in a collective."""

    def check() -> None:
        training.check_data(job, manifest)
        runtime_lib.check_global_batch(
            job.train.global_batch_size, pipelines.rt, job.train.grad_accum_steps
        )
        _verify_own_shards(job, manifest, pipelines)

    distributed.agree_on_checks("data checks", check)


def _verify_own_shards(job: JobSpec, manifest: Manifest, pipelines: Pipelines) -> None:
    """The shard files this process's input pipelines read (training and held-out), against
    the manifest, which was verified when it was written: checksums on a fresh start, sizes
    only on a resume (a run's files were checksummed when it started; on a preemptible slice
    reading a 40-100 GB corpus again at every resume costs minutes per host)."""
    spec = job.train
    names = set(pipelines.files(job, manifest, spec.global_batch_size))
    if manifest.eval_records:
        eval_batch = heldout.checked_eval_batch(job, manifest, pipelines.rt.num_replicas)
        plans = pipelines.plans(job, manifest, eval_batch, split="eval")
        names |= {storage.basename(path) for i in pipelines.mine for path in plans[i].files}
    resuming = bool(checkpoints.finished_steps(job.paths.checkpoints))
    manifest_lib.verify_shards(job.paths.data, manifest, checksums=not resuming, names=names)


def _check_run(
    job: JobSpec, manifest: Manifest, config: Any, *, layout: checkpoints.Layout, rt: Runtime
) -> None:
    """run.json and the space for checkpoints, on every process. The chief writes run.json
    for a fresh run; the others never write it and compare only when checkpoints exist
    (identity.check_identity's read_only: on a fresh run the chief may be writing it now)."""
    spec, directory = job.train, job.paths.checkpoints
    checkpoints.refuse_npz(directory)
    found = checkpoints.finished_steps(directory)
    identity = run_identity_lib.identity(job, manifest, config.to_dict(), backend=BACKEND)
    if rt.is_chief:
        storage.makedirs(directory)
    run_identity_lib.check_identity(
        directory,
        identity,
        has_checkpoint=bool(found),
        record={
            "mesh": rt.mesh_plan.describe(),
            **({"attention": rt.attention.describe()} if rt.attention else {}),
        },
        read_only=not rt.is_chief,
    )
    checkpoints.require_space(directory, layout, keep=spec.keep_checkpoints, kept=len(found))


def _runtime(job: JobSpec, manifest: Manifest, config: Any) -> Runtime:
    """This process's runtime for the job (runtime.runtime: the devices, the precision policy,
    the mesh for the model's parameters) with the job's attention (program.with_attention)."""
    parameters = configs.parameter_count(job.model.family, config)
    rt = runtime_lib.runtime(job.train.precision, job.train.sharding, parameters)
    return program_lib.with_attention(job, config, int(manifest.seq_length), rt)


def _programs(job: JobSpec, manifest: Manifest, config: Any, rt: Runtime) -> program_lib.Programs:
    """The training chunk and evaluation step, lowered by the one builder (program.py) that
    `tpu-payload compile` uses: this run compiles what `compile` compiles for the same job
    and facts (their fingerprints, logged here, are what `compile --json` prints)."""
    eval_batch = (
        heldout.checked_eval_batch(job, manifest, rt.num_replicas)
        if manifest.eval_records
        else None
    )
    programs = program_lib.build(
        job, config, rt, seq_length=int(manifest.seq_length), eval_batch=eval_batch
    )
    prints = ", ".join(f"{name} {value}" for name, value in programs.fingerprints().items())
    training.log(f"train: programs (program.py; sha256 of the lowered text): {prints}")
    return programs


def _build(job: JobSpec, config: Any, manifest: Manifest, rt: Runtime) -> tuple[Any, Any]:
    """(model, optimizer) with seeded initial weights, sharded on the run's mesh
    (program.build_model: the model the programs of program.build take)."""
    return program_lib.build_model(job, config, int(manifest.seq_length), rt)


def _restore_or_start(
    job: JobSpec,
    manifest: Manifest,
    config: Any,
    *,
    model: Any,
    optimizer: Any,
    layout: checkpoints.Layout,
    rt: Runtime,
) -> tuple[int, int | None]:
    """(step, the step of the checkpoint restored or None); run.json was checked before
    (_check_run). Every process restores (Orbax reads each array straight into the sharding
    the trainer keeps it in: _restore_target)."""
    store = checkpoints.Checkpoints(job.paths.checkpoints, layout, keep=job.train.keep_checkpoints)
    try:
        found = store.steps()
        if not found:
            return 0, None
        latest = found[-1]
        like = jax.tree.map(lambda x: _restore_target(x, rt), steps.TrainState.of(model, optimizer))
        store.restore(latest, like).write_back(model, optimizer)
    finally:
        store.close()
    step = int(np.asarray(optimizer.iterations.value))
    training.log(f"train: resumed from {store.path_of(latest)} at step {step}")
    return step, latest


def _restore_target(live: Any, rt: Runtime) -> jax.ShapeDtypeStruct:
    """Where a variable's checkpointed value goes: the variable's own sharding when it was
    created on the mesh, else (Keras' uncommitted single-device value) replicated over the
    mesh, as the trainer places the state. Orbax reads it straight there, whatever the mesh
    the checkpoint was written from."""
    sharding = live.sharding
    if not isinstance(sharding, NamedSharding):
        sharding = NamedSharding(rt.mesh, P())
    return jax.ShapeDtypeStruct(live.shape, live.dtype, sharding=sharding)


class _TrainLoop:
    def __init__(
        self,
        job: JobSpec,
        manifest: Manifest,
        rt: Runtime,
        *,
        model: Any,
        optimizer: Any,
        layout: checkpoints.Layout,
        pipelines: Pipelines,
        evaluator: Evaluator | None,
        programs: program_lib.Programs,
        watch: progress.Watch,
        report: RunReport,
    ):
        self.job, self.manifest, self.rt = job, manifest, rt
        self.watch, self.report = watch, report
        self.group: int | None = None  # the last agreed chunk length
        self.model, self.optimizer, self.layout = model, optimizer, layout
        self.pipelines, self.evaluator = pipelines, evaluator
        self.spec = job.train
        # The compiled chunk (program.py): it takes exactly the state and batch shapes,
        # dtypes and shardings it was built for, and donates the state.
        self.train_chunk = programs.train_chunk()
        self.last_checkpoint: str | None = None
        self.profile = ProfileWindow(job, chief=rt.is_chief)  # train.profile's trace
        self.store = checkpoints.Checkpoints(
            job.paths.checkpoints, layout, keep=job.train.keep_checkpoints
        )

    def batches(self, start_step: int) -> list[Any]:
        spec = self.spec
        return self.pipelines.datasets(
            self.job,
            self.manifest,
            spec.global_batch_size,
            seed=spec.seed,
            start_batch=start_step,
        )

    def save(self, state: steps.TrainState, step: int) -> str:
        """Every process starts writing its shards of checkpoint <step> (Orbax, async: this
        returns once the state is copied to host memory; the end of `with loop` waits for
        the write)."""
        self.last_checkpoint = self.store.save(step, state)
        return self.last_checkpoint

    def __enter__(self) -> _TrainLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        """Wait for the last checkpoint's write: before the final evaluation and the export,
        and before a SIGTERM exit or an error leaves the process."""
        self.profile.close()  # a trace the loop's end (or a stop) left open
        self.store.close()

    def _before_chunk(self, step: int, state: steps.TrainState) -> None:
        self.profile.at(step, state)  # starts or stops train.profile's trace
        progress.stall_point(step)  # a test hook (progress.STALL_ENV)

    def _load(self, batches: list[Any], n: int) -> dict[str, Any]:
        """The next n batches, stacked to one chunk's shape, on their way to the devices."""
        with self.report.during("input"):
            host = [self.pipelines.next_host_batch(batches) for _ in range(n)]
            return self.pipelines.to_devices(
                batches_lib.stack(host, self.rt.steps_per_execution), chunk=True
            )

    def _report(self, meter: training.Meter, start: int, n: int, metrics: dict[str, Any]) -> None:
        """A finished chunk's log lines, TensorBoard and status (waits for that chunk); a
        NaN/inf loss stops the run (before any checkpoint of it is written)."""
        host = jax.device_get(metrics)
        losses = np.asarray(host["loss"])[:n]
        if not np.isfinite(losses).all():
            loss = float(losses.mean())
            raise training.diverged(loss, start + n, n, self.spec, self.last_checkpoint)
        accuracies = np.asarray(host["accuracy"])[:n].tolist()
        norms = np.asarray(host["grad_norm"])[:n].tolist()
        meter.record_steps(start, losses.tolist(), accuracies, norms, log_every=self.spec.log_every)

    def _stopped(
        self, signum: int, step: int, status: StatusWriter
    ) -> training.TrainingInterrupted:
        """Preemption/shutdown: this step's checkpoint is being written; once it is, on every
        process, exit like the signal."""
        self.watch.enter("checkpoint")
        self.store.wait()
        distributed.barrier(f"stopped/{step}")
        return training.interrupted(signum, step, self.last_checkpoint or "(process 0's)", status)

    def _committed(self, step: int, status: StatusWriter) -> None:
        """The final checkpoint's write, inside the loop's deferred stop: a signal while it
        is in flight (after the loop's last agreement) is agreed once it is written, as in
        the loop, and every process exits 128 + the signal with it committed (before, the
        guard ended every process within GUARD_GRACE_S and the write was lost)."""
        self.watch.enter("checkpoint")
        self.store.wait()
        signum, _ = distributed.agree_on_stop(f"stop/final/{step}", training.STOP.signum, None)
        if signum is not None:
            raise self._stopped(signum, step, status)

    def run(
        self, state: steps.TrainState, status: StatusWriter, start_step: int
    ) -> tuple[steps.TrainState, dict[str, Any]]:
        """Train from `start_step` to train.steps in chunks that end only at a checkpoint,
        an evaluation or the last step. JAX dispatch is asynchronous: the next chunk is
        dispatched first, then the host does the previous chunk's logging and status I/O
        and reads the following chunk's batches while the devices run. After each chunk the
        processes agree whether to stop and how long the next chunk is
        (distributed.agree_on_stop): a SIGTERM/SIGINT to any one host checkpoints the same
        step on all, and all exit 128 + the signal; every host runs chunks of the same
        length whatever it measured. An in-loop evaluation agrees on stopping between groups
        of batches too (`_evaluate`)."""
        with training.deferred_stop():
            state, results = self._run(state, status, start_step)
            self._committed(self.spec.steps, status)
        return state, results

    def _run(
        self, state: steps.TrainState, status: StatusWriter, start_step: int
    ) -> tuple[steps.TrainState, dict[str, Any]]:
        spec = self.spec
        meter = training.Meter(
            self.job,
            self.manifest,
            status,
            chief=self.rt.is_chief,
            learning_rate=lambda s: training.learning_rate_at(spec, s),
            report=self.report,
        )
        eval_every = spec.eval_every if self.evaluator is not None else 0
        batches = self.batches(start_step)

        timer = training.ChunkTimer(self.rt.chunk_seconds)

        def chunk_after(step: int) -> int:
            # log_every 0: log boundaries do not cut chunks (Meter.record_steps).
            return min(
                training.chunk_length(
                    step,
                    spec.steps,
                    timer.steps_per_chunk(self.rt.steps_per_execution),
                    0,
                    spec.checkpoint_every,
                    eval_every=eval_every,
                ),
                self.profile.cut(step),  # chunks end at the profile window's edges
            )

        step, total = start_step, spec.steps
        bar = tqdm(
            total=total, initial=step, unit="step", file=sys.stderr, disable=not sys.stderr.isatty()
        )

        def report(start: int, n: int, metrics: dict[str, Any]) -> None:
            self._report(meter, start, n, metrics)
            self.watch.finished()  # the first ends the compile (the ledger follows the watch)
            if start == start_step:
                training.keep_sigterm("by the first step")
            timer.chunk_done(n)
            bar.update(n)
            bar.set_postfix(loss=f"{meter.loss:.4f}")

        def load(n: int) -> dict[str, Any]:
            return self._load(batches, n)

        def agree(step: int) -> tuple[int | None, int]:
            proposal = chunk_after(step) if step < total else None
            signum, n = distributed.agree_on_stop(f"stop/{step}", training.STOP.signum, proposal)
            self.group = n or self.group
            return signum, n or 0

        try:
            signum, n = agree(step)
            if signum is not None:  # before the first chunk: nothing trained to save
                raise training.stopped_outside_loop(signum)
            ready = load(n)
            pending: tuple[int, int, dict[str, Any]] | None = None  # dispatched, not reported
            while step < total:
                self._before_chunk(step, state)
                state, metrics = self.train_chunk(state, ready, np.int32(n))  # dispatched
                chunk, step = (step, n, metrics), step + n
                if pending is not None:
                    report(*pending)  # the previous chunk's host I/O, while this one runs
                pending = chunk
                signum, n = agree(step)
                if step < total and signum is None:
                    ready = load(n)  # the next chunk's batches, while this one runs
                checkpoint_now = step % spec.checkpoint_every == 0 or step == total
                # The final evaluation follows the loop.
                evaluate_now = bool(eval_every) and step % eval_every == 0 and step < total
                if not (checkpoint_now or evaluate_now or signum is not None):
                    continue
                report(*pending)  # waits for this chunk: its state is needed now
                pending = None
                self._at_boundary(
                    state, step, signum, checkpoint=checkpoint_now, evaluation=evaluate_now,
                    group=n, meter=meter, status=status,
                )  # fmt: skip
                timer.pause()  # a checkpoint or an evaluation is not step time
        finally:
            self.pipelines.close(batches)
            bar.close()
            meter.close()
        return state, {
            "first_loss": meter.first_loss,
            "loss": meter.loss,
            "accuracy": meter.accuracy,
            "steps_per_second": meter.mean_steps_per_second(),
        }

    def _at_boundary(
        self,
        state: steps.TrainState,
        step: int,
        signum: int | None,
        *,
        checkpoint: bool,
        evaluation: bool,
        group: int,
        meter: training.Meter,
        status: StatusWriter,
    ) -> None:
        """A chunk ended at a checkpoint, an evaluation or an agreed stop: save, evaluate
        (which a stop may cut short: then this step is saved), or stop."""
        if checkpoint or signum is not None:
            with self.watch.during("checkpoint"):  # a save waits for the write before it
                self.save(state, step)
            status.flush(milestone=True)  # the status page (page.py) at a checkpoint
        if signum is None and evaluation:
            with self.watch.during("evaluate"):
                signum = self._evaluate(step, state, group=group)
            if signum is not None and not checkpoint:
                with self.watch.during("checkpoint"):
                    self.save(state, step)
            meter.exclude_pause()
        if signum is not None:
            raise self._stopped(signum, step, status)
        self.watch.enter("train")

    def _evaluate(self, step: int, state: steps.TrainState, *, group: int) -> int | None:
        """The in-loop evaluation at `step`, in groups of `group` batches (the agreed chunk
        length: a group of forward passes lasts at most about a chunk), the processes
        agreeing after each whether to stop; the agreed signal if they stopped it, else
        None."""
        evaluator = self.evaluator
        if evaluator is None:
            return None
        stopped: list[int] = []

        def stop(done: int) -> bool:
            self.watch.finished()  # a group of batches
            signum = self._evaluation_stop(step, done)
            if signum is not None:
                stopped.append(signum)
            return signum is not None

        evaluator.evaluate(step, state, group=group, stop=stop)
        return stopped[0] if stopped else None

    def _evaluation_stop(self, step: int, done: int) -> int | None:
        """Whether a signal stops the evaluation at `step` after `done` batches (agreed)."""
        name = f"eval-stop/{step}/{done}"
        return distributed.agree_on_stop(name, training.STOP.signum, None)[0]


def export(
    job: JobSpec,
    model: Any,
    stats: dict[str, Any],
    *,
    weights: dict[str, np.ndarray] | None = None,
    manifest: Manifest,
    rt: Runtime,
    status: StatusWriter,
) -> None:
    """PyTorch weights (the Hugging Face layout), tokenizer and model card to `export/`.
    `weights` (by variable path; default: the model's variables) are the trained values."""

    part_configs = None
    if isinstance(model, models.Electra):
        part_configs = {
            "discriminator": configs.export_config(model.config),
            "generator": model.generator_config.to_dict(),
        }

    def save_model(directory: str) -> Any:
        if isinstance(model, models.Electra):
            state: Any = hf_weights.save_electra(model, directory, weights)
        else:
            state = hf_weights.save_pretrained(model, directory, weights)
        _export_gate()
        return state

    training.export_model(
        job,
        save_model,
        manifest=manifest,
        model_config=model.config.to_dict(),
        tf_class=None,
        runtime=rt.describe(),
        status=status,
        stats=stats,
        part_configs=part_configs,
    )


# A test hook, nothing else: a slow export at a point the test controls. With this variable
# set to a path, the chief's export, once the model files are written and before the
# tokenizer, the card and the completion marker, creates `<path>.waiting` and waits until
# `<path>` exists (tests/payload/test_jax_hosts.py: the other process must wait meanwhile).
EXPORT_GATE_ENV = "TPU_PAYLOAD_TEST_EXPORT_GATE"
EXPORT_GATE_TIMEOUT_S = 600.0


def _export_gate() -> None:
    gate = os.environ.get(EXPORT_GATE_ENV, "")
    if not gate:
        return
    storage.write_text(gate + ".waiting", "")
    deadline = time.monotonic() + EXPORT_GATE_TIMEOUT_S
    while not storage.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{EXPORT_GATE_ENV}: {gate} did not appear")
        time.sleep(0.05)
