"""What both training backends share, free of either framework: the data checks, the
backend choice, the chunk boundaries, the stop-on-signal handling, the divergence stop,
the meter (log, TensorBoard, status.json) and the learning-rate formula.

`payload/backends/tf/train.py` (TensorFlow + tf_keras) and `payload/backends/jax/train.py`
(Keras 3 on JAX) both build on it, so a job behaves the same on either: same checks, same messages,
same status fields, same checkpoint cadence, same exit on SIGTERM.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from tqdm import tqdm

from payload.core.errors import DataError, TrainingInterrupted, UserError
from payload.core.status import StatusWriter
from payload.data import tokenizer as tokenizer_lib
from payload.model.configs import ROBERTA_PADDING_IDX
from payload.schema.manifest import special_ids_of
from payload.spec import MASKED_OBJECTIVES
from payload.training import export as export_lib
from payload.training import tracker

if TYPE_CHECKING:
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec, TrainSpec
    from payload.training.report import RunReport

BACKENDS = ("tf", "jax")
EXPORT_MARKER = export_lib.EXPORT_MARKER
is_complete = export_lib.is_complete
# Set by the TPU/GPU VM's trainer unit (infra): the backend whose environment the VM
# installed, the default of `train.backend: auto` there.
BACKEND_ENV = "TPU_PAYLOAD_BACKEND"


class TrainingDivergedError(UserError):
    """The loss became NaN or infinite; checkpoints written before it are kept."""


def resolve_backend(job: JobSpec, environ: Mapping[str, str] = os.environ) -> str:
    """`tf` or `jax`: the job's `train.backend`; for `auto`, `jax` for a family only the JAX
    backend has (spec.JAX_ONLY_FAMILIES: llama, electra), else the VM unit's TPU_PAYLOAD_BACKEND,
    else the TensorFlow backend (docs/backends.md says when that default changes)."""
    from payload.spec import JAX_ONLY_FAMILIES  # noqa: PLC0415

    chosen = job.train.backend
    if chosen != "auto":
        return chosen
    if job.model.family in JAX_ONLY_FAMILIES:
        return "jax"
    from_unit = environ.get(BACKEND_ENV, "")
    if from_unit:
        if from_unit not in BACKENDS:
            raise UserError(
                f"{BACKEND_ENV}: {from_unit!r} is not a training backend (allowed: "
                f"{', '.join(BACKENDS)})"
            )
        return from_unit
    return "tf"


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
    special = special_ids_of(manifest)
    if any(not 0 <= i < manifest.vocab_size for i in special.values()):
        raise DataError(
            f"manifest special ids {special} fall outside vocab_size {manifest.vocab_size}"
        )
    if job.data.objective in MASKED_OBJECTIVES and "mask" not in special:
        raise DataError(
            f"data in {where} has no mask token (special ids: {sorted(special)}); "
            f"{job.data.objective} needs one"
        )
    if (
        job.model.family == "roberta"
        and special.get("pad", ROBERTA_PADDING_IDX) != ROBERTA_PADDING_IDX
    ):
        raise DataError(
            f"roberta needs the padding token at id {ROBERTA_PADDING_IDX} (RoBERTa numbers "
            f"positions from it) but the tokenizer has pad={special['pad']}; list "
            "tokenizer.special_tokens with the pad token second"
        )


WORKER_ENV = "TPU_PRETRAIN_WORKER"  # a slice worker's 0-based index (the trainer unit's)
DATA_WAIT_ENV = "TPU_PAYLOAD_DATA_WAIT_S"
DATA_WAIT_DEFAULT_S = 24 * 3600.0


def worker_index(job: JobSpec, environ: Mapping[str, str] = os.environ) -> int:
    """This host's index on a JAX slice (0: the host that writes; also any single host)."""
    raw = environ.get(WORKER_ENV, "0") or "0"
    if not raw.isdigit():
        raise UserError(f"{WORKER_ENV}: {raw!r} must be a worker index (0, 1, ...)")
    index = int(raw)
    if index > 0 and resolve_backend(job, environ) != "jax":
        raise UserError(
            f"{WORKER_ENV}={index}: only the JAX backend runs on every worker of a slice; "
            "use train.backend: jax"
        )
    return index


