"""Command line: ``tpu-payload {validate,tokenizer,encode,train,run} --job PATH [--force]``,
``tpu-payload plan --job PATH --accelerator TYPE [--mfu F] [--json]`` (payload/plan/estimate.py),
``tpu-payload compile --job PATH --accelerator TYPE [--json]`` (payload/backends/jax/aot.py),
``tpu-payload page --run ROOT`` (payload/training/page.py).

argv (and ``TPU_PAYLOAD_GCS_RETRY_S``, ``TPU_PAYLOAD_VERBOSE``) is read here and nowhere
else. ``output`` is checked before any stage. A :class:`UserError` becomes ``error: <one
line>`` on stderr, exit status 2, and ``last_error`` in status.json; a :class:`TransientError`
(Cloud Storage still failing after its retries, a TPU attached but not initialised) the same
line with exit status 75 (errors.TRANSIENT_EXIT), which the units restart; Ctrl-C says where the
run stopped and that a rerun continues (exit 130); any other exception is a bug: it is
recorded in status.json and re-raised with its traceback. The process never dies of SIGINT
(:class:`_CtrlC`). The frameworks' logs are hidden unless ``--verbose`` or
``TPU_PAYLOAD_VERBOSE=1`` (payload/backends/quiet.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from payload.core.errors import TRANSIENT_EXIT, TransientError, UserError

if TYPE_CHECKING:
    from payload.core.status import StatusWriter
    from payload.spec import JobSpec

COMMANDS = {
    "validate": "check the job spec and print it with defaults filled in",
    "tokenizer": "train the tokenizer on the corpus",
    "encode": "encode the corpus into TFRecord shards + manifest",
    "train": "pre-train the model on the shards, checkpointing and exporting",
    "run": "all stages in order, skipping complete ones",
    "export": "check the finished export; --push-to-hub REPO uploads it to the Hugging Face Hub",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpu-payload",
        description="Corpus -> tokenizer -> TFRecord shards -> Keras pre-training.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--job", required=True, help="job spec (YAML/JSON), local path or gs:// URI"
        )
        sub.add_argument(
            "--verbose",
            action="store_true",
            help="also show TensorFlow's and transformers' logs (or TPU_PAYLOAD_VERBOSE=1)",
        )
        if name == "export":
            sub.add_argument(
                "--push-to-hub",
                metavar="REPO",
                help="upload export/ to this Hub model repo (owner/name; created private if "
                "missing); the token comes from HF_TOKEN, HF_ENDPOINT picks the server",
            )
        elif name != "validate":
            sub.add_argument(
                "--force", action="store_true", help="delete and redo outputs that are complete"
            )
            sub.add_argument(
                "--take-over",
                action="store_true",
                help="take the output's lease from a run that is gone without waiting for it "
                "to expire (a live holder stops at its next heartbeat)",
            )
    plan = commands.add_parser(
        "plan",
        help=PLAN_HELP,
        description=PLAN_HELP + "; exit 2 with one line naming what would fit when it does not",
    )
    _plan_arguments(plan)
    compile_ = commands.add_parser(
        "compile",
        help=COMPILE_HELP,
        description=COMPILE_HELP + " (needs the TPU environment's libtpu; no TPU); exit 2 with "
        "one line when it does not fit, naming the largest batch that compiles",
    )
    compile_.add_argument("--job", required=True, help="job spec (YAML/JSON)")
    compile_.add_argument(
        "--accelerator", required=True, help="TPU type (v5litepod-16, v6e-8, v4-8, v5p-8, ...)"
    )
    compile_.add_argument("--json", action="store_true", help="print the report as JSON")
    compile_.add_argument(
        "--verbose", action="store_true", help="also show libtpu's and XLA's logs"
    )
    page = commands.add_parser("page", help=PAGE_HELP, description=PAGE_HELP)
    page.add_argument(
        "--run", required=True, help="the run's root (runs/<job>), local path or gs:// URI"
    )
    return parser


PAGE_HELP = (
    "write <run>/status.html from its status.json and the watchdog's status "
    "(payload/training/page.py)"
)
# The commands whose chief also writes the status page as it goes (page.PageWriter).
PAGE_COMMANDS = ("train", "run")


COMPILE_HELP = (
    "compile the trainer's programs for a TPU type's topology here: bytes per chip against "
    "the plan, kernels, collectives, FLOPs per step"
)


PLAN_HELP = "bytes per chip, largest batch and hours of the job on an accelerator type"


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from payload.plan import estimate as plan  # noqa: PLC0415  (stdlib + the pure spec/model modules)

    plan.add_arguments(parser)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


RETRY_ENV = "TPU_PAYLOAD_GCS_RETRY_S"
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a process killed by Ctrl-C


class _CtrlC:
    """How Ctrl-C (SIGINT, sent to the whole process group) ends a command: the one-line
    "interrupted …" report and exit 130, or a normal completion; never death by SIGINT.

    While ``armed``, SIGINT raises KeyboardInterrupt (as Python's own handler does) and the
    command reports where it stopped. Once the outcome is decided (the work is done, or the
    report of an interruption or an error has begun) it is disarmed and a SIGINT changes
    nothing. When ``main`` runs as the process's entry point (``argv`` None), SIGINT is then
    ignored until the process ends: at exit, CPython gives SIGINT back its default action
    unless it is ignored (``Py_FinalizeEx`` calls ``_PySignal_Fini`` before it collects
    garbage and unloads the modules, no short step with tokenizers, transformers or
    TensorFlow loaded), and a Ctrl-C in that window killed a process whose outputs were
    already complete (its parent saw -2: death by SIGINT). Only the few milliseconds
    before ``main`` starts remain unguarded.
    """

    def __init__(self) -> None:
        self.armed = True

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.armed:
            raise KeyboardInterrupt

    @staticmethod
    def guard(
        command: Callable[[Sequence[str] | None, _CtrlC], int],
    ) -> Callable[[Sequence[str] | None], int]:
        @functools.wraps(command)
        def main(argv: Sequence[str] | None = None) -> int:
            ctrl_c = _CtrlC()
            previous = None
            try:
                if threading.current_thread() is threading.main_thread():  # signals go there
                    previous = signal.getsignal(signal.SIGINT)
                # Python's own handler only: a process started with SIGINT ignored (`cmd &`
                # in a script, nohup) keeps ignoring it, as Python itself does.
                if previous is signal.default_int_handler:
                    signal.signal(signal.SIGINT, ctrl_c._on_sigint)
                return command(argv, ctrl_c)
            except KeyboardInterrupt:  # while starting: imports, status.json, the TPU check
                ctrl_c.armed = False
                print("interrupted before any stage started", file=sys.stderr)
                return INTERRUPTED_EXIT
            finally:
                ctrl_c.armed = False
                if previous is signal.default_int_handler:
                    if argv is None:  # this process's own command line: it ends after this
                        _ignore_sigint_until_exit()
                    else:  # called in-process (tests): leave SIGINT as it was found
                        signal.signal(signal.SIGINT, previous)

        return main


def _plan(args: argparse.Namespace) -> int:
    from payload.plan import estimate as plan  # noqa: PLC0415

    return plan.run(args)


def _compile(args: argparse.Namespace) -> int:
    """`tpu-payload compile` (payload/backends/jax/aot.py). JAX runs on this machine's CPU:
    the TPU is a topology libtpu compiles for, not a device here."""
    from payload.backends import quiet  # noqa: PLC0415

    try:
        verbose = quiet.configure(args.verbose, os.environ)
    except UserError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from payload.backends.jax import aot  # noqa: PLC0415  (imports JAX and Keras)

    return aot.run(args.job, args.accelerator, as_json=args.json, verbose=verbose)


def _page(args: argparse.Namespace) -> int:
    """`tpu-payload page --run ROOT`: write ROOT/status.html now."""
    from payload.training import page  # noqa: PLC0415

    try:
        _read_retry_deadline()
        print(page.write(args.run.rstrip("/")))
    except (UserError, TransientError) as exc:
        return _error_exit(exc)
    return 0


def _error_exit(exc: UserError | TransientError) -> int:
    """One line for a user's mistake (exit 2) or a transient failure (75: the unit restarts)."""
    print(f"error: {_one_line(exc)}", file=sys.stderr)
    return TRANSIENT_EXIT if isinstance(exc, TransientError) else 2


# The commands that run before (and without) a job spec, status.json or a lease.
_WITHOUT_A_JOB: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _plan,
    "compile": _compile,
    "page": _page,
}


