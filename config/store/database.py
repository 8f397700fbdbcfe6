"""The embedded SQLite store: opening it safely and applying additive migrations.

Every layer that keeps state (approvals, the outbox, tasks) owns its own
migrations and hands them to :func:`open_database`; the algorithm that applies
them once, in order, even when two processes start together, is
:mod:`kazma.config.store.migrations`, shared with PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import aiosqlite
import structlog

from kazma.config.store.errors import is_busy
from kazma.config.store.migrations import Migration as Migration  # where the components import it from
from kazma.config.store.migrations import MigrationError as MigrationError
from kazma.config.store.migrations import run_migrations
from kazma.config.store.writer import StoreWriter

log = structlog.get_logger("kazma.store")

_SCHEMA_TABLE = """
CREATE TABLE IF NOT EXISTS kazma_schema (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at REAL NOT NULL,
    PRIMARY KEY (component, version)
)
"""


async def connect(path: Path | str, *, busy_timeout_ms: int = 5000) -> aiosqlite.Connection:
    """Open ``path`` with WAL, ``busy_timeout`` and ``synchronous=FULL``; autocommit mode."""
    target = Path(path)
    if str(target) != ":memory:":
        target.parent.mkdir(parents=True, exist_ok=True)
    opening = aiosqlite.connect(str(target), isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        conn = await opening
    except BaseException:
        await _worker_stopped(opening)
        raise
    try:
        # busy_timeout first: switching to WAL takes a lock another process may hold.
        await conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        await _switch_to_wal(conn, busy_timeout_ms / 1000)
        await conn.execute("PRAGMA synchronous = FULL")
        await conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        await conn.close()
        raise
    return conn


async def _worker_stopped(conn: aiosqlite.Connection) -> None:
    """Wait, with the loop running, for the worker thread of a connection that failed to open to end.

    aiosqlite stops that thread without waiting for it: a command that then ended (its one line said, the loop
    closed by asyncio.run) left the thread answering a closed loop, a RuntimeError traceback after the clean line.
    """
    # 0.22 keeps the thread apart (a private attribute); before, the connection was the thread
    worker = getattr(conn, "_thread", conn)
    if isinstance(worker, threading.Thread) and worker.ident is not None:
        await asyncio.to_thread(worker.join, 10)


async def _switch_to_wal(conn: aiosqlite.Connection, patience: float) -> None:
    """Two processes creating the same file race for this switch, and SQLite answers the
    loser "database is locked" at once instead of waiting: retry within ``patience``."""
    deadline = time.monotonic() + max(patience, 0.5)
    while True:
        try:
            async with conn.execute("PRAGMA journal_mode = WAL") as cursor:
                row = await cursor.fetchone()
            if row is not None and str(row[0]).lower() == "wal":
                return
            raise sqlite3.OperationalError(f"journal_mode stayed {row[0] if row else 'unknown'!r}, expected 'wal'")
        except sqlite3.OperationalError as exc:
            if not is_busy(exc) or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.02)


class _SqliteMigrations:
    """Migrations on one SQLite connection: ``BEGIN IMMEDIATE`` makes them exclusive between processes."""

    name = "sqlite"

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        await self.conn.execute(_SCHEMA_TABLE)
        async with transaction(self.conn):
            yield

    async def execute(self, sql: str, params: Sequence[object] = ()) -> None:
        await self.conn.execute(sql, tuple(params))

    async def fetch(self, sql: str) -> list[Sequence[Any]]:
        cursor = await self.conn.execute(sql)
        return list(await cursor.fetchall())


async def apply_migrations(conn: aiosqlite.Connection, migrations: Iterable[Migration]) -> list[Migration]:
    """Apply every migration not yet recorded; return the ones applied now."""
    return await run_migrations(_SqliteMigrations(conn), migrations)


async def open_database(
    path: Path | str, *, busy_timeout_ms: int = 5000, migrations: Iterable[Migration] = ()
) -> aiosqlite.Connection:
    conn = await connect(path, busy_timeout_ms=busy_timeout_ms)
    try:
        await apply_migrations(conn, migrations)
    except BaseException:
        await conn.close()
        raise
    return conn


@asynccontextmanager
async def transaction(conn: aiosqlite.Connection) -> AsyncIterator[aiosqlite.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``: takes the write lock up front so two writers queue, not deadlock."""
    await conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        await conn.execute("ROLLBACK")
        raise
    await conn.execute("COMMIT")


async def schema_versions(conn: aiosqlite.Connection) -> dict[str, int]:
    cursor = await conn.execute("SELECT component, MAX(version) FROM kazma_schema GROUP BY component")
    return {str(row[0]): int(row[1]) for row in await cursor.fetchall()}


class Statements:
    """Statements on one connection, run by whoever already holds its :class:`Tables` lock."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn

    # Reads run and finish in the connection's thread in one call: a cursor left open by a caller
    # cancelled mid-read would pin an old snapshot, and this connection would stop seeing the
    # writer's commits.
    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        rows = await self.all(sql, params)
        return rows[0] if rows else None

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        try:
            return list(await self.conn.execute_fetchall(sql, tuple(params)))
        except BaseException as exc:
            _release_cursor(exc)
            raise

    async def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement; the number of rows it changed."""
        cursor = await self.conn.execute(sql, tuple(params))
        changed = cursor.rowcount
        await cursor.close()
        return int(changed)

    async def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        await self.conn.executemany(sql, [tuple(row) for row in rows])


