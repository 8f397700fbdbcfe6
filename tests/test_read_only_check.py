"""The session opened to ask whether the database takes writes (``read_only``), on a real PostgreSQL.

A pool session opened while ``default_transaction_read_only`` was on keeps it; ``read_only`` then asks a session
opened now. That session is one more than the pool's, opened where the pool's were: a full server refuses it,
a server that takes TCP and does not answer holds it. The sessions at hand answer then.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from kazma.bot.store import pg_migrations
from kazma.config.store.pg_tables import PgTables
from kazma.config.store.postgres import open_pg_store
from kazma.config.store.replicas import read_only
from tests.pg_support import every_pool_session_opened_now, find_bindir
from tests.store_backends import NO_SERVER
from tests.tcp_proxy import CuttableProxy

# Not a measure of anything: a test that waits this long has hung (psycopg's own connect bound is 130 s).
HANG = 60.0


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    if find_bindir() is None:
        pytest.skip(NO_SERVER)
    return str(request.getfixturevalue("pg_dsn"))


@contextlib.asynccontextmanager
async def _read_only_default(admin: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    database = sql.Identifier(admin.info.dbname)
    await admin.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database))
    try:
        yield
    finally:
        await admin.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))


async def test_a_full_server_refusing_the_check_session_leaves_the_answer_to_the_pool_session(pg_url: str) -> None:
    """The pool holds every session the server gives its role (max_connections, a role's CONNECTION LIMIT): the
    session opened for the question is refused "too many connections", and /healthz said "unreachable" (the
    refusal's text) for a store that answered, a write through PgTables.transaction() failed on it."""
    role = f"kazma_full_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
        await admin.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 1").format(sql.Identifier(role)))
        try:
            limited = make_conninfo(pg_url, user=role)
            pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                limited, min_size=1, max_size=1, kwargs={"autocommit": True}, name="kazma-full", open=False
            )
            async with _read_only_default(admin):
                await pool.open(wait=True, timeout=HANG)
            try:
                with capture_logs() as logs:
                    assert await read_only(pool, limited) is True
                failed = [e for e in logs if e["event"] == "store.read_only_check_failed"]
                assert [e["pool"] for e in failed] == ["kazma-full"], logs
                assert "too many connections" in failed[0]["error"], failed
                async with pool.connection() as conn:  # not drained: the session the server gave is kept
                    cursor = await conn.execute("SHOW transaction_read_only")
                    assert await cursor.fetchone() == ("on",)
            finally:
                await pool.close()
        finally:
            await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def test_a_write_on_a_stale_session_is_not_held_by_a_server_that_takes_tcp_and_does_not_answer(
    pg_url: str,
) -> None:
    """The session opened for the question took psycopg's default bound (130 s), not the store's: a write
    through PgTables.transaction() that landed on a pool session opened in a read-only time waited that long
    for a server that took the connection and said nothing. It is refused within the store's bound now."""
    params = conninfo_to_dict(pg_url)
    proxy = CuttableProxy(str(params["host"]), int(str(params["port"])))
    await proxy.start()
    store = None
    try:
        through = make_conninfo(pg_url, host="127.0.0.1", port=str(proxy.port))
        store = await open_pg_store(
            through, migrations=pg_migrations(), application_name="kazma-held", connect_timeout=1.0
        )
        tables = PgTables.of(store)
        async with (
            await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin,
            _read_only_default(admin),
        ):
            await every_pool_session_opened_now(store.pool, "on")
        proxy.hold_new()
        with capture_logs() as logs:
            async with asyncio.timeout(HANG):
                with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                    async with tables.transaction() as tx:
                        await tx.run("DELETE FROM kazma_schema WHERE component = 'nobody'")
        assert [e["event"] for e in logs if e["event"].startswith("store.read_only")] == [
            "store.read_only_check_failed"
        ], logs
        proxy.restore()  # the server answers new sessions again: the next write renews the stale ones
        async with tables.transaction() as tx:
            assert await tx.run("DELETE FROM kazma_schema WHERE component = 'nobody'") == 0
    finally:
        if store is not None:
            await store.close()
        await proxy.stop()
