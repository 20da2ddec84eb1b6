"""runs/<job>/status.html: the run as one page, drawn from status.json and the watchdog's status.

One self-contained file: its styles inline, its plots inline SVG (plots.py: matplotlib's SVG
backend), no script and nothing fetched. The bucket it sits in is written by several identities
(the trainer, the controller, the watchdog), so the page is never trusted to run anything: its
Content-Security-Policy (``default-src 'none'; style-src 'unsafe-inline'; img-src data:``)
stops a browser from running a script or fetching anything even if one got in, and every string
from a status file is escaped.

What it reads (each part that is absent shows "not yet"):

- status.json (payload/core/status.py): ``job``, ``stage``, ``state``, ``progress``,
  ``message``, ``metrics`` (``step``, ``loss``, ...), ``last_error``, ``runtime``,
  ``updated_at``, and ``history`` (``train``, ``eval``, ``tokens_per_s``, ``mfu``: lists of
  [step, value]), ``goodput`` (``wall_s``, ``categories``, ``goodput``, ``starts``), ``eta``
  (``tokens_done``, ``tokens_total``, ``tokens_per_s``, ``remaining_s``, ``eta``,
  ``grant_ends``, ``past_grant``, ``warning``) and ``events`` (payload/core/events.py entries);
- the watchdog's status, ``bootstrap/tpu-watch.json`` or ``bootstrap/gpu-watch.json``
  (infra/render/templates/tpu-watch.sh ``watch_status``), with its ``events`` and
  ``capacity_wait_s``.

The same input gives the same bytes (plots.py). :func:`write` reads them through
payload/core/storage.py (a local run root or gs://) and writes status.html beside status.json;
:class:`PageWriter` is the trainer's: throttled, in a background thread, never failing or
stalling the run.
"""

from __future__ import annotations

import html
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timezone
from typing import Any

from payload.core import storage
from payload.core.errors import UserError
from payload.training import plots

PAGE = "status.html"
STATUS = "status.json"
WATCH_FILES = ("tpu-watch.json", "gpu-watch.json")
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
NOT_YET = "not yet"
MAX_EVENT_ROWS = 15
# What the page shows of status.json's `runtime` (the rest is in status.json).
RUNTIME_SHOWN = (
    "accelerator",
    "accelerator_type",
    "backend",
    "chip",
    "devices",
    "hosts",
    "policy",
    "precision",
    "replicas",
    "runtime_version",
)
# docs/deploy-gcp.md, "Connect and watch": TensorBoard runs on the controller, reached over
# the stack's WireGuard VPN.
TENSORBOARD_STEPS = (
    "make vpn-config STACK=<stack>",
    "sudo wg-quick up ./build/vpn/<stack>/tpu-pretrain.conf",
    "pulumi stack output tensorboardUrl    # http://<controller>:6006 over the VPN",
)

_STYLE = """
body{font:14px/1.4 'DejaVu Sans',system-ui,sans-serif;margin:0;padding:12px 18px;color:#212529;
background:#f8f9fa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:0 0 6px}
.sub{color:#495057;margin:0 0 8px}
.state{display:inline-block;padding:1px 8px;border-radius:9px;color:#fff;background:#495057}
.state-running{background:#2b8a3e}.state-complete{background:#1c7ed6}
.state-failed,.state-hung{background:#c92a2a}
.bar{height:18px;background:#dee2e6;border-radius:4px;overflow:hidden;margin:4px 0}
.fill{height:100%;background:#2b8a3e}
.facts{display:flex;flex-wrap:wrap;gap:6px 22px;margin:4px 0}
.facts b{font-weight:600}
.warn{background:#fff3bf;border-left:4px solid #f08c00;padding:4px 8px;margin:6px 0}
.error{background:#ffe3e3;border-left:4px solid #c92a2a;padding:4px 8px;margin:6px 0}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:10px}
.card{background:#fff;border:1px solid #dee2e6;border-radius:6px;padding:8px 10px;min-width:0}
figure{margin:0}figure svg{width:100%;height:auto;display:block}
.none{color:#868e96;font-style:italic}
table{border-collapse:collapse;font-size:12px;width:100%}
td,th{text-align:left;padding:2px 6px;border-bottom:1px solid #e9ecef;vertical-align:top}
code,pre{font:12px 'DejaVu Sans Mono',monospace}pre{margin:4px 0;white-space:pre-wrap}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(history: Mapping[str, Any], name: str) -> list[list[float]]:
    """A history series as [[step, value], ...], pairs that are not two numbers left out."""
    points = history.get(name)
    if not isinstance(points, list):
        return []
    kept = []
    for point in points:
        if isinstance(point, (list, tuple)) and len(point) == 2:
            x, y = _number(point[0]), _number(point[1])
            if x is not None and y is not None:
                kept.append([x, y])
    return kept


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def utc(iso: Any) -> str:
    """An ISO time as 'YYYY-MM-DD HH:MM UTC' (the text as it is when it is not one)."""
    when = plots.parse_time(iso)
    if when is None:
        return str(iso) if iso else NOT_YET
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _figure(plot_id: str, title: str, draw: Callable[[], str] | None, absent: str) -> str:
    body = draw() if draw is not None else f'<p class="none">{_e(absent)}</p>'
    return (
        f'<section class="card" id="{plot_id}-card"><h2>{_e(title)}</h2>'
        f'<figure aria-label="{_e(title)}">{body}</figure></section>'
    )


def merged_events(
    status: Mapping[str, Any], watch_statuses: Mapping[str, Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The trainer's events and each watchdog's, once each, oldest first."""
    seen: set[tuple[str, str, str, str]] = set()
    merged = []
    lists = [status.get("events")] + [w.get("events") for _, w in sorted(watch_statuses.items())]
    for events in lists:
        for event in events if isinstance(events, list) else []:
            if not isinstance(event, Mapping) or not event.get("event"):
                continue
            key = tuple(str(event.get(k, "")) for k in ("event", "at", "source", "host"))
            if key not in seen:
                seen.add(key)  # type: ignore[arg-type]
                merged.append(event)
    return sorted(merged, key=lambda e: str(e.get("at", "")))


