"""Idempotency keys of the approvals API: a retried ``POST /api/v1/approvals`` gets the request it already made.

One small table, its own migration component, written through the store's one access helper.
"""

from __future__ import annotations

import time
from typing import Final

from kazma.config.database import Migration
from kazma.config.pg_schema import PgMigration
from kazma.config.store_backend import StoreConnection, tables_of

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
    )
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
    )
]


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

    async def keep(self, token_name: str, key: str, body_hash: str, request_id: str) -> bool:
        """Remember ``key`` -> ``request_id``; False when the key was taken meanwhile."""
        changed = await self.tables.run(
            "INSERT INTO api_idempotency (token_name, idem_key, body_hash, request_id, created_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (token_name, key, body_hash, request_id, time.time()),
        )
        return changed == 1
