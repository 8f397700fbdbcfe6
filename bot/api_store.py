"""Idempotency keys and quotas of the approvals API, kept in the store so every replica answers alike.

A retried ``POST /api/v1/approvals`` gets the request it already made: the key's row is written in the
transaction that opens the request (with its card posts and its audit rows), so whichever replica commits
first opened it and every other attempt, from any replica, reads that one. A token's opens take turns on one
row of ``api_token_gate`` (a row lock on PostgreSQL; SQLite has one writer anyway), so the key looked up and
the pending requests counted are what the previous open left, on every backend.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Final

from kazma.approvals.chain import AuditChain
from kazma.config.store.backend import StoreConnection, Tx, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

# A key is kept this long past its request's deadline (deadlines are at most 7 days), then swept.
KEY_GRACE_SECONDS: Final = 24 * 3600
# Rows kept before keys had an end (no expires_at): as if their request had the longest deadline.
_LEGACY_LIFETIME = 7 * 24 * 3600 + KEY_GRACE_SECONDS
# A caller over its quota is told to come back within this, whatever the deadlines say.
MAX_RETRY_AFTER: Final = 60

MIGRATIONS: Final = [
    Migration(
        "api_idempotency",
        1,
        (
            """CREATE TABLE IF NOT EXISTS api_idempotency (
                token_name TEXT NOT NULL,
                idem_key TEXT NOT NULL,
                body_hash TEXT NOT NULL,
                request_id TEXT NOT NULL,
                created_at REAL NOT NULL,
                PRIMARY KEY (token_name, idem_key)
            )""",
        ),
    ),
    # Replays counted on the key (no audit row each); keys end; one row per token where its opens take turns.
    Migration(
        "api_idempotency",
        2,
        (
            "ALTER TABLE api_idempotency ADD COLUMN replays INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE api_idempotency ADD COLUMN expires_at REAL",
            "CREATE INDEX IF NOT EXISTS api_idempotency_expiry ON api_idempotency (expires_at)",
            """CREATE TABLE IF NOT EXISTS api_token_gate (
                token_name TEXT PRIMARY KEY,
                last_open_at REAL NOT NULL
            )""",
        ),
    ),
]

PG_MIGRATIONS: Final = [
    PgMigration(
        "api_idempotency",
        1,
        (
            """CREATE TABLE IF NOT EXISTS api_idempotency (
                token_name text NOT NULL,
                idem_key text NOT NULL,
                body_hash text NOT NULL,
                request_id text NOT NULL,
                created_at double precision NOT NULL,
                PRIMARY KEY (token_name, idem_key)
            )""",
        ),
    ),
    PgMigration(
        "api_idempotency",
        2,
        (
            "ALTER TABLE api_idempotency ADD COLUMN IF NOT EXISTS replays integer NOT NULL DEFAULT 0",
            "ALTER TABLE api_idempotency ADD COLUMN IF NOT EXISTS expires_at double precision",
            "CREATE INDEX IF NOT EXISTS api_idempotency_expiry ON api_idempotency (expires_at)",
            """CREATE TABLE IF NOT EXISTS api_token_gate (
                token_name text PRIMARY KEY,
                last_open_at double precision NOT NULL
            )""",
        ),
    ),
]


class KeyReused(Exception):
    """The Idempotency-Key already opened a request with another body."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"the Idempotency-Key already opened request {request_id} with another body")
        self.request_id = request_id


class QuotaFull(Exception):
    """The token has as many requests pending as it may."""

    def __init__(self, pending: int, retry_after: int) -> None:
        super().__init__(f"{pending} requests pending")
        self.pending = pending
        self.retry_after = retry_after


# The token's requests pending now: how many, and the first deadline among them (when one frees a place).
_PENDING = (
    "SELECT COUNT(*), MIN(deadline) FROM approval_requests"
    " WHERE requested_by = ? AND status = 'pending' AND deadline > ?"
)
# The same beside the row of an Idempotency-Key (the key's columns NULL while it is new).
_KEY_AND_PENDING = (
    "SELECT k.request_id, k.body_hash, q.pending, q.earliest"
    " FROM (SELECT COUNT(*) AS pending, MIN(deadline) AS earliest FROM approval_requests"
    " WHERE requested_by = ? AND status = 'pending' AND deadline > ?) q"
    " LEFT JOIN api_idempotency k ON k.token_name = ? AND k.idem_key = ?"
)


