"""The chart of the last hour, drawn on the server as inline SVG (no script, no library).

Two panels share the time axis: throughput (deliveries Completed a minute) and depth (Pending plus
InFlight, and DeadLettered), from the stats history the sweeper records once a minute. The depth
ends at the live counts the page's cards show (``live``), so the two agree; hovering a minute shows
its values.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape

from markupsafe import Markup

from ..core.history import StatsPoint

WIDTH = 960
PANEL = 100
LEFT = 56
RIGHT = 12
TOP = 22
GAP = 34


@dataclass(frozen=True, slots=True)
class Sample:
    """The whole of what is charted at one moment (the sum over the charted subscriptions)."""

    at: datetime
    completed_per_minute: float
    depth: int
    dead_lettered: int


def samples(points: list[StatsPoint]) -> list[Sample]:
    """One sample per recording moment: a sweeper pass records every subscription at once."""
    grouped: dict[datetime, list[StatsPoint]] = defaultdict(list)
    for point in points:
        grouped[point.recorded_at].append(point)
    return [
        Sample(
            at=at,
            completed_per_minute=sum(p.completed_per_minute for p in group),
            depth=sum(p.pending + p.in_flight for p in group),
            dead_lettered=sum(p.dead_lettered for p in group),
        )
        for at, group in sorted(grouped.items())
    ]


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (at least 1)."""
    if value <= 1:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)


def _number(value: float) -> str:
    if value >= 10 or value == int(value):
        return f"{round(value):,}"
    return f"{value:.1f}"


def render_chart(points: list[StatsPoint], now: datetime, *, minutes: int = 60, label: str = "",
                 live: tuple[int, int] | None = None) -> Markup:
    """The SVG of the last ``minutes`` of ``points`` (all subscriptions summed), or a note that
    there is no history yet. ``live`` (depth, dead-lettered) ends the depth panel at ``now``."""
    data = [s for s in samples(points) if s.at >= now - timedelta(minutes=minutes)]
    if live is not None and data:
        data.append(Sample(at=now, completed_per_minute=data[-1].completed_per_minute, depth=live[0],
                           dead_lettered=live[1]))
    height = TOP + PANEL + GAP + PANEL + 26
    span = minutes * 60.0
    plot_width = WIDTH - LEFT - RIGHT

    def x(at: datetime) -> float:
        return LEFT + plot_width * min(max(1 - (now - at).total_seconds() / span, 0.0), 1.0)

    latest = data[-1] if data else None
    summary = (
        f"{label}: no history yet" if latest is None else
        f"{label}: {_number(latest.completed_per_minute)} completed a minute, depth {latest.depth:,}, "
        f"{latest.dead_lettered:,} dead-lettered"
    ).lstrip(": ")
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" role="img" aria-labelledby="chart-title" '
        f'xmlns="http://www.w3.org/2000/svg">',
        f'<title id="chart-title">{escape(summary)}</title>',
    ]
    panels = (
        ("Completed a minute", [(s.at, s.completed_per_minute) for s in data], None, "throughput"),
        ("Depth", [(s.at, float(s.depth)) for s in data],
         [(s.at, float(s.dead_lettered)) for s in data], "depth"),
    )
    for index, (title, series, second, kind) in enumerate(panels):
        top = TOP + index * (PANEL + GAP)
        bottom = top + PANEL
        values = [v for _, v in series] + [v for _, v in (second or [])]
        ceiling = nice_ceiling(max(values, default=0.0))

        def y(value: float, bottom: float = bottom, ceiling: float = ceiling) -> float:
            return bottom - PANEL * value / ceiling

        parts.append(f'<text class="chart-title" x="{LEFT}" y="{top - 8}">{escape(title)}</text>')
        if kind == "depth":
            for offset, (name, text) in enumerate((("depth", "Pending + InFlight"), ("dead", "DeadLettered"))):
                lx = LEFT + 70 + offset * 170
                parts.append(f'<line class="chart-line chart-{name}" x1="{lx}" y1="{top - 12}" x2="{lx + 18}" '
                             f'y2="{top - 12}"/><text class="chart-axis" x="{lx + 24}" y="{top - 8}">{text}</text>')
        parts.append(f'<rect class="chart-frame" x="{LEFT}" y="{top}" width="{plot_width}" height="{PANEL}"/>')
        for fraction in (0.5, 1.0):
            grid = bottom - PANEL * fraction
            parts.append(f'<line class="chart-grid" x1="{LEFT}" y1="{grid:.1f}" x2="{WIDTH - RIGHT}" y2="{grid:.1f}"/>')
            parts.append(f'<text class="chart-axis" x="{LEFT - 6}" y="{grid + 4:.1f}" text-anchor="end">'
                         f'{_number(ceiling * fraction)}</text>')
        parts.append(f'<text class="chart-axis" x="{LEFT - 6}" y="{bottom + 4}" text-anchor="end">0</text>')
        for name, line in ((kind, series), ("dead", second or [])):
            if not line:
                continue
            coords = " ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in line)
            if len(line) == 1:
                cx, cy = coords.split(",")
                parts.append(f'<circle class="chart-dot chart-{name}" cx="{cx}" cy="{cy}" r="3"/>')
            else:
                parts.append(f'<polyline class="chart-line chart-{name}" points="{coords}"/>')
    # A hover target a minute wide around each sample, whose tooltip is the sample's values.
    slot = plot_width / minutes
    bottom = TOP + 2 * PANEL + GAP
    for sample in data:
        tip = (f"{sample.at.strftime('%H:%M')} UTC: {_number(sample.completed_per_minute)} completed a minute, "
               f"depth {sample.depth:,}, {sample.dead_lettered:,} dead-lettered")
        left = min(max(x(sample.at) - slot / 2, LEFT), WIDTH - RIGHT - slot)
        parts.append(f'<rect class="chart-hover" x="{left:.1f}" y="{TOP}" width="{slot:.1f}" height="{bottom - TOP}">'
                     f'<title>{escape(tip)}</title></rect>')
    axis = TOP + 2 * PANEL + GAP + 16
    for back in range(minutes, -1, -15):
        tick = LEFT + plot_width * (1 - back / minutes)
        text = "now" if back == 0 else f"−{back} min"
        parts.append(f'<text class="chart-axis" x="{tick:.1f}" y="{axis}" text-anchor="middle">{text}</text>')
    if latest is None:
        parts.append(f'<text class="chart-empty" x="{LEFT + plot_width / 2:.0f}" y="{TOP + PANEL / 2 + 4:.0f}" '
                     'text-anchor="middle">No history yet: the sweeper records a point a minute.</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