def _ignore_sigint_until_exit() -> None:
    # Blocked first, so no SIGINT can arrive between the two handlers; a pending one is
    # discarded when the block is lifted (POSIX: setting SIG_IGN discards it).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@_CtrlC.guard
def main(argv: Sequence[str] | None, ctrl_c: _CtrlC) -> int:  # noqa: PLR0911
    args = _parser().parse_args(argv)
    if args.command in _WITHOUT_A_JOB:
        return _WITHOUT_A_JOB[args.command](args)
    from payload.backends import quiet  # noqa: PLC0415  (keep --help fast)
    from payload.core import lease, storage  # noqa: PLC0415  (keep --help fast)
    from payload.core.status import StatusWriter  # noqa: PLC0415
    from payload.spec import load_job  # noqa: PLC0415

    try:
        _read_retry_deadline()
        verbose = quiet.configure(args.verbose, os.environ)  # before TensorFlow is imported
        job = load_job(args.job)
        if args.command != "validate":
            storage.check_output(job.output)  # before any stage, and before status.json
        worker = _worker(job, args.command)
        # One writer per output: a second run refuses here, before it writes anything. A
        # JAX slice's other workers write nothing (worker 0 holds the lease).
        held = (
            lease.hold(
                job.output, args.command, os.environ, take_over=getattr(args, "take_over", False)
            )
            if worker == 0
            else None
        )
    except (UserError, TransientError) as exc:
        return _error_exit(exc)
    except KeyboardInterrupt:
        print("interrupted before any stage started", file=sys.stderr)
        return INTERRUPTED_EXIT
    if args.command == "validate":
        print(job.to_json(), end="")
        print(f"ok: {args.job} is valid", file=sys.stderr)
        return 0

    status = (
        StatusWriter(job.paths.status, job.name)
        if worker == 0
        else _unwritten_status(job.paths.status, job.name)
    )
    _note_host_checks(status, os.environ)
    close_pages = _page_writer(job, status, args.command, worker)
    try:
        _declare_tpu_host(args.command)
        _refuse_tf_slice(args.command, job)
        backend = _backend(job)  # a backend the job cannot use is refused before any stage
        _dispatch(
            args,
            job,
            status,
            worker=worker,
            # Just before the train stage, not here: a run that stops in the tokenizer or
            # encode stage (a bad corpus, Ctrl-C) reports it without importing TensorFlow.
            before_train=lambda: quiet.absorb_once_only_logs(
                args.command, verbose=verbose, backend=backend
            ),
        )
        ctrl_c.armed = False  # done: a Ctrl-C from here on changes nothing
    except (UserError, TransientError) as exc:
        ctrl_c.armed = False  # first, in every handler: a Ctrl-C must not cut a report short
        _record_failure(status, args.command, _one_line(exc))
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, UserError) else TRANSIENT_EXIT
    except KeyboardInterrupt:
        ctrl_c.armed = False
        return _interrupted(job, status, args.command, args.job)
    except BaseException as exc:
        ctrl_c.armed = False
        _record_failure(status, args.command, f"{type(exc).__name__}: {_one_line(exc)}")
        raise
    finally:
        close_pages()  # the last page's write, bounded
        if held is not None:
            held.release()
    return 0


