"""Where the trainer's scalars go: TensorBoard's event files always, and with `train.tracker:
wandb` the same scalars to one Weights & Biases run that a restart resumes.

`scalars(job, logdir, namespace=..., enabled=...)` is what the Meter (training loss, rate,
throughput) and the held-out evaluators open instead of a bare `Scalars`: `write(step,
values)` goes to the event file and, for wandb, to the W&B run as `<namespace>/<name>` at the
trainer's own step. Only the chief opens a run (`enabled`), as only the chief writes events.

The W&B run id is kept in the run's directory beside checkpoints/ (`tracker.json`, written
through payload/core/storage.py, so on gs:// too): the first start writes it, every later
start (a rerun, a preempted VM's replacement) reads it and calls `wandb.init(id=...,
resume="allow")` (wandb 0.29 `wandb_settings.py`: "allow" resumes a run with that id if one
exists, else starts it). A resumed online run continues at the step W&B already holds
(`run.starting_step`); steps below it, the ones trained again since the last checkpoint, are
not sent (W&B's server would drop them: wandb-core's "Tried to log to step %d that is less
than the current step %d ... this data will be ignored"). With WANDB_MODE=offline wandb 0.29
ignores `resume` ("`resume` will be ignored since W&B syncing is set to `offline`"): each
start writes its own offline run under the same id (docs/operating.md "Tracker").

The service process: wandb runs its core in a process of its own session (wandb 0.29
`service_process.py`: `start_new_session=True`), found by the WANDB_SERVICE variable it sets
in the environment. A stale one (a killed trainer's, or its parent's) would hold the run id
("run ID %s is in use"): the trainer drops an inherited WANDB_SERVICE so that it starts its
own, tears the service down when the run ends (on a stop by signal too, marking the run
preempting), and if an init still finds the id in use it tears down and tries once more.

The API key is wandb's own WANDB_API_KEY, read by wandb from the trainer's environment; it
is never read, logged or written here (docs/operating.md says how a VM gets it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from payload.core import storage
from payload.core.errors import UserError
from payload.core.tensorboard import Scalars
from payload.schema.observe import TRACKER_FILE

if TYPE_CHECKING:
    from payload.spec import JobSpec

DEFAULT_PROJECT = "tpu-pretrain"  # unless WANDB_PROJECT names one (wandb reads it itself)
SERVICE_ENV = "WANDB_SERVICE"  # wandb's: the service a process connects to
INSTALL_HINT = "pip install 'tpu-pretrain-payload[wandb]' (docs/operating.md \"Tracker\")"


def new_run_id() -> str:
    """Eight lowercase letters and digits, as wandb's own ids (wandb/sdk/lib/runid.py)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def tracker_file(job: JobSpec) -> str:
    return storage.join(job.paths.root, TRACKER_FILE)


def kept_run_id(job: JobSpec) -> str | None:
    """The W&B run id a previous start of this run kept, or None."""
    path = tracker_file(job)
    if not storage.exists(path):
        return None
    return str(json.loads(storage.read_text(path))["wandb_run_id"])


def keep_run_id(job: JobSpec, run_id: str) -> str:
    """Write the id if no start wrote one first (if_absent); the kept one either way."""
    record = {"tracker": "wandb", "wandb_run_id": run_id}
    with contextlib.suppress(storage.AlreadyExists):  # another start kept one first: theirs
        storage.write_text(tracker_file(job), json.dumps(record, indent=2) + "\n", if_absent=True)
    return kept_run_id(job) or run_id


def require(job: JobSpec) -> None:
    """Before training starts: train.tracker: wandb without the package is one line now,
    not after the data checks and the compile."""
    if job.train.tracker == "wandb":
        _import_wandb()


def forget(job: JobSpec) -> None:
    """`train --force` starts the run over: a new W&B run, not the old one resumed (whose
    later steps would hide the new run's)."""
    storage.remove(tracker_file(job))


