"""The waiters' safety sweep outlives an error that is not the store's: logged, counted, and it goes on.

It caught only store errors: anything else (here the real one aiosqlite raises for a connection that is gone,
``ValueError: Connection closed``) ended its task silently, a "Task exception was never retrieved" at garbage
collection. From then on nothing found what ended unheard (another process's decision, a lost ``NOTIFY``) for
the long-polls already waiting: the sweep only started again when another waiter joined.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from kazma.approvals import MIGRATIONS, ApprovalStore
from kazma.approvals.waiters import Waiters
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from kazma.config.store.database import open_database
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER


async def test_a_sweep_that_meets_an_unexpected_error_is_logged_counted_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    conn = await open_database(tmp_path / "k.db", migrations=MIGRATIONS)
    store = ApprovalStore(conn, keyring=TEST_KEYRING, audit=TEST_SIGNER)
    waiters = Waiters(store.ended_among, 0.02, time.time, store.commits_seen, store.get)
    waiters.restart = Backoff(base=0.02, cap=0.1)
    failed = failure_count("approval_wait_task")
    watch = waiters.join("r-waited")
    try:
        await conn.close()  # every sweep from now on meets aiosqlite's ValueError, not a store error
        async with asyncio.timeout(20):
            while failure_count("approval_wait_task") < failed + 2:  # counted, and swept again after it
                await asyncio.sleep(0.01)
        sweep = waiters._sweep
        assert sweep is not None
        assert not sweep.done(), "the sweep ended: the waiters are never looked at again"
        crashes = [r for r in caplog.records if r.getMessage() == "task.failed"]
        assert crashes
        assert getattr(crashes[0], "task", None) == "kazma-approval-waiters-sweep"
        assert "Connection closed" in str(getattr(crashes[0], "error", ""))
    finally:
        waiters.leave("r-waited", watch)
    assert sweep.cancelling() or sweep.done()  # nobody waits: the sweep stops
