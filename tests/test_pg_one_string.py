"""A PostgreSQL group sent as one string of statements bound on the client (PgWriter._attempt_batched), attacked:
every value reads back exactly as given (quotes, backslashes, ``%``, ``$$``, a statement's own terminator, U+0000,
floats to the last bit: the seals and the chain are computed over them in Python), each answer reaches the
operation that asked it, and an operation that wants an answer there gets the real one, its statements run once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from decimal import Decimal

import psycopg
import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.model import Status
from kazma.approvals.seal import seal_problem
from kazma.bot.store import pg_migrations
from kazma.config.store.backend import Tx
from kazma.config.store.group_commit import Unasking
from kazma.config.store.pg_text import nul_safe
from kazma.config.store.postgres import PgBatchTx, PgStore, PgWriter, open_pg_store
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

# Everything client-side binding could get wrong in one reason: quoting, escapes, placeholders, dollar quoting,
# a statement boundary, NUL (escaped by pg_text), the escape character itself, and text past the BMP.
TRICKY = "it's 100% \\ wrong\x00 $$; COMMIT; -- %s ? \ufdd0 \U0001f600 E'\\x00'"


@contextlib.asynccontextmanager
async def service_on(dsn: str) -> AsyncIterator[tuple[ApprovalService, PgWriter]]:
    backend: PgStore = await open_pg_store(dsn, migrations=pg_migrations(), application_name="one-string")
    try:
        store = ApprovalStore(backend, keyring=TEST_KEYRING, audit=TEST_SIGNER)
        yield ApprovalService(store, approvals_config()), await backend.writer()
    finally:
        await backend.close()


async def test_a_group_in_one_string_keeps_every_value_and_answers_each_press_its_own(pg_dsn: str) -> None:
    async with service_on(pg_dsn) as (service, writer):
        warm = await service.open("shell", {"warm": True}, "agent:builder", "telegram:-100")
        # Decided once, so the chain knows its head and the next groups need no answer before their commit.
        await service.decide(warm.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        opened = [await service.open("shell", {"n": n}, "agent:builder", "telegram:-100") for n in range(6)]
        batched = writer.batched
        # In one group: a Deny with the reason first then an Approve for the even ones, the other way round for
        # the odd ones. Each caller must be answered about its own request.
        presses = []
        for n, request in enumerate(opened):
            deny = service.decide(request.id, Decision.DENY, actor="slack:U111", platform="slack", reason=TRICKY)
            approve = service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
            presses += [deny, approve] if n % 2 == 0 else [approve, deny]
        results = await asyncio.gather(*presses)
        assert writer.batched == batched + 1  # the whole group went as one string, committed once
        for n, request in enumerate(opened):
            first, second = results[2 * n], results[2 * n + 1]
            assert first.request_id == second.request_id == request.id
            assert first.won
            assert not second.won
            denied = n % 2 == 0
            assert first.outcome is not None
            assert second.outcome is not None
            assert first.outcome.status is second.outcome.status is (Status.DENIED if denied else Status.APPROVED)
            stored = await service.store.get(request.id)
            assert stored is not None
            assert stored.reason == (TRICKY if denied else None)
            assert stored.decided_by == ("slack:U111" if denied else "telegram:111")
            assert seal_problem(TEST_KEYRING, stored) is None  # sealed over decided_at as stored, to the bit
            reviews = await service.store.reviews(request.id)
            assert [(r.actor, r.reason) for r in reviews] == [(stored.decided_by, stored.reason)]
        await Checkpointer(service.store, TEST_SIGNER, min_interval=0.0).sign()
        events = await service.store.chain_events(limit=10_000)
        checkpoints = await service.store.chain_checkpoints(limit=10_000)
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]  # every event hashed in Python reads back the same
    decided = [e for e in events if e.event == "decided" and e.actor == "slack:U111"]
    assert len(decided) == 3
    assert all(e.detail is not None and TRICKY in e.detail for e in decided)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len(events) == 2 + 6 + 6 * 2  # opened/decided, 6 opened, then a decision and a lost press each


async def test_an_operation_that_asks_after_sending_gets_the_answer_and_its_statements_run_once(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    writer = PgWriter(pg_dsn)
    try:

        def sends_then_asks(tx: Tx) -> int:
            tx.send("INSERT INTO t VALUES (1)")  # twice would fail the group: the stopped attempt sent nothing
            return int(tx.one("SELECT count(*) FROM t")[0])

        def sends(tx: Tx) -> str:
            tx.send("INSERT INTO t VALUES (?)", (2,))
            return "sent"

        assert await writer.submit(Unasking(sends)) == "sent"
        assert writer.batched == 1  # nothing asked: one string
        # Marked as asking nothing, yet it asks: the hint is wrong, the answer still right.
        assert await writer.submit(Unasking(sends_then_asks)) == 2
        assert writer.batched == 1  # it asked: the group went pipelined
    finally:
        await writer.close()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute("SELECT id FROM t ORDER BY id").fetchall() == [(1,), (2,)]


async def test_an_operation_that_swallows_errors_still_gets_the_real_answer(pg_dsn: str) -> None:
    """The stop an operation meets when it asks inside a one-string attempt is no database error: an ``except
    Exception`` around a read must not turn it into the operation's fallback value, committed as if read."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id integer PRIMARY KEY)")
        admin.execute("INSERT INTO t VALUES (1), (2), (3)")
    writer = PgWriter(pg_dsn)
    try:

        def counts_or_guesses(tx: Tx) -> int:
            try:
                seen = int(tx.one("SELECT count(*) FROM t")[0])
            except Exception:  # a database error: the operation carries on with what it assumes
                seen = -1
            tx.send("INSERT INTO t VALUES (?)", (100 + seen,))
            return seen

        assert await writer.submit(Unasking(counts_or_guesses)) == 3
    finally:
        await writer.close()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute("SELECT max(id) FROM t").fetchone() == (103,)


