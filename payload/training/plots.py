"""The status page's plots: matplotlib figures saved as SVG (its SVG backend), for inlining into
runs/<job>/status.html (page.py). Everything is drawn as vectors: the SVG backend imports Agg
only to rasterize artists marked rasterized (matplotlib/backends/backend_mixed.py
``MixedModeRenderer``, whose raster renderer is ``RendererAgg``), and none here is, so the SVG
holds no ``<image>`` (test_status_page.py checks).

matplotlib is imported inside the functions: commands that never draw a page never import it.
The figures are drawn through the object-oriented API (``Figure`` with ``FigureCanvasSVG``),
never pyplot, so no global backend or figure registry is touched and a background thread may
draw (one at a time: page.PageWriter).

Deterministic: the same input gives the same bytes. matplotlib's SVG backend salts the ids it
hashes with a random uuid unless ``svg.hashsalt`` is set, and writes the time as metadata unless
``metadata={"Date": None}`` (matplotlib/backends/backend_svg.py, ``_make_id`` and
``_write_metadata``; the matplotlibrc's ``svg.hashsalt``). Text is kept as SVG ``<text>``
(``svg.fonttype: none``): one font, DejaVu Sans, lays the text out, and the browser draws it in
that font or its sans-serif. It is matplotlib's own copy on every machine, whatever fonts the
system has: the font manager lists its bundled fonts before the system's and keeps the first of
equal scores (matplotlib/font_manager.py, ``FontManager.__init__`` and ``_findfont_cached``).
``text.parse_math`` is off so a ``$`` in a label from the status is text, not mathtext.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

# At most this many points of one series are drawn (evenly spaced, the last kept): a week-long
# run's history would otherwise make a page of megabytes.
MAX_POINTS = 1500
WIDTH_IN, HEIGHT_IN = 6.2, 2.6
# Colours of a start's bar by how it ended (goodput's `end`, goodput.ENDS); anything else
# is grey.
END_COLOURS = {
    "running": "#2b8a3e",
    "finished": "#1c7ed6",
    "preempted": "#e8590c",
    "killed": "#d9480f",
    "stopped": "#c92a2a",
    "failed": "#c92a2a",
    "hung": "#862e9c",
}
EVENT_COLOURS = {
    "preempted": "#e8590c",
    "recreated": "#1c7ed6",
    "capacity-wait": "#f08c00",
    "unhealthy": "#862e9c",
    "stopped": "#c92a2a",
    "hung": "#862e9c",
    "finished": "#2b8a3e",
    "eta-past-grant": "#f08c00",
}
_RC = {
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "font.size": 9.0,
    "text.parse_math": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def thin(points: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """At most MAX_POINTS of (x, y), evenly spaced, the last always kept."""
    pairs = [(float(p[0]), float(p[1])) for p in points]
    if len(pairs) <= MAX_POINTS:
        return pairs
    stride = len(pairs) / (MAX_POINTS - 1)
    picked = [pairs[int(i * stride)] for i in range(MAX_POINTS - 1)]
    return [*picked, pairs[-1]]


@contextmanager
def _figure(plot_id: str) -> Iterator[Any]:
    """A figure whose SVG has the id `plot_id` (and its hashed ids salted with it)."""
    import matplotlib  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    with matplotlib.rc_context({**_RC, "svg.hashsalt": plot_id, "svg.id": plot_id}):
        yield Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=100, layout="constrained")


def _svg(fig: Any) -> str:
    """The figure as an <svg> element (the XML declaration and DOCTYPE cut off)."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG  # noqa: PLC0415

    out = io.StringIO()
    FigureCanvasSVG(fig).print_svg(out, metadata={"Date": None})
    text = out.getvalue()
    return text[text.index("<svg") :].strip()


def loss(
    plot_id: str, train: Sequence[Sequence[float]], held_out: Sequence[Sequence[float]]
) -> str:
    with _figure(plot_id) as fig:
        ax = fig.add_subplot()
        if train:
            xs, ys = zip(*thin(train), strict=True)
            ax.plot(xs, ys, color="#1c7ed6", linewidth=1.2, label="training")
        if held_out:
            xs, ys = zip(*thin(held_out), strict=True)
            ax.plot(xs, ys, color="#e8590c", marker="o", markersize=3, label="held-out")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(loc="upper right", frameon=False)
        return _svg(fig)


