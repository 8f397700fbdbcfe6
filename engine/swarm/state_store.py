"""What the swarm remembers beyond tasks: breaker states and per-worker numbers per day.

Breakers are saved on every state change and restored at start, so a worker that
was resting before a restart is still resting after it. Worker numbers are one
row per worker and UTC day, added to with each call; SQL that ports to PostgreSQL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kazma.config.store.backend import StoreConnection, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

MIGRATIONS = [
    Migration(
        "swarm_state",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_breakers (
                worker TEXT PRIMARY KEY,
                state TEXT NOT NULL,
                failures INTEGER NOT NULL,
                retry_at REAL NOT NULL,
                updated_at REAL NOT NULL
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS swarm_worker_days (
                worker TEXT NOT NULL,
                day TEXT NOT NULL,
                completed INTEGER NOT NULL DEFAULT 0,
                failed INTEGER NOT NULL DEFAULT 0,
                latency_seconds REAL NOT NULL DEFAULT 0,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                cost REAL NOT NULL DEFAULT 0,
                PRIMARY KEY (worker, day)
            )
            """,
        ),
    )
]

# The same tables on PostgreSQL (REAL is double precision there: epoch seconds need its 15 digits).
PG_MIGRATIONS = [
    PgMigration(
        "swarm_state",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_breakers (
                worker text PRIMARY KEY,
                state text NOT NULL,
                failures integer NOT NULL,
                retry_at double precision NOT NULL,
                updated_at double precision NOT NULL
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS swarm_worker_days (
                worker text NOT NULL,
                day text NOT NULL,
                completed integer NOT NULL DEFAULT 0,
                failed integer NOT NULL DEFAULT 0,
                latency_seconds double precision NOT NULL DEFAULT 0,
                prompt_tokens bigint NOT NULL DEFAULT 0,
                completion_tokens bigint NOT NULL DEFAULT 0,
                cost double precision NOT NULL DEFAULT 0,
                PRIMARY KEY (worker, day)
            )
            """,
        ),
    )
]


@dataclass(frozen=True)
class SavedBreaker:
    worker: str
    state: str
    failures: int
    retry_at: float  # epoch seconds when an open breaker may probe again


@dataclass(frozen=True)
class WorkerDay:
    worker: str
    day: str  # YYYY-MM-DD, UTC
    completed: int
    failed: int
    latency_seconds: float  # the sum; divide by calls for the mean
    prompt_tokens: int
    completion_tokens: int
    cost: float

    @property
    def calls(self) -> int:
        return self.completed + self.failed

    @property
    def mean_latency(self) -> float:
        return self.latency_seconds / self.calls if self.calls else 0.0


def day_of(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d")


class SwarmStateStore:
    def __init__(self, conn: StoreConnection, *, clock: Callable[[], float] = time.time) -> None:
        self.tables = tables_of(conn)
        self.clock = clock

    async def save_breaker(self, worker: str, state: str, failures: int, retry_in: float) -> None:
        now = self.clock()
        await self.tables.run(
            "INSERT INTO swarm_breakers (worker, state, failures, retry_at, updated_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (worker) DO UPDATE SET state = excluded.state, failures = excluded.failures,"
            " retry_at = excluded.retry_at, updated_at = excluded.updated_at",
            (worker, state, failures, now + retry_in, now),
        )

    async def breakers(self) -> list[SavedBreaker]:
        rows = await self.tables.all("SELECT worker, state, failures, retry_at FROM swarm_breakers ORDER BY worker")
        return [SavedBreaker(str(r[0]), str(r[1]), int(r[2]), float(r[3])) for r in rows]

    async def record_call(
        self, worker: str, *, ok: bool, latency: float, prompt_tokens: int, completion_tokens: int, cost: float
    ) -> None:
        await self.tables.run(
            "INSERT INTO swarm_worker_days"
            " (worker, day, completed, failed, latency_seconds, prompt_tokens, completion_tokens, cost)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (worker, day) DO UPDATE SET completed = swarm_worker_days.completed + excluded.completed,"
            " failed = swarm_worker_days.failed + excluded.failed,"
            " latency_seconds = swarm_worker_days.latency_seconds + excluded.latency_seconds,"
            " prompt_tokens = swarm_worker_days.prompt_tokens + excluded.prompt_tokens,"
            " completion_tokens = swarm_worker_days.completion_tokens + excluded.completion_tokens,"
            " cost = swarm_worker_days.cost + excluded.cost",
            (worker, day_of(self.clock()), int(ok), int(not ok), latency, prompt_tokens, completion_tokens, cost),
        )

    async def worker_days(self, days: int = 7) -> list[WorkerDay]:
        """Rows of the last ``days`` UTC days (today included), newest day first."""
        since = day_of(self.clock() - (days - 1) * 86400.0)
        rows = await self.tables.all(
            "SELECT worker, day, completed, failed, latency_seconds, prompt_tokens, completion_tokens, cost"
            " FROM swarm_worker_days WHERE day >= ? ORDER BY day DESC, worker",
            (since,),
        )
        return [
            WorkerDay(str(r[0]), str(r[1]), int(r[2]), int(r[3]), float(r[4]), int(r[5]), int(r[6]), float(r[7]))
            for r in rows
        ]
