"""The status page's tests' fixtures in their documented shape (payload/training/page.py's
docstring).

- :func:`watch_status`: the controller watchdog's status (bootstrap/tpu-watch.json), which no
  local run writes: a preemption and a restart in the middle of the train stage, as real event
  payloads (payload/core/events.py `entry`); :func:`write_watch_status` puts it beside a real
  run's status.json (the Chromium test: every other field is the real run's own).
- :func:`add_new_fields`: a whole status.json for the renderer's own tests
  (test_status_page.py), `history`, `goodput`, `eta` and `events` made from a base status and
  trainer log lines, with two starts so the timeline has a restart to show.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from payload.core import events

LOG_LINE = re.compile(r"^step (\d+)/\d+  loss ([0-9.]+) .*  ([0-9.]+) steps/s", re.MULTILINE)
EVAL_LINE = re.compile(r"^eval step (\d+)/\d+  loss ([0-9.]+)", re.MULTILINE)


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def history_from_log(log: str, *, tokens_per_step: int) -> dict[str, list[list[float]]]:
    """`history` from the trainer's log lines: loss per logged step, held-out loss per
    evaluation, tokens/s where the line measured a rate, an MFU of the same shape."""
    train, rate = [], []
    for step, loss, steps_per_s in LOG_LINE.findall(log):
        train.append([int(step), float(loss)])
        if float(steps_per_s) > 0:
            rate.append([int(step), float(steps_per_s) * tokens_per_step])
    held_out = [[int(step), float(loss)] for step, loss in EVAL_LINE.findall(log)]
    mfu = [[step, round(0.3 + 0.01 * i, 4)] for i, (step, _) in enumerate(rate)]
    return {"train": train, "eval": held_out, "tokens_per_s": rate, "mfu": mfu}


def add_new_fields(
    status: dict[str, Any], log: str, *, tokens_per_step: int, total_steps: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(status.json with history/goodput/eta/events, the watchdog's tpu-watch.json)."""
    train = status["stages"]["train"]
    began, ended = _time(train["started_at"]), _time(train["finished_at"])
    middle = began + (ended - began) / 2
    resumed = middle + timedelta(seconds=1)
    wall = max((ended - began).total_seconds(), 2.0)
    step = train["metrics"]["step"]
    steps_per_s = float(train["metrics"].get("steps_per_second") or 1.0)
    productive = min(step / steps_per_s, wall * 0.8)
    doc = dict(status)
    doc["history"] = history_from_log(log, tokens_per_step=tokens_per_step)
    doc["goodput"] = {
        "wall_s": wall,
        "categories": {
            "productive": productive,
            "compile": (wall - productive) * 0.6,
            "checkpoint": (wall - productive) * 0.3,
            "lost": (wall - productive) * 0.1,
        },
        "goodput": productive / wall,
        "starts": [
            {
                "started_at": _iso(began),
                "ended_at": _iso(middle),
                "end": "preempted",
                "first_step": 0,
                "last_step": step // 2,
                "restored_step": None,
            },
            {
                "started_at": _iso(resumed),
                "ended_at": _iso(ended),
                "end": "finished",
                "first_step": step // 2,
                "last_step": step,
                "restored_step": step // 2,
            },
        ],
    }
    done = step * tokens_per_step
    doc["eta"] = {
        "tokens_done": done,
        "tokens_total": total_steps * tokens_per_step,
        "tokens_per_s": steps_per_s * tokens_per_step,
        "remaining_s": 0.0,
        "eta": _iso(ended),
        "grant_ends": "2026-12-31T23:59:59Z",
        "past_grant": False,
        "warning": None,
    }
    common = {"bucket": "test-tpu-pretrain", "job": status["job"], "host": "vm"}
    doc["events"] = [
        events.entry("finished", source="trainer", message="the export is written",
                     at=_iso(ended), step=step, export="export/", **common),
    ]  # fmt: skip
    watch = watch_status(status)
    return doc, watch


def watch_status(status: dict[str, Any]) -> dict[str, Any]:
    """The watchdog's tpu-watch.json: the TPU preempted halfway through the train stage and
    asked for again a second later."""
    train = status["stages"]["train"]
    began, ended = _time(train["started_at"]), _time(train["finished_at"])
    middle = began + (ended - began) / 2
    resumed = middle + timedelta(seconds=1)
    common = {"bucket": "test-tpu-pretrain", "job": status["job"], "host": "vm"}
    return {
        "role": "tpu-watch",
        "tpu_state": "READY",
        "action": "none",
        "message": "the TPU is READY",
        "updated_at": _iso(ended),
        "capacity_wait_s": 0,
        "events": [
            events.entry("preempted", source="watchdog", message="the TPU was preempted",
                         at=_iso(middle), state="PREEMPTED", **common),
            events.entry("recreated", source="watchdog", message="asked for the TPU again",
                         at=_iso(resumed), reason="preempted", **common),
        ],
    }  # fmt: skip


def write_watch_status(run_root: Path) -> dict[str, Any]:
    """bootstrap/tpu-watch.json beside a real run's status.json; returns the watchdog's doc."""
    status = json.loads((run_root / "status.json").read_text())
    watch = watch_status(status)
    (run_root / "bootstrap").mkdir(exist_ok=True)
    (run_root / "bootstrap" / "tpu-watch.json").write_text(json.dumps(watch) + "\n")
    return watch
