"""The replica's two long-lived PostgreSQL loops (the LISTEN listener, the leader lease) outlive an error nobody
expected: it is logged as ``task.failed`` and counted as ``replica_task``, and the loop goes on, instead of its task
ending silently (its error seen only at stop). Against the suite's real PostgreSQL server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.abc import Buffer
from psycopg.pq import Format
from psycopg.types.bool import BoolLoader

from kazma.config.metrics import failure_count
from kazma.config.store.leader import LeaderLease
from kazma.config.store.pg_listen import PgListener
from tests.pg_support import PostgresServer

WAIT = 20.0
CHANNEL = "kazma_loops_test"
BOOL_OID = 16


async def _until(check: Callable[[], bool], timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def _failed_tasks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [str(getattr(r, "task", "")) for r in caplog.records if r.getMessage() == "task.failed"]


@pytest.fixture
def ascii_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """A database in the SQL_ASCII encoding (old installations): the server passes bytes through as they came, and
    a client reads them as ASCII."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'").format(
                sql.Identifier(name)
            )
        )
    try:
        yield pg_server.dsn_for(name)
    finally:
        pg_server.drop_database(name)


def _notify(dsn: str, payload: str) -> None:
    # A UTF-8 client: into a SQL_ASCII database its bytes go unchanged.
    with psycopg.connect(dsn, autocommit=True, client_encoding="UTF8") as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))


async def test_a_listener_that_cannot_read_a_notification_says_so_and_listens_again(
    ascii_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[str] = []
    resyncs: list[int] = []

    async def resync() -> None:
        resyncs.append(1)

    listener = PgListener(
        ascii_dsn, [CHANNEL], lambda _c, payload, _p: heard.append(payload), resync,
        application_name="kazma-loops-listen", check_every=3600.0,
    )  # fmt: skip
    counted = failure_count("replica_task")
    listener.start()
    try:
        assert await listener.wait_connected(WAIT)
        # psycopg decodes the payload as ASCII and raises UnicodeDecodeError, not a psycopg.Error: the listener's
        # task ended there, and every later wake-up was lost with nothing said until stop()
        await asyncio.to_thread(_notify, ascii_dsn, "décidé")
        await _until(lambda: listener.connects == 2 and listener.connected)
        assert failure_count("replica_task") == counted + 1
        assert "kazma-pg-listen" in _failed_tasks(caplog)
        assert len(resyncs) == 2  # what the lost notification said is looked for once
        await asyncio.to_thread(_notify, ascii_dsn, "plain")
        await _until(lambda: heard == ["plain"])
    finally:
        await listener.stop()  # raised the UnicodeDecodeError before: the task had ended with it


async def test_a_lease_whose_connect_fails_unexpectedly_says_so_and_keeps_trying(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A host name psycopg cannot even encode (a label longer than 63 bytes): UnicodeError from its resolver, not
    # the OSError of a host that does not resolve. The loop ended there: no lease, no word of why.
    lease = LeaderLease(f"host={'h' * 64}.invalid dbname=x", name="loops-test", replica="r1")
    counted = failure_count("replica_task")
    lease.start()
    try:
        await _until(lambda: failure_count("replica_task") >= counted + 2)  # each attempt fails, and is tried again
        assert lease.state == "disconnected"
        assert not lease.is_leader
        assert "leader-lease-loops-test" in _failed_tasks(caplog)
        # the operator mends the address (the lease reads it at each attempt): it leads
        lease.dsn = pg_dsn
        await _until(lambda: lease.is_leader)
    finally:
        await lease.stop()


class _FailingWhenAsked(BoolLoader):
    """PostgreSQL's booleans read as usual, until a test asks for the next one to fail: an error no lease handles,
    raised inside psycopg by its own adapters' public extension point (no library object is replaced)."""

    armed = False

    def load(self, data: Buffer) -> bool:
        if _FailingWhenAsked.armed:
            _FailingWhenAsked.armed = False
            raise ValueError("a boolean that cannot be read")
        return super().load(data)


@pytest.fixture
def failing_bools() -> Iterator[type[_FailingWhenAsked]]:
    original = psycopg.adapters.get_loader(BOOL_OID, Format.TEXT)
    assert original is not None
    psycopg.adapters.register_loader(BOOL_OID, _FailingWhenAsked)
    try:
        yield _FailingWhenAsked
    finally:
        _FailingWhenAsked.armed = False
        psycopg.adapters.register_loader(BOOL_OID, original)  # the later tests of this process read as before


async def test_a_leader_whose_loop_fails_unexpectedly_steps_down_at_once_and_leads_again(
    pg_dsn: str, failing_bools: type[_FailingWhenAsked], caplog: pytest.LogCaptureFixture
) -> None:
    lost: list[str] = []
    acquired: list[int] = []

    async def on_acquired() -> None:
        acquired.append(1)

    async def on_lost(reason: str) -> None:
        lost.append(reason)

    lease = LeaderLease(pg_dsn, name="loops-test", replica="r1", on_acquired=on_acquired, on_lost=on_lost)
    counted = failure_count("replica_task")
    lease.start()
    try:
        await _until(lambda: lease.is_leader and acquired == [1])
        failing_bools.armed = True  # the leader's next check of its lock fails in a way it did not expect
        # Its task ended there: is_leader ran out only after the grace, and on_lost was never called, so the
        # duties it started ran on beside the next leader's.
        await _until(lambda: lost != [], timeout=lease.timing.check_interval + 2 * lease.timing.check_timeout)
        assert "ValueError: a boolean that cannot be read" in lost[0]
        assert failure_count("replica_task") == counted + 1
        assert "leader-lease-loops-test" in _failed_tasks(caplog)
        await _until(lambda: lease.is_leader and acquired == [1, 1])  # a new session takes the lease again
    finally:
        await lease.stop()
