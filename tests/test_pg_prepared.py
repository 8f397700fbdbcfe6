"""Statements a component registers as prepared (kazma.config.store.pg_schema.prepared) go as EXECUTE in a group
sent as one string, with the same values; when the prepared statement is gone from the session, the group is still
committed (the thread runs it as itself) and the connection's prepared statements are not used again."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest

from kazma.config.store import pg_schema
from kazma.config.store.backend import Tx
from kazma.config.store.group_commit import Unasking
from kazma.config.store.postgres import PgWriter
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

INSERT = "INSERT INTO prepared_t (id, note) VALUES (?, ?)"


@pytest.fixture
def registered() -> Iterator[str]:
    pg_schema.prepared("kazma_test_insert", INSERT, ("integer", "text"))
    try:
        yield INSERT
    finally:
        del pg_schema.PREPARED[INSERT]


def inserts(value: int, note: str) -> Callable[[Tx], int]:
    def op(tx: Tx) -> int:
        tx.send(INSERT, (value, note))
        return value

    return op


def sends(sql: str) -> Callable[[Tx], None]:
    def op(tx: Tx) -> None:
        tx.send(sql)

    return op


def last_query(dsn: str, pid: int | None) -> str:
    with psycopg.connect(dsn, autocommit=True) as admin:
        found = admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert found is not None
    return str(found[0])


def rows(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as admin:
        return [(r[0], r[1]) for r in admin.execute("SELECT id, note FROM prepared_t ORDER BY id").fetchall()]


async def test_a_registered_statement_goes_as_execute_with_the_same_values(pg_dsn: str, registered: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE prepared_t (id integer PRIMARY KEY, note text)")
    writer = PgWriter(pg_dsn)
    try:
        assert await writer.submit(Unasking(inserts(1, "first"))) == 1  # opens the connection (and prepares)
        assert await writer.submit(Unasking(inserts(2, "it's; -- not SQL"))) == 2
        assert "EXECUTE kazma_test_insert(2, 'it''s; -- not SQL')" in last_query(pg_dsn, writer.backend_pid)
    finally:
        await writer.close()
    assert writer.batched == 2
    assert writer.pipeline_retries == 0
    assert rows(pg_dsn) == [(1, "first"), (2, "it's; -- not SQL")]


async def test_a_prepared_statement_gone_from_the_session_costs_one_retry_and_then_goes_as_itself(
    pg_dsn: str, registered: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE prepared_t (id integer PRIMARY KEY, note text)")
    writer = PgWriter(pg_dsn)
    try:
        await writer.submit(Unasking(inserts(1, "a")))
        await writer.submit(Unasking(sends("DEALLOCATE kazma_test_insert")))  # on the writer's own session
        assert await writer.submit(Unasking(inserts(2, "b"))) == 2  # EXECUTE fails: run again as itself
        assert writer.pipeline_retries == 1
        assert await writer.submit(Unasking(inserts(3, "c"))) == 3
        assert "INSERT INTO prepared_t" in last_query(pg_dsn, writer.backend_pid)
    finally:
        await writer.close()
    assert writer.pipeline_retries == 1  # the connection's prepared statements were given up after the first
    assert rows(pg_dsn) == [(1, "a"), (2, "b"), (3, "c")]
