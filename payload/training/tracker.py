"""`train.tracker: wandb`: the training and held-out scalars to a Weights & Biases run that
survives preemption, beside the TensorBoard event files (always written).

Only the chief logs (process 0 of a slice; the TF backend's one process): the others get
TensorBoard's no-op writer, as today. The W&B run's id is kept in
``checkpoints/wandb-run.json`` with the last step logged to it, written when the run starts and
again at each logged step (a few bytes, like status.json), so a restart after a preemption
opens the same run: ``wandb.init(id=..., resume="allow")`` ("allow": resume the run with that
id if it exists, else create it; wandb 0.29.0 ``wandb/sdk/wandb_init.py`` ``init``).

Steps after a resume. W&B's step only increases: "The step must always increase, and it is
not possible to log to a previous step" (``wandb/sdk/wandb_run.py`` ``Run.log``). A restart
resumes from the last checkpoint, which may be older than the last step logged: the steps
trained again (last checkpoint + 1 .. last logged) are not sent again. W&B keeps the values of
the first pass for them; TensorBoard has both passes, and status.json the latest. The bound
is the larger of what wandb-run.json records and the resumed run's ``starting_step`` (the
server's next step; 0 offline, where only the file knows).

The API key is never in the job spec, the metadata or a log: wandb reads it from
``WANDB_API_KEY`` or its netrc on the chief host, the user's to provide (on a VM, e.g. from
Secret Manager). WANDB_MODE, WANDB_DIR, WANDB_PROJECT and WANDB_ENTITY are wandb's own
environment variables; ``train.wandb_project`` / ``train.wandb_entity`` take precedence.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

from payload.core import storage
from payload.core.errors import SpecError
from payload.core.tensorboard import Scalars

if TYPE_CHECKING:
    from payload.spec import JobSpec

STATE_FILE = "wandb-run.json"
WANDB_EXTRA = "pip install 'tpu-pretrain-payload[wandb]' (wandb 0.29.0) where the trainer runs"
# One W&B run per process, shared by the training meter and the evaluator (wandb's run is
# process-wide state too): the state file's path -> the open run and its writers' count.
_OPEN: dict[str, _Run] = {}


def require(job: JobSpec) -> None:
    """The one-line refusal of `train.tracker: wandb` where wandb is not installed."""
    if job.train.tracker == "wandb" and importlib.util.find_spec("wandb") is None:
        raise SpecError(
            f"train.tracker: wandb needs the wandb package, which this environment lacks: "
            f"{WANDB_EXTRA}; or use train.tracker: tensorboard"
        )


def state_path(job: JobSpec) -> str:
    return storage.join(job.paths.checkpoints, STATE_FILE)


def scalars(job: JobSpec, logdir: str, *, chief: bool, prefix: str = "") -> Scalars:
    """The TensorBoard writer of `logdir`, which with `train.tracker: wandb` on the chief also
    sends each scalar to the job's W&B run as `<prefix>/<name>` (`prefix` "": the name)."""
    if job.train.tracker != "wandb" or not chief:
        return Scalars(logdir, enabled=chief)
    return _Tracked(logdir, _Run.acquire(job), prefix)


class _Tracked(Scalars):
    def __init__(self, logdir: str, run: _Run, prefix: str):
        super().__init__(logdir)
        self._run, self._prefix = run, prefix

    def write(self, step: int, values: Mapping[str, float]) -> None:
        super().write(step, values)
        named = {f"{self._prefix}/{k}" if self._prefix else k: float(v) for k, v in values.items()}
        self._run.log(step, named)

    def close(self) -> None:
        super().close()
        if self._run is not None:
            self._run.release()
            self._run = None  # type: ignore[assignment]


class _Run:
    """The job's W&B run in this process, opened by the first writer, finished by the last."""

    def __init__(self, job: JobSpec):
        import wandb  # noqa: PLC0415  (the optional extra: only with train.tracker: wandb)

        self.path = state_path(job)
        state = json.loads(storage.read_text(self.path)) if storage.exists(self.path) else {}
        # A new run's id: 12 lowercase hex digits (W&B ids are letters, digits, - and _).
        run_id = state.get("run_id") or secrets.token_hex(6)
        try:
            self.run = wandb.init(
                id=run_id,
                resume="allow",
                name=job.name,
                project=job.train.wandb_project,
                entity=job.train.wandb_entity,
                config={"job": job.to_dict()},
            )
        except wandb.errors.UsageError as error:  # no API key, a bad setting: the user's
            raise SpecError(f"train.tracker: wandb: {error}".splitlines()[0]) from None
        self.run_id = run_id
        # Steps at or below this were logged by an earlier start of the run (module docstring).
        self.floor = max(int(state.get("last_step", 0)), int(self.run.starting_step) - 1)
        self.logged = self.floor  # the last step sent, kept in the state file
        self.users = 0
        self._save()

    @classmethod
    def acquire(cls, job: JobSpec) -> _Run:
        run = _OPEN.get(state_path(job))
        if run is None:
            run = _OPEN[state_path(job)] = cls(job)
            if run.floor:
                print(
                    f"train: W&B run {run.run_id} resumed; steps up to {run.floor} were logged "
                    "to it by an earlier start and are not sent again",
                    flush=True,
                )
        run.users += 1
        return run

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """`values` at `step`, unless an earlier start logged that step (W&B would drop it).
        This start's own steps come in order: several writes of one step share its row."""
        if step <= self.floor:
            return
        self.run.log(dict(values), step=step)
        if step > self.logged:
            self.logged = step
            self._save()

    def _save(self) -> None:
        text = json.dumps({"run_id": self.run_id, "last_step": self.logged}) + "\n"
        storage.write_text(self.path, text)

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            _OPEN.pop(self.path, None)
            self.run.finish()
