"""The leader changes in the middle of recovering what a gone replica left, on a real PostgreSQL.

Replica ``c`` is gone, leaving pending requests (orphans), approved calls it verified to run and never
reported ended, and one approved call it never started. The old leader ``a`` starts the recovery and stalls
half-way (a paused process, a slow network: its writes wait at a gate this test holds), the new leader ``b``
runs the whole recovery meanwhile, a person presses one of the orphans, and then ``a`` goes on from where it
stopped. Attacked: every orphan ends exactly once, none both cancelled and decided; every call is reported
once (one ``execution_lost`` audit row, one notice to its conversation); no audit row twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import psycopg
import pytest

from kazma.approvals import ApprovalService, ApprovalStore, Decision
from kazma.approvals.model import ApprovalRequest, Status
from kazma.approvals.service import Recovery
from kazma.config.store.postgres import PgStore
from tests.approvals_support import approvals_config
from tests.store_backends import replica_store

WAIT = 30.0
ORPHANS = 6
VERIFIED = 3
LIVE = {"a", "b"}  # c is gone


class StallingStore(ApprovalStore):
    """The old leader's store: its writes of one kind stop at a gate after ``after`` of them went through."""

    def __init__(self, conn: PgStore, *, stall: str, after: int) -> None:
        super().__init__(conn, replica="a")
        self.stall = stall
        self.after = after
        self.passed = 0
        self.stalled = asyncio.Event()  # set once a write waits at the gate
        self.gate = asyncio.Event()

    async def _through(self) -> None:
        self.passed += 1
        if self.passed > self.after:
            self.stalled.set()
            await self.gate.wait()

    async def finish(self, request_id: str, status: Status, **kw: Any) -> tuple[bool, ApprovalRequest | None]:
        if self.stall == "finish":
            await self._through()
        return await super().finish(request_id, status, **kw)

    async def execution_lost(self, request_id: str, detail: str, **kw: bool) -> bool:
        if self.stall == "execution_lost":
            await self._through()
        return await super().execution_lost(request_id, detail, **kw)


async def _nothing_ran(ids: Sequence[str]) -> Mapping[str, list[str | None]]:
    return {}  # the execution record holds no row: none of c's verified calls started


async def _all_lost(ids: Sequence[str]) -> Mapping[str, list[str | None]]:
    return {i: ["lost"] for i in ids}  # each started and never finished: it may have run


