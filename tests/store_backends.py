"""Store-level tests on both engines: a SQLite file, or a fresh database on the suite's PostgreSQL server.

``store_engine`` (a parametrised fixture) names the engine and where its data lives; :func:`open_store`
opens what the stores take (an ``aiosqlite.Connection`` or a ``PgStore``) with every component's
migrations, and :func:`raw_rows` reads around the stores, through a connection of its own, so a test sees
only what was committed.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kazma.bot.store import all_migrations, pg_migrations
from kazma.config.store.backend import StoreConnection
from kazma.config.store.database import Migration, open_database
from kazma.config.store.postgres import PgStore, open_pg_store, pyformat
from tests.pg_support import find_bindir

NO_SERVER = "PostgreSQL server binaries (initdb, pg_ctl, postgres) are not installed: run scripts/install-test-deps"


@dataclass(frozen=True)
class Engine:
    name: str  # "sqlite" | "postgresql"
    where: str  # a SQLite file's path, or a PostgreSQL DSN

    @property
    def postgres(self) -> bool:
        return self.name == "postgresql"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        yield Engine("sqlite", str(tmp_path / "k.db"))
        return
    if find_bindir() is None:
        pytest.skip(NO_SERVER)
    yield Engine("postgresql", str(request.getfixturevalue("pg_dsn")))


@asynccontextmanager
async def open_store(
    engine: Engine,
    *,
    migrations: Iterable[Migration] | None = None,
    busy_timeout_ms: int = 5000,
    application_name: str = "kazma-test",
) -> AsyncIterator[StoreConnection]:
    """What the stores take, migrated (every component unless ``migrations`` says otherwise); closed after."""
    if engine.postgres:
        chosen = pg_migrations() if migrations is None else list(migrations)
        store = await open_pg_store(engine.where, migrations=chosen, application_name=application_name)
        try:
            yield store
        finally:
            await store.close()
        return
    conn = await open_database(
        engine.where, busy_timeout_ms=busy_timeout_ms, migrations=all_migrations() if migrations is None else migrations
    )
    try:
        yield conn
    finally:
        await conn.close()


@asynccontextmanager
async def replica_store(dsn: str, name: str) -> AsyncIterator[PgStore]:
    """One replica's connection to a shared PostgreSQL store, migrated, its ``application_name`` naming it (``kazma
    NAME``, as in pg_stat_activity); closed after. The tests that stage two replicas' views of one store use it."""
    store = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"kazma {name}")
    try:
        yield store
    finally:
        await store.close()


def raw_rows(engine: Engine, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
    """Rows read through a connection of their own: only what is committed is there."""
    if engine.postgres:
        with psycopg.connect(engine.where, autocommit=True) as conn:
            return [tuple(row) for row in conn.execute(pyformat(sql), tuple(params)).fetchall()]
    raw = sqlite3.connect(engine.where)
    try:
        return [tuple(row) for row in raw.execute(sql, tuple(params)).fetchall()]
    finally:
        raw.close()


async def rename_table(engine: Engine, old: str, new: str) -> None:
    """Rename a table on the store itself, through a connection of its own: a store's real error for whatever
    reads or writes it meanwhile ("no such table", "relation does not exist"); renamed back, all is as it was.

    Off the event loop: a live Kazma in this process may hold a lock on the store across loop turns, and a
    blocking rename on the loop would wait for an end that cannot come ("database is locked", or for ever)."""
    await asyncio.to_thread(_rename_table_now, engine, f"ALTER TABLE {old} RENAME TO {new}")


def _rename_table_now(engine: Engine, sql: str) -> None:
    if engine.postgres:
        with psycopg.connect(engine.where, autocommit=True) as pg:
            pg.execute(sql.encode())  # two table names the test chose, no input
        return
    lite = sqlite3.connect(engine.where)
    try:
        lite.execute(sql)
        lite.commit()
    finally:
        lite.close()