async def test_a_failed_statement_in_the_string_fails_its_own_operation_and_the_others_commit(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id integer PRIMARY KEY)")
        admin.execute("INSERT INTO t VALUES (1)")
    writer = PgWriter(pg_dsn)
    try:

        def inserts(value: int) -> Callable[[Tx], int]:
            def op(tx: Tx) -> int:
                tx.send("INSERT INTO t VALUES (?)", (value,))
                return value

            return op

        results = await asyncio.gather(
            writer.submit(Unasking(inserts(2))),
            writer.submit(Unasking(inserts(1))),
            writer.submit(Unasking(inserts(3))),
            return_exceptions=True,
        )
    finally:
        await writer.close()
    assert results[0] == 2
    assert isinstance(results[1], psycopg.errors.UniqueViolation)
    assert results[2] == 3
    assert writer.pipeline_retries >= 1  # the string failed as a whole, and the group ran again
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute("SELECT id FROM t ORDER BY id").fetchall() == [(1,), (2,), (3,)]


async def test_only_a_group_whose_every_operation_asks_nothing_tries_the_one_string(pg_dsn: str) -> None:
    """An operation not marked :class:`Unasking` (an open, a claim: they read) keeps its whole group off the one
    string, so its Python is never run twice; a group of marked ones goes as one."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    writer = PgWriter(pg_dsn)
    runs: list[int] = []
    try:

        def sends(value: int) -> Callable[[Tx], int]:
            def op(tx: Tx) -> int:
                runs.append(value)
                tx.send("INSERT INTO t VALUES (?)", (value,))
                return value

            return op

        assert list(await asyncio.gather(writer.submit(Unasking(sends(1))), writer.submit(sends(2)))) == [1, 2]
        assert writer.batched == 0  # one of them was not marked: pipelined at once
        assert runs == [1, 2]  # each operation's Python ran once
        assert list(await asyncio.gather(writer.submit(Unasking(sends(3))), writer.submit(Unasking(sends(4))))) == [
            3,
            4,
        ]
        assert writer.batched == 1
        assert writer.groups == 2
    finally:
        await writer.close()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute("SELECT id FROM t ORDER BY id").fetchall() == [(1,), (2,), (3,), (4,)]


@pytest.mark.parametrize("on", [True, False], ids=["literals written here", "psycopg's literals"])
def test_every_value_bound_into_the_string_reads_back_as_given(pg_dsn: str, on: bool) -> None:
    """Text, integers, floats and booleans are written as literals by PgBatchTx itself (psycopg's as_literal for
    anything else, or where quoting differs): each must read back as the very value, with psycopg's types, also
    after a minus sign (a negative number must not start a ``--`` comment)."""
    values: list[object] = [
        TRICKY,
        "'",
        "''",
        "\\",
        "\\'",
        "x'; SELECT 1; --",
        "\x00",
        "\ufdd0\ufdd0",
        "",
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**70,
        0.1,
        -0.0,
        -1.5e-300,
        5e-324,
        1e300,
        1764670000.123456,
        float("inf"),
        float("-inf"),
        True,
        False,
    ]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        nul_safe(conn)
        tx = PgBatchTx(psycopg.ClientCursor(conn))
        tx._plain = tx._plain and on
        for value in values:
            # 1 - value: a negative number right after a minus sign (ints past 2**62 would overflow bigint).
            subtracted = value if type(value) is float or (type(value) is int and abs(value) < 2**62) else 0
            tx.send("SELECT ?, 1 -?", (value, subtracted))  # "1 -" then "-1": no comment
        cursor = conn.cursor()
        for statement, value in zip(tx.statements, values, strict=True):
            row = cursor.execute(statement.encode()).fetchone()
            assert row is not None
            if type(value) is float:  # a float's literal is PostgreSQL's numeric (as psycopg writes it), exact
                assert float(row[0]) == value, statement
                assert float(row[1]) == 1 - value, statement
            else:
                assert type(row[0]) is type(value) or type(row[0]) is Decimal, statement
                assert row[0] == value, statement
                if type(value) is int and abs(value) < 2**62:
                    assert row[1] == 1 - value, statement
        nan = PgBatchTx(psycopg.ClientCursor(conn))
        nan.send("SELECT ?", (float("nan"),))
        row = cursor.execute(nan.statements[0].encode()).fetchone()
        assert row is not None
        assert math.isnan(row[0])
