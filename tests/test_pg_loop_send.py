"""A PostgreSQL group that goes as one string is sent from the event loop (PgWriter._send_on_loop), not by the
writer thread: attacked where that could change what a caller is told. It runs on the loop's thread, commits before
its caller is answered, a failed string still fails only its own operation, and a connection lost under it fails
the group (never runs it again: whether its COMMIT was kept is unknown) while the next group opens a new one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import psycopg
import pytest

from kazma.config.store.backend import Tx
from kazma.config.store.group_commit import Unasking
from kazma.config.store.postgres import PgWriter
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")


def inserts(value: int, threads: list[int]) -> Callable[[Tx], int]:
    def op(tx: Tx) -> int:
        threads.append(threading.get_ident())
        tx.send("INSERT INTO t VALUES (?)", (value,))
        return value

    return op


def rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as admin:
        return [row[0] for row in admin.execute("SELECT id FROM t ORDER BY id").fetchall()]


@asynccontextmanager
async def table_t_and_writer(dsn: str) -> AsyncIterator[tuple[PgWriter, list[int]]]:
    """A fresh table ``t``, and a writer on ``dsn`` (closed after the block) with the list of threads its
    operations ran on (see :func:`inserts`)."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    writer = PgWriter(dsn)
    try:
        yield writer, []
    finally:
        await writer.close()


async def test_a_group_that_asks_nothing_runs_and_commits_on_the_loop_before_its_caller_is_answered(
    pg_dsn: str,
) -> None:
    async with table_t_and_writer(pg_dsn) as (writer, threads):
        assert await writer.submit(Unasking(inserts(1, threads))) == 1  # the first group opens the connection
        for value in (2, 3):
            assert await writer.submit(Unasking(inserts(value, threads))) == value
            assert rows(pg_dsn)[-1] == value  # committed when answered
        assert await asyncio.gather(*(writer.submit(Unasking(inserts(v, threads))) for v in (4, 5))) == [4, 5]
    assert threads[1:] == [threading.get_ident()] * 4  # every group after the first ran on the loop's thread
    assert writer.sent_from_loop == 3
    assert writer.groups == 4
    assert rows(pg_dsn) == [1, 2, 3, 4, 5]


async def test_a_failed_string_sent_from_the_loop_fails_its_own_operation_and_the_others_commit(pg_dsn: str) -> None:
    async with table_t_and_writer(pg_dsn) as (writer, threads):
        await writer.submit(Unasking(inserts(1, threads)))
        results = await asyncio.gather(
            writer.submit(Unasking(inserts(2, threads))),
            writer.submit(Unasking(inserts(1, threads))),
            writer.submit(Unasking(inserts(3, threads))),
            return_exceptions=True,
        )
        assert writer.sent_from_loop == 1
        # The transaction the string left aborted was rolled back: the writer goes on.
        assert await writer.submit(Unasking(inserts(4, threads))) == 4
    assert results[0] == 2
    assert isinstance(results[1], psycopg.errors.UniqueViolation)
    assert results[2] == 3
    assert writer.pipeline_retries >= 1
    assert rows(pg_dsn) == [1, 2, 3, 4]


async def test_a_connection_lost_under_a_string_sent_from_the_loop_fails_the_group_and_the_next_reconnects(
    pg_dsn: str,
) -> None:
    async with table_t_and_writer(pg_dsn) as (writer, threads):
        await writer.submit(Unasking(inserts(1, threads)))
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (writer.backend_pid,))
        outcome = await asyncio.gather(writer.submit(Unasking(inserts(2, threads))), return_exceptions=True)
        assert await writer.submit(Unasking(inserts(3, threads))) == 3
    if isinstance(outcome[0], BaseException):
        # Lost while the string was out: failed, never run again on the new connection.
        assert isinstance(outcome[0], psycopg.OperationalError)
        assert rows(pg_dsn) == [1, 3]
    else:  # the send itself failed first (nothing reached the server): the thread ran it on a new connection
        assert outcome[0] == 2
        assert rows(pg_dsn) == [1, 2, 3]


def counts_text(text: str) -> Callable[[Tx], str]:
    def op(tx: Tx) -> str:
        tx.send("INSERT INTO t VALUES (100 + length(?))", (text,))
        return text

    return op


@pytest.mark.parametrize("from_loop", [True, False], ids=["sent from the loop", "sent by the thread"])
async def test_a_value_no_string_can_carry_fails_its_own_operation_and_the_writer_goes_on(
    pg_dsn: str, from_loop: bool
) -> None:
    """A lone surrogate is no UTF-8, so a group binding one cannot be sent as one string. Found only as the string
    was sent, it left a group sent from the loop in flight for good (it and every later write waited forever) and,
    on the thread, failed the whole group; the pipelined path binds each operation's values apart."""
    # A writer left waiting fails here (its close waits for the group in flight too), not by holding the suite.
    async with asyncio.timeout(60), table_t_and_writer(pg_dsn) as (writer, threads):
        writer.send_from_loop = from_loop
        await writer.submit(Unasking(inserts(1, threads)))  # the connection is open: the next group may go as one
        results = await asyncio.gather(
            writer.submit(Unasking(inserts(2, threads))),
            writer.submit(Unasking(counts_text("x\udcffy"))),
            writer.submit(Unasking(inserts(3, threads))),
            return_exceptions=True,
        )
        assert await writer.submit(Unasking(inserts(4, threads))) == 4
    assert results[0] == 2
    assert isinstance(results[1], UnicodeEncodeError), results[1]
    assert results[2] == 3
    assert rows(pg_dsn) == [1, 2, 3, 4]


async def test_a_transaction_aborted_unseen_answers_nobody_as_if_it_committed(pg_dsn: str) -> None:
    """What runs at a transaction's end (a deferred flush) swallowed a database error: the server answers the
    COMMIT with ROLLBACK and keeps nothing. Statement by statement, the writer still answered every operation with
    its result, a press told it won a decision that was never written."""

    def swallows(tx: Tx, items: list[object]) -> None:
        with contextlib.suppress(psycopg.Error):  # the transaction is aborted, and nothing here says so
            tx.run("SELECT 1 / 0")

    def op(tx: Tx) -> int:
        tx.send("INSERT INTO t VALUES (?)", (7,))
        tx.defer(swallows, None)
        return 7

    async with table_t_and_writer(pg_dsn) as (writer, _):
        with pytest.raises(psycopg.Error, match="aborted unseen"):
            await writer.submit(op)
        assert await writer.submit(inserts(8, [])) == 8  # the writer goes on
    assert rows(pg_dsn) == [8]
