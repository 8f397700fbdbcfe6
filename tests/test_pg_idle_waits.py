"""An idle replica's waiting connections on a real PostgreSQL: woken by what the server sends, not by a clock.

The ``LISTEN`` connection and the leader lease's connection wait on their sockets. Attacked: a notification
sent while the listener waits is heard at once; a listener whose session the server ends reconnects, looks
again (``on_resync``) and hears the next one; a lease whose backend is terminated notices it; and, idle, the
two connections do not wake the event loop ten times a second each (psycopg's own wait looks every 0.1 s),
counted as loop passes in a window, a count the machine's load does not change.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
from collections.abc import Callable

import psycopg

from kazma.config.store.leader import LeaderLease
from kazma.config.store.pg_listen import PgListener

WAIT = 20.0


async def _until(check: Callable[[], bool], timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def _notify(dsn: str, payload: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify('kazma_idle_test', %s)", (payload,))


def _terminate(dsn: str, application_name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (application_name,)
        ).fetchall()
    return len(rows)


def _loop_passes(profile: cProfile.Profile) -> int:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(entry[1] for (_, _, name), entry in stats.items() if name == "_run_once")


async def test_a_listener_hears_at_once_and_after_its_session_was_ended(pg_dsn: str) -> None:
    heard: list[str] = []
    resyncs: list[int] = []

    async def resync() -> None:
        resyncs.append(1)

    listener = PgListener(
        pg_dsn, ["kazma_idle_test"], lambda _c, payload, _p: heard.append(payload), resync,
        application_name="kazma-idle-listen", check_every=3600.0,
    )  # fmt: skip
    listener.start()
    try:
        assert await listener.wait_connected(WAIT)
        await asyncio.to_thread(_notify, pg_dsn, "one")
        await _until(lambda: heard == ["one"])  # an hour's check cannot explain it
        assert await asyncio.to_thread(_terminate, pg_dsn, "kazma-idle-listen") == 1
        await _until(lambda: listener.connects == 2 and listener.connected)
        assert len(resyncs) == 2  # what was said while it did not listen is looked for once
        await asyncio.to_thread(_notify, pg_dsn, "two")
        await _until(lambda: heard == ["one", "two"])
    finally:
        await listener.stop()


async def test_idle_listener_and_lease_do_not_wake_the_loop_ten_times_a_second(pg_dsn: str) -> None:
    listener = PgListener(pg_dsn, ["kazma_idle_test"], lambda *_: None, _nothing, check_every=3600.0)
    lease = LeaderLease(pg_dsn, name="idle-test", replica="r1")
    listener.start()
    lease.start()
    try:
        assert await listener.wait_connected(WAIT)
        await _until(lambda: lease.is_leader)
        profile = cProfile.Profile()
        profile.enable()
        await asyncio.sleep(1.0)  # the window measured: nothing is sent, the lease checks itself every 1.5 s
        profile.disable()
        # psycopg's own waits made about 20 passes here (10 a second for each connection); on the sockets, the
        # sleep's own pass and a lease check's few remain.
        assert _loop_passes(profile) <= 8
        # ... and a lease whose session the server ends still notices at once (its wait reads the socket).
        assert await asyncio.to_thread(_terminate, pg_dsn, "kazma-lease r1") == 1
        await _until(lambda: not lease.is_leader, timeout=10.0)
    finally:
        await lease.stop()
        await listener.stop()


async def _nothing() -> None:
    return None
