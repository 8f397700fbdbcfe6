"""/healthz with a database whose server processes stop running: the answer still comes within its bound.

A follower on a real PostgreSQL, the server processes of its read pool stopped (SIGSTOP: a backend hung in the
kernel, a paused VM, a network black hole looks the same to the client). The health read gave up at
HEALTH_TIMEOUT and then waited, in place, for psycopg's cancel of the query — up to 5 s for the server to take
the cancel and 5 s more for it to end the query — so a monitor promised an answer in 2 s waited 7 s and more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from kazma.bot.app import App
from kazma.bot.replication import HEALTH_TIMEOUT, Replication
from kazma.config.store import leader
from tests.audit_support import AUDIT_KEY
from tests.platforms_support import three_fakes
from tests.test_healthz_follower import FAST, replica, until


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def follower(tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[App]:
    """Replica "b" following "x", a bare session holding the lease all along (its record is read too)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    monkeypatch.setattr(leader, "LeaseTiming", lambda: FAST)
    holder_name = leader.LeaderLease.APPLICATION_PREFIX + "x"
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, application_name=holder_name) as x:
        await x.execute("SELECT pg_advisory_lock(%s)", (leader.lock_key("kazma"),))
        async with three_fakes() as fakes, replica(fakes, pg_dsn, "b", tmp_path, monkeypatch) as b:
            yield b


async def all_taken(pool: AsyncConnectionPool[Any]) -> list[int]:
    """Every connection the pool may open, taken at once (none lost), each one's server process id."""
    async with contextlib.AsyncExitStack() as stack:
        size = pool.max_size
        conns = [await stack.enter_async_context(pool.connection(timeout=30.0)) for _ in range(size)]
        return [conn.info.backend_pid for conn in conns]


def health_reads() -> int:
    return sum(1 for task in asyncio.all_tasks() if task.get_name() == "kazma-health-read")


async def test_a_followers_health_answers_within_its_bound_while_the_stores_server_processes_do_not_run(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with follower(tmp_path, pg_dsn, monkeypatch) as b:
        replication = b.replication
        assert replication is not None
        pool = replication.store.pool
        assert (await replication.health()).store_reachable
        # Every connection of the pool open, so that none the read takes is a new one (whose process runs).
        pids = await all_taken(pool)
        with capture_logs() as logs, stopped(pids):
            # Twice the bound, which it waited out and then 5 s more (psycopg's cancel) before it answered.
            async with asyncio.timeout(2 * HEALTH_TIMEOUT):
                health = await replication.health()
            assert not health.store_reachable
            assert health.problem == f"the store did not answer within {HEALTH_TIMEOUT:g} s"
            # Asked again while the given-up read is still being cancelled: no second read, the same answer.
            async with asyncio.timeout(2 * HEALTH_TIMEOUT):
                again = await replication.health()
            assert not again.store_reachable
            assert again.problem == f"{health.problem} (an earlier read is still unanswered)"
            assert health_reads() == 1  # the given-up read ends in the background, not dropped
        assert [e["event"] for e in logs if e["event"].startswith("replica.health_read")] == [
            "replica.health_read_given_up"
        ]
        # The processes run again: the given-up read ends, the store is reachable, and no pool connection is lost.
        with capture_logs() as logs:
            await until(_reachable(replication))
        assert health_reads() == 0
        assert "replica.health_read_ended" in [e["event"] for e in logs]
        assert len(await all_taken(pool)) == pool.max_size


def _reachable(replication: Replication) -> Any:
    async def check() -> bool:
        return (await replication.health()).store_reachable

    return check


async def test_a_followers_health_answers_within_its_bound_while_hung_queries_hold_every_pool_connection(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-only check, the lease holder and the holder's record each take a pool connection: with every one
    held by a query waiting on a lock, the health read waits for a connection, and gives up at its bound."""
    async with follower(tmp_path, pg_dsn, monkeypatch) as b:
        replication = b.replication
        assert replication is not None
        pool = replication.store.pool
        key = 424242
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as blocker:
            await blocker.execute("SELECT pg_advisory_lock(%s)", (key,))

            async def hung() -> None:
                async with pool.connection() as conn:
                    await conn.execute("SELECT pg_advisory_lock(%s)", (key,))
                    await conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

            hanging = [asyncio.create_task(hung()) for _ in range(pool.max_size)]
            await until(_all_waiting(pg_dsn, pool.max_size))
            async with asyncio.timeout(2 * HEALTH_TIMEOUT):
                health = await replication.health()
            assert not health.store_reachable
            await blocker.execute("SELECT pg_advisory_unlock(%s)", (key,))
            await asyncio.gather(*hanging)
        await until(_reachable(replication))
        assert len(await all_taken(pool)) == pool.max_size


def _all_waiting(dsn: str, count: int) -> Any:
    async def check() -> bool:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND application_name LIKE '%-read'"
            )
            row = await cur.fetchone()
            return row is not None and row[0] == count

    return check


async def test_a_replica_stopping_while_a_given_up_health_read_hangs_ends_it_and_loses_no_pool_connection(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The given-up read is a task of the replica's that its stop waits for: cancelled a second time there, while
    psycopg waits for the server to take the first cancel, it ends (psycopg closes the connection, the pool opens
    its slot again) with the server still stopped, and no task is left running."""
    async with follower(tmp_path, pg_dsn, monkeypatch) as b:
        replication = b.replication
        assert replication is not None
        pool = replication.store.pool
        pids = await all_taken(pool)
        with stopped(pids):
            health = await replication.health()
            assert health.problem == f"the store did not answer within {HEALTH_TIMEOUT:g} s"
            assert health_reads() == 1
            async with asyncio.timeout(60.0):  # a hang detector, not a measure
                await replication.stop()
            assert health_reads() == 0
        assert len(await all_taken(pool)) == pool.max_size
