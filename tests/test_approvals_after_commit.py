"""A failure after an approval write committed: the write stands, and what follows it must not act as if it had
not. An opening that fails after its commit ends the request it wrote (its asker never waits for it, so a press
on its card must not approve a call nothing would act on: the chaos cell ``approvals.open.committed=error`` ended
"approved, nothing waits"); a press whose error comes after its commit is the decision (the cell
``approvals.decide.after_commit=error`` told the presser to press again and left the waiter to its poll)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kazma.approvals import (
    ApprovalRefused,
    ApprovalRequest,
    ApprovalService,
    Decision,
    PressVerdict,
    Status,
    button_data,
)
from kazma.approvals.card import ApprovalCard
from kazma.approvals.policy import SafetyPolicy
from kazma.approvals.withdrawal import Gone
from kazma.config import failpoints
from kazma.config.metrics import failure_count
from tests.approvals_support import RecordingPublisher, approval_service
from tests.store_backends import Engine, rename_table

ARGS = {"command": "rm -rf build/"}


@pytest.fixture
def disarmed() -> Iterator[None]:
    yield
    failpoints.disarm()


class FailingPublisher(RecordingPublisher):
    """A publisher whose post fails with an error that is not :class:`CardsNotQueued` (a bug, a platform)."""

    async def publish(self, card: ApprovalCard) -> None:
        self.published.append(card)
        raise RuntimeError("the card could not be built")


async def _pressed_after(service: ApprovalService, request_id: str) -> PressVerdict:
    press = await service.decide_from_button(
        button_data(request_id, Decision.APPROVE), actor="telegram:111", platform="telegram"
    )
    return press.verdict


async def test_a_failure_after_the_commit_cancels_the_request_and_a_press_cannot_approve_it(
    store_engine: Engine, disarmed: None
) -> None:
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        failpoints.arm_for_test("approvals.open.committed=error")
        before = failure_count("approval_open_unfinished")
        with pytest.raises(ApprovalRefused, match="opening its approval failed after it was written") as refused:
            await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        assert "it was cancelled, so no press can approve it. Nothing ran" in str(refused.value)
        [request] = await service.store.requests()
        assert request.status is Status.CANCELLED
        assert (request.reason or "").startswith("opening it failed after it was written; nothing ran (open: ")
        assert publisher.settled == [request.id]  # its cards (queued with the row) settle to that outcome
        assert await _pressed_after(service, request.id) is not PressVerdict.WON
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.CANCELLED
        assert failure_count("approval_open_unfinished") == before + 1


async def test_a_publisher_failing_with_an_unexpected_error_cancels_the_request(store_engine: Engine) -> None:
    publisher = FailingPublisher()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        with pytest.raises(ApprovalRefused, match="the card could not be built"):
            await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        [request] = await service.store.requests()
        assert request.status is Status.CANCELLED
        assert await _pressed_after(service, request.id) is not PressVerdict.WON


async def test_a_press_whose_error_comes_after_its_commit_stands_wakes_the_waiter_and_settles(
    store_engine: Engine, disarmed: None
) -> None:
    """The error after the commit (a connection lost as the commit answered) must not tell the presser "still
    pending, press again" while the decision stands, nor leave its waiter to its next poll (30 s among replicas)."""
    publisher = RecordingPublisher()
    async with approval_service(store_engine.where, publisher=publisher, poll_interval=30.0) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        read = asyncio.Event()
        get = service.store.get

        async def get_and_say(request_id: str) -> ApprovalRequest | None:
            found = await get(request_id)
            read.set()
            return found

        service.store.get = get_and_say  # type: ignore[method-assign]
        waiter = asyncio.create_task(service.wait(request.id))
        await asyncio.wait_for(read.wait(), timeout=10)  # it read the request pending: it now waits to be woken
        service.store.get = get  # type: ignore[method-assign]
        failpoints.arm_for_test("approvals.decide.after_commit=error")
        press = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert press.verdict is PressVerdict.WON, press.message
        assert press.message.startswith("Approved. Recorded as")
        outcome = await asyncio.wait_for(waiter, timeout=10)  # woken, not left to its 30 s poll
        assert outcome.approved
        assert request.id in publisher.settled


