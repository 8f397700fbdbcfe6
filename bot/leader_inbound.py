"""The leader's inbound connections as the followers read them: one row per platform, written by the leader.

Among replicas only the leader holds the platforms' inbound connections (Telegram polling, the Discord gateway,
Slack's socket); a follower's ``/healthz`` said "serving" for them whatever became of the leader's. The leader
records each platform's inbound state here when it changes (never per event), with the lease session it holds
(its server process id): a follower trusts a row only while the replica named in it holds the lease on that
same session. A row of a leader that lost the lease, or of an earlier life of a replica of the same name, reads
as unknown, not as open. A row is keyed by its session too: a write of a leader that lost the lease, landing after
the new leader's (it began while the old one still led, and the database was slow), adds rows nobody reads
instead of overwriting the new leader's, which would leave the followers' lines unknown until its next write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from kazma.adapters.bus import INBOUND_NOT_OPEN, InboundState
from kazma.config.store.backend import StoreConnection, tables_of
from kazma.config.store.database import Migration
from kazma.config.store.pg_schema import PgMigration

MIGRATIONS: Final = [
    Migration(
        "leader_inbound",
        1,
        (
            """CREATE TABLE IF NOT EXISTS leader_inbound (
                platform TEXT NOT NULL,
                replica TEXT NOT NULL,
                lease_pid INTEGER NOT NULL,
                state TEXT NOT NULL,
                detail TEXT NOT NULL,
                since REAL NOT NULL,
                PRIMARY KEY (platform, replica, lease_pid)
            )""",
        ),
    ),
    # When the row was last written (wall clock): a new leader inherits the "not open since" of the leadership
    # just before it only, not of one that ended long ago with nobody left to forget its rows (all replicas down).
    Migration("leader_inbound", 2, ("ALTER TABLE leader_inbound ADD COLUMN recorded REAL NOT NULL DEFAULT 0",)),
]

PG_MIGRATIONS: Final = [
    PgMigration(
        "leader_inbound",
        1,
        (
            """CREATE TABLE IF NOT EXISTS leader_inbound (
                platform text NOT NULL,
                replica text NOT NULL,
                lease_pid bigint NOT NULL,
                state text NOT NULL,
                detail text NOT NULL,
                since double precision NOT NULL,
                PRIMARY KEY (platform, replica, lease_pid)
            )""",
        ),
    ),
    PgMigration(
        "leader_inbound",
        2,
        ("ALTER TABLE leader_inbound ADD COLUMN IF NOT EXISTS recorded double precision NOT NULL DEFAULT 0",),
    ),
]

_UPSERT: Final = (
    "INSERT INTO leader_inbound (platform, replica, lease_pid, state, detail, since, recorded)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (platform, replica, lease_pid) DO UPDATE SET state = excluded.state, detail = excluded.detail,"
    " since = excluded.since, recorded = excluded.recorded"
)
# Rows of sessions that ended (PostgreSQL: the leader's store): nobody holds the lease on them any more, and
# none of them can write again. A live session's rows stay, whoever wrote last.
_FORGET_ENDED: Final = "DELETE FROM leader_inbound WHERE lease_pid NOT IN (SELECT pid FROM pg_stat_activity)"


class LeaderInboundRecord:
    def __init__(self, conn: StoreConnection) -> None:
        self.tables = tables_of(conn)

    async def record(self, replica: str, lease_pid: int, states: Mapping[str, InboundState], now: float) -> None:
        """The leader's inbound state of every platform with a singleton ingress, in one transaction."""
        rows = [(p, replica, lease_pid, s.state, s.detail, s.since, now) for p, s in sorted(states.items())]
        await self.tables.run_many(_UPSERT, rows)  # one statement: the rows change together

    async def forget_ended(self) -> int:
        """The rows of lease sessions that ended, dropped (a new leader's first record: one leadership's rows
        each, never read again); PostgreSQL only."""
        return await self.tables.run(_FORGET_ENDED)

    async def read(self, replica: str, lease_pid: int) -> tuple[dict[str, InboundState], bool]:
        """What ``replica`` recorded on the lease session ``lease_pid`` (rows of another session are left out),
        and whether it has recorded anything at all, on any session (a replica of an earlier release never does)."""
        rows = await self.tables.all(
            "SELECT platform, state, detail, since, lease_pid FROM leader_inbound WHERE replica = ?", (replica,)
        )
        states = {
            str(p): InboundState(str(state), str(detail), float(since))
            for p, state, detail, since, pid in rows
            if int(pid) == lease_pid
        }
        return states, bool(rows)

    async def down_before(self, lease_pid: int, recorded_after: float) -> dict[str, float]:
        """Since when each platform's inbound connection was not open, as the leadership before the session
        ``lease_pid`` last recorded it (the latest change among the other sessions' rows, when that was to "not
        open"): read by a new leader before its first record forgets those rows. Only rows written after
        ``recorded_after`` count: rows left by a leadership that ended long before (every replica stopped, none to
        forget them) told a new leader "not open since last week" of a platform nobody had tried since."""
        rows = await self.tables.all(
            "SELECT platform, state, since FROM leader_inbound WHERE lease_pid <> ? AND recorded > ?",
            (lease_pid, recorded_after),
        )
        latest: dict[str, tuple[float, str]] = {}
        for platform, state, since in rows:
            if str(platform) not in latest or float(since) > latest[str(platform)][0]:
                latest[str(platform)] = (float(since), str(state))
        return {p: since for p, (since, state) in latest.items() if state == INBOUND_NOT_OPEN}
