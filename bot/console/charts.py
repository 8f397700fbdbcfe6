"""Server-rendered SVG charts for the dashboard: no script, no chart library, nothing the CSP has to allow.

Two shapes cover the dashboard: columns over time (stacked by series, e.g. approvals per hour by outcome) and
horizontal bars per category (stacked by series, e.g. tokens per worker). Lengths are proportional to the data,
scaled to the largest total. Every chart carries its own text equivalent: an SVG ``<title>`` and ``<desc>`` that
say what it shows, and a table of the same numbers under it, so a screen reader (or a person who prefers
numbers) loses nothing. Colours are CSS classes (``k-<series>``) filled from the console's CSS variables, so
dark mode recolours the charts with the page. Labels come from data (worker names, statuses): all escaped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from kazma.adapters.web.render import e
from kazma.bot.console.times import when_html

# Drawing area in SVG user units; the SVG scales to its box (width 100%).
WIDTH = 320
PLOT_HEIGHT = 120
BAR_HEIGHT = 16
BAR_GAP = 6
LABEL_WIDTH = 90
AXIS = 18  # room for the axis labels under the columns

CHART_STYLE = """
figure.chart { margin: 0; }
.chart svg text { fill: currentColor; font-size: 11px; }
.chart .axis { stroke: var(--line); }
.chart .k-approved { fill: var(--approve); } .chart .k-denied { fill: var(--deny); }
.chart .k-timeout { fill: var(--card); } .chart .k-cancelled { fill: var(--muted); }
.chart .k-pending { fill: var(--accent); } .chart .k-count { fill: var(--accent); }
.chart .k-prompt { fill: var(--accent); } .chart .k-completion { fill: var(--approve); }
.chart .k-swarm { fill: var(--accent); } .chart .k-plan { fill: var(--card); }
.chart .legend { display: flex; gap: 1em; flex-wrap: wrap; font-size: .85em; margin: .3em 0; }
.chart .swatch { display: inline-block; width: .8em; height: .8em; border-radius: 2px; margin-right: .3em; }
.chart .legend .k-approved { background: var(--approve); } .chart .legend .k-denied { background: var(--deny); }
.chart .legend .k-timeout { background: var(--card); } .chart .legend .k-cancelled { background: var(--muted); }
.chart .legend .k-pending, .chart .legend .k-count, .chart .legend .k-prompt, .chart .legend .k-swarm
  { background: var(--accent); }
.chart .legend .k-completion { background: var(--approve); } .chart .legend .k-plan { background: var(--card); }
.chart details { font-size: .85em; }
.chart .empty { color: var(--muted); }
"""

_KEY = re.compile(r"[^a-z0-9_-]+")


def _num(value: float) -> str:
    """A coordinate: two decimals at most, no trailing zeros (stable text for tests and diffs)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _key(name: str) -> str:
    return _KEY.sub("-", name.lower()) or "x"


@dataclass(frozen=True)
class Series:
    """One stacked part of every bar: its key (``k-<key>`` colours it) and the label the legend shows."""

    key: str
    label: str


@dataclass(frozen=True)
class Bar:
    """One column or bar: its label, its values per series key, and optionally the moment it stands for."""

    label: str
    values: Mapping[str, float]
    at: datetime | None = None

    def total(self, series: Sequence[Series]) -> float:
        return sum(max(0.0, float(self.values.get(s.key, 0))) for s in series)


@dataclass(frozen=True)
class Chart:
    """What one chart shows; ``unit`` names the quantity (``approvals``, ``tokens``)."""

    id: str
    title: str
    summary: str
    series: Sequence[Series]
    bars: Sequence[Bar]
    unit: str = ""
    value_format: str = "{:,.0f}"
    notes: Sequence[str] = field(default_factory=tuple)

    @property
    def peak(self) -> float:
        return max((b.total(self.series) for b in self.bars), default=0.0)

    def value(self, value: float) -> str:
        return self.value_format.format(value)


def _legend(chart: Chart) -> str:
    if len(chart.series) < 2:
        return ""
    items = "".join(f'<span><span class="swatch k-{_key(s.key)}"></span>{e(s.label)}</span>' for s in chart.series)
    return f'<div class="legend" aria-hidden="true">{items}</div>'


def _table(chart: Chart) -> str:
    """The same numbers as text: one row per bar, one column per series, and the total."""
    head = "".join(f"<th>{e(s.label)}</th>" for s in chart.series)
    total_head = "<th>total</th>" if len(chart.series) > 1 else ""
    rows = []
    for bar in chart.bars:
        label = when_html(bar.at) if bar.at is not None else e(bar.label)
        cells = "".join(f"<td>{e(chart.value(float(bar.values.get(s.key, 0))))}</td>" for s in chart.series)
        total = f"<td>{e(chart.value(bar.total(chart.series)))}</td>" if len(chart.series) > 1 else ""
        rows.append(f"<tr><th>{label}</th>{cells}{total}</tr>")
    return (
        f"<details><summary>The numbers</summary><table><tr><th></th>{head}{total_head}</tr>"
        f"{''.join(rows)}</table></details>"
    )


