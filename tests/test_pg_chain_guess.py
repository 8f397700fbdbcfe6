"""The audit chain's append on PostgreSQL sent on a guess as one plain statement (approvals PG migration 19), attacked:
the rows go in on the numbers after the head this process last committed, under the chain's lock tried, or the
transaction fails as a stale guess and its group runs again asking. Whatever made the guess wrong (another replica
appended, a transaction holds the lock, a number taken) must end as the append would have ended unguessed: every
event once, one chain that verifies, no audit failure counted."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from kazma.approvals import Decision
from kazma.approvals.chain import CHAIN_LOCK
from kazma.approvals.pg_press import _guessed_append
from kazma.bot.store import pg_migrations
from kazma.config.metrics import failure_count
from kazma.config.store.postgres import STALE_GUESS, apply_pg_migrations, pyformat
from tests.pg_support import find_bindir
from tests.test_pg_prepared import last_query
from tests.test_pg_press_guess import checked_log, replicas

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")


async def test_a_lone_press_appends_its_event_by_the_guessed_statement_not_the_function(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 1) as [(service, writer)]:
        first = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        second = await service.open("shell", {"command": "pwd"}, "agent:builder", "telegram:-100")
        assert (await service.decide(first.id, Decision.APPROVE, actor="slack:U111", platform="slack")).won
        assert service.store.chain.guesses_hold  # its head known: the next append goes on a guess
        assert (await service.decide(second.id, Decision.DENY, actor="slack:U111", platform="slack")).won
        sent = last_query(pg_dsn, writer.backend_pid)
        assert "EXECUTE kazma_audit_guessed_1(" in sent, sent
        assert "kazma_audit_link" not in sent, sent
        log = await checked_log(service)
    assert [event for event, request, _ in log if request == second.id] == ["opened", "decided"]


async def test_a_guessed_append_whose_number_another_replica_took_runs_again_and_chains_after_it(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 2) as [(one, writer), (other, _)]:
        requests = [await one.open("shell", {"n": n}, "agent:builder", "telegram:-100") for n in range(3)]
        assert (await one.decide(requests[0].id, Decision.APPROVE, actor="slack:U111", platform="slack")).won
        assert (await other.decide(requests[1].id, Decision.APPROVE, actor="slack:U111", platform="slack")).won
        retries, failures = writer.pipeline_retries, failure_count("audit_chain")
        # Its guess numbers the decision after its own last event, which the other replica's now holds.
        assert (await one.decide(requests[2].id, Decision.DENY, actor="slack:U111", platform="slack")).won
        assert writer.pipeline_retries == retries + 1
        assert failure_count("audit_chain") == failures
        log = await checked_log(one)
    assert [(event, request) for event, request, _ in log if event == "decided"] == [
        ("decided", requests[0].id),
        ("decided", requests[1].id),
        ("decided", requests[2].id),
    ]


async def test_a_guessed_append_does_not_wait_behind_a_transaction_holding_the_chains_lock(pg_dsn: str) -> None:
    async with replicas(pg_dsn, 1) as [(service, writer)]:
        first = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        second = await service.open("shell", {"command": "pwd"}, "agent:builder", "telegram:-100")
        assert (await service.decide(first.id, Decision.APPROVE, actor="slack:U111", platform="slack")).won
        retries, failures = writer.pipeline_retries, failure_count("audit_chain")
        holder = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT pg_advisory_xact_lock(%s)", (CHAIN_LOCK,))
            pressing = asyncio.create_task(
                service.decide(second.id, Decision.DENY, actor="slack:U111", platform="slack")
            )
            # The guess failed at once (the lock was taken), and the group run again asks: it waits for the lock.
            async with asyncio.timeout(30):
                while not await _waits_for_advisory_lock(holder, writer.backend_pid):
                    await asyncio.sleep(0.01)  # another backend's state, read from pg_locks
            assert writer.pipeline_retries == retries + 1
            assert not pressing.done()
            await holder.execute("COMMIT")
            assert (await pressing).won
        finally:
            await holder.close()
        assert failure_count("audit_chain") == failures
        log = await checked_log(service)
    assert [event for event, request, _ in log if request == second.id] == ["opened", "decided"]


async def _waits_for_advisory_lock(conn: psycopg.AsyncConnection[object], pid: int | None) -> bool:
    cursor = await conn.execute(
        "SELECT 1 FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted", (pid,)
    )
    return await cursor.fetchone() is not None


async def test_a_guessed_append_of_several_rows_goes_in_whole_or_fails_whole(pg_dsn: str) -> None:
    await apply_pg_migrations(pg_dsn, pg_migrations())

    def row(seq: int, prev: str, chained: str) -> tuple[object, ...]:
        return (seq, None, "rule_used", "slack:U111", "slack", 1.0, None, None, prev, chained, None, None)

    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(pyformat(_guessed_append(1)), (CHAIN_LOCK, *row(1, "0" * 64, "1" * 64)))
        await conn.execute(pyformat(_guessed_append(1)), (CHAIN_LOCK, *row(3, "2" * 64, "3" * 64)))  # seq 3 taken
        # Rows 2 and 3 on the guess that the head is 1: 2 would go in, 3 cannot.
        with pytest.raises(psycopg.Error) as raised:
            await conn.execute(
                pyformat(_guessed_append(2)), (CHAIN_LOCK, *row(2, "1" * 64, "2" * 64), *row(3, "2" * 64, "x" * 64))
            )
        assert raised.value.sqlstate == STALE_GUESS
        cursor = await conn.execute("SELECT seq, chain_hash FROM approval_events ORDER BY seq")
        assert await cursor.fetchall() == [(1, "1" * 64), (3, "3" * 64)]
        # The identity moved past what went in: a row inserted without a number takes none the chain gave.
        cursor = await conn.execute("SELECT last_value FROM approval_events_seq_seq")
        assert await cursor.fetchone() == (3,)
