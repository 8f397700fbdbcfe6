"""A replica judged gone that comes back: what the leader reported as never run does not run after all.

Replica A waits for its agent's approval; A's link to PostgreSQL drops for longer than the takeover bound (or A
is SIGSTOPped past its lease). The leader sees A missing for good: it reports the approved call "did not run and
will not run on its own. Ask again" in the conversation and on every card. Then A comes back, its waiter reads
"approved", and the call ran (nothing looked at the report): the person, told to ask again, would run it twice.
Now the report and the start are ordered on the request's row: whichever comes first stands.
"""

from __future__ import annotations

import asyncio

import pytest

from kazma.approvals import Decision, ExecutionMismatch
from kazma.approvals.service import ApprovalService
from tests.approvals_support import approval_service

CALL = ("write_file", {"path": "/srv/a"})


def named(service: ApprovalService, replica: str) -> ApprovalService:
    service.store.replica = replica
    return service


async def test_an_approval_reported_as_never_run_does_not_run_when_its_replica_comes_back(pg_dsn: str) -> None:
    async with approval_service(pg_dsn) as a, approval_service(pg_dsn) as b:
        a, b = named(a, "rep-a"), named(b, "rep-b")
        request = await a.open(*CALL, "agent:builder", "discord:5")
        waiting = asyncio.create_task(a.wait(request.id))  # A's agent, waiting
        assert (await b.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won

        recovery = await b.recover({"rep-b"})  # the leader: rep-a has been missing for good
        assert [r.id for r in recovery.never_ran] == [request.id]
        assert "will not run on its own" in dict(recovery.messages())["discord:5"]

        assert (await waiting).approved  # rep-a is back: its waiter reads the approval
        with pytest.raises(ExecutionMismatch, match="already reported as not run"):
            await a.verify_execution(request.id, *CALL)
        events = [e.event for e in await a.store.events(request.id)]
        assert events == ["opened", "decided", "execution_lost", "execution_refused"]


async def test_a_call_its_replica_started_first_is_not_reported_as_never_run(pg_dsn: str) -> None:
    async with approval_service(pg_dsn) as a, approval_service(pg_dsn) as b:
        a, b = named(a, "rep-a"), named(b, "rep-b")
        request = await a.open(*CALL, "agent:builder", "discord:5")
        assert (await b.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        await a.verify_execution(request.id, *CALL)  # it runs
        recovery = await b.recover({"rep-b"})
        assert recovery.never_ran == []
        assert await b.store.events(request.id, event="execution_lost") == []


async def test_a_start_racing_the_report_either_runs_unreported_or_is_refused(pg_dsn: str) -> None:
    async with approval_service(pg_dsn) as a, approval_service(pg_dsn) as b:
        a, b = named(a, "rep-a"), named(b, "rep-b")
        for _ in range(10):
            request = await a.open(*CALL, "agent:builder", "discord:5")
            assert (await b.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
            ran, recovery = await asyncio.gather(
                a.verify_execution(request.id, *CALL), b.recover({"rep-b"}), return_exceptions=True
            )
            assert not isinstance(recovery, BaseException), recovery
            reported = [r.id for r in recovery.never_ran] == [request.id]
            assert reported == isinstance(ran, ExecutionMismatch), (ran, recovery)
            events = [e.event for e in await a.store.events(request.id)]
            assert events.count("execution_started") + events.count("execution_lost") == 1, events
