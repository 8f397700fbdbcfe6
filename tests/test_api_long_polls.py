"""The approvals API's long-polls share one wait per request and are answered in one step each (LongPolls).

Attacked: many long-polls of one request each waiting on the service and each stepping through it before the
one description could start (500 of them put the last answer 25-55 ms after the commit); one long-poll giving
up or failing taking the answer away from the others; a wait left behind on the service by long-polls that all
went away (it would keep the request watched, and expire it, for nobody); and the web server's stop holding
long-polls until its shutdown timeout. A real approvals service on a real store; only ``describe`` is the test's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from kazma.approvals import ApprovalService, Decision
from kazma.approvals.model import ApprovalRequest
from kazma.bot.console.long_polls import LongPolls
from tests.approvals_support import approval_service
from tests.store_backends import Engine
from tests.test_approval_waiters import HOUR, Steps

ARGS = {"command": "ls -la"}


class Described:
    """The answer's body for an ended request, counting how often it was made; ``fail``: raise this instead."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.fail: Exception | None = None

    async def __call__(self, ended: ApprovalRequest) -> bytes:
        self.made.append(ended.id)
        await asyncio.sleep(0)  # as describe does: it reads the store for an approval
        if self.fail is not None:
            raise self.fail
        return json.dumps({"id": ended.id, "status": ended.status.value}).encode()


async def _until(condition: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def _open(polls: LongPolls, request_id: str, count: int, *, wait: float) -> list[asyncio.Task[bytes]]:
    """``count`` long-polls of ``request_id``, each with ``?wait=`` ``wait``, once all of them are open."""
    opened = [asyncio.create_task(polls.answer_within(request_id, wait)) for _ in range(count)]
    await _until(lambda: polls.polling(request_id) == count)
    return opened


def _watched(service: ApprovalService, request_id: str) -> int:
    watch = service._waiters.watches.get(request_id)
    return 0 if watch is None else watch.waiters


async def test_long_polls_of_one_request_share_one_wait_and_one_description(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        described = Described()
        polls = LongPolls(service, described)
        answers = [asyncio.create_task(polls.answer_within(request.id, 60)) for _ in range(50)]
        await _until(lambda: polls.polling(request.id) == 50 and _watched(service, request.id) == 1)
        assert _watched(service, request.id) == 1  # one waiter on the service for the 50, not 50
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        bodies = await asyncio.wait_for(asyncio.gather(*answers), 10)
        assert {json.loads(b)["status"] for b in bodies} == {"approved"}
        assert len({id(b) for b in bodies}) == 1  # the one body, for every long-poll
        assert described.made == [request.id]
        assert polls.polling() == 0
        await _until(lambda: _watched(service, request.id) == 0)


async def test_each_long_poll_runs_once_after_the_decision_with_its_answer_made_before(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        described = Described()
        polls = LongPolls(service, described)
        steps = [0]
        waiting: list[Coroutine[Any, Any, bytes]] = [polls.answer_within(request.id, 60) for _ in range(100)]
        answers = [asyncio.create_task(Steps(poll, steps)) for poll in waiting]
        await _until(lambda: polls.polling(request.id) == 100 and _watched(service, request.id) == 1)
        steps[0] = 0
        await service.decide(request.id, Decision.DENY, actor="web:admin", platform="web", reason="no")
        await asyncio.wait_for(asyncio.gather(*answers), 10)
        # One step each: woken with the body ready. Woken through the service, each stepped again to await the
        # description it had to wait for (and the description could only start after all of them stepped).
        assert steps[0] == 100


async def test_a_long_poll_that_gives_up_leaves_the_others_answered_by_the_decision(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        polls = LongPolls(service, Described())
        staying = await _open(polls, request.id, 3, wait=60)
        with pytest.raises(TimeoutError):
            await polls.answer_within(request.id, 0.05)  # its own ?wait= ran out first
        assert polls.polling(request.id) == 3
        assert _watched(service, request.id) == 1
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        bodies = await asyncio.wait_for(asyncio.gather(*staying), 10)
        assert {json.loads(b)["status"] for b in bodies} == {"approved"}


async def test_long_polls_that_all_went_away_leave_no_wait_on_the_service(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        polls = LongPolls(service, Described())
        gone = [asyncio.create_task(polls.answer_within(request.id, 60)) for _ in range(4)]
        await _until(lambda: _watched(service, request.id) == 1)
        for poll in gone:
            poll.cancel()  # the clients went away
        await asyncio.gather(*gone, return_exceptions=True)
        await _until(lambda: _watched(service, request.id) == 0)
        assert polls.polling() == 0
        assert (await service.store.get(request.id)).status.value == "pending"  # type: ignore[union-attr]
        again = asyncio.create_task(polls.answer_within(request.id, 60))  # a new long-poll waits afresh
        await _until(lambda: _watched(service, request.id) == 1)
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        assert json.loads(await asyncio.wait_for(again, 10))["status"] == "approved"


async def test_a_description_that_failed_reaches_every_long_poll_and_the_next_one_tries_again(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        described = Described()
        described.fail = RuntimeError("the store went away")
        polls = LongPolls(service, described)
        answers = await _open(polls, request.id, 5, wait=60)
        await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        failed = await asyncio.wait_for(asyncio.gather(*answers, return_exceptions=True), 10)
        assert [str(f) for f in failed] == ["the store went away"] * 5
        assert described.made == [request.id]  # described once for all five, failed once for all five
        described.fail = None
        body = await asyncio.wait_for(polls.answer_within(request.id, 60), 10)  # not the failure kept
        assert json.loads(body)["status"] == "approved"


async def test_the_servers_stop_answers_every_open_long_poll_at_once_and_the_next_ones_too(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        polls = LongPolls(service, Described())
        answers = await _open(polls, request.id, 5, wait=3600)
        polls.stop()
        ended = await asyncio.wait_for(asyncio.gather(*answers, return_exceptions=True), 10)
        assert all(isinstance(e, TimeoutError) for e in ended), ended
        with pytest.raises(TimeoutError, match="stops"):
            await polls.answer_within(request.id, 3600)
        await _until(lambda: _watched(service, request.id) == 0)
        assert (await service.store.get(request.id)).status.value == "pending"  # type: ignore[union-attr]


async def test_the_servers_stop_as_a_long_polls_own_wait_runs_out_answers_every_long_poll(tmp_path: Path) -> None:
    async with approval_service(tmp_path / "k.db", poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        polls = LongPolls(service, Described())
        staying = await _open(polls, request.id, 3, wait=3600)
        expiring = asyncio.create_task(polls.answer_within(request.id, 0))
        await asyncio.sleep(0)  # its first step: it waits, its timeout due at once
        await asyncio.sleep(0)  # its timeout ran (it is cancelled) and it has not run since
        assert not expiring.done()  # the turn in between: what is attacked
        assert polls.polling(request.id) == 4
        polls.stop()  # raised RuntimeError (an expiring timeout cannot be rescheduled), the rest left waiting
        ended = await asyncio.wait_for(asyncio.gather(*staying, expiring, return_exceptions=True), 10)
        assert all(isinstance(e, TimeoutError) for e in ended), ended
        assert polls.polling() == 0
