"""What the dashboard shows, read in one go, and the numbers its charts draw.

Everything is read through the stores' public methods, plus small read-only queries of its own over
``tables_of(conn)`` (approvals per hour by outcome, time to decide, plan steps by status). They are plain SQL
that ports to PostgreSQL (no SQLite functions: hours are bucketed here, in Python) and they never write.

Press → decision latency is not in the approvals audit: the compare-and-set runs at the press, so a request's
``decided_at`` (its ``decided`` audit row) is the one time stored. Kazma measures it where it happens, in the
``kazma_press_to_decision_seconds`` histogram (a press reaching Kazma → its decision stored, every platform's
buttons and the console's own); the chart reads that histogram, so it covers this process since it started.
How long calls waited for a person (opened → the deciding press) comes from the store and covers 24 hours.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import Histogram

from kazma.approvals.model import ApprovalRequest
from kazma.approvals.rules import Rule, RuleState
from kazma.config.metrics import PRESS_TO_DECISION
from kazma.config.store.backend import StoreConnection, tables_of
from kazma.engine.swarm.call_records import CallRecord
from kazma.engine.swarm.state_store import WorkerDay
from kazma.engine.swarm.store import TaskRecord

HOURS = 24
HOUR = 3600.0
# The outcomes a chart of decisions shows, in stacking order, with the word people read.
OUTCOMES = (("approved", "approved"), ("denied", "denied"), ("timeout", "expired"), ("cancelled", "cancelled"))
# Press → decision buckets drawn: edges of the metric's own buckets, so regrouping its counts is exact.
PRESS_EDGES = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, math.inf)


@dataclass(frozen=True)
class Latencies:
    """A latency histogram: how many observations fell at or under each edge (not cumulative), and the total."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)

    def percentile(self, q: float) -> float | None:
        """The edge of the bucket holding the ``q``-th percentile (an upper bound); None without observations."""
        if not self.total:
            return None
        rank, seen = max(1, math.ceil(q / 100.0 * self.total)), 0
        for edge, count in zip(self.edges, self.counts, strict=True):
            seen += count
            if seen >= rank:
                return edge
        return self.edges[-1]


def latencies_of(histogram: Histogram, edges: tuple[float, ...] = PRESS_EDGES) -> Latencies:
    """A Prometheus histogram's observations, regrouped under ``edges`` (each must be one of its bucket bounds)."""
    cumulative: dict[float, float] = {}
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                cumulative[float(sample.labels["le"])] = sample.value
    below = [int(cumulative.get(edge, 0)) for edge in edges]
    return Latencies(edges, tuple(b - a for a, b in zip([0, *below[:-1]], below, strict=True)))


def press_latencies() -> Latencies:
    return latencies_of(PRESS_TO_DECISION)


@dataclass(frozen=True)
class HourOutcomes:
    start: datetime  # the hour's first second, UTC
    counts: dict[str, int]


@dataclass(frozen=True)
class DashboardData:
    """One snapshot: shared by every open dashboard, rendered per viewer (forms carry each session's token)."""

    tasks: Sequence[TaskRecord]
    worker_lines: Sequence[str]
    approvals: Sequence[ApprovalRequest]
    counts: dict[str, int]
    worker_days: Sequence[WorkerDay] = ()
    rules: Sequence[tuple[Rule, RuleState]] = ()  # rows in force, each as it stands (approvals.rules)
    hours: Sequence[HourOutcomes] = ()
    waits: Sequence[float] = ()  # seconds from open to the deciding press, human decisions of the last 24 h
    plan_steps: dict[str, int] = field(default_factory=dict)
    calls: Mapping[str, Sequence[CallRecord]] = field(default_factory=dict)  # each task's worker calls, in order
    press: Latencies | None = None  # press → decision stored, this process since it started
    taken_at: float = 0.0
    version: int = 0  # the change feed's version this snapshot reflects (the page hands it to the event stream)


def hour_start(at: float) -> float:
    return math.floor(at / HOUR) * HOUR


def bucket_hours(rows: Sequence[tuple[str, float]], now: float, hours: int = HOURS) -> list[HourOutcomes]:
    """``(status, decided_at)`` rows into the last ``hours`` hours (the current one last), counts per outcome."""
    first = hour_start(now) - (hours - 1) * HOUR
    counts: defaultdict[int, Counter[str]] = defaultdict(Counter)
    for status, at in rows:
        slot = int((hour_start(at) - first) // HOUR)
        if 0 <= slot < hours:
            counts[slot][status] += 1
    return [HourOutcomes(datetime.fromtimestamp(first + i * HOUR, UTC), dict(counts[i])) for i in range(hours)]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..100) of ``values``; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def tokens_per_worker(days: Sequence[WorkerDay]) -> list[tuple[str, int, int]]:
    """``(worker, prompt, completion)`` summed over the days given, most tokens first."""
    prompt: Counter[str] = Counter()
    completion: Counter[str] = Counter()
    for day in days:
        prompt[day.worker] += day.prompt_tokens
        completion[day.worker] += day.completion_tokens
    workers = sorted(set(prompt) | set(completion), key=lambda w: (-(prompt[w] + completion[w]), w))
    return [(w, prompt[w], completion[w]) for w in workers]


class DashboardQueries:
    """The dashboard's own read queries (read-only; through ``tables_of``, like every store, on either engine)."""

    def __init__(self, conn: StoreConnection, *, clock: Callable[[], float] = time.time) -> None:
        self.tables = tables_of(conn)
        self.clock = clock

    async def decisions_since(self, since: float) -> list[tuple[str, float]]:
        """``(status, decided_at)`` of every request that got an outcome since ``since``."""
        rows = await self.tables.all(
            "SELECT status, decided_at FROM approval_requests WHERE decided_at IS NOT NULL AND decided_at >= ?",
            (since,),
        )
        return [(str(r[0]), float(r[1])) for r in rows]

    async def waits_since(self, since: float) -> list[float]:
        """Seconds from open to the deciding press, for each human decision (approved or denied) since ``since``."""
        rows = await self.tables.all(
            "SELECT decided_at - created_at FROM approval_requests"
            " WHERE status IN ('approved', 'denied') AND decided_at >= ?",
            (since,),
        )
        return [max(0.0, float(r[0])) for r in rows]

    async def plan_steps(self) -> dict[str, int]:
        rows = await self.tables.all("SELECT status, COUNT(*) FROM plan_steps GROUP BY status")
        return {str(r[0]): int(r[1]) for r in rows}

    async def charts(self) -> tuple[list[HourOutcomes], list[float], dict[str, int]]:
        now = self.clock()
        since = hour_start(now) - (HOURS - 1) * HOUR
        hours = bucket_hours(await self.decisions_since(since), now)
        return hours, await self.waits_since(now - HOURS * HOUR), await self.plan_steps()
