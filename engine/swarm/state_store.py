"""What the swarm remembers beyond tasks: breaker states, per-worker numbers per day, and retries asked once.

Breakers are saved on every state change and restored at start, so a worker that
was resting before a restart is still resting after it. Worker numbers are one
row per worker and UTC day, added to with each call; SQL that ports to PostgreSQL.

A ``/swarm retry`` of a task that may have done part of its work runs only when asked twice within
:data:`~kazma.engine.swarm.commands.CONFIRM_WINDOW`. The first ask is kept here, not in one process: with
replicas, the second ask may reach another one (a Slack event, the console, `kazma swarm` in a terminal),
which before asked again, and a third ask ran it wherever it landed on the first one's record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kazma.config.store.backend import StoreConnection, Tx, tables_of
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
    ),
    Migration(
        "swarm_state",
        2,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_retry_asks (
                actor TEXT NOT NULL,
                task_id TEXT NOT NULL,
                asked_at REAL NOT NULL,
                PRIMARY KEY (actor, task_id)
            )
            """,
        ),
    ),
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
    ),
    PgMigration(
        "swarm_state",
        2,
        (
            """
            CREATE TABLE IF NOT EXISTS swarm_retry_asks (
                actor text NOT NULL,
                task_id text NOT NULL,
                asked_at double precision NOT NULL,
                PRIMARY KEY (actor, task_id)
            )
            """,
        ),
    ),
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

    async def asked_again(self, actor: str, task_id: str, window: float) -> bool:
        """Whether ``actor`` asked to retry ``task_id`` before, within ``window`` seconds: then that ask is used up
        and this one confirms it. Otherwise this ask is kept (the next within the window confirms it).

        One transaction; the used-up ask is deleted, so of two replicas hearing the second ask at once, one
        confirms (the other's delete finds nothing, after the first one's commit, and keeps a new ask)."""
        now = self.clock()

        def ask(tx: Tx) -> bool:
            if tx.run(
                "DELETE FROM swarm_retry_asks WHERE actor = ? AND task_id = ? AND asked_at >= ?",
                (actor, task_id, now - window),
            ):
                return True
            tx.run(
                "INSERT INTO swarm_retry_asks (actor, task_id, asked_at) VALUES (?, ?, ?)"
                " ON CONFLICT (actor, task_id) DO UPDATE SET asked_at = excluded.asked_at",
                (actor, task_id, now),
            )
            # asks nobody confirmed are dropped here, so the table holds at most what the window saw
            tx.run("DELETE FROM swarm_retry_asks WHERE asked_at < ?", (now - window,))
            return False

        writer = await self.tables.writer()
        return await writer.submit(ask)
