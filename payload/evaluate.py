"""Held-out evaluation during training: loss, perplexity and accuracy on a FIXED set.

The held-out shards (encode.py) are read in order, batched with drop_remainder and, for
MLM, masked with a constant seed (not the job's): the same sequences with the same masked
positions at every evaluation, in every run and after every resume, so the numbers compare.
The masked/parsed batches are cached after the first pass. Reported: mean loss over the
predicted tokens, perplexity = exp(loss), and accuracy at the masked positions (MLM) or of
the next token (CLM).

This module is framework-free (the set, the batch size, the report); each backend computes
the sums (payload/backends/tf/evaluate.py, payload/backends/jax/train.py `Evaluator`).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from payload.errors import DataError
from payload.tensorboard import Scalars

if TYPE_CHECKING:
    from payload.manifest import Manifest
    from payload.spec import JobSpec
    from payload.status import StatusWriter

# Fixed for every run: held-out masks must not depend on train.seed.
EVAL_MASK_SEED = 1_234_567


def eval_batch_size(eval_records: int, global_batch_size: int, replicas: int) -> int:
    """The training batch, or the largest multiple of the replica count that fits the set."""
    if eval_records >= global_batch_size:
        return global_batch_size
    return eval_records // replicas * replicas


def checked_eval_batch(job: JobSpec, manifest: Manifest, replicas: int) -> int:
    """eval_batch_size, or DataError when the held-out split cannot give every replica a row."""
    batch = eval_batch_size(manifest.eval_records, job.train.global_batch_size, replicas)
    if batch == 0:
        raise DataError(
            f"the held-out split in {job.paths.data} has {manifest.eval_records} sequences, "
            f"fewer than the {replicas} replicas; raise data.eval_min_sequences and re-run "
            "`tpu-payload encode --force`, or set data.eval_fraction: 0"
        )
    return batch


def report(
    job: JobSpec,
    status: StatusWriter,
    writer: Scalars,
    step: int,
    totals: Any,
    *,
    sequences: int,
    seconds: float,
) -> dict[str, float]:
    """The metrics of one evaluation from its sums (loss, weight, correct), to the log,
    TensorBoard (`writer`: logs/eval) and status.json; both backends report through it."""
    loss_sum, weight_sum, correct = (float(x) for x in totals)
    loss = loss_sum / max(weight_sum, 1.0)
    metrics: dict[str, Any] = {
        "eval_step": step,
        "eval_loss": round(loss, 6),
        "eval_perplexity": round(math.exp(min(loss, 700.0)), 4),
        "eval_accuracy": round(correct / max(weight_sum, 1.0), 6),
        "eval_sequences": sequences,
        "eval_predictions": int(weight_sum),
        "eval_seconds": round(seconds, 3),
    }
    writer.write(
        step,
        {
            "loss": loss,
            "perplexity": metrics["eval_perplexity"],
            "accuracy": metrics["eval_accuracy"],
        },
    )
    name = "masked acc" if job.data.objective == "mlm" else "next-token acc"
    tqdm.write(
        f"eval step {step}/{job.train.steps}  loss {loss:.4f}  "
        f"ppl {metrics['eval_perplexity']:.2f}  {name} {metrics['eval_accuracy']:.3f}  "
        f"({sequences} held-out sequences)",
        file=sys.stderr,
    )
    status.update(stage="train", progress=step / job.train.steps, step=step, **metrics)
    return metrics
