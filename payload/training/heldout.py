"""Held-out evaluation during training: loss, perplexity and accuracy on a FIXED set.

The held-out shards (encode.py) are read in order, batched with drop_remainder and, for
MLM, masked with a constant seed (not the job's): the same sequences with the same masked
positions at every evaluation, in every run and after every resume, so the numbers compare.
The masked/parsed batches are cached after the first pass. Reported: mean loss over the
predicted tokens, perplexity = exp(loss), and accuracy at the masked positions (MLM) or of
the next token (CLM).

This module is framework-free (the set, the batch size, the report); each backend computes
the sums (payload/backends/tf/evaluate.py, payload/backends/jax/evaluate.py `Evaluator`).

ELECTRA (rtd) reports its two networks: the generator's MLM loss, perplexity and accuracy
at the masked positions (eval_loss / eval_perplexity / eval_accuracy are the generator's,
comparable with an MLM run's), the discriminator's loss and accuracy over every real token,
and its precision, recall and F1 on the replaced tokens (those where the generator's sample
differs from the original); eval_rtd_loss is the training objective, generator loss +
50 x discriminator loss. The generator's samples are drawn with a fixed key per held-out
batch, so they too are the same at every evaluation of the same weights.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from payload.core.errors import DataError

if TYPE_CHECKING:
    from payload.core.status import StatusWriter
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec
    from payload.training.tracker import TrackedScalars

# Fixed for every run: held-out masks must not depend on train.seed.
EVAL_MASK_SEED = 1_234_567


def eval_batch_size(eval_records: int, global_batch_size: int, replicas: int) -> int:
    """The training batch, or the largest multiple of the replica count that fits the set."""
    if eval_records >= global_batch_size:
        return global_batch_size
    return eval_records // replicas * replicas


def micro_batch_count(rows_per_device: int, train_rows_per_device: int) -> int:
    """The fewest micro-batches an evaluation batch of `rows_per_device` rows per device
    splits into evenly, none larger than a training micro-batch's rows per device."""
    need = -(-rows_per_device // max(train_rows_per_device, 1))
    for count in range(need, rows_per_device + 1):
        if rows_per_device % count == 0:
            return count
    return max(rows_per_device, 1)


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
    writer: TrackedScalars,
    step: int,
    totals: Any,
    *,
    sequences: int,
    seconds: float,
) -> dict[str, float]:
    """The metrics of one evaluation from its sums (loss, weight, correct), to the log,
    TensorBoard (`writer`: logs/eval) and status.json; both backends report through it."""
    if job.data.objective == "rtd":
        metrics = _report_rtd(
            job, status, writer, step, totals, sequences=sequences, seconds=seconds
        )
    else:
        metrics = _report(job, status, writer, step, totals, sequences=sequences, seconds=seconds)
    status.add_point("eval", step, metrics["eval_loss"])  # the status page's held-out curve
    status.flush(milestone=True)  # status.json and the status page (page.py) show it now
    return metrics


def _report(
    job: JobSpec,
    status: StatusWriter,
    writer: TrackedScalars,
    step: int,
    totals: Any,
    *,
    sequences: int,
    seconds: float,
) -> dict[str, float]:
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


def rtd_metrics(totals: Any) -> dict[str, float]:
    """ELECTRA's held-out metrics from the sums of steps.RTD_TERMS (JAX backend)."""
    from payload.model.configs import ELECTRA_DISC_WEIGHT, ELECTRA_GEN_WEIGHT  # noqa: PLC0415

    gen_loss, masked, gen_correct, disc_loss, tokens, disc_correct, tp, fp, fn = (
        float(x) for x in totals
    )
    generator_loss = gen_loss / max(masked, 1.0)
    discriminator_loss = disc_loss / max(tokens, 1.0)
    precision = tp / max(tp + fp, 1.0)
    recall = tp / max(tp + fn, 1.0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {
        "eval_loss": round(generator_loss, 6),
        "eval_perplexity": round(math.exp(min(generator_loss, 700.0)), 4),
        "eval_accuracy": round(gen_correct / max(masked, 1.0), 6),
        "eval_predictions": int(masked),
        "eval_rtd_loss": round(
            ELECTRA_GEN_WEIGHT * generator_loss + ELECTRA_DISC_WEIGHT * discriminator_loss, 6
        ),
        "eval_discriminator_loss": round(discriminator_loss, 6),
        "eval_discriminator_accuracy": round(disc_correct / max(tokens, 1.0), 6),
        "eval_replaced_precision": round(precision, 6),
        "eval_replaced_recall": round(recall, 6),
        "eval_replaced_f1": round(f1, 6),
        "eval_replaced_fraction": round((tp + fn) / max(tokens, 1.0), 6),
        "eval_tokens": int(tokens),
    }


def _report_rtd(
    job: JobSpec,
    status: StatusWriter,
    writer: TrackedScalars,
    step: int,
    totals: Any,
    *,
    sequences: int,
    seconds: float,
) -> dict[str, float]:
    metrics: dict[str, Any] = {"eval_step": step, **rtd_metrics(totals)}
    metrics.update(eval_sequences=sequences, eval_seconds=round(seconds, 3))
    writer.write(
        step,
        {
            # loss / perplexity / accuracy: the generator's, as an MLM run's tags.
            "loss": metrics["eval_loss"],
            "perplexity": metrics["eval_perplexity"],
            "accuracy": metrics["eval_accuracy"],
            "rtd_loss": metrics["eval_rtd_loss"],
            "discriminator_loss": metrics["eval_discriminator_loss"],
            "discriminator_accuracy": metrics["eval_discriminator_accuracy"],
            "replaced_f1": metrics["eval_replaced_f1"],
        },
    )
    tqdm.write(
        f"eval step {step}/{job.train.steps}  generator loss {metrics['eval_loss']:.4f}  "
        f"masked acc {metrics['eval_accuracy']:.3f}  discriminator loss "
        f"{metrics['eval_discriminator_loss']:.4f}  "
        f"acc {metrics['eval_discriminator_accuracy']:.3f}  "
        f"replaced F1 {metrics['eval_replaced_f1']:.3f}  ({sequences} held-out sequences)",
        file=sys.stderr,
    )
    status.update(stage="train", progress=step / job.train.steps, step=step, **metrics)
    return metrics
