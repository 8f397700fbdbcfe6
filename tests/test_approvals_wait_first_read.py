"""A waiter whose very first read of its request fails: it reads again (the one backoff) instead of raising.

It raised: the asker's call failed with the store's error while the request it had just opened stayed pending
with live cards, so a press approved a call that nobody waited for (nothing ran; only the next start reported
it). The store's error is real: the requests table is taken away under the running service, through a
connection of the test's own, and put back.
"""

from __future__ import annotations

import asyncio

from kazma.approvals import Decision, PressVerdict, Status, button_data
from kazma.config.metrics import failure_count
from tests.approvals_support import RecordingPublisher, approval_service
from tests.store_backends import Engine, rename_table

ARGS = {"command": "rm -rf build/"}


async def _until(predicate: object, seconds: float = 20.0) -> None:
    assert callable(predicate)
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_a_waiter_whose_first_read_fails_reads_again_and_gets_the_decision(store_engine: Engine) -> None:
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        failed = failure_count("approval_wait")
        await rename_table(store_engine, "approval_requests", "approval_requests_away")
        try:
            waiter = asyncio.create_task(service.wait(request.id))
            # it failed its first read, and then read again (and failed again): it did not give up
            await _until(lambda: failure_count("approval_wait") >= failed + 2 or waiter.done())
            assert not waiter.done(), f"the waiter gave up on its first failed read: {waiter.exception()!r}"
        finally:
            await rename_table(store_engine, "approval_requests_away", "approval_requests")
        press = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert press.verdict is PressVerdict.WON, press.message
        outcome = await asyncio.wait_for(waiter, timeout=10)  # woken by the decision, not left to its backoff
        assert outcome.approved
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.APPROVED
