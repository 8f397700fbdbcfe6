"""Waiters woken, not polling: a decision wakes every waiter of its request at once, read once for all of them.

Attacked: a waiter that gave up (an API long-poll's own timeout) taking the request's wake-up away from the
waiters still there, in this process and across replicas (NOTIFY); many waiters of one request each reading
it again; and the safety sweep, the only thing left for a decision nobody here heard of (another process on
the same file, a NOTIFY lost). The poll intervals are an hour wherever a wake-up is what is tested, so only
the wake-up can explain a waiter answered within the test's bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kazma.approvals import ApprovalService, Decision, Status
from kazma.approvals.model import ApprovalRequest
from tests.api_support import Door, kazma_door
from tests.approvals_support import ManualClock, approval_service
from tests.store_backends import Engine
from tests.test_bus import MemoryPlatform
from tests.test_replication import replica

HOUR = 3600.0
T = TypeVar("T")
ARGS = {"command": "ls -la"}


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def _polling(door: Door, request_id: str, count: int) -> Callable[[], bool]:
    """``count`` API long-polls of ``request_id`` are open (they share one wait on the service)."""
    api = door.server.api
    assert api is not None
    return lambda: api.polling(request_id) == count


def _waiting(service: ApprovalService, request_id: str, count: int) -> Callable[[], bool]:
    def check() -> bool:
        watch = service._waiters.watches.get(request_id)
        return watch is not None and watch.waiters == count

    return check


async def _one_gives_up(service: ApprovalService, request_id: str) -> asyncio.Task[ApprovalRequest]:
    """Two long-polls of ``request_id``; the first one's own timeout ends it. The one still waiting."""
    first = asyncio.create_task(service.wait_request(request_id, cancel_with_waiter=False))
    second = asyncio.create_task(service.wait_request(request_id, cancel_with_waiter=False))
    await _until(_waiting(service, request_id, 2))
    first.cancel()  # what asyncio.timeout does to a long-poll whose ?wait= ran out
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not second.done()
    return second