def _page_writer(
    job: JobSpec, status: StatusWriter, command: str, worker: int
) -> Callable[[], None]:
    """The chief's status page, written at its status.json's writes (throttled) and
    milestones, for the commands that train; what waits for its last write."""
    if worker != 0 or command not in PAGE_COMMANDS:
        return lambda: None
    from payload.training import page  # noqa: PLC0415  (matplotlib only once it draws)

    pages = page.PageWriter(job.paths.root)
    status.on_flush = pages
    return pages.close


def _dispatch(
    args: argparse.Namespace,
    job: JobSpec,
    status: StatusWriter,
    *,
    worker: int,
    before_train: Callable[[], None],
) -> None:
    from payload import pipeline  # noqa: PLC0415

    if args.command == "export":
        _export(job, args.push_to_hub)
    elif args.command == "run" and worker > 0:
        _train_on_worker(job, status, worker, before_train)
    elif args.command == "run":
        pipeline.run(job, status, force=args.force, before_train=before_train)
    else:
        pipeline.run_stage(job, args.command, status, force=args.force, before_train=before_train)


def _backend(job: JobSpec) -> str:
    from payload.training import shared as training  # noqa: PLC0415

    return training.resolve_backend(job, os.environ)


def _worker(job: JobSpec, command: str) -> int:
    """TPU_PRETRAIN_WORKER of a JAX slice's trainer unit (0 elsewhere)."""
    if command not in ("train", "run"):
        return 0
    from payload.training import shared as training  # noqa: PLC0415

    return training.worker_index(job, os.environ)