def _release_cursor(exc: BaseException) -> None:
    """Let go of the cursor of a read that failed part way (a row SQLite could not hand back, a disk error).

    aiosqlite's fetch runs in the connection's thread, and its cursor stays referenced from the exception's
    traceback, which outlives the read (the failed future keeps it): its statement was never reset, so the
    connection kept its read snapshot open, and every later read on it saw the store as it was before the
    failure, the writer's commits never. Clearing the finished frames drops the cursor, which resets it. (Frames
    still running, this one's and the connection thread's, are left as they are.)"""
    traceback.clear_frames(exc.__traceback__)


class Tables:
    """A component's access to its tables: every store in Kazma reads and writes through one of these.

    Every statement — reads included — runs under one asyncio lock per
    connection: a read cursor still open on a shared connection pins an old WAL
    snapshot, and a later ``BEGIN IMMEDIATE`` on it then fails with SQLITE_BUSY
    without waiting. A transaction holds the lock for its whole body.
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[aiosqlite.Connection, Tables]] = weakref.WeakKeyDictionary()

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn
        self._lock = asyncio.Lock()
        self._statements = Statements(conn)
        self._writer: StoreWriter | None = None

    def use_writer(self, writer: StoreWriter) -> None:
        """Group this connection's writes with others': one writer per store file is the point."""
        self._writer = writer

    async def writer(self) -> StoreWriter:
        """The group-committing writer for this connection's file (one is made on first use), as patient with
        another process's lock as this connection is (its ``busy_timeout``, which :func:`connect` set from the
        store's ``busy_timeout_ms``: the writer made here waited its own default of 5 s whatever that was)."""
        if self._writer is None:
            rows = await self.all("PRAGMA database_list")
            path = next((str(row[2]) for row in rows if row[1] == "main"), "")
            busy = await self.one("PRAGMA busy_timeout")
            if self._writer is None:  # another caller may have made it while this one read the path
                self._writer = StoreWriter(path or ":memory:", busy_timeout_ms=int(busy[0]))
        return self._writer

    @classmethod
    def of(cls, conn: aiosqlite.Connection) -> Tables:
        """The one ``Tables`` of ``conn``: two stores sharing a connection must share its lock too."""
        tables = cls._shared.get(conn)
        if tables is None:
            tables = cls._shared[conn] = cls(conn)
        return tables

    # A read waits for the writes this process submitted before it: whoever wrote and then reads, or
    # reads what another task just wrote, sees it — as when both went through one connection.
    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        if self._writer is not None:
            await self._writer.caught_up()
        async with self._lock:
            return await self._statements.one(sql, params)

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        if self._writer is not None:
            await self._writer.caught_up()
        async with self._lock:
            return await self._statements.all(sql, params)

    async def run(self, sql: str, params: Iterable[Any] = ()) -> int:
        """One statement in its own transaction; the number of rows it changed. With a writer attached
        (:meth:`use_writer`) it rides in the file's next group commit."""
        if self._writer is not None:
            values = tuple(params)
            return await self._writer.submit(lambda tx: tx.run(sql, values))
        async with self._lock:
            return await self._statements.run(sql, params)

    async def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        """The statement once per row, all in one transaction (one commit): another connection's rows never come
        between them. Without a writer each row was its own transaction (the connection is in autocommit)."""
        if self._writer is not None:
            values = [tuple(row) for row in rows]
            await self._writer.submit(lambda tx: tx.run_many(sql, values))
            return
        async with self.transaction() as statements:
            await statements.run_many(sql, rows)

    @asynccontextmanager
    async def locked(self) -> AsyncIterator[Statements]:
        """Several statements with nobody else's in between, outside a transaction (reads)."""
        async with self._lock:
            yield self._statements

    async def _begin(self) -> None:
        """``BEGIN IMMEDIATE`` that a cancellation cannot leave half done.

        The statement runs in the connection's thread: a caller cancelled while it waits has left, but the
        BEGIN still runs, and the connection would stay inside a transaction nobody ends (every later
        transaction on it then fails). So the wait is shielded, and a cancelled caller ends what it began.
        """
        begin = asyncio.ensure_future(self.conn.execute("BEGIN IMMEDIATE"))
        try:
            await asyncio.shield(begin)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await begin
                if self.conn.in_transaction:
                    await self.conn.execute("ROLLBACK")
            raise

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Statements]:
        """``BEGIN IMMEDIATE`` … ``COMMIT``; rolled back on any failure, a failed ``COMMIT`` included."""
        async with self._lock:
            await self._begin()
            try:
                yield self._statements
                await self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    try:
                        await self.conn.execute("ROLLBACK")
                    except Exception as exc:  # the original error matters more than a failed rollback
                        log.warning("store.rollback_failed", error=f"{type(exc).__name__}: {exc}")
                raise
