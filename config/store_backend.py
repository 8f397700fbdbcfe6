"""What a store component needs from its backend: reads, and a writer of operations (SQLite or PostgreSQL).

A component (the approvals store, the card outbox) reads with ``one``/``all``
and writes with ``await (await backend.writer()).submit(op)``, where ``op`` is
a small synchronous function of a :class:`Tx`. On SQLite the backend is the
connection's :class:`~kazma.config.database.Tables` and its
:class:`~kazma.config.writer.StoreWriter`; on PostgreSQL it is a
:class:`~kazma.config.postgres.PgStore`. SQL is written once, with ``?``
placeholders, in the dialect both engines share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import aiosqlite

from kazma.config.database import Tables

T = TypeVar("T")


class Tx(Protocol):
    """Statements inside the writer's transaction (see :class:`kazma.config.writer.Tx`)."""

    def one(self, sql: str, params: Iterable[Any] = ()) -> Any: ...

    def all(self, sql: str, params: Iterable[Any] = ()) -> list[Any]: ...

    def run(self, sql: str, params: Iterable[Any] = ()) -> int: ...

    def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None: ...

    def notify(self, channel: str, payload: str = "") -> None:
        """Tell every other replica once the transaction commits (a no-op where there are none)."""
        ...


class Writer(Protocol):
    async def submit(self, op: Callable[[Tx], T]) -> T:
        """Run ``op`` in the next group commit; its result once that commit is durable."""
        ...

    async def caught_up(self) -> None:
        """Return once every write submitted so far is answered."""
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
