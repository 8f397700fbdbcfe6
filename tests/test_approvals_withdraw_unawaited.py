"""A withdrawal whose asker was cancelled meanwhile, and which the store then refused: counted and logged.

``withdraw`` runs the withdrawal on its own so that a cancelled asker (a web server shutting down cancels what
runs past its timeout) does not cut it off half-way. When the store then refused it, nobody looked at the
error: nothing was counted or logged (a "Task exception was never retrieved" at garbage collection at best),
and the request stayed pending with live buttons although its asker was gone. The store's refusal is real: a
trigger on the requests table, made through a connection of the test's own.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kazma.approvals import Status
from kazma.approvals.withdrawal import Gone
from kazma.config.metrics import failure_count
from tests.approvals_support import RecordingPublisher, approval_service
from tests.outside_writes import write_around

ARGS = {"command": "rm -rf build/"}


async def test_a_withdrawal_refused_after_its_asker_was_cancelled_is_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    db = tmp_path / "k.db"
    async with approval_service(db, publisher=RecordingPublisher()) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        refused = failure_count("approval_withdraw")
        await write_around(
            db,
            [
                "CREATE TRIGGER refuse_cancels BEFORE UPDATE OF status ON approval_requests"
                " WHEN NEW.status = 'cancelled' BEGIN SELECT RAISE(ABORT, 'the store refused it'); END"
            ],
        )
        asker = asyncio.create_task(service.withdraw(request.id, Gone.DISCONNECTED))
        async with asyncio.timeout(20):
            while not service._withdrawals:  # the withdrawal runs on its own now
                await asyncio.sleep(0)
        asker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asker
        async with asyncio.timeout(20):
            while service._withdrawals:
                await asyncio.sleep(0.01)
        assert failure_count("approval_withdraw") == refused + 1
        failed = [r for r in caplog.records if r.getMessage() == "approvals.withdraw_failed"]
        assert failed
        assert getattr(failed[0], "request_id", None) == request.id
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.PENDING  # left to the silent-asker sweep or the next start
