"""A waiter at its request's deadline while the store refuses writes: it waits for the store, then ends "timeout".

Another process on the SQLite file holds the write lock past the writer's busy timeout (or, among replicas, the
database cannot be reached) just as a request's deadline passes. The waiter's write of the timeout fails: the
store's error ("database is locked") came out of ``wait`` and ended the agent's turn in it, with the request left
pending. Now the waiter tries again, and once the store takes writes again the request ends ``timeout`` for it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from kazma.approvals import Status
from kazma.config.metrics import failure_count
from kazma.config.store.database import Tables
from kazma.config.store.writer import StoreWriter
from tests.approvals_support import ManualClock, approval_service


async def test_a_timeout_the_store_refuses_at_the_deadline_is_written_once_it_takes_writes(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    clock = ManualClock()
    async with approval_service(path, clock=clock, poll_interval=0.05) as service:
        writer = StoreWriter(path, busy_timeout_ms=100)
        Tables.of(service.store.conn).use_writer(writer)
        try:
            request = await service.open("write_file", {"path": "a"}, "agent:builder", "discord:5", deadline=60)
            failed = failure_count("approval_wait")
            holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                # Another process's write lock, held past the deadline; taken off the loop, which Kazma may need
                # to end a transaction it holds.
                await asyncio.to_thread(holder.execute, "BEGIN IMMEDIATE")
                waiting = asyncio.create_task(service.wait(request.id))
                clock.advance(61)
                async with asyncio.timeout(30):
                    while failure_count("approval_wait") == failed and not waiting.done():
                        await asyncio.sleep(0.02)
                assert not waiting.done(), waiting.exception()  # the refused write is no ending
                assert (await service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            outcome = await asyncio.wait_for(waiting, 30)
            assert outcome.status is Status.TIMEOUT
            stored = await service.store.get(request.id)
            assert stored is not None
            assert (stored.status, stored.reason) == (Status.TIMEOUT, "no decision before the deadline")
        finally:
            await writer.close()
