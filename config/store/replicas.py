"""Who is alive among the replicas sharing one PostgreSQL database, and who leads: asked of the server.

Every replica keeps one lease connection (:class:`~kazma.config.store.leader.LeaderLease`), named
``kazma-lease <replica>`` in ``pg_stat_activity``, whether it leads or follows. The server ends a
session whose replica died (the socket closes) or fell silent (``idle_session_timeout`` on that
session), so the set of those names *is* the set of live replicas, with no heartbeat table to keep.
The leader is the session holding the lease's advisory lock in ``pg_locks``.
"""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool

from kazma.config.store.leader import LeaderLease

_LIVE = (
    "SELECT DISTINCT substr(application_name, %s) FROM pg_stat_activity"
    " WHERE datname = current_database() AND starts_with(application_name, %s)"
)
_HOLDER = (
    "SELECT substr(a.application_name, %s), a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.database = (SELECT oid FROM pg_database"
    " WHERE datname = current_database()) AND l.classid::bigint = %s AND l.objid::bigint = %s AND l.objsubid = 1"
)
PREFIX = LeaderLease.APPLICATION_PREFIX


async def live_replicas(pool: AsyncConnectionPool[Any]) -> set[str]:
    """The replicas with a lease session open on this database now."""
    async with pool.connection() as conn:
        cursor = await conn.execute(_LIVE, (len(PREFIX) + 1, PREFIX))
        return {str(row[0]) for row in await cursor.fetchall()}


# Whether this database takes writes: a standby promoted away from (the DSN names a hot standby after a failover)
# or default_transaction_read_only answers every read and refuses every decision.
_READ_ONLY = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"


async def read_only(pool: AsyncConnectionPool[Any]) -> bool:
    """Whether a connection of ``pool`` refuses writes (a standby, or a read-only default)."""
    async with pool.connection() as conn:
        cursor = await conn.execute(_READ_ONLY)
        row = await cursor.fetchone()
        return bool(row and row[0])


async def lease_holder(pool: AsyncConnectionPool[Any], key: int) -> str | None:
    """The replica whose session holds the advisory lock ``key`` (a lease's), or None."""
    held = await lease_session(pool, key)
    return None if held is None else held[0]


async def lease_session(pool: AsyncConnectionPool[Any], key: int) -> tuple[str, int] | None:
    """The replica whose session holds the advisory lock ``key``, and that session's server process id (a new
    session, even the same replica's, has another: what it recorded on an earlier one is told apart), or None."""
    async with pool.connection() as conn:
        cursor = await conn.execute(_HOLDER, (len(PREFIX) + 1, (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF))
        row = await cursor.fetchone()
        return None if row is None else (str(row[0]), int(row[1]))