def latest_metrics(status: Mapping[str, Any]) -> Mapping[str, Any]:
    """The latest training metrics: status.json's `metrics` while training, else (a later
    stage, the run complete) what the train stage recorded last."""
    metrics = _mapping(status.get("metrics"))
    if "step" in metrics:
        return metrics
    return _mapping(_mapping(_mapping(status.get("stages")).get("train")).get("metrics"))


def _header(status: Mapping[str, Any]) -> str:
    metrics = latest_metrics(status)
    state = str(status.get("state") or "pending")
    step, loss = metrics.get("step"), _number(metrics.get("loss"))
    total = _mapping(status.get("stages")).get("train")
    facts = [
        ("stage", status.get("stage") or NOT_YET, "stage"),
        ("step", step if step is not None else NOT_YET, "step"),
        ("loss", f"{loss:.4f}" if loss is not None else NOT_YET, "loss"),
        ("updated", utc(status.get("updated_at")), "updated"),
    ]
    values = {"step": step, "loss": metrics.get("loss"), "updated": status.get("updated_at")}
    spans = "".join(
        f'<span>{_e(label)} <b id="{key}" data-value="{_e(values.get(key, value))}">'
        f"{_e(value)}</b></span>"
        for label, value, key in facts
    )
    message = status.get("message") or (total or {}).get("message") or ""
    return (
        f"<header><h1>{_e(status.get('job') or '(no job)')} "
        f'<span class="state state-{_e(state)}" id="state">{_e(state)}</span></h1>'
        f'<p class="sub" id="message">{_e(message)}</p><div class="facts">{spans}</div></header>'
    )


def _progress(status: Mapping[str, Any]) -> str:
    eta = _mapping(status.get("eta"))
    done, total = _number(eta.get("tokens_done")), _number(eta.get("tokens_total"))
    if done is not None and total:
        fraction = done / total
        what = f"{done:,.0f} of {total:,.0f} tokens"
    else:
        fraction = _number(status.get("progress")) or 0.0
        what = "tokens: not yet"
    fraction = max(0.0, min(1.0, fraction))
    rate = _number(eta.get("tokens_per_s"))
    remaining = _number(eta.get("remaining_s"))
    facts = [
        ("progress", f"{100 * fraction:.1f} %", "progress", fraction),
        ("", what, "tokens", done),
        ("rate", f"{rate:,.0f} tokens/s" if rate is not None else NOT_YET, "rate", rate),
        (
            "remaining",
            plots.hours(remaining) if remaining is not None else NOT_YET,
            "remaining",
            remaining,
        ),
        ("ETA", utc(eta.get("eta")), "eta", eta.get("eta")),
        ("grant ends", utc(eta.get("grant_ends")), "grant-ends", eta.get("grant_ends")),
    ]
    spans = "".join(
        f'<span>{_e(label)} <b id="{key}" data-value="{_e("" if raw is None else raw)}">'
        f"{_e(text)}</b></span>"
        for label, text, key, raw in facts
    )
    warning = ""
    if eta.get("warning") or eta.get("past_grant"):
        text = eta.get("warning") or "at the current rate the run ends after the grant's end"
        warning = f'<p class="warn" id="eta-warning">{_e(text)}</p>'
    return (
        f'<section class="card" id="progress-card"><h2>progress</h2>'
        f'<div class="bar" role="progressbar" aria-valuemin="0" aria-valuemax="100" '
        f'aria-valuenow="{100 * fraction:.1f}"><div class="fill" '
        f'style="width:{100 * fraction:.2f}%"></div></div>'
        f'<div class="facts">{spans}</div>{warning}</section>'
    )