def _unwritten_status(path: str, job_name: str) -> StatusWriter:
    from payload.training import shared as training  # noqa: PLC0415

    return training.UnwrittenStatus(path, job_name)


def _train_on_worker(
    job: JobSpec, status: StatusWriter, worker: int, before_train: Callable[[], None]
) -> None:
    """`run` on a slice worker other than 0: worker 0 makes the tokenizer and the data; this
    one waits for them, then trains as its own process of the slice."""
    from payload import pipeline  # noqa: PLC0415
    from payload.training import shared as training  # noqa: PLC0415

    raw = os.environ.get(training.DATA_WAIT_ENV, "")
    try:
        timeout = float(raw) if raw else training.DATA_WAIT_DEFAULT_S
    except ValueError:
        timeout = -1.0
    if timeout <= 0:
        raise UserError(f"{training.DATA_WAIT_ENV}: {raw!r} must be a positive number of seconds")
    training.wait_for_data(job, timeout_s=timeout)
    print(f"worker {worker}: training as one process of the slice; worker 0 writes the outputs")
    pipeline.run_stage(job, "train", status, before_train=before_train)


def _interrupted(job: JobSpec, status: StatusWriter, command: str, job_arg: str) -> int:
    """Report a Ctrl-C during ``command``: exit 130 and where it stopped, or exit 0 when the
    command's work was complete before it (the stage had written its completion marker)."""
    from payload import pipeline  # noqa: PLC0415

    stage = _stage(status, command)
    doc = status.document
    rerun = (
        f"rerun `tpu-payload {command} --job {job_arg}` to continue (complete stages are "
        "skipped, training resumes from its last checkpoint)"
    )
    if stage == "run" and doc.get("state") == "complete":  # every stage was complete
        return 0
    if doc.get("stage") == stage and _finished(job, stage):
        if doc.get("state") not in ("complete", "skipped"):
            status.update(stage=stage, state="complete", message="complete")
        status.flush()
        if stage == (pipeline.STAGES[-1] if command == "run" else command):  # all done
            if command == "run":
                status.update(stage="run", state="complete", message="all stages complete")
                status.flush()
            print(f"{stage}: complete")
            for name, where in pipeline.outputs(job, stage).items():
                print(f"  {name}: {where}")
            return 0
        message = f"interrupted during {command} after {stage} completed; {rerun}"
        _record_failure(status, command, message, stage=command)
    else:
        progress = doc.get("progress")
        where = f"{stage}" + (f" at {progress:.0%}" if isinstance(progress, float) else "")
        message = f"interrupted during {where}; nothing half-written is marked complete: {rerun}"
        _record_failure(status, command, message)
    print(message, file=sys.stderr)
    return INTERRUPTED_EXIT


def _finished(job: JobSpec, stage: str) -> bool:
    """Whether ``stage`` wrote its completion marker (False when that cannot be told)."""
    from payload import backends, pipeline  # noqa: PLC0415

    if stage not in pipeline.STAGES or (stage == "train" and not backends.loaded()):
        return False  # training cannot have finished without its module
    try:
        return pipeline.is_complete(job, stage)
    except Exception:  # e.g. the bucket is unreachable: report the interruption as such
        return False


