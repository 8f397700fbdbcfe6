"""PostgreSQL in fewer round trips, attacked: a group in pipeline mode still gives each failure to the operation
that caused it; a press made as one statement seals what the row holds, not what this process remembered; an
audit append hashed on a guess of the head never forks the chain when another writer appended first."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import psycopg
import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.audit_verify import verify
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.seal import seal_problem
from kazma.bot.store import pg_migrations
from kazma.config.store.backend import Tx
from kazma.config.store.postgres import PgStore, PgWriter, open_pg_store
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")


@contextlib.asynccontextmanager
async def replicas(dsn: str, count: int) -> AsyncIterator[list[PgStore]]:
    async with contextlib.AsyncExitStack() as stack:
        stores = []
        for n in range(count):
            store = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"rt{n}")
            stack.push_async_callback(store.close)
            stores.append(store)
        yield stores


async def test_a_failed_statement_nobody_waited_for_fails_its_own_operation_not_the_next(pg_dsn: str) -> None:
    """And the statements of the group it aborted run again as they are, in it and in the groups after it."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    writer = PgWriter(pg_dsn)
    try:

        def first(tx: Tx) -> str:
            tx.send("INSERT INTO t VALUES (1)")
            return "first"

        def duplicate(tx: Tx) -> str:
            tx.send("INSERT INTO t VALUES (1)")  # fails, but nothing here waits for its answer
            return "duplicate"

        def reader(tx: Tx) -> int:
            return int(tx.one("SELECT count(*) FROM t")[0])  # the first read after it: where its error surfaces

        for _ in range(6):  # the reader's statement is one psycopg would prepare on its next use by now
            assert await writer.submit(reader) == 0
        results = await asyncio.gather(
            writer.submit(first), writer.submit(duplicate), writer.submit(reader), return_exceptions=True
        )
        assert await writer.submit(reader) == 1  # and in the groups after it
    finally:
        await writer.close()
    assert results[0] == "first"
    assert isinstance(results[1], psycopg.errors.UniqueViolation)
    assert results[2] == 1  # it ran and committed, after the first
    assert writer.pipeline_retries >= 1  # the group did go out pipelined first
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute("SELECT id FROM t").fetchall() == [(1,)]


async def test_a_press_seals_what_the_row_holds_when_what_this_process_remembered_was_changed(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 1) as (backend,):
        service = ApprovalService(ApprovalStore(backend, keyring=TEST_KEYRING), approvals_config())
        request = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        # Around Kazma, after this process remembered what a press of it seals: the tool and its hash.
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(
                "UPDATE approval_requests SET tool = 'rm', args_hash = %s WHERE id = %s", ("f" * 64, request.id)
            )
        result = await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert result.won
        decided = await service.store.get(request.id)
        assert decided is not None
        assert decided.tool == "rm"
        # The seal is over the row as the compare-and-set found it, so it verifies against that row.
        assert seal_problem(TEST_KEYRING, decided) is None


async def test_appends_hashed_on_a_stale_head_are_run_again_and_the_chain_stays_one_line(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 2) as stores:
        services = [
            ApprovalService(ApprovalStore(s, keyring=TEST_KEYRING, audit=TEST_SIGNER), approvals_config())
            for s in stores
        ]
        # One writer alone first: its appends find the head they guessed, so it starts guessing without asking.
        for n in range(3):
            await services[0].open("shell", {"n": n}, "agent:builder", "telegram:-100")
        # Then both, in turn and at once: every guess of the one is made stale by the other.
        for n in range(6):
            await services[n % 2].open("shell", {"turn": n}, "agent:builder", "telegram:-100")
        opened = await asyncio.gather(
            *(services[n % 2].open("shell", {"both": n}, "agent:builder", "telegram:-100") for n in range(20))
        )
        await asyncio.gather(
            *(
                services[(n + k) % 2].decide(r.id, Decision.APPROVE, actor=actor, platform=platform)
                for n, r in enumerate(opened)
                for k, (actor, platform) in enumerate((("telegram:111", "telegram"), ("slack:U111", "slack")))
            )
        )
        await Checkpointer(services[0].store, TEST_SIGNER, min_interval=0.0).sign()
        writers = [await s.writer() for s in stores]
        assert sum(w.pipeline_retries for w in writers) >= 1  # a guess was stale, and that group ran again
        events = await services[0].store.chain_events(limit=10_000)
        checkpoints = await services[0].store.chain_checkpoints(limit=10_000)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len(events) == 3 + 6 + 20 + 40  # every open, every press (a decision or a lost press), once each
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]


async def test_a_close_after_a_rider_gave_up_ends_the_writer_and_starts_no_other(pg_dsn: str) -> None:
    """A checkpoint waiting to ride whose caller was cancelled (the checkpointer stopped first) is not waited for
    by the close; it must not be handed to a fresh writer thread once the close took the old one away (the two
    threads then raced for the stop signal, and the close could wait forever for the one that lost)."""

    def one(tx: Tx) -> int:
        return int(tx.one("SELECT 1")[0])

    for _ in range(5):
        writer = PgWriter(pg_dsn)
        assert await writer.submit(one) == 1  # the writer's thread runs
        rider = asyncio.create_task(writer.submit(one, ride=30.0))
        await asyncio.sleep(0)  # it waits to ride
        rider.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rider
        await asyncio.wait_for(writer.close(), timeout=20)
        assert [t for t in threading.enumerate() if t.name == "kazma-pg-writer" and t.is_alive()] == []
