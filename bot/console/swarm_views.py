"""Swarm pieces of the console dashboard: a task's handoff chains, its steps, and the per-worker numbers per day.

Kept apart from :mod:`kazma.bot.console.pages` so the dashboard's layout and these
swarm views can change independently. Everything shown is escaped: worker notes
and reasons are model output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kazma.adapters.web.render import e
from kazma.engine.swarm.call_records import CallRecord
from kazma.engine.swarm.patterns import handoff_paths
from kazma.engine.swarm.state_store import WorkerDay
from kazma.engine.swarm.store import TaskRecord
from kazma.engine.types import tools_line


def handoffs_of(task: TaskRecord) -> list[dict[str, Any]]:
    details = (task.result or {}).get("details") or {}
    chain = details.get("handoffs") if isinstance(details, dict) else None
    return [h for h in chain if isinstance(h, dict)] if isinstance(chain, list) else []


def handoff_chain(task: TaskRecord) -> str:
    """``a → b → a`` with each handoff's reason on hover and below; empty when the task had no handoff."""
    chain = handoffs_of(task)
    if not chain:
        return ""
    paths = "; ".join(" → ".join(e(n) for n in path) for path in handoff_paths(chain))
    reasons = "".join(
        f"<li>{e(h.get('from', '?'))} → {e(h.get('to', '?'))}: {e(h.get('reason', ''))}</li>" for h in chain
    )
    return f'<div class="handoffs"><span class="chain">handoffs: {paths}</span><ul>{reasons}</ul></div>'


def call_rows(calls: Sequence[CallRecord]) -> str:
    """A task's worker calls, one row each: step, worker, model, tools (with approvals), time, tokens, cost, end."""
    if not calls:
        return ""
    rows = "".join(
        f"<tr><td>{c.seq}</td><td>{e(c.step)}</td><td>{e(c.worker)}</td><td>{e(c.model or '-')}</td>"
        f"<td>{e(tools_line(c.tools))}</td><td>{'' if c.seconds is None else f'{c.seconds:.1f} s'}</td>"
        f"<td>{c.prompt_tokens} + {c.completion_tokens}</td><td>{'' if c.cost is None else f'{c.cost:.4f}'}</td>"
        f"<td>{'running' if c.ok is None else 'ok' if c.ok else e(c.error)}</td></tr>"
        for c in calls
    )
    return (
        f'<details class="calls"><summary>{len(calls)} step{"s" * (len(calls) != 1)}</summary><table>'
        "<tr><th>#</th><th>step</th><th>worker</th><th>model</th><th>tools</th><th>took</th><th>tokens</th>"
        f"<th>cost</th><th>ended</th></tr>{rows}</table></details>"
    )


def worker_numbers(rows: Sequence[WorkerDay]) -> str:
    """Per worker and UTC day: completed, failed, mean latency, tokens and cost."""
    if not rows:
        return "<h2>Workers per day</h2><p>no worker calls recorded yet</p>"
    body = "".join(
        f"<tr><td>{e(r.day)}</td><td>{e(r.worker)}</td><td>{r.completed}</td><td>{r.failed}</td>"
        f"<td>{r.mean_latency:.1f} s</td><td>{r.prompt_tokens} + {r.completion_tokens}</td><td>{r.cost:.4f}</td></tr>"
        for r in rows
    )
    return (
        "<h2>Workers per day</h2><table><tr><th>day (UTC)</th><th>worker</th><th>completed</th><th>failed</th>"
        f"<th>mean latency</th><th>tokens</th><th>cost</th></tr>{body}</table>"
    )