def wait_for_data(
    job: JobSpec,
    *,
    timeout_s: float,
    poll_s: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """A slice worker other than 0 trains on the data worker 0 encodes: wait (bounded) for
    its manifest, the encode stage's completion marker."""
    from payload.data.encode import stage as encode  # noqa: PLC0415

    deadline = clock() + timeout_s
    announced = False
    while not encode.is_complete(job):
        if clock() >= deadline:
            raise DataError(
                f"no encoded data in {job.paths.data} after {timeout_s:.0f} s: worker 0 encodes "
                f"it (see its status.json, {job.paths.status}); raise {DATA_WAIT_ENV} if "
                "encoding takes longer"
            )
        if not announced:
            log(f"train: waiting for worker 0's data in {job.paths.data}")
            announced = True
        sleep(poll_s)


def chunk_length(
    step: int, total: int, plan_spe: int, log_every: int, ckpt_every: int, *, eval_every: int = 0
) -> int:
    """Steps until the next log/checkpoint/eval/final boundary, at most steps_per_execution.
    A boundary of 0 never cuts (the JAX backend passes log_every 0: it logs from the
    chunk's per-step metrics, Meter.record_steps)."""
    boundary = total
    for every in (log_every, ckpt_every, eval_every):
        if every > 0:
            boundary = min(boundary, (step // every + 1) * every)
    return max(1, min(plan_spe, boundary - step))


# Until a step has been timed, a chunk on a runtime bounded in seconds holds this many steps:
# nothing about the step time is known before (the plan's estimate assumes an MFU this run
# may not reach), and a stop must not wait for 64 steps of a large model (~100 s for 1b on
# v5litepod-16). The cost is a few host round trips while the first chunks are timed.
FIRST_CHUNK_STEPS = 1


class ChunkTimer:
    """How many steps the next chunk may hold so that it lasts about `chunk_seconds` (None:
    no bound in seconds): the latest chunk's measured seconds per step, taken between the
    ends of two consecutive chunks (the devices run chunks back to back). The first chunk
    (compiling) and a chunk after a pause (checkpoint, evaluation) set only the clock; until
    a step has been timed a chunk holds FIRST_CHUNK_STEPS. Each host of a slice times its
    own steps: the length a chunk runs is the smallest every host proposes
    (backends/jax/distributed.py agree_on_stop)."""

    def __init__(self, chunk_seconds: float | None, clock: Callable[[], float] = time.perf_counter):
        self.chunk_seconds = chunk_seconds
        self.step_seconds: float | None = None
        self._last: float | None = None
        self._clock = clock

    def chunk_done(self, n: int) -> None:
        now = self._clock()
        if self._last is not None and n > 0:
            self.step_seconds = (now - self._last) / n
        self._last = now

    def pause(self) -> None:
        self._last = None

    def steps_per_chunk(self, steps_per_execution: int) -> int:
        if self.chunk_seconds is None:
            return steps_per_execution
        if not self.step_seconds:
            return min(FIRST_CHUNK_STEPS, steps_per_execution)
        fit = int(self.chunk_seconds // self.step_seconds)
        return max(1, min(steps_per_execution, fit))


def diverged(loss: float, step: int, n: int, spec: TrainSpec, last_checkpoint: str | None):
    """The one-line error for a NaN/inf loss between steps step - n and step."""
    return TrainingDivergedError(
        f"loss became {loss} between steps {step - n} and {step} "
        f"(train.learning_rate={spec.learning_rate}); the last good checkpoint "
        f"is kept ({last_checkpoint or 'none yet'}): lower "
        "train.learning_rate or raise train.warmup_steps"
    )


def learning_rate_at(spec: TrainSpec, step: float) -> float:
    """The rate of optimizer step `step` (0-based): linear warm-up from (step + 1) / warmup,
    then linear / cosine decay to end_ratio x peak at train.steps, or constant. The formula
    of schedule.WarmupDecay (TF) and backends/jax/schedule.WarmupDecay (Keras 3), in Python."""
    peak, warmup = float(spec.learning_rate), float(max(spec.warmup_steps, 0))
    span = float(max(spec.steps - spec.warmup_steps, 1))
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    end = float(spec.end_learning_rate_ratio)
    if spec.decay == "linear":
        factor = 1.0 - (1.0 - end) * progress
    elif spec.decay == "cosine":
        factor = end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0
    if warmup > 0 and step < warmup:
        return peak * min((step + 1.0) / warmup, 1.0)
    return peak * factor


def log(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


class UnwrittenStatus(StatusWriter):
    """status.json as a worker that is not the chief sees it: kept in memory, never written."""

    def flush(self, *, milestone: bool = False) -> None:
        self._dirty = False


class StopRequest:
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


class _RecordedStop:
    """The signal that stops this process, as the handler recorded it. The handler never
    raises: a raise from a signal handler lands wherever the interpreter is, and inside a
    garbage-collection callback (JAX's `_xla_gc_callback`), a `__del__` or a weakref
    callback Python prints "Exception ignored in: ..." and carries on, so the stop was lost.
    The program acts on it at its own boundaries instead: `stop_point()` and every wait of a
    slice's agreements (backends/jax/distributed.py), and the slice's guard thread ends the
    process if none is reached within seconds (distributed.SliceGuard)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred = False  # inside a training loop: acted on at the loop's agreement
        self.urgent = False  # a second signal while deferred: stop at once
        self.acted = False  # the main thread raised it: nothing left for the guard to do
        self.os_handler: int | None = None  # SIGTERM's handler in the kernel, once installed

    def record(self, signum: int, frame: object) -> None:
        # Plain assignments only: no lock a nested signal could find held (the guard polls).
        if self.signum is None:
            self.signum = signum
        elif self.deferred:
            self.urgent = True

    def at_once(self) -> bool:
        """A signal arrived that must stop the process now (not at a loop's agreement)."""
        return self.signum is not None and not self.acted and (not self.deferred or self.urgent)


STOP = _RecordedStop()


def _kernel_handler(signum: int) -> int | None:
    """The address of `signum`'s handler as the kernel holds it (sigaction(2) with no new
    action; the handler is the first member of glibc's struct sigaction), None where that
    cannot be read. `signal.getsignal` shows only what Python installed: a library that
    installs its own handler in C (libtpu: "*** SIGTERM received by PID ...") is seen here."""
    try:
        import ctypes  # noqa: PLC0415

        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(512)  # struct sigaction: 152 bytes on Linux
        if libc.sigaction(signum, None, action) != 0:
            return None
        return int(ctypes.c_void_p.from_buffer(action).value or 0)
    except (OSError, AttributeError, TypeError):
        return None


def stop_at_once_on_sigterm() -> None:
    """From now on SIGTERM stops this process at once outside a training loop (exit 143,
    one line), inside one at the loop's next agreement (`deferred_stop`). Called right after
    `jax.distributed.initialize()`, whose preemption service replaces SIGTERM's action with
    one that only sets a flag (openxla/xla
    xla/tsl/distributed_runtime/preemption/preemption_notifier.cc, SigtermNotifier), so that
    a SIGTERM during the start-up (checksums, the model build, a restore, reading the
    held-out set) is not ignored until systemd's SIGKILL 90 s later. Python's `signal.signal`
    replaces the C++ handler. The handler only records the signal (`_RecordedStop`).
    Nothing is half-written when the process ends in the start-up: every output is written
    whole and moved into place (storage.py), checkpoints only inside the loop."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, STOP.record)
    STOP.os_handler = _kernel_handler(signal.SIGTERM)


def take_sigterm_back() -> str | None:
    """Install the recording handler again if anything replaced it since
    `stop_at_once_on_sigterm` (in Python or in C: libtpu installs its own fatal-signal
    handlers when the TPU backend starts); what was found instead, or None if nothing was."""
    if threading.current_thread() is not threading.main_thread():
        return None
    python, kernel = signal.getsignal(signal.SIGTERM), _kernel_handler(signal.SIGTERM)
    if python == STOP.record and (kernel is None or kernel == STOP.os_handler):
        return None
    found = (
        f"Python handler {python!r}"
        if python != STOP.record
        else f"a handler installed in C at {kernel:#x}"
    )
    stop_at_once_on_sigterm()
    return found


def keep_sigterm(when: str) -> None:
    """Take SIGTERM's handler back if anything replaced it (`take_sigterm_back`), and say so:
    as the backend starts, during the compile and by the first step (libtpu installs its
    own handlers as its backend starts; what a compile or the first execution loads may do
    the same)."""
    replaced = take_sigterm_back()
    if replaced:
        log(f"train: SIGTERM's handler was replaced by {replaced} {when}; taken back")


def stop_message(signum: int) -> str:
    """What a stop at once by `signum` says (outside a training loop, or a second signal)."""
    where = "at once (a second signal)" if STOP.urgent else "outside the training loop"
    return (
        f"stopped by signal {signum} {where} (no checkpoint written now): rerun to continue "
        "from the last checkpoint"
    )


def stopped_outside_loop(signum: int) -> TrainingInterrupted:
    """The stop of a signal outside a training loop (logged here, raised by the caller)."""
    message = stop_message(signum)
    log(f"train: {message}")
    STOP.acted = True
    return TrainingInterrupted(signum, message)


def stop_point() -> None:
    """A boundary of the start-up (or of the end, after the loop): a signal recorded that
    must stop the process now is raised here, in the program's own code."""
    if STOP.at_once() and threading.current_thread() is threading.main_thread():
        raise stopped_outside_loop(int(STOP.signum or 0))


class deferred_stop:  # noqa: N801  (a context manager used as `with training.deferred_stop()`)
    """Inside a training loop: SIGTERM and SIGINT are recorded for the loop to act on at its
    next agreement (checkpoint, then exit 128 + the signal); a second signal stops at once.
    On leaving, SIGINT gets its previous handler back and a signal recorded after the loop's
    last agreement stops the process at the next boundary."""

    def __enter__(self) -> deferred_stop:
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, STOP.record)  # taken back again, whatever changed it
            STOP.os_handler = _kernel_handler(signal.SIGTERM)
            self._previous = signal.signal(signal.SIGINT, STOP.record)
        STOP.deferred = True
        return self

    def __exit__(self, *exc: object) -> None:
        STOP.deferred = False
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def interrupted(signum: int, step: int, path: str, status: StatusWriter) -> TrainingInterrupted:
    """Report a stop by signal after the checkpoint `path` of `step` was saved."""
    message = f"stopped by signal {signum} at step {step}; checkpoint {path} saved: rerun to resume"
    log(f"train: {message}")
    status.fail(stage="train", error=message)
    STOP.acted = True
    return TrainingInterrupted(signum, message)


class Meter:
    """Loss, learning rate and throughput to the log, TensorBoard and status.json.

    `learning_rate(step)` gives the rate of a 0-based optimizer step (the backend's own
    schedule, so the log shows what the optimizer used); `report` (report.py) takes each
    log line's loss and rate: the history, the ETA and the goodput ledger."""

    def __init__(
        self,
        job: JobSpec,
        manifest: Manifest,
        status: StatusWriter,
        *,
        chief: bool,
        learning_rate: Callable[[int], float],
        report: RunReport | None = None,
    ):
        self.total = job.train.steps
        self.report = report
        self.sequences_per_step = job.train.global_batch_size
        self.tokens_per_step = job.train.global_batch_size * manifest.seq_length
        self.learning_rate = learning_rate
        self.status = status
        # One event file per run, the chief's: other workers' would duplicate every scalar.
        # With train.tracker: wandb the same scalars go to the run's W&B run (tracker.py).
        self.writer = tracker.scalars(job, job.paths.logs, namespace="train", enabled=chief)
        self.loss = self.accuracy = float("nan")
        self.first_loss: float | None = None
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.run_start, self.run_steps = self.window_start, 0
        self.warm = False
        self._last_record = self.window_start
        self._window: list[tuple[float, float]] = []  # (loss, accuracy) since the last log

    def record(self, step: int, n: int, loss: float, accuracy: float) -> None:
        """A chunk of n steps ending at `step` finished (the TF backend: it ran just now)."""
        if self.report is not None:
            self.report.chunk_done(step)
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

    def record_steps(
        self,
        start: int,
        losses: Sequence[float],
        accuracies: Sequence[float],
        grad_norms: Sequence[float],
        *,
        log_every: int,
    ) -> None:
        """The per-step metrics of a chunk of steps start + 1 .. start + len(losses), for a
        backend whose chunks do not end at log boundaries (the JAX backend): a log line at
        every `log_every` boundary inside the chunk and at the last step, each with the mean
        loss and accuracy of the steps since the previous log line (what a chunk cut at each
        log boundary reported), its own step's gradient norm, and the throughput measured
        over the chunks since the previous log line."""
        n = len(losses)
        if self.report is not None:  # the phase is the JAX watch's (report.RunReport.follow)
            self.report.steps_done(start + n)
        self._last_record = time.perf_counter()
        if not self.warm:
            # The first chunk includes tracing and compilation: keep it out of throughput.
            self.warm, self.window_start, self.window_steps = True, self._last_record, 0
            self.run_start, self.run_steps = self.window_start, 0
        else:
            self.window_steps += n
            self.run_steps += n
        elapsed = self._last_record - self.window_start
        rate = self.window_steps / elapsed if self.window_steps and elapsed > 0 else 0.0
        for i in range(n):
            step = start + i + 1
            self._window.append((float(losses[i]), float(accuracies[i])))
            if step % log_every == 0 or step == self.total:
                self.loss = math.fsum(x for x, _ in self._window) / len(self._window)
                self.accuracy = math.fsum(a for _, a in self._window) / len(self._window)
                self._window = []
                if self.first_loss is None:
                    self.first_loss = self.loss
                self.log(step, float(grad_norms[i]), steps_per_second=rate)

    def exclude_pause(self) -> None:
        """Restart the throughput window after an evaluation: steps/s counts training only."""
        now = time.perf_counter()
        paused = now - self._last_record
        self.window_start += paused
        self.run_start += paused

    def mean_steps_per_second(self) -> float:
        elapsed = time.perf_counter() - self.run_start
        return self.run_steps / elapsed if self.run_steps and elapsed > 0 else 0.0

    def log(self, step: int, grad_norm: float, *, steps_per_second: float | None = None) -> None:
        """A log line, TensorBoard scalars and status.json for `step`; the throughput is the
        window's since the previous line unless given (record_steps measures it per chunk)."""
        if steps_per_second is None:
            elapsed = time.perf_counter() - self.window_start
            steps_per_s = self.window_steps / elapsed if self.window_steps and elapsed > 0 else 0.0
        else:
            steps_per_s = steps_per_second
        lr = float(self.learning_rate(step - 1))  # the rate of the step just taken
        scalars = {
            "loss": self.loss,
            "accuracy": self.accuracy,
            "learning_rate": lr,
            "grad_norm": grad_norm,
        }
        if steps_per_s:
            scalars["steps_per_second"] = steps_per_s
            scalars["sequences_per_second"] = steps_per_s * self.sequences_per_step
            scalars["tokens_per_second"] = steps_per_s * self.tokens_per_step
        self.writer.write(step, scalars)
        log(
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
        if self.report is not None:
            self.report.logged(step, self.loss, steps_per_s)
        self.window_start, self.window_steps = time.perf_counter(), 0

    def close(self) -> None:
        self.writer.close()


def recorded_metrics(status: StatusWriter, stats: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics this run recorded (kept in status.json across reruns), this process's last:
    what the model card reports."""
    recorded = dict(status.document.get("stages", {}).get("train", {}).get("metrics", {}))
    recorded.update({k: v for k, v in stats.items() if k in ("step", "loss", "accuracy")})
    recorded.update({k: v for k, v in stats.items() if k.startswith("eval_")})
    return recorded


def export_summary(job: JobSpec, stats: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """What export_complete.json records about the run."""
    return {
        "job": job.name,
        "family": job.model.family,
        "objective": job.data.objective,
        "backend": backend,
        "step": stats.get("step"),
        "loss": stats.get("loss"),
        "first_loss": stats.get("first_loss"),
        **{k: v for k, v in stats.items() if k.startswith("eval_")},
    }


def export_model(
    job: JobSpec,
    save_model: Callable[[str], Any],
    *,
    manifest: Manifest,
    model_config: Mapping[str, Any],
    tf_class: str | None,
    runtime: Mapping[str, Any],
    status: StatusWriter,
    stats: Mapping[str, Any],
    part_configs: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """The export of either backend (export.write_export): the model files `save_model`
    writes, the tokenizer, the model card with this run's recorded metrics, the marker.
    `part_configs`: each part's model config, for a family of export.EXPORT_PARTS."""
    from payload.training import modelcard  # noqa: PLC0415

    recorded = recorded_metrics(status, stats)
    backend = "jax" if runtime.get("backend") == "jax" else "tf"

    def card(parameters: int, part: str | None = None) -> str:
        return modelcard.render(
            job=job,
            manifest=manifest,
            model_config=(part_configs or {}).get(part or "", model_config),
            pytorch_class=export_lib.pytorch_class(job.model.family, part),
            part=part,
            tf_class=tf_class,
            parameters=parameters,
            runtime=runtime,
            metrics=recorded,
        )

    export_lib.write_export(
        job,
        save_model,
        tokenizer_lib.load_tokenizer(job.paths.tokenizer),
        card=card,
        summary=export_summary(job, stats, backend),
        stop_point=stop_point,
    )