def _goodput(status: Mapping[str, Any]) -> str:
    good = _mapping(status.get("goodput"))
    # The categories that took time (goodput.py CATEGORIES: a run without a restart has no
    # lost progress or down time), and productive always.
    categories = {
        str(k): v
        for k, v in _mapping(good.get("categories")).items()
        if (_number(v) or 0.0) > 0 or (k == "productive" and _number(v) is not None)
    }
    wall = _number(good.get("wall_s"))
    fraction = _number(good.get("goodput"))
    title = "goodput"
    if fraction is not None:
        title += f" {100 * fraction:.1f} %"
    if wall is not None:
        title += f" of {plots.hours(wall)} wall time"
    draw = (lambda: plots.goodput("plot-goodput", categories, wall)) if categories else None
    return _figure("plot-goodput", title, draw, f"goodput: {NOT_YET}")


def _timeline(status: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
    starts = [
        s for s in _mapping(status.get("goodput")).get("starts") or [] if isinstance(s, Mapping)
    ]
    plural = "" if len(starts) == 1 else "s"
    title = f"starts, preemptions and restarts (UTC): {len(starts)} start{plural}"
    draw = None
    if starts or events:

        def draw() -> str:
            return plots.timeline(
                "plot-timeline", starts, events, now=str(status.get("updated_at") or "")
            )

    return _figure("plot-timeline", title, draw, f"starts and events: {NOT_YET}")


def _events_table(events: Sequence[Mapping[str, Any]]) -> str:
    if not events:
        return f'<p class="none" id="events">events: {NOT_YET}</p>'
    rows = "".join(
        f"<tr><td>{_e(utc(e.get('at')))}</td><td>{_e(e.get('event'))}</td>"
        f"<td>{_e(e.get('source', ''))}</td><td>{_e(e.get('message', ''))}</td></tr>"
        for e in list(events)[-MAX_EVENT_ROWS:][::-1]
    )
    return (
        '<table id="events"><tr><th>at</th><th>event</th><th>from</th><th>message</th></tr>'
        f"{rows}</table>"
    )


def _plain(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def _table(rows: Mapping[str, Any], table_id: str) -> str:
    cells = "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(_plain(v))}</td></tr>"
        for k, v in sorted(rows.items())
        if v not in (None, "")
    )
    return f'<table id="{table_id}">{cells}</table>'


def _details(status: Mapping[str, Any], watch_statuses: Mapping[str, Mapping[str, Any]]) -> str:
    error = _mapping(status.get("last_error"))
    if error:
        where = " ".join(str(error[k]) for k in ("stage", "phase") if error.get(k))
        last_error = (
            f'<div class="error" id="last-error"><b>{_e(where or "error")}</b> '
            f"at {_e(utc(error.get('at')))}<pre>{_e(error.get('error', ''))}</pre></div>"
        )
    else:
        last_error = '<p class="none" id="last-error">last error: none</p>'
    runtime = {k: v for k, v in _mapping(status.get("runtime")).items() if k in RUNTIME_SHOWN}
    accelerator = (
        _table(runtime, "runtime") if runtime else f'<p class="none" id="runtime">{NOT_YET}</p>'
    )
    watch = ""
    for name, doc in sorted(watch_statuses.items()):
        shown = {k: v for k, v in doc.items() if k != "events"}
        watch += f"<h2>{_e(name)}</h2>{_table(shown, 'watch-' + name.split('.')[0])}"
    if not watch:
        watch = f'<p class="none" id="watch">watchdog: {NOT_YET}</p>'
    steps = "\n".join(TENSORBOARD_STEPS)
    tensorboard = (
        "<p>TensorBoard runs on the controller and is reached over the stack's VPN "
        "(docs/deploy-gcp.md, <i>Connect and watch</i>):</p>"
        f'<pre id="tensorboard">{_e(steps)}</pre>'
    )
    return (
        f'<section class="card"><h2>last error</h2>{last_error}'
        f"<h2>accelerator</h2>{accelerator}</section>"
        f'<section class="card"><h2>watchdog</h2>{watch}<h2>TensorBoard</h2>{tensorboard}</section>'
    )


def render(status: Mapping[str, Any], watch_statuses: Mapping[str, Mapping[str, Any]]) -> str:
    """The page for one status.json document and the watchdog statuses found (by file name)."""
    history = _mapping(status.get("history"))
    train, held_out = _series(history, "train"), _series(history, "eval")
    tokens, mfu = _series(history, "tokens_per_s"), _series(history, "mfu")
    events = merged_events(status, watch_statuses)
    loss = _figure(
        "plot-loss",
        "training and held-out loss",
        (lambda: plots.loss("plot-loss", train, held_out)) if train or held_out else None,
        f"loss history: {NOT_YET}",
    )
    throughput = _figure(
        "plot-throughput",
        "tokens/s and MFU",
        (lambda: plots.throughput("plot-throughput", tokens, mfu)) if tokens or mfu else None,
        f"throughput history: {NOT_YET}",
    )
    job = status.get("job") or "(no job)"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(job)}: {_e(status.get('state') or 'pending')}</title>"
        f"<style>{_STYLE}</style></head><body>"
        f"{_header(status)}{_progress(status)}"
        f'<div class="grid">{loss}{throughput}{_goodput(status)}{_timeline(status, events)}'
        f'<section class="card"><h2>events</h2>{_events_table(events)}</section>'
        f"{_details(status, watch_statuses)}</div>"
        "</body></html>\n"
    )


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        data = json.loads(storage.read_text(path))
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None


