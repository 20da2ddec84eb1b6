"""The status page (payload/training/page.py) without a browser: what it shows of each part of
status.json, "not yet" for what is absent, no script and nothing fetched, every string from a
status file escaped, the same bytes for the same input, and the trainer's writer: throttled,
forced at milestones, never failing the run. The page in a real Chromium, from a real run:
test_status_page_browser.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from page_helpers import add_new_fields
from train_helpers import assert_user_error, run_cli

from payload.core.status import StatusWriter
from payload.training import page, plots

LOG = """\
step 3/12  loss 5.6478  acc 0.111  lr 1.20e-03  0.00 steps/s  0 seq/s
step 6/12  loss 4.6910  acc 0.415  lr 2.00e-03  2.10 steps/s  34 seq/s
eval step 6/12  loss 4.0506  ppl 57.43  next-token acc 0.667  (16 held-out sequences)
step 9/12  loss 3.8332  acc 0.571  lr 1.14e-03  3.35 steps/s  54 seq/s
step 12/12  loss 3.3107  acc 0.655  lr 2.86e-04  3.35 steps/s  54 seq/s
eval step 12/12  loss 3.0396  ppl 20.90  next-token acc 0.694  (16 held-out sequences)
"""


def base_status(**extra: Any) -> dict[str, Any]:
    return {
        "job": "tiny",
        "stage": "train",
        "state": "running",
        "progress": 0.5,
        "message": "",
        "metrics": {"step": 6, "loss": 4.691, "steps_per_second": 2.1},
        "last_error": None,
        "runtime": {"accelerator": "v5litepod-8", "backend": "jax", "hosts": 2},
        "updated_at": "2026-12-02T07:20:00+00:00",
        "stages": {
            "train": {
                "state": "complete",
                "started_at": "2026-12-02T07:00:00+00:00",
                "finished_at": "2026-12-02T07:20:00+00:00",
                "metrics": {"step": 12, "loss": 3.3107, "steps_per_second": 3.35},
            }
        },
        **extra,
    }


def full_status() -> tuple[dict[str, Any], dict[str, Any]]:
    return add_new_fields(base_status(), LOG, tokens_per_step=512, total_steps=12)


def text_of(markup: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</', markup, re.DOTALL)
    assert found, f"no element {element_id}"
    return found.group(1)


def test_the_page_shows_every_part_of_a_full_status() -> None:
    status, watch = full_status()
    markup = page.render(status, {"tpu-watch.json": watch})
    for plot in ("plot-loss", "plot-throughput", "plot-goodput", "plot-timeline"):
        assert re.search(rf'<svg [^>]*id="{plot}"', markup), plot
    assert "<image" not in markup  # vectors only: nothing rasterized (by Agg) into the SVG
    assert text_of(markup, "step") == "6"
    assert text_of(markup, "loss") == "4.6910"
    assert text_of(markup, "eta") == "2026-12-02 07:20 UTC"
    assert text_of(markup, "grant-ends") == "2026-12-31 23:59 UTC"
    assert 'data-value="2026-12-02T07:20:00Z"' in markup
    assert "goodput " in markup and "wall time" in markup
    assert "restarts (UTC): 2 starts" in markup
    # The watchdog's events and the trainer's, merged, newest first.
    events_table = text_of(markup, "events") + markup.split('id="events"', 1)[1][:2000]
    for name in ("preempted", "recreated", "finished"):
        assert name in events_table, name
    assert "v5litepod-8" in markup and "tensorboardUrl" in markup
    assert "not yet" not in markup.split("<body>", 1)[1].split('id="last-error"', 1)[0]


def test_what_is_absent_says_not_yet() -> None:
    markup = page.render(base_status(), {})
    for plot in ("plot-loss", "plot-throughput", "plot-goodput", "plot-timeline"):
        assert f'id="{plot}"' not in markup.replace(f'id="{plot}-card"', ""), plot
    for absent in ("loss history", "throughput history", "goodput", "starts and events"):
        assert f"{absent}: not yet" in markup, absent
    assert text_of(markup, "eta") == "not yet"
    assert "watchdog: not yet" in markup
    # The progress bar falls back to status.json's progress.
    assert 'aria-valuenow="50.0"' in markup


def test_a_finished_run_shows_the_train_stage_s_last_step() -> None:
    status = base_status(stage="run", state="complete", metrics={})
    assert text_of(page.render(status, {}), "step") == "12"


def test_no_script_nothing_fetched_and_every_status_string_escaped() -> None:
    status, watch = full_status()
    hostile = '<script>alert(1)</script><img src="https://example.com/x">'
    status["job"] = hostile
    status["message"] = hostile
    status["last_error"] = {"stage": "train", "error": hostile + " $x^2$ --> <!--", "at": "x"}
    status["goodput"]["categories"][hostile + "$a$"] = 5.0
    watch["events"][0]["message"] = hostile
    watch["events"][0]["event"] = "$\\frac{1}{0}$ -->"
    markup = page.render(status, {"tpu-watch.json": watch})
    assert f'content="{page.CSP}"' in markup
    assert 'http-equiv="Content-Security-Policy"' in markup
    assert "<script" not in markup.lower()
    assert "<img" not in markup.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in markup
    # No stylesheet, font or image from anywhere else; the plots' own xmlns are names.
    assert not re.search(r"<[^<>]*\s(?:src|href|xlink:href)=\"(?!#)", markup)
    assert "@import" not in markup and not re.search(r"url\((?!#)", markup)


def test_the_same_status_gives_the_same_bytes_in_another_process(tmp_path: Path) -> None:
    status, watch = full_status()
    (tmp_path / "status.json").write_text(json.dumps(status))
    (tmp_path / "bootstrap").mkdir()
    (tmp_path / "bootstrap" / "tpu-watch.json").write_text(json.dumps(watch))
    first = page.render(status, {"tpu-watch.json": watch})
    code = (
        "import json, sys; from payload.training import page; "
        "print(page.render(json.load(open(sys.argv[1])), page.watch_statuses(sys.argv[2])), end='')"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "status.json"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert other.stdout == first
    assert "Date" not in first.split("</metadata>", 1)[0].split("<metadata>", 1)[-1]


def test_long_histories_are_thinned_keeping_the_last_point() -> None:
    points = [[i, 1.0 / (i + 1)] for i in range(10_000)]
    thinned = plots.thin(points)
    assert len(thinned) == plots.MAX_POINTS
    assert thinned[0] == (0.0, 1.0) and thinned[-1] == (9999.0, 1.0 / 10_000)


def test_write_reads_the_run_root_and_writes_status_html(tmp_path: Path) -> None:
    status, watch = full_status()
    (tmp_path / "status.json").write_text(json.dumps(status))
    (tmp_path / "bootstrap").mkdir()
    (tmp_path / "bootstrap" / "gpu-watch.json").write_text(json.dumps(watch))
    path = page.write(str(tmp_path))
    assert path == str(tmp_path / "status.html")
    markup = (tmp_path / "status.html").read_text()
    assert "gpu-watch.json" in markup and "preempted" in markup


def test_before_the_trainer_the_page_shows_what_the_watchdog_does(tmp_path: Path) -> None:
    # A node waiting for capacity, or preempted before the trainer's first status: the page
    # is the watchdog's (its events, its message), the run pending.
    _, watch = full_status()
    watch["message"] = "no capacity at the last attempt (v5litepod-16); next attempt in 60s"
    (tmp_path / "bootstrap").mkdir()
    (tmp_path / "bootstrap" / "tpu-watch.json").write_text(json.dumps(watch))
    page.write(str(tmp_path))
    markup = (tmp_path / "status.html").read_text()
    assert "state-pending" in markup
    assert "the trainer has not written its status yet; the watchdog: no capacity" in markup
    for event in watch["events"]:
        assert f">{event['event']}<" in markup
    assert not (tmp_path / "status.json").exists()


def test_the_cli_writes_the_page_or_names_the_missing_status(tmp_path: Path) -> None:
    missing = run_cli("page", "--run", str(tmp_path / "nowhere"), timeout=120)
    assert_user_error(missing, r"status\.json does not exist and no watchdog status")
    (tmp_path / "status.json").write_text("{not json")
    assert_user_error(run_cli("page", "--run", str(tmp_path), timeout=120), r"is not JSON")
    (tmp_path / "status.json").write_text(json.dumps(base_status()))
    done = run_cli("page", "--run", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "status.html")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_writer_is_throttled_forced_at_milestones_and_never_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = Clock()
    writer = page.PageWriter(str(tmp_path), min_interval_s=60.0, clock=clock)
    status = StatusWriter(str(tmp_path / "status.json"), "tiny", min_interval_s=0.0)
    status.on_flush = writer
    status.update(stage="train", step=1, loss=5.0)
    writer.close()
    assert writer.written == 1 and (tmp_path / "status.html").exists()
    clock.now += 30
    status.update(stage="train", step=2, loss=4.0)  # status.json written, the page throttled
    writer.close()
    assert writer.written == 1
    status.flush(milestone=True)  # an evaluation, a checkpoint, the end
    writer.close()
    assert writer.written == 2
    assert 'id="step" data-value="2"' in (tmp_path / "status.html").read_text()

    calls = []

    def broken(*args: Any, **kwargs: Any) -> str:
        calls.append(args)
        raise OSError("the bucket said no")

    monkeypatch.setattr(page, "write", broken)
    for _ in range(3):
        writer({"job": "tiny"}, force=True)
        writer.close()
    assert len(calls) == 3
    assert capsys.readouterr().err.count("status page not written") == 1


def test_the_writer_never_makes_training_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, started = threading.Event(), threading.Event()
    seen: list[Any] = []

    def slow(run_root: str, status: Any = None) -> str:
        started.set()
        assert gate.wait(60)
        seen.append(status["step"])
        return run_root

    monkeypatch.setattr(page, "write", slow)
    writer = page.PageWriter(str(tmp_path), min_interval_s=0.0, close_timeout_s=0.1)
    writer({"step": 1}, force=True)
    assert started.wait(60)
    writer({"step": 2}, force=True)  # returns while the first write hangs
    writer({"step": 3}, force=True)  # replaces step 2: only the newest document is written
    writer.close()  # bounded: returns after close_timeout_s with the write still hanging
    assert seen == []
    gate.set()
    writer.close_timeout_s = 60
    writer.close()
    assert seen == [1, 3]


def test_the_goodput_plot_leaves_out_categories_that_took_no_time() -> None:
    status = base_status(
        goodput={
            "wall_s": 100.0,
            "categories": {"productive": 60.0, "compile": 40.0, "lost": 0.0, "down": 0},
            "goodput": 0.6,
            "starts": [],
        }
    )
    markup = page.render(status, {})
    plot = markup.split('id="plot-goodput"', 1)[1].split("</svg>", 1)[0]
    assert "productive" in plot and "compile" in plot
    assert "lost" not in plot and "down" not in plot