async def test_a_waiter_still_there_is_woken_after_another_waiter_of_its_request_gave_up(
    store_engine: Engine,
) -> None:
    async with approval_service(store_engine.where, poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        still = await _one_gives_up(service, request.id)
        result = await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")
        assert result.won
        ended = await asyncio.wait_for(still, timeout=10)  # an hour's poll cannot explain it
        assert (ended.status, ended.decided_by) == (Status.APPROVED, "web:admin")
        pending = await service.store.get(request.id)
        assert pending is not None
        assert pending.status is Status.APPROVED  # the one that gave up withdrew nothing


async def test_many_waiters_of_one_request_read_it_once_after_its_decision(
    store_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with approval_service(store_engine.where, poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        waiters = [asyncio.create_task(service.wait_request(request.id, cancel_with_waiter=False)) for _ in range(200)]
        await _until(_waiting(service, request.id, len(waiters)))
        watch = service._waiters.watches[request.id]
        # All asleep on the event: their first read (shared, started with the uncounted get) is over. A decision
        # landing while it ran would be read by it, before the commit or after: one read or none, by timing.
        await _until(lambda: len(watch.event._waiters) == len(waiters))
        reads: list[str] = []
        get = service.store.get

        async def counted(request_id: str) -> ApprovalRequest | None:
            reads.append(request_id)
            return await get(request_id)

        monkeypatch.setattr(service.store, "get", counted)
        await service.decide(request.id, Decision.DENY, actor="web:admin", platform="web", reason="no")
        ended = await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)
        assert {(r.status, r.reason) for r in ended} == {(Status.DENIED, "no")}
        # One read for all 200, not one each; on SQLite none: the decision's transaction read the request for them.
        assert len(reads) == (1 if store_engine.postgres else 0)
        assert len({id(r) for r in ended}) == 1  # one object for all: one answer encoded for all (the API's)


class Steps(Coroutine[Any, Any, T]):
    """A waiter's coroutine, counting each time its task runs it (a step of the task: one resumption)."""

    def __init__(self, inner: Coroutine[Any, Any, T], counter: list[int]) -> None:
        self.inner = inner
        self.counter = counter

    def send(self, value: Any) -> Any:
        self.counter[0] += 1
        return self.inner.send(value)

    def throw(self, *exc: Any) -> Any:
        self.counter[0] += 1
        return self.inner.throw(*exc)

    def close(self) -> None:
        self.inner.close()

    def __await__(self) -> Generator[Any, None, T]:
        raise NotImplementedError  # only ever run as a task's coroutine


async def test_a_decision_wakes_each_waiter_of_its_request_once_with_the_outcome_already_read(
    store_engine: Engine,
) -> None:
    # 500 long-polls of one request answered at once: each waiter's task running twice (woken, then parked on the
    # one read, then woken again by it) was twice the work of the wake-up, before any answer is written.
    async with approval_service(store_engine.where, poll_interval=HOUR) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci")
        steps = [0]
        waiters = [
            asyncio.create_task(Steps(service.wait_request(request.id, cancel_with_waiter=False), steps))
            for _ in range(100)
        ]
        await _until(_waiting(service, request.id, len(waiters)))
        watch = service._waiters.watches[request.id]
        await _until(lambda: len(watch.event._waiters) == len(waiters))  # all asleep on the event
        steps[0] = 0
        assert (await service.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")).won
        ended = await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)
        assert {(r.status, r.decided_by) for r in ended} == {(Status.APPROVED, "web:admin")}
        assert steps[0] == len(waiters)  # once each, not twice


async def test_a_decision_nobody_here_heard_of_still_ends_the_wait_by_the_safety_sweep(store_engine: Engine) -> None:
    # Two services on one store, as two processes on one SQLite file (the CLI beside `kazma run`) or a replica
    # whose NOTIFY was lost: nothing tells the waiter, only its sweep can find the decision.
    async with (
        approval_service(store_engine.where, poll_interval=0.05) as here,
        approval_service(store_engine.where, poll_interval=HOUR) as elsewhere,
    ):
        request = await here.open("shell", ARGS, "api:ci", "api:ci")
        waiter = asyncio.create_task(here.wait_request(request.id, cancel_with_waiter=False))
        await _until(_waiting(here, request.id, 1))
        assert (await elsewhere.decide(request.id, Decision.APPROVE, actor="web:admin", platform="web")).won
        ended = await asyncio.wait_for(waiter, timeout=10)
        assert (ended.status, ended.decided_by) == (Status.APPROVED, "web:admin")


async def test_the_sweep_ends_a_wait_whose_deadline_passed_by_the_services_clock(store_engine: Engine) -> None:

    clock = ManualClock()
    async with approval_service(store_engine.where, poll_interval=0.05, clock=clock) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci", deadline=HOUR)
        waiter = asyncio.create_task(service.wait(request.id))
        await _until(_waiting(service, request.id, 1))
        clock.advance(2 * HOUR)  # the loop's own timer still has an hour to go: only the sweep can notice
        outcome = await asyncio.wait_for(waiter, timeout=10)
        assert outcome.status is Status.TIMEOUT


async def test_many_waiters_past_their_requests_deadline_end_it_once(
    store_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    async with approval_service(store_engine.where, poll_interval=0.05, clock=clock) as service:
        request = await service.open("shell", ARGS, "api:ci", "api:ci", deadline=HOUR)
        waiters = [asyncio.create_task(service.wait(request.id, cancel_with_waiter=False)) for _ in range(50)]
        await _until(_waiting(service, request.id, len(waiters)))
        finishes: list[str] = []
        finish = service.store.finish

        async def counted(request_id: str, *args: Any, **kwargs: Any) -> Any:
            finishes.append(request_id)
            return await finish(request_id, *args, **kwargs)

        monkeypatch.setattr(service.store, "finish", counted)
        clock.advance(2 * HOUR)
        outcomes = await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)
        assert {o.status for o in outcomes} == {Status.TIMEOUT}
        assert finishes == [request.id]  # one compare-and-set ended it, not one per waiter


async def test_api_long_polls_left_after_one_gave_up_are_all_answered_by_one_press(tmp_path: Path) -> None:
    async with (
        kazma_door(tmp_path) as door,
        httpx.AsyncClient(base_url=door.url, headers=door.auth(), timeout=60, trust_env=False) as http,
    ):
        door.app.service.poll_interval = HOUR  # only the press's wake-up can answer them within the bound
        opened = (await http.post("/api/v1/approvals", json={"tool": "deploy", "arguments": {"env": "prod"}})).json()
        url = f"/api/v1/approvals/{opened['id']}"
        staying = [asyncio.create_task(http.get(url, params={"wait": "60"})) for _ in range(5)]
        await _until(_polling(door, opened["id"], 5), 30)
        gave_up = await http.get(url, params={"wait": "0.2"})  # its own ?wait= ends first
        assert gave_up.json()["status"] == "pending"
        await door.press("a")
        answers = await asyncio.wait_for(asyncio.gather(*staying), 20)
        assert {a.json()["status"] for a in answers} == {"approved"}
        assert len({a.text for a in answers}) == 1  # one description of the one read, for every long-poll


async def _wait_for(awaitable: Awaitable[ApprovalRequest], timeout: float) -> ApprovalRequest:
    return await asyncio.wait_for(awaitable, timeout)


async def test_a_decision_on_another_replica_wakes_the_waiter_left_after_one_gave_up(pg_dsn: str) -> None:
    platforms = [MemoryPlatform("telegram")]
    async with replica(pg_dsn, "a", platforms) as a, replica(pg_dsn, "b", platforms) as b:  # polls every minute
        request = await a.service.open("shell", {"command": "ls"}, "api:ci", "api:ci")
        still = await _one_gives_up(a.service, request.id)
        result = await b.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert result.won
        ended = await _wait_for(still, 15)  # NOTIFY, not the minute's poll
        assert (ended.status, ended.decided_by) == (Status.DENIED, "telegram:111")
