"""The dashboard's SVG charts: lengths proportional to the data, a text equivalent for each, labels escaped."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime

from prometheus_client import Histogram

from kazma.bot.console.charts import Bar, Chart, Series, bars, columns
from kazma.bot.console.dashboard_charts import approvals_chart, charts_html, latency_chart, tasks_chart, tokens_chart
from kazma.bot.console.dashboard_data import (
    HOUR,
    PRESS_EDGES,
    DashboardData,
    Latencies,
    bucket_hours,
    latencies_of,
    percentile,
    tokens_per_worker,
)
from kazma.engine.swarm.state_store import WorkerDay

SVG = "{http://www.w3.org/2000/svg}"
OUTCOMES = [Series("approved", "approved"), Series("denied", "denied")]


def svg_of(figure: str) -> ET.Element:
    found = re.search(r"<svg .*</svg>", figure, flags=re.DOTALL)
    assert found is not None, figure
    return ET.fromstring(found.group(0))  # noqa: S314 - our own output; well-formed XML, or this raises


def rects(figure: str) -> list[dict[str, str]]:
    return [dict(r.attrib) for r in svg_of(figure).iter(f"{SVG}rect")]


def test_columns_are_stacked_and_proportional_to_the_largest_total() -> None:
    chart = Chart(
        "c",
        "Approvals",
        "three hours",
        OUTCOMES,
        [Bar("h0", {"approved": 2, "denied": 1}), Bar("h1", {}), Bar("h2", {"approved": 3})],
    )
    drawn = rects(columns(chart))
    assert [(r["data-series"], float(r["height"])) for r in drawn] == [
        ("approved", 80.0),  # 2 of the peak 3, on a 120-unit plot
        ("denied", 40.0),
        ("approved", 120.0),
    ]
    # stacked from the bottom (y grows downwards): approved 40..120, denied 0..40 on top of it
    assert [float(r["y"]) for r in drawn] == [40.0, 0.0, 0.0]
    assert [r["class"] for r in drawn] == ["k-approved", "k-denied", "k-approved"]
    assert float(drawn[0]["x"]) < float(drawn[2]["x"])  # time runs rightwards


def test_bars_are_stacked_left_to_right_and_proportional() -> None:
    chart = Chart(
        "t",
        "Tokens",
        "two workers",
        [Series("prompt", "prompt"), Series("completion", "completion")],
        [Bar("a", {"prompt": 10, "completion": 30}), Bar("b", {"prompt": 20})],
    )
    drawn = rects(bars(chart))
    widths = [float(r["width"]) for r in drawn]
    assert widths == [47.5, 142.5, 95.0]  # the bar area is 190 units; the peak (40) fills it
    assert float(drawn[1]["x"]) == float(drawn[0]["x"]) + 47.5  # completion starts where prompt ends
    assert len({r["y"] for r in drawn}) == 2  # one row per worker


def test_every_chart_has_a_title_a_description_and_a_table_of_the_same_numbers() -> None:
    figure = columns(
        Chart("c", "Approvals per hour", "2 approved, 1 denied", OUTCOMES, [Bar("h", {"approved": 2, "denied": 1})])
    )
    svg = svg_of(figure)
    assert svg.get("role") == "img"
    assert svg.get("aria-labelledby") == "c-title c-desc"
    assert svg.findtext(f"{SVG}title") == "Approvals per hour"
    assert svg.findtext(f"{SVG}desc") == "2 approved, 1 denied"
    assert "<tr><th>h</th><td>2</td><td>1</td><td>3</td></tr>" in figure
    # colours come from classes the page's CSS fills from its variables (dark mode included): no colour literals
    assert "fill=" not in figure
    assert "style=" not in figure


def test_no_data_draws_no_bars_and_says_so() -> None:
    for draw in (columns, bars):
        figure = draw(
            Chart("e", "Nothing", "No approval was decided.", OUTCOMES, [Bar("h", {}), Bar("i", {"approved": 0})])
        )
        assert "<svg" not in figure
        assert '<p class="empty">No approval was decided.</p>' in figure
        assert draw(Chart("e", "Nothing", "none", OUTCOMES, [])).count("<svg") == 0


def test_labels_and_titles_are_escaped() -> None:
    evil = '<script>alert(1)</script>&"'
    figure = bars(Chart("x", f"title {evil}", f"desc {evil}", [Series("count", evil)], [Bar(evil, {"count": 1})]))
    assert "<script>" not in figure
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&quot;" in figure
    svg = svg_of(figure)  # still well-formed
    assert svg.findtext(f"{SVG}title") == f"title {evil}"


def test_hours_percentiles_histogram_and_tokens() -> None:
    now = 1_800_000_000.0 + 1234.0
    start = now - now % HOUR
    hours = bucket_hours(
        [("approved", now), ("denied", now - 10), ("approved", start - 1), ("timeout", now - 30 * HOUR)], now
    )
    assert len(hours) == 24
    assert hours[-1].start == datetime.fromtimestamp(start, UTC)
    assert hours[-1].counts == {"approved": 1, "denied": 1}
    assert hours[-2].counts == {"approved": 1}
    assert sum(sum(h.counts.values()) for h in hours) == 3  # the one from 30 h ago is not drawn
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile([float(i) for i in range(1, 101)], 95) == 95
    assert percentile([], 95) == 0.0
    histogram = Histogram("test_press_seconds", "a test", buckets=(0.01, 0.05, 1.0, 10.0), registry=None)
    for seconds in (0.002, 0.003, 0.03, 0.5, 20.0):
        histogram.observe(seconds)
    latencies = latencies_of(histogram, (0.01, 1.0, math.inf))
    assert latencies.counts == (2, 2, 1)  # regrouped from the metric's finer buckets, not cumulative
    assert latencies.total == 5
    assert latencies.percentile(50) == 1.0  # the 3rd of 5 is in the (0.01, 1] bucket
    assert latencies.percentile(95) == math.inf
    assert (
        latencies_of(Histogram("test_none_seconds", "none", buckets=(1.0,), registry=None), (1.0, math.inf)).percentile(
            50
        )
        is None
    )
    days = [WorkerDay("a", "2026-12-01", 1, 0, 1.0, 10, 5, 0.0), WorkerDay("b", "2026-12-01", 1, 0, 1.0, 100, 1, 0.0),
            WorkerDay("a", "2026-11-30", 1, 0, 1.0, 10, 5, 0.0)]  # fmt: skip
    assert tokens_per_worker(days) == [("b", 100, 1), ("a", 20, 10)]


def test_the_dashboard_charts_name_their_numbers() -> None:
    now = 1_800_000_000.0
    data = DashboardData(
        tasks=[],
        worker_lines=[],
        approvals=[],
        counts={"running": 1, "succeeded": 2, "failed": 0},
        worker_days=[WorkerDay("researcher", "2026-12-01", 2, 0, 1.0, 300, 100, 0.0)],
        hours=bucket_hours([("approved", now), ("approved", now), ("denied", now), ("timeout", now)], now),
        waits=[4.0, 20.0, 90.0],
        plan_steps={"done": 3, "in_progress": 1},
        press=Latencies(PRESS_EDGES, (0, 3, 1, 0, 0, 0, 0, 0, 0, 0)),
    )
    assert "4 approval requests got an outcome in the last 24 hours: 2 approved, 1 denied, 1 expired, 0 cancelled" in (
        approvals_chart(data)
    )
    assert len(rects(approvals_chart(data))) == 3  # one column, three outcomes
    latency = latency_chart(data)
    assert "4 presses decided since Kazma started" in latency
    assert "median at most 50 ms, 95th percentile at most 100 ms" in latency
    assert [float(r["width"]) for r in rects(latency)] == [190.0, 63.33]  # 3 and 1 presses: ≤ 50 ms, ≤ 100 ms
    assert (
        "Calls waited for a person (opened → deciding press, 24 h): 3 decisions, median 20 s, 95th percentile 1.5 min"
        in latency
    )
    tasks = tasks_chart(data)
    assert "3 swarm tasks and 4 plan steps" in tasks
    assert [r["data-series"] for r in rects(tasks)] == ["swarm", "swarm", "plan", "plan"]  # failed: 0 + 0, not drawn
    assert "researcher 300 + 100" in tokens_chart(data)
    assert charts_html(data).count('<figure class="chart"') == 4
    empty = charts_html(DashboardData([], [], [], {}))
    assert empty.count('<p class="empty">') == 4
