"""Who is alive among the replicas sharing one PostgreSQL database, and who leads: asked of the server.

Every replica keeps one lease connection (:class:`~kazma.config.store.leader.LeaderLease`), named
``kazma-lease <replica>`` in ``pg_stat_activity``, whether it leads or follows. The server ends a
session whose replica died (the socket closes) or fell silent (``idle_session_timeout`` on that
session), so the set of those names *is* the set of live replicas, with no heartbeat table to keep.
The leader is the session holding the lease's advisory lock in ``pg_locks``.
"""

from __future__ import annotations

from typing import Any

import psycopg
import structlog
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
log = structlog.get_logger("kazma.store")


async def live_replicas(pool: AsyncConnectionPool[Any]) -> set[str]:
    """The replicas with a lease session open on this database now."""
    async with pool.connection() as conn:
        cursor = await conn.execute(_LIVE, (len(PREFIX) + 1, PREFIX))
        return {str(row[0]) for row in await cursor.fetchall()}


# Whether this database takes writes: a standby promoted away from (the DSN names a hot standby after a failover)
# or default_transaction_read_only answers every read and refuses every decision. pg_is_in_recovery() is asked of
# the server now; transaction_read_only is the session's, which took the database's and role's
# default_transaction_read_only when it opened and keeps it (ALTER DATABASE ... SET/RESET reach new sessions only).
_READ_ONLY = "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'"


async def _refuses(conn: psycopg.AsyncConnection[Any]) -> tuple[bool, bool]:
    """Whether the server is a standby, and whether ``conn``'s session refuses writes."""
    cursor = await conn.execute(_READ_ONLY)
    row = await cursor.fetchone()
    return (bool(row[0]), bool(row[1])) if row else (False, False)


async def read_only(
    pool: AsyncConnectionPool[Any], conninfo: str, *, writer_refused: bool = False, connect_timeout: float = 10.0
) -> bool:
    """Whether the database refuses writes now: a standby, or a read-only default that a session opened now takes.

    A pool session that opened while ``default_transaction_read_only`` was on refuses writes for its life: after
    the operator's RESET, /healthz landing on it said "refusing writes" (503) while every write was taken. Its
    answer, and the writer's refusal (``writer_refused``: the writer dropped that session, its next one opens
    now), are checked on a session of ``conninfo`` opened for the question. A pool session found stale so, the
    pool's sessions are renewed: a write through ``PgTables.transaction()`` takes a pool session too. A session
    that cannot be opened for the question (a server at max_connections, one that does not answer within
    ``connect_timeout``) leaves the answer to the sessions at hand."""
    async with pool.connection() as conn:
        standby, session_refuses = await _refuses(conn)
    if standby:
        return True
    if not (session_refuses or writer_refused):
        return False
    name = f"{pool.name}-check"
    try:
        # Bounded as the writer's opens are: psycopg's own default waited 130 s for a server that took the TCP
        # connection and never answered, and held a write through PgTables.transaction() as long.
        fresh = await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, application_name=name, connect_timeout=max(1, int(connect_timeout))
        )
    except psycopg.OperationalError as exc:
        # One more session than the pool's: a full server refuses it ("too many clients"), and /healthz said
        # "unreachable", a write failed on it, while the sessions at hand answered. Their answer stands, as
        # before this question was asked; the pool is not drained on a server that may not give its slots back.
        log.warning("store.read_only_check_failed", backend="postgresql", pool=pool.name, error=str(exc).strip())
        return True
    async with fresh:
        standby, refuses = await _refuses(fresh)
    if session_refuses and not (standby or refuses):
        log.info("store.read_only_sessions_renewed", backend="postgresql", pool=pool.name)
        await pool.drain()
    return standby or refuses


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