def _refuse_tf_slice(command: str, job: JobSpec) -> None:
    """TPU_NAME naming a slice was the TF backend's single-client slice, which is gone:
    slices run the JAX backend, one program per host (docs/pod-slices.md)."""
    name = os.environ.get("TPU_NAME", "").strip()
    if command not in ("train", "run") or name in ("", "local") or _backend(job) != "tf":
        return
    raise UserError(
        f"TPU_NAME={name}: the TensorFlow backend trains on one host only; a multi-host slice "
        "runs train.backend: jax on every host (docs/pod-slices.md); unset TPU_NAME or use "
        "train.backend: jax"
    )


def _note_host_checks(status: StatusWriter, env: Mapping[str, str]) -> None:
    """The VM's startup script compared this host with the catalog and left the result in
    TPU_PRETRAIN_HOST_FACTS (infra/render/templates/facts.sh, set by the trainer and data units):
    each mismatch goes into status.json and the log. Not an error: the job runs on."""
    path = env.get("TPU_PRETRAIN_HOST_FACTS", "")
    if not path:
        return
    try:
        facts = json.loads(Path(path).read_text(encoding="utf-8"))
        checks = [str(line) for line in facts.get("mismatches", [])]
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        checks = [f"the host check's facts {path} could not be read: {_one_line(exc)}"]
    status.note_host_checks(checks)
    for line in checks:
        print(f"host check: {line}", file=sys.stderr)


def _declare_tpu_host(command: str) -> None:
    """The TPU or GPU VM's trainer unit names the host (infra/render/templates/tpu.sh, gpu.sh):
    then training refuses to fall back to the CPU (payload/backends/tf/strategy.py)."""
    gpu = os.environ.get("TPU_PRETRAIN_GPU", "")
    if command in ("train", "run") and gpu:
        from payload.core import hosts  # noqa: PLC0415

        count = os.environ.get("TPU_PRETRAIN_GPU_COUNT", "1")
        if not count.isdigit() or int(count) < 1:
            raise UserError(f"TPU_PRETRAIN_GPU_COUNT: {count!r} must be a positive integer")
        policy = os.environ.get("TPU_PRETRAIN_GPU_PRECISION", "")
        if policy not in ("mixed_bfloat16", "mixed_float16", "float32"):
            raise UserError(
                f"TPU_PRETRAIN_GPU_PRECISION: {policy!r} must be mixed_bfloat16, mixed_float16 "
                "or float32"
            )
        image = os.environ.get("TPU_PRETRAIN_RUNTIME_VERSION", "") or "unknown"
        hosts.expect_gpu(hosts.GpuHost(gpu, int(count), policy, image))
        return
    accelerator = os.environ.get("TPU_PRETRAIN_ACCELERATOR_TYPE", "")
    if command in ("train", "run") and accelerator:
        from payload.core import hosts  # noqa: PLC0415

        runtime = os.environ.get("TPU_PRETRAIN_RUNTIME_VERSION", "") or "unknown"
        hosts.expect_tpu(hosts.TpuHost(accelerator, runtime))


def _read_retry_deadline() -> None:
    from payload.core import storage  # noqa: PLC0415

    raw = os.environ.get(RETRY_ENV)
    if raw is None:
        return
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 3600:
        raise UserError(f"{RETRY_ENV}: {raw!r} must be a number of seconds in (0, 3600]")
    storage.set_retry_deadline(seconds)


def _export(job: JobSpec, push_to_hub: str | None) -> None:
    from payload.training import export  # noqa: PLC0415

    if not export.is_complete(job):
        raise export.HubError(
            f"no finished export in {job.paths.export}: run `tpu-payload train --job ...` first"
        )
    print(f"export: {job.paths.export}")
    if push_to_hub:
        export.push_to_hub(job, push_to_hub)


def _record_failure(
    status: StatusWriter, command: str, error: str, *, stage: str | None = None
) -> None:
    """Best effort: a status write that fails must not hide the original error."""
    try:
        status.fail(stage=stage or _stage(status, command), error=error)
    except Exception as exc:
        print(f"warning: could not write {status.path}: {_one_line(exc)}", file=sys.stderr)


def _stage(status: object, command: str) -> str:
    stage = getattr(status, "document", {}).get("stage")
    return str(stage) if stage else command
