"""Web console sessions, kept in the store: a restart logs nobody out, and any replica serves a logged-in user.

The cookie carries a random session token; the table keeps only its SHA-256 (``token_hash``), so a copy
of the store opens no session. Each row also keeps a *binding*: an HMAC, keyed by the session token, of
what the session was opened with (the digest of a console token, or the proof of a person). It lets a
rotated console token end the sessions made with the old one, without the store holding anything a stolen
copy could test token guesses against. Expired rows are refused and deleted when met, and swept at each login.

Since people sign in (sessions v2), a row also says *who* and *how*: the person, the identity the proof
established (``web:alice`` for a passkey, ``telegram:111`` for a Telegram Mini App), the proof itself, and
the passkey used (revoking a passkey deletes the sessions it opened). A row made before v2 names no proof:
it is ended when met, since only a shared token could have made it.

One table, its own migration component, SQL that runs on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kazma.config.store.backend import StoreConnection, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

MIGRATIONS: Final = [
    Migration(
        "sessions",
        1,
        (
            """CREATE TABLE IF NOT EXISTS web_sessions (
                token_hash TEXT PRIMARY KEY,
                login TEXT NOT NULL,
                role TEXT NOT NULL,
                binding TEXT NOT NULL,
                flash TEXT NOT NULL,
                created_at REAL NOT NULL,
                last_seen REAL NOT NULL,
                expires_at REAL NOT NULL
            )""",
            "CREATE INDEX IF NOT EXISTS web_sessions_expiry ON web_sessions (expires_at)",
        ),
    ),
    Migration(
        "sessions",
        2,
        (
            "ALTER TABLE web_sessions ADD COLUMN proof TEXT",
            "ALTER TABLE web_sessions ADD COLUMN person TEXT",
            "ALTER TABLE web_sessions ADD COLUMN identity TEXT",
            "ALTER TABLE web_sessions ADD COLUMN credential_id TEXT",
            "CREATE INDEX IF NOT EXISTS web_sessions_credential ON web_sessions (credential_id)"
            " WHERE credential_id IS NOT NULL",
        ),
    ),
]

PG_MIGRATIONS: Final = [
    PgMigration(
        "sessions",
        1,
        (
            """CREATE TABLE IF NOT EXISTS web_sessions (
                token_hash text PRIMARY KEY,
                login text NOT NULL,
                role text NOT NULL,
                binding text NOT NULL,
                flash text NOT NULL,
                created_at double precision NOT NULL,
                last_seen double precision NOT NULL,
                expires_at double precision NOT NULL
            )""",
            "CREATE INDEX IF NOT EXISTS web_sessions_expiry ON web_sessions (expires_at)",
        ),
    ),
    PgMigration(
        "sessions",
        2,
        (
            "ALTER TABLE web_sessions ADD COLUMN proof text",
            "ALTER TABLE web_sessions ADD COLUMN person text",
            "ALTER TABLE web_sessions ADD COLUMN identity text",
            "ALTER TABLE web_sessions ADD COLUMN credential_id text",
            "CREATE INDEX IF NOT EXISTS web_sessions_credential ON web_sessions (credential_id)"
            " WHERE credential_id IS NOT NULL",
        ),
    ),
]

MAX_FLASH = 20  # lines kept for the next page; a flood of them is cut, oldest first


@dataclass(frozen=True)
class StoredSession:
    token_hash: str
    login: str
    role: str
    binding: str
    flash: tuple[str, ...]
    created_at: float
    last_seen: float
    expires_at: float
    proof: str | None = None  # how it was opened (see auth.Proof); None: made before people signed in
    person: str | None = None
    identity: str | None = None
    credential_id: str | None = None


@dataclass(frozen=True)
class Opening:
    """Who a new session is for, and how they were proven."""

    login: str
    role: str
    proof: str
    person: str | None = None
    identity: str | None = None
    credential_id: str | None = None


_COLUMNS = (
    "token_hash, login, role, binding, flash, created_at, last_seen, expires_at, proof, person, identity, credential_id"
)


class SessionStore:
    def __init__(self, conn: StoreConnection, *, clock: Callable[[], float] = time.time) -> None:
        self.tables = tables_of(conn)
        self.clock = clock  # epoch seconds: rows outlive the process

    async def open(
        self, token_hash: str, opening: Opening, *, binding: str, lifetime: float, max_sessions: int
    ) -> float:
        """Keep a new session; returns its expiry. Sweeps expired rows and, past ``max_sessions`` of the same
        opener (one shared token, or one proven identity), that opener's sessions closest to expiring.

        Room is made only among the opener's own sessions: a reader-token holder signing in a thousand times
        (every new session expires last) would otherwise push every approver's session out of the table.
        """
        now = self.clock()
        await self.tables.run("DELETE FROM web_sessions WHERE expires_at <= ?", (now,))
        key: tuple[str, ...]
        if opening.identity is None:  # a shared token's: its sessions are those of the same token
            same, key = "proof = ? AND identity IS NULL", (opening.proof,)
        else:
            same, key = "proof = ? AND identity = ?", (opening.proof, opening.identity)
        row = await self.tables.one(f"SELECT COUNT(*) FROM web_sessions WHERE {same}", key)  # noqa: S608
        over = int(row[0]) - max_sessions + 1 if row else 0
        if over > 0:
            await self.tables.run(
                "DELETE FROM web_sessions WHERE token_hash IN"  # noqa: S608
                f" (SELECT token_hash FROM web_sessions WHERE {same} ORDER BY expires_at, created_at LIMIT ?)",
                (*key, over),
            )
        expires = now + lifetime
        await self.tables.run(
            f"INSERT INTO web_sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608
            (token_hash, opening.login, opening.role, binding, "[]", now, now, expires, opening.proof,
             opening.person, opening.identity, opening.credential_id),
        )  # fmt: skip
        return expires

    async def find(self, token_hash: str) -> StoredSession | None:
        """The live session with this hash; an expired one is deleted and not returned."""
        row = await self.tables.one(f"SELECT {_COLUMNS} FROM web_sessions WHERE token_hash = ?", (token_hash,))  # noqa: S608
        if row is None:
            return None
        session = StoredSession(
            str(row[0]), str(row[1]), str(row[2]), str(row[3]), _lines(str(row[4])),
            float(row[5]), float(row[6]), float(row[7]), row[8], row[9], row[10], row[11],
        )  # fmt: skip
        if session.expires_at <= self.clock():
            await self.end(token_hash)
            return None
        return session

    async def seen(self, token_hash: str) -> None:
        await self.tables.run("UPDATE web_sessions SET last_seen = ? WHERE token_hash = ?", (self.clock(), token_hash))

    async def keep_flash(self, token_hash: str, lines: list[str]) -> None:
        await self.tables.run(
            "UPDATE web_sessions SET flash = ? WHERE token_hash = ?", (json.dumps(lines[-MAX_FLASH:]), token_hash)
        )

    async def end(self, token_hash: str) -> bool:
        """Delete the session; False when there was none."""
        return await self.tables.run("DELETE FROM web_sessions WHERE token_hash = ?", (token_hash,)) == 1

    async def end_opened_with(self, credential_ids: list[str]) -> int:
        """Delete every session a passkey among ``credential_ids`` opened (it was revoked); how many."""
        if not credential_ids:
            return 0
        marks = ", ".join("?" * len(credential_ids))
        return await self.tables.run(f"DELETE FROM web_sessions WHERE credential_id IN ({marks})", credential_ids)  # noqa: S608

    async def count(self) -> int:
        row = await self.tables.one("SELECT COUNT(*) FROM web_sessions")
        return int(row[0]) if row else 0


def _lines(text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    return tuple(str(line) for line in value) if isinstance(value, list) else ()
