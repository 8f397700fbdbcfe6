"""Two recoveries of what a gone replica left overlap, on a real PostgreSQL: the plan steps and swarm tasks.

Replica ``c`` is gone, leaving a plan step running. The leader ``a`` judges it gone and starts recovering; its
writes stall at a gate this test holds (a paused process, a slow network). Meanwhile another recovery runs (the
new leader's, or ``c``'s own at its restart under its name) and ``c``, back, goes on working. Then ``a`` goes on.
Attacked: a step is failed as interrupted once and the lead asked about it once; work that runs now (a retry of
the step, a plan or a task ``c`` started since) is never ended as interrupted by the stale judgement; what ``c``
owns now stays ``c``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from kazma.bot.store import pg_migrations
from kazma.config.store.postgres import PgStore, open_pg_store
from kazma.engine.executor import PlanExecutor, StepResult
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import PlanStore
from tests.test_executor import WORKERS, RecordingDispatcher

WAIT = 30.0
CHAT = "telegram:-1"
REQUESTER = "telegram:111"
LIVE = {"a", "b"}  # c is gone, as a and b judge


class Gate:
    """Where the old leader's recovery stalls: its first write of one kind waits until the test opens it."""

    def __init__(self) -> None:
        self.stalled = asyncio.Event()
        self.open = asyncio.Event()

    async def through(self) -> None:
        self.stalled.set()
        await self.open.wait()


class StallingPlanStore(PlanStore):
    """The old leader's plan store: failing a running step (the recovery's write) waits at the gate."""

    def __init__(self, conn: PgStore, gate: Gate) -> None:
        super().__init__(conn, replica="a")
        self.gate = gate

    async def set_status(self, plan_id: str, index: int, expected: StepStatus, new: StepStatus, **kw: Any) -> bool:
        if expected is StepStatus.IN_PROGRESS and new is StepStatus.FAILED:
            await self.gate.through()
        return await super().set_status(plan_id, index, expected, new, **kw)


@asynccontextmanager
async def _store(dsn: str, name: str) -> AsyncIterator[PgStore]:
    store = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"kazma {name}")
    try:
        yield store
    finally:
        await store.close()


def _executor(store: PlanStore) -> tuple[PlanExecutor, RecordingDispatcher]:
    dispatcher = RecordingDispatcher(store)
    return PlanExecutor(store, dispatcher, lead_name="kazma", assignees=WORKERS), dispatcher


def _plan(*steps: StepSpec) -> PlanSpec:
    return PlanSpec(goal="ship it", steps=list(steps) or [StepSpec(index=1, title="build", assignee="builder",
                                                                   input="build")])  # fmt: skip


async def _within(work: Awaitable[Any] | Callable[[], Awaitable[Any]]) -> Any:
    return await asyncio.wait_for(work() if callable(work) else work, WAIT)


async def test_a_step_retried_after_another_recovery_interrupted_it_is_not_interrupted_again(pg_dsn: str) -> None:
    """The leader read c's running step (attempt 1) and stalled before failing it; c restarted under its name,
    failed it itself, its lead retried it and c runs attempt 2. The leader, going on, failed attempt 2 — a step
    running on a live replica — as interrupted, and asked the lead about it a second time."""
    gate = Gate()
    async with _store(pg_dsn, "c") as sc, _store(pg_dsn, "a") as sa:
        c, _ = _executor(PlanStore(sc, replica="c"))
        plan = await c.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))  # step 1 runs on c; c dies
        leader, on_leader = _executor(StallingPlanStore(sa, gate))

        stalled = asyncio.create_task(leader.mark_interrupted(LIVE))  # the leader still leads: no lease lost
        await _within(gate.stalled.wait())
        back, on_back = _executor(PlanStore(sc, replica="c"))  # c restarted: its previous life's, at start
        failed, actions = await _within(back.mark_interrupted(LIVE))
        assert failed == [(plan.id, 1)]
        await back.perform(actions)
        assert on_back.asked_lead == [(plan.id, 1)]
        await back.retry_step(CHAT, 1, None, by="kazma")  # the lead retries it: attempt 2 runs on c
        gate.open.set()
        again, told = await _within(stalled)
        await leader.perform(told)

        loaded = await back.store.load(plan.id)
        assert loaded is not None
        assert (loaded.steps[1].status, loaded.steps[1].attempts) == (StepStatus.IN_PROGRESS, 2)
        assert again == []
        assert on_leader.asked_lead == [], "the lead asked about one interruption twice"


class StallingResultStore(PlanStore):
    """Replica c's plan store: a step's result (the write after its read of the step) waits at the gate."""

    def __init__(self, conn: PgStore, gate: Gate) -> None:
        super().__init__(conn, replica="c")
        self.gate = gate

    async def set_status(self, plan_id: str, index: int, expected: StepStatus, new: StepStatus, **kw: Any) -> bool:
        if expected is StepStatus.IN_PROGRESS and new is StepStatus.DONE:
            await self.gate.through()
        return await super().set_status(plan_id, index, expected, new, **kw)


async def test_the_result_of_a_step_recovered_meanwhile_never_ends_its_retry(pg_dsn: str) -> None:
    """c was judged gone while its step still ran (cut off from the database for longer than the takeover
    bound). Its result came in: c read the step (attempt 1, running) and stalled before writing it; the leader
    failed the step as interrupted and the lead retried it on b. c's write, going on, ended b's attempt 2 done
    with attempt 1's output, and b's own result was then refused."""
    gate = Gate()
    async with _store(pg_dsn, "c") as sc, _store(pg_dsn, "b") as sb:
        c, _ = _executor(StallingResultStore(sc, gate))
        plan = await c.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))  # step 1, attempt 1, runs on c
        finishing = asyncio.create_task(c.complete(plan.id, 1, StepResult(ok=True, summary="from c"), attempt=1))
        await _within(gate.stalled.wait())
        leader, _ = _executor(PlanStore(sb, replica="b"))
        failed, actions = await _within(leader.mark_interrupted(LIVE))  # c judged gone
        assert failed == [(plan.id, 1)]
        await leader.perform(actions)
        await leader.retry_step(CHAT, 1, None, by="kazma")  # attempt 2 runs on b
        gate.open.set()
        assert not await _within(finishing), "attempt 1's result recorded over attempt 2"

        loaded = await leader.store.load(plan.id)
        assert loaded is not None
        assert (loaded.steps[1].status, loaded.steps[1].attempts) == (StepStatus.IN_PROGRESS, 2)
        assert await leader.complete(plan.id, 1, StepResult(ok=True, summary="from b"), attempt=2)
        done = await leader.store.load(plan.id)
        assert done is not None
        assert done.steps[1].output_summary == "from b"
