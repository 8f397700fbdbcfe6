"""The dashboard's four charts, from one :class:`~kazma.bot.console.dashboard_data.DashboardData` snapshot."""

from __future__ import annotations

from collections.abc import Sequence

from kazma.bot.console.charts import Bar, Chart, Series, bars, columns
from kazma.bot.console.dashboard_data import (
    OUTCOMES,
    PRESS_EDGES,
    DashboardData,
    Latencies,
    percentile,
    tokens_per_worker,
)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def approvals_chart(data: DashboardData) -> str:
    series = [Series(key, label) for key, label in OUTCOMES]
    # tooltips cannot hold a <time> the script localises: they say how long ago; the table gives the hours
    last = len(data.hours) - 1
    columns_ = [
        Bar("this hour" if i == last else f"the hour {last - i} h before this one", h.counts, at=h.start)
        for i, h in enumerate(data.hours)
    ]
    totals = {key: sum(h.counts.get(key, 0) for h in data.hours) for key, _ in OUTCOMES}
    decided = sum(totals.values())
    summary = (
        f"{decided} approval requests got an outcome in the last 24 hours: "
        + ", ".join(f"{totals[key]} {label}" for key, label in OUTCOMES)
        + ". One column per hour, oldest on the left."
        if decided
        else "No approval request got an outcome in the last 24 hours."
    )
    chart = Chart("chart-approvals", "Approvals per hour by outcome", summary, series, columns_, unit="per hour")
    return columns(chart, axis_labels={0: "24 h ago", last // 2: "12 h ago", last: "now"} if columns_ else None)


def latency_chart(data: DashboardData) -> str:
    press = data.press or Latencies(PRESS_EDGES, (0,) * len(PRESS_EDGES))
    p50, p95 = press.percentile(50), press.percentile(95)
    summary = (
        f"{press.total} presses decided since Kazma started; from a press reaching Kazma to its decision being "
        f"stored: median at most {edge_label(p50)}, 95th percentile at most {edge_label(p95)}."
        if p50 is not None and p95 is not None
        else "No press has been decided since Kazma started."
    )
    notes = [f"Calls waited for a person (opened → deciding press, 24 h): {wait_summary(data.waits)}."]
    lower = (0.0, *press.edges[:-1])
    chart = Chart(
        "chart-latency",
        "Press → decision latency",
        summary,
        [Series("count", "presses")],
        [
            Bar(f"≤ {edge_label(edge)}" if edge != float("inf") else f"> {edge_label(low)}", {"count": n})
            for low, edge, n in zip(lower, press.edges, press.counts, strict=True)
        ],
        unit="presses",
        notes=notes if data.waits else (),
    )
    return bars(chart)


def edge_label(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:g} s"


def wait_summary(waits: Sequence[float]) -> str:
    median, p95 = duration(percentile(waits, 50)), duration(percentile(waits, 95))
    return f"{len(waits)} decisions, median {median}, 95th percentile {p95}"


def tasks_chart(data: DashboardData) -> str:
    statuses = [
        s for s in dict.fromkeys([*data.counts, *data.plan_steps]) if data.counts.get(s) or data.plan_steps.get(s)
    ]
    swarm, steps = sum(data.counts.values()), sum(data.plan_steps.values())
    summary = (
        f"{swarm} swarm tasks and {steps} plan steps: "
        + ", ".join(f"{s} {data.counts.get(s, 0)} + {data.plan_steps.get(s, 0)}" for s in statuses)
        + " (swarm + plan)."
        if statuses
        else "No swarm task or plan step yet."
    )
    chart = Chart(
        "chart-tasks",
        "Tasks by status",
        summary,
        [Series("swarm", "swarm tasks"), Series("plan", "plan steps")],
        [Bar(s, {"swarm": data.counts.get(s, 0), "plan": data.plan_steps.get(s, 0)}) for s in statuses],
        unit="tasks",
    )
    return bars(chart)


def tokens_chart(data: DashboardData) -> str:
    rows = tokens_per_worker(data.worker_days)
    summary = (
        "Tokens used by each worker in the last 7 days (prompt + completion): "
        + ", ".join(f"{w} {p:,} + {c:,}" for w, p, c in rows)
        + "."
        if rows
        else "No worker call recorded in the last 7 days."
    )
    chart = Chart(
        "chart-tokens",
        "Tokens per worker (7 days)",
        summary,
        [Series("prompt", "prompt"), Series("completion", "completion")],
        [Bar(w, {"prompt": p, "completion": c}) for w, p, c in rows],
        unit="tokens",
    )
    return bars(chart)


def charts_html(data: DashboardData) -> str:
    return (
        f'<div class="charts">{approvals_chart(data)}{latency_chart(data)}{tasks_chart(data)}{tokens_chart(data)}</div>'
    )