def throughput(
    plot_id: str, tokens_per_s: Sequence[Sequence[float]], mfu: Sequence[Sequence[float]]
) -> str:
    with _figure(plot_id) as fig:
        ax = fig.add_subplot()
        handles = []
        if tokens_per_s:
            xs, ys = zip(*thin(tokens_per_s), strict=True)
            handles += ax.plot(xs, ys, color="#2b8a3e", linewidth=1.2, label="tokens/s")
        ax.set_xlabel("step")
        ax.set_ylabel("tokens/s")
        if mfu:
            right = ax.twinx()
            right.spines["right"].set_visible(True)
            right.grid(False)
            xs, ys = zip(*thin(mfu), strict=True)
            handles += right.plot(
                xs, [100.0 * y for y in ys], color="#862e9c", linewidth=1.0, label="MFU %"
            )
            right.set_ylabel("MFU %")
            right.set_ylim(bottom=0)
        ax.set_ylim(bottom=0)
        ax.legend(handles=handles, loc="lower right", frameon=False)
        return _svg(fig)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"


def goodput(plot_id: str, categories: Mapping[str, float], wall_s: float | None) -> str:
    items = sorted(((str(k), float(v)) for k, v in categories.items()), key=lambda kv: -kv[1])
    total = float(wall_s) if wall_s else sum(v for _, v in items)
    with _figure(plot_id) as fig:
        ax = fig.add_subplot()
        unit, per = ("hours", 3600.0) if total >= 3600 else ("minutes", 60.0)
        names = [k for k, _ in items][::-1]
        seconds = [v for _, v in items][::-1]
        colours = ["#2b8a3e" if n == "productive" else "#868e96" for n in names]
        bars = ax.barh(names, [v / per for v in seconds], color=colours)
        labels = [f"{hours(v)} ({100 * v / total:.1f} %)" if total else "" for v in seconds]
        ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
        ax.set_xlabel(unit)
        ax.margins(x=0.3)
        ax.grid(axis="y", visible=False)
        return _svg(fig)


def parse_time(iso: Any) -> datetime | None:
    """An ISO 8601 time with its zone (a trailing Z too), else None."""
    if not iso:
        return None
    try:
        parsed = datetime.fromisoformat(str(iso).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else None


def timeline(
    plot_id: str,
    starts: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    *,
    now: str | None,
) -> str:
    """The trainer's starts as bars (coloured by how each ended) over the events' markers, one
    row per kind of event, against UTC time."""
    from matplotlib import dates as mdates  # noqa: PLC0415

    end_of_now = parse_time(now)
    bars: list[tuple[datetime, datetime, str]] = []
    for start in starts:
        began = parse_time(start.get("started_at"))
        if began is None:
            continue
        ended = parse_time(start.get("ended_at")) or end_of_now or began
        bars.append((began, max(ended, began), str(start.get("end") or "running")))
    marks: dict[str, list[datetime]] = {}
    for event in events:
        at = parse_time(event.get("at"))
        if at is not None:
            marks.setdefault(str(event.get("event")), []).append(at)
    rows = ["trainer starts", *sorted(marks)]
    with _figure(plot_id) as fig:
        ax = fig.add_subplot()
        ax.xaxis_date(tz="UTC")
        for began, ended, end in bars:
            x0 = mdates.date2num(began)
            width = max(mdates.date2num(ended) - x0, 1e-5)
            ax.broken_barh(
                [(x0, width)], (-0.3, 0.6), facecolors=END_COLOURS.get(end, "#868e96"), label=end
            )
        for row, name in enumerate(rows[1:], start=1):
            ax.plot(
                marks[name],
                [row] * len(marks[name]),
                linestyle="none",
                marker="D",
                markersize=5,
                color=EVENT_COLOURS.get(name, "#495057"),
            )
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.grid(axis="y", visible=False)
        locator = mdates.AutoDateLocator(tz="UTC")
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz="UTC"))
        everything = [t for b in bars for t in b[:2]] + [t for ts in marks.values() for t in ts]
        if everything and max(everything) == min(everything):
            centre = mdates.date2num(everything[0])
            ax.set_xlim(centre - 1 / 1440, centre + 1 / 1440)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        if unique:
            ax.legend(
                unique.values(),
                unique.keys(),
                loc="lower left",
                bbox_to_anchor=(0.0, 1.0),
                ncols=len(unique),
                frameon=False,
                fontsize=8,
            )
        return _svg(fig)
