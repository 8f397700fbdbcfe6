"""One migrations algorithm on both engines: the same migrations give the same record, and a failure the same
nothing, whether the store is a SQLite file or a PostgreSQL database."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest

from kazma.config.store.database import apply_migrations, connect
from kazma.config.store.migrations import Migration, MigrationError
from kazma.config.store.postgres import apply_pg_migrations
from tests.store_backends import Engine, raw_rows

# A literal '%' and '?' in a statement: a migration is sent as written, never read for placeholders.
NOTES_V1 = Migration(
    "notes",
    1,
    ("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL CHECK (body NOT LIKE '%?%'))",),
)
NOTES_V2 = Migration("notes", 2, ("ALTER TABLE notes ADD COLUMN author TEXT",))
TAGS_V1 = Migration("tags", 1, ("CREATE TABLE IF NOT EXISTS tags (name TEXT PRIMARY KEY)",))
BROKEN_V3 = Migration("notes", 3, ("ALTER TABLE missing_table ADD COLUMN x TEXT",))


async def _apply(engine: Engine, migrations: list[Migration]) -> list[Migration]:
    if engine.postgres:
        return await apply_pg_migrations(engine.where, migrations)
    conn = await connect(engine.where)
    try:
        return await apply_migrations(conn, migrations)
    finally:
        await conn.close()


def _write(engine: Engine, sql: str) -> None:
    if engine.postgres:
        with psycopg.connect(engine.where, autocommit=True) as conn:
            conn.execute(sql)
        return
    with sqlite3.connect(engine.where) as raw:  # commits on leaving
        raw.execute(sql)
    raw.close()


def _recorded(engine: Engine) -> list[tuple[str, int]]:
    return [(str(c), int(v)) for c, v in raw_rows(engine, "SELECT component, version FROM kazma_schema ORDER BY 1, 2")]


async def test_each_migration_is_applied_once_in_order_and_recorded(store_engine: Engine) -> None:
    assert await _apply(store_engine, [NOTES_V1, TAGS_V1]) == [NOTES_V1, TAGS_V1]
    _write(store_engine, "INSERT INTO notes (id, body) VALUES (1, 'kept')")
    assert await _apply(store_engine, [NOTES_V1, NOTES_V2, TAGS_V1]) == [NOTES_V2]
    assert await _apply(store_engine, [NOTES_V1, NOTES_V2, TAGS_V1]) == []
    assert _recorded(store_engine) == [("notes", 1), ("notes", 2), ("tags", 1)]
    assert raw_rows(store_engine, "SELECT body, author FROM notes") == [("kept", None)]


async def test_a_failed_migration_leaves_nothing_of_its_run(store_engine: Engine) -> None:
    await _apply(store_engine, [NOTES_V1])
    with pytest.raises(Exception, match="missing_table"):
        await _apply(store_engine, [NOTES_V1, NOTES_V2, TAGS_V1, BROKEN_V3])
    # NOTES_V2 and TAGS_V1 ran before the failure in the same transaction: neither stays, nor its record
    assert _recorded(store_engine) == [("notes", 1)]
    assert await _apply(store_engine, [NOTES_V1, NOTES_V2, TAGS_V1]) == [NOTES_V2, TAGS_V1]


async def test_versions_out_of_order_are_refused_before_anything_runs(store_engine: Engine) -> None:
    with pytest.raises(MigrationError, match="ascending"):
        await _apply(store_engine, [NOTES_V2, NOTES_V1])
    assert await _apply(store_engine, [NOTES_V1]) == [NOTES_V1]
