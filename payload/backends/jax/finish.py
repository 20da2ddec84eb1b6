"""The end of a run on the JAX backend after the training loop: the final evaluation as a
stop point that resumes (docs/preemption.md "What a stop costs").

The loop's last agreement is followed by the final checkpoint's write, inside the loop's
deferred stop (train.py `_TrainLoop._committed`): a signal then is agreed once the write is
committed. The final evaluation is deferred the same way: the processes agree, before it
and after every group of batches (as long as a chunk's steps), whether a signal stops it;
a stop exits 128 + the signal with the final checkpoint committed, and the restart repeats
only the evaluation (a stop there costs at most one evaluation, never a step of training).
The export after it stops at once at its stop points (payload/training/export.py: the
marker is never written after one, the scratch directory goes with it) or, if its main
thread is inside a gather or an upload, from the slice guard within GUARD_GRACE_S; its
restart repeats the export from the final checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from payload.backends.jax import distributed
from payload.training import shared as training

if TYPE_CHECKING:
    from payload.backends.jax.evaluate import Evaluator
    from payload.backends.jax.progress import Watch
    from payload.backends.jax.steps import TrainState
    from payload.core.status import StatusWriter


def final_evaluation(
    evaluator: Evaluator,
    step: int,
    state: TrainState,
    *,
    group: int,
    checkpoint: str,
    status: StatusWriter,
    watch: Watch,
) -> dict[str, Any] | None:
    """The held-out metrics after the last step, in groups of the agreed `group` batches
    (the smallest any process proposes: every process asks at the same batches); a signal
    stops it at the next group on every process (TrainingInterrupted, the checkpoint of
    `step` at `checkpoint` kept)."""
    with training.deferred_stop():
        name = f"final-eval/{step}"
        signum, agreed = distributed.agree_on_stop(name, training.STOP.signum, group)
        if signum is not None:
            raise training.interrupted(signum, step, checkpoint, status)
        stopped: list[int] = []

        def stop(done: int) -> bool:
            watch.finished()  # a group of batches
            where = f"final-eval-stop/{step}/{done}"
            signum = distributed.agree_on_stop(where, training.STOP.signum, None)[0]
            if signum is not None:
                stopped.append(signum)
            return signum is not None

        with watch.during("evaluate"):
            metrics = evaluator.evaluate(step, state, group=agreed or 1, stop=stop)
        if stopped:
            raise training.interrupted(stopped[0], step, checkpoint, status)
    return metrics
