"""Command line: ``tpu-payload {validate,tokenizer,encode,train,run} --job PATH [--force]``.

argv (and ``TPU_PAYLOAD_GCS_RETRY_S``, ``TPU_PAYLOAD_VERBOSE``) is read here and nowhere
else. ``output`` is checked before any stage. A :class:`UserError` becomes ``error: <one
line>`` on stderr, exit status 2, and ``last_error`` in status.json; Ctrl-C says where the
run stopped and that a rerun continues (exit 130); any other exception is a bug: it is
recorded in status.json and re-raised with its traceback. The frameworks' logs are hidden
unless ``--verbose`` or ``TPU_PAYLOAD_VERBOSE=1`` (payload/quiet.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from payload.errors import UserError

if TYPE_CHECKING:
    from payload.spec import JobSpec
    from payload.status import StatusWriter
    from payload.strategy import SliceTarget

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
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


RETRY_ENV = "TPU_PAYLOAD_GCS_RETRY_S"
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a process killed by Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from payload import pipeline, quiet, storage  # noqa: PLC0415  (keep --help fast)
    from payload.spec import load_job  # noqa: PLC0415
    from payload.status import StatusWriter  # noqa: PLC0415

    try:
        _read_retry_deadline()
        verbose = quiet.configure(args.verbose, os.environ)  # before TensorFlow is imported
        job = load_job(args.job)
        if args.command != "validate":
            storage.check_output(job.output)  # before any stage, and before status.json
    except UserError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before any stage started", file=sys.stderr)
        return INTERRUPTED_EXIT
    if args.command == "validate":
        print(job.to_json(), end="")
        print(f"ok: {args.job} is valid", file=sys.stderr)
        return 0

    status = StatusWriter(job.paths.status, job.name)
    _declare_tpu_host(args.command)
    try:
        quiet.absorb_once_only_logs(args.command, verbose=verbose)
        target = _slice_target(args.command)
        if args.command == "export":
            _export(job, args.push_to_hub)
        elif args.command == "run":
            pipeline.run(job, status, force=args.force, target=target)
        else:
            pipeline.run_stage(job, args.command, status, force=args.force, target=target)
    except UserError as exc:
        _record_failure(status, args.command, _one_line(exc))
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        stage = _stage(status, args.command)
        progress = status.document.get("progress")
        where = f"{stage}" + (f" at {progress:.0%}" if isinstance(progress, float) else "")
        message = (
            f"interrupted during {where}; nothing half-written is marked complete: rerun "
            f"`tpu-payload {args.command} --job {args.job}` to continue (complete stages are "
            "skipped, training resumes from its last checkpoint)"
        )
        _record_failure(status, args.command, message)
        print(message, file=sys.stderr)
        return INTERRUPTED_EXIT
    except BaseException as exc:
        _record_failure(status, args.command, f"{type(exc).__name__}: {_one_line(exc)}")
        raise
    return 0


def _slice_target(command: str) -> SliceTarget | None:
    """The multi-host TPU slice from TPU_NAME & co. (train/run only: TensorFlow is imported)."""
    if command not in ("train", "run") or os.environ.get("TPU_NAME", "local") == "local":
        return None
    from payload.strategy import slice_target  # noqa: PLC0415

    return slice_target(os.environ)


def _declare_tpu_host(command: str) -> None:
    """The TPU VM's trainer unit names the host (infra/templates/tpu.sh): then training
    refuses to fall back to the CPU (payload/strategy.py)."""
    accelerator = os.environ.get("TPU_PRETRAIN_ACCELERATOR_TYPE", "")
    if command in ("train", "run") and accelerator:
        from payload import strategy  # noqa: PLC0415  (imports TensorFlow)

        runtime = os.environ.get("TPU_PRETRAIN_RUNTIME_VERSION", "") or "unknown"
        strategy.expect_tpu(strategy.TpuHost(accelerator, runtime))


def _read_retry_deadline() -> None:
    from payload import storage  # noqa: PLC0415

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
    from payload import export  # noqa: PLC0415

    if not export.is_complete(job):
        raise export.HubError(
            f"no finished export in {job.paths.export}: run `tpu-payload train --job ...` first"
        )
    print(f"export: {job.paths.export}")
    if push_to_hub:
        export.push_to_hub(job, push_to_hub)


def _record_failure(status: StatusWriter, command: str, error: str) -> None:
    """Best effort: a status write that fails must not hide the original error."""
    try:
        status.fail(stage=_stage(status, command), error=error)
    except Exception as exc:
        print(f"warning: could not write {status.path}: {_one_line(exc)}", file=sys.stderr)


def _stage(status: object, command: str) -> str:
    stage = getattr(status, "document", {}).get("stage")
    return str(stage) if stage else command
