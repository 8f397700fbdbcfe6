"""On PostgreSQL a write's deadline is kept once its group is sent: an approved call's start held behind another
session's row lock is refused within START_RECORD_WITHIN, while the lock is held, and never recorded after.

A group already sent used to wait for the lock as long as the other session held it (a lone operation, as a start
usually is, has no ``lock_timeout`` at all): the call was neither refused in time nor kept from running late, and a
caller that stopped waiting left a start that committed after it was told "not recorded". The writer now cancels the
transaction under way at the earliest deadline of its operations (PgWriter's ``_Cut``), gives the late ones up
(``WriteGivenUp``, never run again) and runs the others again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import psycopg
import pytest
from psycopg import sql

from kazma.approvals import Decision, ExecutionMismatch
from kazma.approvals import service as service_module
from kazma.config.store.backend import Tx
from kazma.config.store.errors import WriteGivenUp
from kazma.config.store.postgres import PgWriter
from tests.approvals_support import approval_service
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

ARGS = {"command": "echo hi"}


@asynccontextmanager
async def row_locked(dsn: str, table: str, key: str) -> AsyncIterator[None]:
    """Another session holds the row's lock (``SELECT … FOR UPDATE`` in an open transaction) for the block's length."""
    blocker = await psycopg.AsyncConnection.connect(dsn)
    try:
        await blocker.execute("BEGIN")
        query = sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(sql.Identifier(table))
        row = await (await blocker.execute(query, (key,))).fetchone()
        assert row is not None
        yield
    finally:
        await blocker.execute("ROLLBACK")
        await blocker.close()


def rows(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {str(k): int(v) for k, v in conn.execute("SELECT id, v FROM t ORDER BY id").fetchall()}


def put(key: str, value: int) -> Callable[[Tx], int]:
    """Insert ``key``; the one named "late" first takes the row another session holds."""

    def op(tx: Tx) -> int:
        if key == "late":
            tx.one("SELECT 1 FROM t WHERE id = 'held' FOR UPDATE")
        tx.run("INSERT INTO t (id, v) VALUES (?, ?)", (key, value))
        return value

    return op


async def test_a_start_held_behind_a_row_lock_is_refused_in_time_and_never_recorded_after(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_module, "START_RECORD_WITHIN", 0.3)
    monkeypatch.setattr(service_module, "REFUSAL_RECORD_WITHIN", 0.1)
    async with approval_service(pg_dsn) as service:
        request = await service.open("shell", ARGS, "lead", "conv-1")
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        async with row_locked(pg_dsn, "approval_requests", request.id):
            # A guard against a hang, not a measure: the bound is 0.3 s; the lock is held until the block ends.
            async with asyncio.timeout(60):
                with pytest.raises(
                    ExecutionMismatch, match=r"start could not be recorded .*given up at its deadline.* it did not run"
                ):
                    await service.verify_execution(request.id, "shell", ARGS)
        # The lock is free: a start the writer still held would commit now. One group goes at a time, so once a
        # write submitted after the refusal is answered, every group before it has returned.
        await service.store.write(lambda tx: tx.one("SELECT 1"))
        events = [e.event for e in await service.store.events(request.id)]
        assert "execution_started" not in events  # refused as not recorded, and not recorded later either
        assert "execution_refused" in events  # its refusal needs no lock on the request's row: on the record


async def test_a_verification_whose_first_read_waits_behind_a_held_write_is_refused_within_the_bound(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read waits for this process's earlier writes; one of them (another call's start, with no deadline
    of its own) waits for another session's row lock as long as it is held. The bound used to start only after."""
    monkeypatch.setattr(service_module, "START_RECORD_WITHIN", 0.3)
    monkeypatch.setattr(service_module, "REFUSAL_RECORD_WITHIN", 0.1)
    async with approval_service(pg_dsn) as service:
        held, request = [await service.open("shell", {"n": n}, "lead", "conv-1") for n in range(2)]
        for each in (held, request):
            await service.decide(each.id, Decision.APPROVE, actor="web:admin", platform="web")
        writer = await service.store.tables.writer()
        assert isinstance(writer, PgWriter)
        async with row_locked(pg_dsn, "approval_requests", held.id):
            earlier = asyncio.ensure_future(service.store.execution_starts(held.id, "tool=shell"))
            async with asyncio.timeout(60):
                while not writer._in_flight:  # on its way, waiting for the lock
                    await asyncio.sleep(0)
                with pytest.raises(
                    ExecutionMismatch,
                    match=r"start could not be recorded .*did not even answer the reads.* did not run",
                ):
                    await service.verify_execution(request.id, "shell", {"n": 1})
            assert not earlier.done()
        assert await earlier is None  # the other call's start, free to commit once the lock is
        await service.store.write(lambda tx: tx.one("SELECT 1"))
        events = [e.event for e in await service.store.events(request.id)]
        assert "execution_started" not in events
        # Its refusal's record waited behind the held write too, and was given up: with nothing on the record saying
        # it ran, a recovery reports it as never run, which is true.
        assert request.id in [r.id for r in await service.store.approved_not_started()]


@pytest.mark.parametrize("pipelined", [True, False])
async def test_a_write_past_its_deadline_in_a_group_sent_is_given_up_and_the_others_commit(
    pg_dsn: str, pipelined: bool
) -> None:
    """Its group's other write commits while the lock is still held (it does not need it); the one given up never
    does. ``lock_timeout`` (ten minutes here) is not what ends the wait."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id text PRIMARY KEY, v integer NOT NULL)")
        admin.execute("INSERT INTO t VALUES ('held', 0)")
    writer = PgWriter(pg_dsn, lock_timeout_ms=600_000, pipelined=pipelined)
    try:
        await writer.submit(lambda tx: tx.one("SELECT 1"))  # connected
        async with row_locked(pg_dsn, "t", "held"):
            loop = asyncio.get_running_loop()
            late = asyncio.ensure_future(writer.submit(put("late", 1), deadline=loop.time() + 0.2))
            other = asyncio.ensure_future(writer.submit(put("other", 2)))  # the same turn: one group
            async with asyncio.timeout(60):  # a guard against a hang, not a measure
                with pytest.raises(WriteGivenUp, match=r"given up at its deadline|cut at a write's deadline"):
                    await late
                assert await other == 2
            assert rows(pg_dsn) == {"held": 0, "other": 2}  # committed while the lock is held
        await writer.submit(put("after", 3))  # one group at a time: everything before it has returned
        assert rows(pg_dsn) == {"after": 3, "held": 0, "other": 2}
    finally:
        await writer.close()


async def test_a_lone_write_past_its_deadline_is_given_up_and_the_next_write_goes_through(pg_dsn: str) -> None:
    """A lone write waits for a lock without ``lock_timeout``: its deadline is what ends the wait, and the connection
    serves the next write (the cancel does not land on it)."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id text PRIMARY KEY, v integer NOT NULL)")
        admin.execute("INSERT INTO t VALUES ('held', 0)")
    writer = PgWriter(pg_dsn)
    try:
        async with row_locked(pg_dsn, "t", "held"):
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(60):
                with pytest.raises(WriteGivenUp):
                    await writer.submit(put("late", 1), deadline=loop.time() + 0.2)
                for n in range(5):
                    assert await writer.submit(put(f"next{n}", n)) == n
        await writer.submit(put("after", 9))
        assert rows(pg_dsn) == {"after": 9, "held": 0, **{f"next{n}": n for n in range(5)}}
    finally:
        await writer.close()
