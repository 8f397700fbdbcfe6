"""What the PostgreSQL store relies on from psycopg 3 and psycopg_pool, checked against a real server.

Each test pins one assumption of the scale-out design (DESIGN.md, Storage): wake-ups by
LISTEN/NOTIFY on a dedicated connection, noticing a lost connection, the advisory-lock lease,
`FOR UPDATE SKIP LOCKED` claims and the `UPDATE … RETURNING` compare-and-set. A driver upgrade
that changes one of them fails here, not in a replica.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from tests.pg_support import PgDatabase, PostgresServer

WAIT = 10.0  # bound on every wait for something that should happen at once

AsyncConn = psycopg.AsyncConnection[TupleRow]


async def _connect(dsn: str, application_name: str = "kazma-test") -> AsyncConn:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=application_name)


async def _fetch_one(conn: AsyncConn, query: str) -> object:
    cur = await conn.execute(query)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def _collect(conn: AsyncConn, into: asyncio.Queue[str]) -> None:
    async for note in conn.notifies():
        into.put_nowait(note.payload)


async def _kill(server: PostgresServer, application_name: str, db: PgDatabase) -> None:
    ended = await asyncio.to_thread(server.terminate_client, application_name, database=db.name)
    assert ended == 1


async def test_notify_wakes_a_waiting_listener_while_the_pool_is_busy(pg_dsn: str) -> None:
    listener = await _connect(pg_dsn)
    await listener.execute("LISTEN wake")
    got: asyncio.Queue[str] = asyncio.Queue()
    listening = asyncio.create_task(_collect(listener, got))
    async with AsyncConnectionPool(pg_dsn, min_size=2, max_size=4, open=False, kwargs={"autocommit": True}) as pool:

        async def busy() -> None:
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_sleep(0.05)")

        load = [asyncio.create_task(busy()) for _ in range(8)]
        async with pool.connection() as conn:
            await conn.execute("SELECT pg_notify('wake', 'hello')")
        assert await asyncio.wait_for(got.get(), WAIT) == "hello"

        # A NOTIFY inside a transaction is delivered at its commit, after one committed later-started.
        async with pool.connection() as writer, pool.connection() as other, writer.transaction():
            await writer.execute("NOTIFY wake, 'in-transaction'")
            await other.execute("NOTIFY wake, 'committed-first'")
            assert await asyncio.wait_for(got.get(), WAIT) == "committed-first"
        assert await asyncio.wait_for(got.get(), WAIT) == "in-transaction"
        await asyncio.gather(*load)
    listening.cancel()
    await listener.close()


async def test_a_killed_listener_ends_with_an_error(pg_server: PostgresServer, pg_database: PgDatabase) -> None:
    """How a replica notices it lost its wake-up connection: `notifies()` raises at once."""
    listener = await _connect(pg_database.dsn, "listener")
    await listener.execute("LISTEN wake")
    listening = asyncio.create_task(_collect(listener, asyncio.Queue()))
    await _kill(pg_server, "listener", pg_database)
    with pytest.raises(psycopg.OperationalError):
        await asyncio.wait_for(listening, WAIT)
    assert listener.closed
    await listener.close()


async def _hold_lease(conn: AsyncConn) -> None:
    """Sit on the lease connection: notifies() returns on timeout, raises when the connection dies."""
    while True:
        async for _ in conn.notifies(timeout=1.0):
            pass
        await conn.execute("SELECT 1")  # a heartbeat between waits also catches a silent peer


async def test_advisory_lease_is_released_when_its_connection_dies(
    pg_server: PostgresServer, pg_database: PgDatabase
) -> None:
    leader = await _connect(pg_database.dsn, "leader")
    rival = await _connect(pg_database.dsn, "rival")
    try:
        assert await _fetch_one(leader, "SELECT pg_try_advisory_lock(7001)") is True
        assert await _fetch_one(rival, "SELECT pg_try_advisory_lock(7001)") is False
        holding = asyncio.create_task(_hold_lease(leader))
        await _kill(pg_server, "leader", pg_database)
        with pytest.raises(psycopg.OperationalError):  # the old leader learns it lost the lease
            await asyncio.wait_for(holding, WAIT)
        assert await _fetch_one(rival, "SELECT pg_try_advisory_lock(7001)") is True
    finally:
        await leader.close()
        await rival.close()


async def test_skip_locked_claims_are_disjoint(pg_dsn: str) -> None:
    setup = await _connect(pg_dsn)
    await setup.execute("CREATE TABLE outbox (id int PRIMARY KEY, claimed_by text)")
    await setup.execute("INSERT INTO outbox SELECT g, NULL FROM generate_series(1, 10) g")
    claim = "SELECT id FROM outbox WHERE claimed_by IS NULL ORDER BY id LIMIT 3 FOR UPDATE SKIP LOCKED"
    a, b = await _connect(pg_dsn), await _connect(pg_dsn)
    try:
        async with a.transaction(), b.transaction():
            ids_a = [r[0] for r in await (await a.execute(claim)).fetchall()]
            ids_b = [r[0] for r in await (await b.execute(claim)).fetchall()]
        assert ids_a == [1, 2, 3]
        assert ids_b == [4, 5, 6]
    finally:
        for conn in (setup, a, b):
            await conn.close()


async def test_compare_and_set_has_exactly_one_winner(pg_dsn: str) -> None:
    setup = await _connect(pg_dsn)
    await setup.execute("CREATE TABLE requests (id text PRIMARY KEY, status text NOT NULL, decided_by text)")
    await setup.execute("INSERT INTO requests VALUES ('r1', 'pending', NULL)")
    cas = "UPDATE requests SET status = %s, decided_by = %s WHERE id = 'r1' AND status = 'pending' RETURNING status"
    async with AsyncConnectionPool(pg_dsn, min_size=4, max_size=8, open=False, kwargs={"autocommit": True}) as pool:

        async def press(i: int) -> tuple[str, str] | None:
            outcome = "approved" if i % 2 else "denied"
            async with pool.connection() as conn:
                row = await (await conn.execute(cas, (outcome, f"web:user{i}"))).fetchone()
            return None if row is None else (outcome, f"web:user{i}")

        results = await asyncio.gather(*(press(i) for i in range(12)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    row = await (await setup.execute("SELECT status, decided_by FROM requests")).fetchone()
    assert row == winners[0]
    await setup.close()


async def test_pool_replaces_a_connection_killed_server_side(
    pg_server: PostgresServer, pg_database: PgDatabase
) -> None:
    async with AsyncConnectionPool(
        pg_database.dsn, min_size=1, max_size=1, open=False, check=AsyncConnectionPool.check_connection,
        kwargs={"autocommit": True, "application_name": "pooled"},
    ) as pool:  # fmt: skip
        async with pool.connection() as conn:
            before = await _fetch_one(conn, "SELECT pg_backend_pid()")
        await _kill(pg_server, "pooled", pg_database)
        async with pool.connection() as conn:
            after = await _fetch_one(conn, "SELECT pg_backend_pid()")
    assert after != before