def watch_statuses(run_root: str) -> dict[str, dict[str, Any]]:
    """The watchdog statuses under `run_root`/bootstrap/ that exist, by file name (one that is
    not valid JSON is left out: the watchdog rewrites it on its next tick)."""
    found = {}
    for name in WATCH_FILES:
        try:
            doc = _read_json(storage.join(run_root, "bootstrap", name))
        except ValueError:
            continue
        if doc is not None:
            found[name] = doc
    return found


def write(run_root: str, status: Mapping[str, Any] | None = None) -> str:
    """Render `run_root`/status.html from its status.json (or `status`, the document the
    trainer holds) and the watchdog statuses; write it atomically; return its path."""
    watching = watch_statuses(run_root)
    if status is None:
        path = storage.join(run_root, STATUS)
        try:
            status = _read_json(path)
        except ValueError as exc:
            raise UserError(f"{path} is not JSON: {exc}") from None
        if status is None:
            if not watching:
                raise UserError(
                    f"{path} does not exist and no watchdog status is under "
                    f"{storage.join(run_root, 'bootstrap')}: nothing has run yet"
                )
            status = before_the_trainer(run_root, watching)
    page = storage.join(run_root, PAGE)
    storage.write_text(page, render(status, watching))
    return page


def before_the_trainer(run_root: str, watching: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The status a page shows before the trainer wrote one (the node is being created, waits
    for capacity, or was preempted before its first log): state ``pending``, the job the
    watchdog names (else the run root's last part) and what the watchdog is doing."""
    newest = max(watching.values(), key=lambda w: str(w.get("updated_at") or ""))
    job = str(newest.get("job") or run_root.rstrip("/").rsplit("/", 1)[-1])
    doing = newest.get("message") or newest.get("action") or "watching"
    return {
        "job": job,
        "stage": None,
        "state": "pending",
        "message": f"the trainer has not written its status yet; the watchdog: {doing}",
        "updated_at": newest.get("updated_at"),
    }


class PageWriter:
    """The trainer's status.html: at most once every `min_interval_s` unless forced (an
    evaluation, a checkpoint, the end), rendered and written in a background thread so
    training never waits on matplotlib or the bucket. A write still running when another is
    asked for is followed by one with the newest document; a failure is logged once and the
    run goes on. :meth:`close` waits for the last write, at most `close_timeout_s`."""

    def __init__(
        self,
        run_root: str,
        *,
        min_interval_s: float = 60.0,
        close_timeout_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_root = run_root
        self.min_interval_s = min_interval_s
        self.close_timeout_s = close_timeout_s
        self._clock = clock
        self._last: float | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._failed = False
        self.written = 0

    def __call__(self, document: dict[str, Any], force: bool = False) -> None:
        now = self._clock()
        if not force and self._last is not None and now - self._last < self.min_interval_s:
            return
        self._last = now
        with self._lock:
            self._pending = document
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="status-page", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                document, self._pending = self._pending, None
                if document is None:
                    self._thread = None
                    return
            try:
                write(self.run_root, document)
                self.written += 1
            except Exception as exc:  # the page never stops a run
                if not self._failed:
                    self._failed = True
                    print(
                        f"warning: status page not written ({type(exc).__name__}: {exc}); "
                        "training goes on",
                        file=sys.stderr,
                        flush=True,
                    )

    def close(self) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(self.close_timeout_s)