async def test_a_store_refusing_the_opening_refuses_the_call_with_why_instead_of_ending_the_turn(
    store_engine: Engine, disarmed: None
) -> None:
    """``approvals.open.row=error``: the store's error left the policy and ended the agent's whole turn in silence
    (the person never heard back); the call is refused with why, and the turn goes on to say so."""
    async with approval_service(store_engine.where, publisher=RecordingPublisher()) as service:
        failpoints.arm_for_test("approvals.open.row=error")
        verdict = await SafetyPolicy(service).check(
            "shell", ARGS, requested_by="agent:builder", conversation="telegram:-100"
        )
        assert not verdict.allowed
        assert "its request could not be opened (the approvals store failed" in verdict.reason
        assert verdict.reason.endswith("so it did not run; ask again.")
        assert await service.store.requests() == []


class TableTakingPublisher(RecordingPublisher):
    """A post that fails after taking the requests table away on the store itself (through a connection of its
    own): the opening's cancel then meets the store's real error."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    async def publish(self, card: ApprovalCard) -> None:
        self.published.append(card)
        await rename_table(self.engine, "approval_requests", "approval_requests_away")
        raise RuntimeError("the card could not be built")


async def test_an_opening_whose_cancel_fails_too_is_cancelled_by_the_next_press_never_approved(
    store_engine: Engine,
) -> None:
    """The opening failed after its commit, and its cancel failed as well: the request stayed pending with live
    cards and nobody waiting, and a press approved it ("Approved. Recorded") while nothing would ever run it. A
    press now tries the cancel again and approves nothing; the failure is counted and said to the asker."""
    publisher = TableTakingPublisher(store_engine)
    async with approval_service(store_engine.where, publisher=publisher) as service:
        before = failure_count("approval_open_uncancelled")
        try:
            with pytest.raises(ApprovalRefused, match="could not be cancelled") as refused:
                await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        finally:
            await rename_table(store_engine, "approval_requests_away", "approval_requests")
        [request] = await service.store.requests()
        assert request.status is Status.PENDING  # the store refused the cancel: it stands, nobody waits for it
        press = await service.decide_from_button(
            button_data(request.id, Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert press.verdict is PressVerdict.REFUSED, press.message
        assert press.message.startswith("This request was cancelled: opening it failed after it was written")
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.CANCELLED
        assert publisher.settled == [request.id]  # its cards settle to that outcome
        assert "a press on its card cancels it instead of approving" in str(refused.value)
        assert failure_count("approval_open_uncancelled") == before + 1


async def test_an_opening_whose_cancel_fails_is_reported_at_the_next_start(store_engine: Engine) -> None:
    """Nobody pressed and the process stopped without cancelling it: the next start ends it and tells the
    conversation that asked (its cards settle to that outcome)."""
    async with approval_service(store_engine.where, publisher=TableTakingPublisher(store_engine)) as service:
        try:
            with pytest.raises(ApprovalRefused, match="could not be cancelled"):
                await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        finally:
            await rename_table(store_engine, "approval_requests_away", "approval_requests")
    async with approval_service(store_engine.where, publisher=RecordingPublisher()) as restarted:
        recovery = await restarted.recover()
        [request] = recovery.cancelled
        assert request.status is Status.CANCELLED
        [(conversation, text)] = recovery.messages()
        assert conversation == "telegram:-100"
        assert f"The approval request for shell ({request.id}) was cancelled" in text


class HeldSettle(RecordingPublisher):
    """A publisher whose card edits take a while (a platform answering slowly), released by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def settle(self, request_id: str) -> None:
        self.entered.set()
        await self.release.wait()
        self.settled.append(request_id)


async def test_a_withdrawal_whose_asker_is_cancelled_midway_still_settles_its_cards_before_the_stop(
    store_engine: Engine,
) -> None:
    """A web server shutting down cancels an /mcp handler that runs past its timeout, possibly while its
    withdrawal is between the store's ``cancelled`` and the card edits: the request ended with its cards left
    live, and the stop's card drain had nothing to drain (the flaky ``test_kazma_stopped_with_an_mcp_call_…``)."""
    publisher = HeldSettle()
    async with approval_service(store_engine.where, publisher=publisher) as service:
        request = await service.open("shell", ARGS, "agent:mcp", "web:c", durable=True)
        handler = asyncio.ensure_future(service.withdraw(request.id, Gone.STOPPED))
        await asyncio.wait_for(publisher.entered.wait(), 10)
        handler.cancel()  # the server's shutdown timeout ran out on the handler
        with pytest.raises(asyncio.CancelledError):
            await handler
        stopping = asyncio.ensure_future(service.withdraw_turns())
        await asyncio.sleep(0)  # the stop has begun and waits
        assert not stopping.done()
        publisher.release.set()
        await asyncio.wait_for(stopping, 10)
        assert publisher.settled == [request.id]  # the edits were queued before the bus would drain
        stored = await service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.CANCELLED