async def _left_by_c(service: ApprovalService) -> tuple[list[str], list[str], str]:
    """What replica c leaves behind: pending orphans, approved calls verified and never ended, one never started."""
    orphans = [(await service.open("shell", {"n": n}, "agent:b", "telegram:-100")).id for n in range(ORPHANS)]
    verified = []
    for n in range(VERIFIED):
        request = await service.open("shell", {"v": n}, "agent:b", "telegram:-100")
        assert (await service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        assert await service.store.execution_starts(request.id, "shell") is None  # verified, about to run
        verified.append(request.id)
    unstarted = await service.open("shell", {"u": 0}, "agent:b", "telegram:-100")
    assert (await service.decide(unstarted.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
    return orphans, verified, unstarted.id


def _events(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT request_id, event FROM approval_events WHERE request_id IS NOT NULL").fetchall()
    return [(str(r), str(e)) for r, e in rows]


async def _within(work: Awaitable[Any] | Callable[[], Awaitable[Any]]) -> Any:
    return await asyncio.wait_for(work() if callable(work) else work, WAIT)


@pytest.mark.parametrize(("stall", "started"), [("finish", False), ("execution_lost", False), ("execution_lost", True)])
async def test_a_leader_change_mid_recovery_ends_every_orphan_once_and_reports_every_call_once(
    pg_dsn: str, stall: str, started: bool
) -> None:
    config = approvals_config()
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "a") as sa, replica_store(pg_dsn, "b") as sb:
        orphans, verified, unstarted = await _left_by_c(ApprovalService(ApprovalStore(sc, replica="c"), config))
        old_store = StallingStore(sa, stall=stall, after=2 if stall == "finish" else 1)
        old = ApprovalService(old_store, config)
        new = ApprovalService(ApprovalStore(sb, replica="b"), config)
        old.executions_of = new.executions_of = _all_lost if started else _nothing_ran

        stalled = asyncio.create_task(old.recover(LIVE, batch=2))
        await _within(old_store.stalled.wait())
        # the new leader takes over and runs the whole recovery while the old one is stuck
        pressed = orphans[-1]
        if stall == "finish":  # a person presses an orphan the old leader read as pending and has yet to reach
            assert (await new.decide(pressed, Decision.DENY, actor="telegram:111", platform="telegram")).won
        taken: Recovery = await _within(new.recover(LIVE, batch=2))
        old_store.gate.set()
        resumed: Recovery = await _within(stalled)

    events = _events(pg_dsn)
    twice = sorted({pair for pair in events if events.count(pair) > 1})
    assert twice == [], f"audit rows written twice: {twice}"
    endings = {rid: [e for r, e in events if r == rid and e in ("cancelled", "decided")] for rid in orphans}
    for rid in orphans:
        # exactly one ending each: opened and decided (the press) or cancelled by one of the leaders, never both
        decisions = [e for r, e in events if r == rid and e == "decided"]
        assert len(endings[rid]) == 1, (rid, endings[rid], decisions)
    cancelled = [r.id for r in taken.cancelled] + [r.id for r in resumed.cancelled]
    assert sorted(cancelled) == sorted(r for r in orphans if endings[r] == ["cancelled"])
    assert len(cancelled) == len(set(cancelled)) == ORPHANS - (1 if stall == "finish" else 0)
    reported = [r.id for r in taken.never_ran + resumed.never_ran + taken.may_have_run + resumed.may_have_run]
    assert sorted(reported) == sorted([*verified, unstarted]), "each call reported once, to one conversation"
    assert len(taken.may_have_run + resumed.may_have_run) == (VERIFIED if started else 0)
    lost = [r for r, e in events if e == "execution_lost"]
    assert sorted(lost) == sorted([*verified, unstarted])


async def test_an_old_leader_that_resumes_after_losing_the_lease_stops_recovering(pg_dsn: str) -> None:
    """The old leader judged c gone, then stalled; meanwhile the new leader recovered, and c came back under its
    name and had a call approved that it is about to run. The old leader, resuming with its stale judgement,
    reported that call as never run (``execution_lost``), and c, reaching it, refused to run an approval a
    person had just given. A recovery goes on only while its replica leads."""
    config = approvals_config()
    leads = {"a": True}
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "a") as sa, replica_store(pg_dsn, "b") as sb:
        orphans, _, _ = await _left_by_c(ApprovalService(ApprovalStore(sc, replica="c"), config))
        old_store = StallingStore(sa, stall="finish", after=2)
        old = ApprovalService(old_store, config)
        new = ApprovalService(ApprovalStore(sb, replica="b"), config)

        stalled = asyncio.create_task(old.recover(LIVE, batch=2, leading=lambda: leads["a"]))
        await _within(old_store.stalled.wait())
        leads["a"] = False  # its lease ran out while it stalled; b leads and recovers
        await _within(new.recover(LIVE, batch=2))
        back = ApprovalService(ApprovalStore(sc, replica="c"), config)  # c, restarted under its name
        wanted = await back.open("shell", {"again": 1}, "agent:b", "telegram:-100")
        assert (await back.decide(wanted.id, Decision.APPROVE, actor="telegram:111", platform="telegram")).won
        old_store.gate.set()
        resumed: Recovery = await _within(stalled)

        assert wanted.id not in [r.id for r in resumed.never_ran]
        assert await back.store.execution_starts(wanted.id, "shell") is None  # c runs what was approved
    events = _events(pg_dsn)
    assert "execution_refused" not in {e for r, e in events if r == wanted.id}, events
    assert [e for r, e in events if r in orphans and e == "cancelled"] == ["cancelled"] * len(orphans)
