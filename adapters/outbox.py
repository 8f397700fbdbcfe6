"""Durable card posts: one outbox row per (request, platform), retried until done, resumed at start.

Edits need no rows of their own: a card recorded in ``approval_cards`` whose
request has an outcome but no ``settled_at`` *is* the pending edit, so a crash
between a decision and its edits leaves exactly the work still to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiosqlite

from kazma.config.database import Migration, Tables

MIGRATIONS = [
    Migration(
        "outbox",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS card_outbox (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                request_id TEXT NOT NULL,
                platform TEXT NOT NULL,
                created_at REAL NOT NULL,
                attempts INTEGER NOT NULL DEFAULT 0,
                next_at REAL NOT NULL,
                done_at REAL,
                outcome TEXT,
                last_error TEXT,
                UNIQUE (request_id, platform)
            )
            """,
            "CREATE INDEX IF NOT EXISTS card_outbox_due ON card_outbox (platform, done_at, next_at)",
        ),
    )
]


@dataclass(frozen=True)
class PostJob:
    id: int
    request_id: str
    platform: str
    attempts: int


class Outbox:
    def __init__(self, conn: aiosqlite.Connection, *, clock: Callable[[], float] = time.time) -> None:
        self.conn = conn
        self.clock = clock
        self.tables = Tables.of(conn)

    async def _write(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """Through the store's group-committing writer (see :mod:`kazma.config.writer`)."""
        writer = await self.tables.writer()
        await writer.submit(lambda tx: tx.run_many(sql, rows))

    async def enqueue(self, request_id: str, platforms: list[str]) -> None:
        now = self.clock()
        await self._write(
            "INSERT INTO card_outbox (request_id, platform, created_at, next_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(request_id, platform, now, now) for platform in platforms],
        )

    async def due(self, platform: str, limit: int = 20) -> list[PostJob]:
        rows = await self.tables.all(
            "SELECT id, request_id, platform, attempts FROM card_outbox"
            " WHERE platform = ? AND done_at IS NULL AND next_at <= ? ORDER BY id LIMIT ?",
            (platform, self.clock(), limit),
        )
        return [PostJob(int(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]

    async def next_due_at(self, platform: str) -> float | None:
        row = await self.tables.one(
            "SELECT MIN(next_at) FROM card_outbox WHERE platform = ? AND done_at IS NULL", (platform,)
        )
        return None if row is None or row[0] is None else float(row[0])

    async def started(self, job: PostJob) -> None:
        """A post is about to be attempted: counted first, so a crash mid-post leaves a trace of it."""
        await self._write("UPDATE card_outbox SET attempts = attempts + 1 WHERE id = ?", [(job.id,)])

    async def done(self, job: PostJob, outcome: str, error: str | None = None) -> None:
        await self._write(
            "UPDATE card_outbox SET done_at = ?, outcome = ?, last_error = ? WHERE id = ?",
            [(self.clock(), outcome, error, job.id)],
        )

    async def retry_later(self, job: PostJob, delay: float, error: str) -> None:
        await self._write(
            "UPDATE card_outbox SET next_at = ?, last_error = ? WHERE id = ?",
            [(self.clock() + delay, error, job.id)],
        )

    async def pending(self) -> list[tuple[str, str, int, str | None]]:
        """(request, platform, attempts, last error) of every unfinished post, for doctor and tests."""
        rows = await self.tables.all(
            "SELECT request_id, platform, attempts, last_error FROM card_outbox WHERE done_at IS NULL ORDER BY id"
        )
        return [(str(r[0]), str(r[1]), int(r[2]), r[3]) for r in rows]