@dataclass(frozen=True)
class ApiOpen:
    """One ``POST /api/v1/approvals`` inside the transaction that opens its request (the approvals service's
    ``OpenGate``): the token's turn, its key, its quota, and its audit row."""

    token: str
    actor: str  # api:<token>: the requester of every request the token opens
    key: str | None
    body_hash: str
    max_pending: int
    expires_at: float  # when the key may be forgotten: its request's deadline and a day
    tool: str
    args_hash: str
    now: float

    def admit(self, tx: Tx, request_id: str) -> str | None:
        # The token's turn: nobody else opens for it until this transaction ends (held from this statement on,
        # whether or not its answer was waited for: the reads below come after it on the same connection).
        tx.send(
            "INSERT INTO api_token_gate (token_name, last_open_at) VALUES (?, ?)"
            " ON CONFLICT (token_name) DO UPDATE SET last_open_at = excluded.last_open_at",
            (self.token, self.now),
        )
        if self.key is None:
            pending, earliest = tx.one(_PENDING, (self.actor, self.now))
        else:
            # The key's row and the quota's count in one statement: one round trip fewer on PostgreSQL, where the
            # writer waits for each answer an open reads.
            known, first_hash, pending, earliest = tx.one(
                _KEY_AND_PENDING, (self.actor, self.now, self.token, self.key)
            )
            if known is not None:
                return self._replay(tx, str(known), str(first_hash))
        if int(pending) >= self.max_pending:
            wait = MAX_RETRY_AFTER if earliest is None else math.ceil(float(earliest) - self.now)
            raise QuotaFull(int(pending), max(1, min(MAX_RETRY_AFTER, wait)))
        if self.key is not None:
            kept = tx.run(
                "INSERT INTO api_idempotency (token_name, idem_key, body_hash, request_id, created_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (self.token, self.key, self.body_hash, request_id, self.now, self.expires_at),
            )
            if kept != 1:  # taken meanwhile (only possible without the turn): the first one stands
                row = tx.one(
                    "SELECT request_id, body_hash FROM api_idempotency WHERE token_name = ? AND idem_key = ?",
                    (self.token, self.key),
                )
                if row is not None:
                    return self._replay(tx, str(row[0]), str(row[1]))
        return None

    def _replay(self, tx: Tx, request_id: str, first_hash: str) -> str:
        """The key opened ``request_id`` before (with a body of hash ``first_hash``): that request stands."""
        if first_hash != self.body_hash:
            raise KeyReused(request_id)
        tx.run(
            "UPDATE api_idempotency SET replays = replays + 1 WHERE token_name = ? AND idem_key = ?",
            (self.token, self.key),
        )
        return request_id

    def opened(self, tx: Tx, request_id: str, audit: AuditChain) -> None:
        audit.append(
            tx, request_id, "api_opened", actor=self.actor, platform="api", at=self.now, args_hash=self.args_hash,
            detail=f"tool={self.tool}",
        )  # fmt: skip


class IdempotencyKeys:
    def __init__(self, conn: StoreConnection) -> None:
        self.tables = tables_of(conn)

    async def find(self, token_name: str, key: str) -> tuple[str, str] | None:
        """(request id, body hash) already made with ``key`` by this token, or None."""
        row = await self.tables.one(
            "SELECT request_id, body_hash FROM api_idempotency WHERE token_name = ? AND idem_key = ?",
            (token_name, key),
        )
        return None if row is None else (str(row[0]), str(row[1]))

    async def replays(self, token_name: str, key: str) -> int | None:
        """How often ``key`` was sent again after it opened its request (None: no such key)."""
        row = await self.tables.one(
            "SELECT replays FROM api_idempotency WHERE token_name = ? AND idem_key = ?", (token_name, key)
        )
        return None if row is None else int(row[0])

    async def keep(
        self, token_name: str, key: str, body_hash: str, request_id: str, *, expires_at: float | None = None
    ) -> bool:
        """Remember ``key`` -> ``request_id``; False when the key was taken meanwhile."""
        now = time.time()
        changed = await self.tables.run(
            "INSERT INTO api_idempotency (token_name, idem_key, body_hash, request_id, created_at, expires_at)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (token_name, key, body_hash, request_id, now, now + _LEGACY_LIFETIME if expires_at is None else expires_at),
        )
        return changed == 1

    async def forget_expired(self, now: float | None = None) -> int:
        """Sweep keys past their lifetime (a day past their request's deadline); how many went."""
        at = time.time() if now is None else now
        return await self.tables.run(
            "DELETE FROM api_idempotency WHERE expires_at < ? OR (expires_at IS NULL AND created_at < ?)",
            (at, at - _LEGACY_LIFETIME),
        )
