"""``Tables`` on PostgreSQL: the access every store other than approvals and the outbox reads and writes through.

The same methods as :class:`kazma.config.store.database.Tables`, with the same meaning:

- ``one``/``all`` read on the pool, after the writes this process submitted before them (as
  :meth:`PgStore.one <kazma.config.store.postgres.PgStore.one>` does), so whoever wrote and then reads sees it;
- ``run``/``run_many`` go through the shared :class:`~kazma.config.store.postgres.PgWriter`, in the same group
  commits as every other component's writes;
- ``transaction()`` is several statements on one pooled connection between ``BEGIN`` and ``COMMIT``
  (rolled back on any error). SQLite's ``BEGIN IMMEDIATE`` makes such bodies run one after another,
  and the stores count on it (a capacity check and its insert, a read of step states and the delete
  that depends on them). Here a transaction-level advisory lock, taken first, gives the same order
  across every process and replica on the database; single-statement writes do not take it, exactly as
  on SQLite, where they are atomic on their own.
- ``locked()`` is several reads that see one snapshot (a read-only ``REPEATABLE READ`` transaction).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import psycopg
import structlog

from kazma.config.store.postgres import PgStore, PgWriter, pyformat
from kazma.config.store.replicas import read_only

log = structlog.get_logger("kazma.store")

# The advisory lock every ``transaction()`` body holds: "kazma", 2 (1 is the migration lock).
TRANSACTION_LOCK = 0x6B617A6D61_0002


class PgStatements:
    """Statements on one pooled connection, inside the transaction its :class:`PgTables` opened."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn

    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        cursor = await self.conn.execute(pyformat(sql), tuple(params))
        return await cursor.fetchone()

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        cursor = await self.conn.execute(pyformat(sql), tuple(params))
        return list(await cursor.fetchall())

    async def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement; the number of rows it changed."""
        cursor = await self.conn.execute(pyformat(sql), tuple(params))
        return int(cursor.rowcount)

    async def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        values = [tuple(row) for row in rows]
        if values:  # psycopg refuses an empty executemany with nothing to prepare; SQLite does nothing
            async with self.conn.cursor() as cursor:
                await cursor.executemany(pyformat(sql), values)


class PgTables:
    """A component's access to its tables on PostgreSQL; get it with :func:`kazma.config.store.backend.tables_of`."""

    _shared: ClassVar[weakref.WeakKeyDictionary[PgStore, PgTables]] = weakref.WeakKeyDictionary()

    def __init__(self, store: PgStore, *, lock_key: int = TRANSACTION_LOCK) -> None:
        self.store = store
        self.lock_key = lock_key

    @classmethod
    def of(cls, store: PgStore) -> PgTables:
        """The one ``PgTables`` of ``store`` (stores sharing a backend share it, as on SQLite)."""
        tables = cls._shared.get(store)
        if tables is None:
            tables = cls._shared[store] = cls(store)
        return tables

    async def writer(self) -> PgWriter:
        return await self.store.writer()

    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        return await self.store.one(sql, params)

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        return await self.store.all(sql, params)

    async def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement in the writer's next group commit; the number of rows it changed."""
        values = tuple(params)
        writer = await self.store.writer()
        return await writer.submit(lambda tx: tx.run(sql, values))

    async def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        values = [tuple(row) for row in rows]
        if not values:
            return
        writer = await self.store.writer()
        await writer.submit(lambda tx: tx.run_many(sql, values))

    @asynccontextmanager
    async def locked(self) -> AsyncIterator[PgStatements]:
        """Several reads of one snapshot, after this process's submitted writes."""
        await (await self.store.writer()).caught_up()
        async with self.store.pool.connection() as conn:
            await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                yield PgStatements(conn)
            finally:
                await _rollback(conn)  # it read only: ending it either way keeps nothing

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[PgStatements]:
        """``BEGIN`` … ``COMMIT`` under the transaction lock; rolled back on any failure, a failed COMMIT included."""
        await (await self.store.writer()).caught_up()
        async with self._session_for_writes() as conn:
            await conn.execute("BEGIN")
            try:
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.lock_key,))
                yield PgStatements(conn)
            except BaseException:
                await _rollback(conn)
                raise
            await conn.execute("COMMIT")

    @asynccontextmanager
    async def _session_for_writes(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pool session to write on. One that opened while the database's ``default_transaction_read_only`` was on
        keeps it for its life: after the operator's RESET, every write that landed on it was refused, until the
        pool replaced it (an hour later) or /healthz happened to. The server reports the session's setting with
        every change (PostgreSQL 14 and later), so this costs no round trip while the session takes writes."""
        async with self.store.pool.connection() as conn:
            if conn.info.parameter_status("default_transaction_read_only") != "on":
                yield conn
                return
        # Asked of a session opened now: the pool's sessions are renewed when the database takes writes again.
        await read_only(self.store.pool, self.store.conninfo, connect_timeout=self.store.connect_timeout)
        async with self.store.pool.connection() as conn:
            yield conn


async def _rollback(conn: psycopg.AsyncConnection[Any]) -> None:
    """End the transaction on ``conn``, unless the connection is gone (the pool then discards it)."""
    if conn.closed or conn.broken:
        return
    try:
        await conn.execute("ROLLBACK")
    except psycopg.Error as exc:  # the original error matters more; the pool discards a connection left unclean
        log.warning("store.rollback_failed", backend="postgresql", error=f"{type(exc).__name__}: {exc}")
