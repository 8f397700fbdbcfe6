"""What a store component needs from its backend: reads, and a writer of operations (SQLite or PostgreSQL).

A component (the approvals store, the card outbox) reads with ``one``/``all``
and writes with ``await (await backend.writer()).submit(op)``, where ``op`` is
a small synchronous function of a :class:`Tx`. On SQLite the backend is the
connection's :class:`~kazma.config.store.database.Tables` and its
:class:`~kazma.config.store.writer.StoreWriter`; on PostgreSQL it is a
:class:`~kazma.config.store.postgres.PgStore`. SQL is written once, with ``?``
placeholders, in the dialect both engines share.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import aiosqlite

from kazma.config.store.database import Tables

if TYPE_CHECKING:
    from kazma.config.store.postgres import PgStore

T = TypeVar("T")


class Tx(Protocol):
    """Statements inside the writer's transaction (see :class:`kazma.config.store.writer.Tx`)."""

    def one(self, sql: str, params: Iterable[Any] = ()) -> Any: ...

    def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]: ...

    def run(self, sql: str, params: Iterable[Any] = ()) -> int: ...

    def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None: ...

    def send(self, sql: str, params: Iterable[Any] = ()) -> None:
        """One statement whose result nobody reads: on PostgreSQL it goes out without waiting for its answer
        (pipeline mode); an error in it fails the transaction all the same."""
        ...

    def notify(self, channel: str, payload: str = "") -> None:
        """Tell every other replica once the transaction commits (a no-op where there are none)."""
        ...

    def defer(self, flush: Callable[[Any, list[Any]], None], item: Any) -> None:
        """Hand ``item`` to ``flush``, run once with every such item just before the transaction commits
        (see :class:`kazma.config.store.group_commit.Deferred`)."""
        ...

    def after_commit(self, done: Callable[[], None]) -> None:
        """Call ``done`` once the transaction committed (never if it did not)."""
        ...


class Writer(Protocol):
    async def submit(self, op: Callable[[Tx], T], *, ride: float = 0.0, deadline: float | None = None) -> T:
        """Run ``op`` in the next group commit; its result once that commit is durable. ``ride`` > 0: in the next
        group other operations start, or alone after ``ride`` seconds (see :mod:`kazma.config.store.group_commit`).
        ``deadline`` (the loop's time): given up past it, never to commit, while it waits for its group or for another
        connection's lock (PostgreSQL: the transaction under way is cancelled then, its other operations run again)."""
        ...

    def release_riders(self) -> None:
        """Operations submitted to ride go in the next group now."""
        ...

    async def caught_up(self) -> None:
        """Return once every write submitted so far is answered (except one still waiting to ride)."""
        ...

    async def close(self) -> None:
        """Commit what is queued, then stop."""
        ...


class StoreBackend(Protocol):
    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any: ...

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]: ...

    async def writer(self) -> Writer: ...


def backend_of(conn: aiosqlite.Connection | StoreBackend) -> StoreBackend:
    """A SQLite connection's shared :class:`Tables`, or the backend itself."""
    if isinstance(conn, aiosqlite.Connection):
        return Tables.of(conn)
    return conn


# What every store's constructor takes: the SQLite connection, or the PostgreSQL backend.
StoreConnection: TypeAlias = "aiosqlite.Connection | PgStore"


class SqlStatements(Protocol):
    """Statements a store runs: ``?`` placeholders, the SQL both engines share."""

    async def one(self, sql: str, params: Iterable[Any] = ()) -> Any: ...

    async def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]: ...

    async def run(self, sql: str, params: Iterable[Any] = ()) -> int: ...

    async def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None: ...


class StoreTables(SqlStatements, Protocol):
    """What a store needs of its tables: :class:`~kazma.config.store.database.Tables` (SQLite) or
    :class:`~kazma.config.store.pg_tables.PgTables` (PostgreSQL).

    ``run``/``run_many`` are single statements committed on their own (in a group commit when a writer is
    attached); ``transaction()`` runs a body's statements atomically and one body after another;
    ``locked()`` runs several reads with nobody's statements in between.
    """

    def locked(self) -> AbstractAsyncContextManager[SqlStatements]: ...

    def transaction(self) -> AbstractAsyncContextManager[SqlStatements]: ...

    async def writer(self) -> Writer: ...


def is_postgres(conn: StoreConnection) -> bool:
    """``conn`` is the PostgreSQL backend (its SQL may lock rows it reads: ``FOR SHARE``)."""
    return not isinstance(conn, aiosqlite.Connection)


def tables_of(conn: StoreConnection) -> StoreTables:
    """The one shared ``Tables`` of a SQLite connection, or the one ``PgTables`` of a PostgreSQL backend."""
    if isinstance(conn, aiosqlite.Connection):
        return Tables.of(conn)
    from kazma.config.store.pg_tables import PgTables  # psycopg only when PostgreSQL is used

    return PgTables.of(conn)


def held_by_gone(column: str, live: Collection[str] | None) -> tuple[str, tuple[str, ...]]:
    """A condition (and its parameters) for rows whose holder in ``column`` is a process that is gone: every
    held row when ``live`` is empty or None (the only process, restarted), else those held outside ``live``."""
    if not live:
        return f"{column} IS NOT NULL", ()
    names = tuple(live)
    return f"{column} IS NOT NULL AND {column} NOT IN ({', '.join('?' * len(names))})", names


async def database_identity(backend: object) -> str:
    """Which database ``backend`` (a SQLite connection or its ``Tables``, a ``PgStore`` or its ``PgTables``)
    writes to: two stores with the same identity can write in one transaction of either's writer."""
    if isinstance(backend, aiosqlite.Connection):
        backend = Tables.of(backend)
    if isinstance(backend, Tables):
        rows = await backend.all("PRAGMA database_list")
        path = next((str(row[2]) for row in rows if row[1] == "main"), "")
        return f"sqlite:{path}" if path else f"sqlite-memory:{id(backend.conn)}"
    store = getattr(backend, "store", backend)  # PgTables -> PgStore
    conninfo = getattr(store, "conninfo", None)
    return f"postgresql:{conninfo}" if conninfo is not None else f"other:{id(store)}"