def _import_wandb() -> Any:
    try:
        import wandb  # noqa: PLC0415  (the optional extra, only for train.tracker: wandb)
    except ImportError:
        raise UserError(f"train.tracker: wandb needs the wandb package: {INSTALL_HINT}") from None
    return wandb


class WandbRun:
    """One W&B run per training run and process, shared by the writers that log to it and
    finished when the last of them closes."""

    def __init__(self, job: JobSpec):
        self.root = job.paths.root
        self.wandb = wandb = _import_wandb()
        os.environ.pop(SERVICE_ENV, None)  # another process's service: start our own
        self.run_id = kept_run_id(job) or keep_run_id(job, new_run_id())
        options: dict[str, Any] = {
            "project": os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            "name": job.name,
            "id": self.run_id,
            "resume": "allow",
            "config": job.to_dict(),
            # The trainer's own log lines stay its own (console "off": no capture of stderr).
            "settings": wandb.Settings(console="off", disable_git=True, quiet=True),
        }
        if not storage.is_gcs(job.paths.root):
            options["dir"] = storage.join(job.paths.root, "wandb")
            storage.makedirs(options["dir"])
        try:
            self.run = self._init(options)
        except wandb.errors.UsageError as exc:  # no API key, a bad WANDB_* setting
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"train.tracker: wandb: {first} (set WANDB_API_KEY in the trainer's "
                'environment, or WANDB_MODE=offline: docs/operating.md "Tracker")'
            ) from None
        self.starting_step = int(self.run.starting_step or 0)
        self.users = 0

    def _init(self, options: dict[str, Any]) -> Any:
        try:
            return self.wandb.init(**options)
        except Exception as exc:
            if "is in use" not in str(exc):
                raise
            # A stale service holds the id: leave it, start a service of our own, once.
            self.wandb.teardown()
            os.environ.pop(SERVICE_ENV, None)
            return self.wandb.init(**options)

    def log(self, namespace: str, step: int, values: Mapping[str, float]) -> None:
        if step < self.starting_step:
            return  # W&B already has this step (a resumed online run)
        self.run.log({f"{namespace}/{k}": float(v) for k, v in values.items()}, step=step)

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        _RUNS.pop(self.root, None)
        exc = sys.exc_info()[1]  # closed from a `finally`: what is ending the loop, if any
        code = 0
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else 1
            if code > 128:
                self.run.mark_preempting()  # stopped by a signal: a restart resumes it
        elif exc is not None:
            code = 1
        self.run.finish(exit_code=code)
        self.wandb.teardown(exit_code=code)


_RUNS: dict[str, WandbRun] = {}  # this process's open W&B runs, by the run's directory


def _shared_run(job: JobSpec) -> WandbRun:
    run = _RUNS.get(job.paths.root)
    if run is None:
        run = _RUNS[job.paths.root] = WandbRun(job)
    run.users += 1
    return run


class TrackedScalars:
    """`Scalars` (TensorBoard) plus, for train.tracker: wandb, the run's `namespace/` keys."""

    def __init__(self, events: Scalars, run: WandbRun | None, namespace: str):
        self.events, self.run, self.namespace = events, run, namespace

    @property
    def path(self) -> str | None:
        return self.events.path

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self.events.write(step, values)
        if self.run is not None:
            self.run.log(self.namespace, step, values)

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        self.events.close()
        run, self.run = self.run, None
        if run is not None:
            run.release()


def scalars(job: JobSpec, logdir: str, *, namespace: str, enabled: bool) -> TrackedScalars:
    """The writer of `namespace`'s scalars (train, eval): the event file under `logdir`,
    and the job's W&B run when train.tracker is wandb and this process is the chief."""
    run = _shared_run(job) if enabled and job.train.tracker == "wandb" else None
    return TrackedScalars(Scalars(logdir, enabled=enabled), run, namespace)