def _frame(chart: Chart, width: float, height: float, drawing: str) -> str:
    title_id, desc_id = f"{chart.id}-title", f"{chart.id}-desc"
    notes = "".join(f'<p class="meta">{e(n)}</p>' for n in chart.notes)
    return (
        f'<figure class="chart" id="{e(chart.id)}"><h3>{e(chart.title)}</h3>{_legend(chart)}'
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_num(width)} {_num(height)}" role="img"'
        f' aria-labelledby="{e(title_id)} {e(desc_id)}">'
        f'<title id="{e(title_id)}">{e(chart.title)}</title><desc id="{e(desc_id)}">{e(chart.summary)}</desc>'
        f"{drawing}</svg>{notes}{_table(chart)}</figure>"
    )


def _empty(chart: Chart) -> str:
    return (
        f'<figure class="chart" id="{e(chart.id)}"><h3>{e(chart.title)}</h3>'
        f'<p class="empty">{e(chart.summary)}</p></figure>'
    )


def columns(chart: Chart, *, axis_labels: Mapping[int, str] | None = None) -> str:
    """Vertical columns left to right (time runs rightwards), each stacked by series from the bottom.

    ``axis_labels`` puts text under some columns (by index): e.g. "24 h ago" … "now".
    """
    peak = chart.peak
    if not chart.bars or peak <= 0:
        return _empty(chart)
    slot = WIDTH / len(chart.bars)
    width = max(1.0, slot * 0.8)
    parts = [f'<line class="axis" x1="0" y1="{PLOT_HEIGHT}" x2="{WIDTH}" y2="{PLOT_HEIGHT}"/>']
    for i, bar in enumerate(chart.bars):
        x = i * slot + (slot - width) / 2
        bottom = float(PLOT_HEIGHT)
        for s in chart.series:
            value = max(0.0, float(bar.values.get(s.key, 0)))
            if value <= 0:
                continue
            height = value / peak * PLOT_HEIGHT
            bottom -= height
            parts.append(
                f'<rect class="k-{_key(s.key)}" data-series="{e(s.key)}" data-value="{e(chart.value(value))}"'
                f' x="{_num(x)}" y="{_num(bottom)}" width="{_num(width)}" height="{_num(height)}">'
                f"<title>{e(bar.label)}: {e(chart.value(value))} {e(s.label)}</title></rect>"
            )
    for i, text in (axis_labels or {}).items():
        anchor = "start" if i == 0 else "end" if i == len(chart.bars) - 1 else "middle"
        x = i * slot + (0 if anchor == "start" else slot if anchor == "end" else slot / 2)
        parts.append(f'<text x="{_num(x)}" y="{PLOT_HEIGHT + 13}" text-anchor="{anchor}">{e(text)}</text>')
    parts.append(f'<text x="0" y="10">{e(chart.value(peak))} {e(chart.unit)}</text>')
    return _frame(chart, WIDTH, PLOT_HEIGHT + AXIS, "".join(parts))


def bars(chart: Chart) -> str:
    """Horizontal bars, one per category (top to bottom), stacked by series from the left; the total at the end."""
    peak = chart.peak
    if not chart.bars or peak <= 0:
        return _empty(chart)
    room = WIDTH - LABEL_WIDTH - 40  # the bar area, with space after it for the total
    parts = []
    for i, bar in enumerate(chart.bars):
        y = i * (BAR_HEIGHT + BAR_GAP)
        parts.append(f'<text x="0" y="{_num(y + BAR_HEIGHT - 4)}">{e(_short(bar.label))}</text>')
        left = float(LABEL_WIDTH)
        for s in chart.series:
            value = max(0.0, float(bar.values.get(s.key, 0)))
            if value <= 0:
                continue
            length = value / peak * room
            parts.append(
                f'<rect class="k-{_key(s.key)}" data-series="{e(s.key)}" data-value="{e(chart.value(value))}"'
                f' x="{_num(left)}" y="{_num(y)}" width="{_num(length)}" height="{BAR_HEIGHT}">'
                f"<title>{e(bar.label)}: {e(chart.value(value))} {e(s.label)}</title></rect>"
            )
            left += length
        total = bar.total(chart.series)
        parts.append(f'<text x="{_num(left + 4)}" y="{_num(y + BAR_HEIGHT - 4)}">{e(chart.value(total))}</text>')
    height = len(chart.bars) * (BAR_HEIGHT + BAR_GAP)
    return _frame(chart, WIDTH, height, "".join(parts))


def _short(label: str, limit: int = 14) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…"
