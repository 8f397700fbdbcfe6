"""Two recoveries of what a gone replica left overlap, on a real PostgreSQL: the plan steps and swarm tasks.

Replica ``c`` is gone, leaving a plan step running. The leader ``a`` judges it gone and starts recovering; its
writes stall at a gate this test holds (a paused process, a slow network). Meanwhile another recovery runs (the
new leader's, or ``c``'s own at its restart under its name) and ``c``, back, goes on working. Then ``a`` goes on.
Attacked: a step is failed as interrupted once and the lead asked about it once; work that runs now (a retry of
the step, a plan, a task or a tool call ``c`` started since) is never ended as interrupted (or lost) by the stale
judgement; what ``c`` owns now stays ``c``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import pytest

from kazma.bot.app import build_app
from kazma.config import load_config_text
from kazma.config.store.postgres import PgStore
from kazma.engine.executor import PlanExecutor, StepResult
from kazma.engine.model import ScriptedProvider
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import LeftStep, PlanStore
from kazma.engine.swarm.service import SwarmService
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import InterruptedTask, SwarmTaskStore
from kazma.engine.swarm.types import Pattern, TaskStatus
from kazma.engine.tools.executions import ExecutionRecord, ExecutionSummary
from tests.audit_support import AUDIT_KEY
from tests.store_backends import replica_store
from tests.swarm_rig import config as swarm_config
from tests.test_executor import WORKERS, RecordingDispatcher, hold_backoffs, running

WAIT = 30.0
CHAT = "telegram:-1"
OTHER_CHAT = "telegram:-2"
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

    async def fail_interrupted(self, left: LeftStep, *args: Any) -> ExecutionSummary | None:
        await self.gate.through()
        return await super().fail_interrupted(left, *args)


class StallingTaskStore(SwarmTaskStore):
    """The old leader's swarm store: the recovery's read-and-interrupt waits at the gate."""

    def __init__(self, conn: PgStore, gate: Gate) -> None:
        super().__init__(conn, replica="a")
        self.gate = gate

    async def recover(
        self, live: Collection[str] | None = None, *, leading: Callable[[], bool] | None = None
    ) -> list[InterruptedTask]:
        await self.gate.through()
        return await super().recover(live, leading=leading)


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
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "a") as sa:
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


async def test_an_old_leader_that_resumes_after_losing_the_lease_leaves_the_plans_of_a_replica_back(
    pg_dsn: str,
) -> None:
    """The old leader stalled in the middle of failing c's steps; the new leader recovered them, and c came back
    under its name and asked a person a question in a new plan. The old leader, going on with its stale
    judgement, took c's new plan over (it is the old leader's now: nobody repairs it when c dies) and posted
    c's question a second time."""
    gate = Gate()
    leads = {"a": True}
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "a") as sa, replica_store(pg_dsn, "b") as sb:
        c, _ = _executor(PlanStore(sc, replica="c"))
        left = await c.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))  # step 1 runs on c; c dies
        old, _ = _executor(StallingPlanStore(sa, gate))
        new, _ = _executor(PlanStore(sb, replica="b"))

        stalled = asyncio.create_task(old.mark_interrupted(LIVE, leading=lambda: leads["a"]))
        await _within(gate.stalled.wait())
        leads["a"] = False  # its lease ran out while it stalled; b leads and recovers
        assert (await _within(new.mark_interrupted(LIVE)))[0] == [(left.id, 1)]
        back, _ = _executor(PlanStore(sc, replica="c"))  # c restarted under its name, asks a person
        asking = await back.start(OTHER_CHAT, _plan(StepSpec(index=1, title="region", assignee="user", input="which?")),
                                  PlanOrigin("ship it", REQUESTER))  # fmt: skip
        gate.open.set()
        failed, told = await _within(stalled)

        assert failed == []
        assert [a.kind for a in told if a.plan.id == asking.id] == [], "c's question shown a second time"
        assert await back.store.owner(asking.id) == "c"


async def test_an_old_leader_that_resumes_after_losing_the_lease_leaves_the_swarm_tasks_of_a_replica_back(
    pg_dsn: str,
) -> None:
    """The old leader stalled before interrupting c's swarm tasks; the new leader recovered them, and c came back
    under its name, started a task and paused a pipeline at a checkpoint. The old leader, going on with its
    stale judgement, ended c's running task as interrupted (its tools still running on c) and took c's paused
    pipeline over (two replicas waiting for one checkpoint)."""
    gate = Gate()
    leads = {"a": True}
    cfg = swarm_config()
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "a") as sa, replica_store(pg_dsn, "b") as sb:
        on_c = SwarmTaskStore(sc, replica="c")
        left = await on_c.admit(Pattern.DISPATCH, {"prompt": "p"}, owner="web:x")  # running on c; c dies
        old = SwarmService(StallingTaskStore(sa, gate), {}, cfg, state=SwarmStateStore(sa))
        new = SwarmService(SwarmTaskStore(sb, replica="b"), {}, cfg, state=SwarmStateStore(sb))
        try:
            stalled = asyncio.create_task(old.recover_gone(LIVE, leading=lambda: leads["a"]))
            await _within(gate.stalled.wait())
            leads["a"] = False  # its lease ran out while it stalled; b leads and recovers
            assert len(await _within(new.recover_gone(LIVE))) == 1
            assert (await on_c.get(left.task_id)).status is TaskStatus.INTERRUPTED  # type: ignore[union-attr]
            running = await on_c.admit(Pattern.DISPATCH, {"prompt": "q"}, owner="web:x")  # c, back under its name
            paused = await on_c.admit(Pattern.PIPELINE, {"prompt": "r"}, owner="web:x")
            assert await on_c.pause(paused, "checkpoint:req1")
            gate.open.set()
            lines = await _within(stalled)
        finally:
            await old.close()
            await new.close()

        assert lines == []
        assert (await on_c.get(running.task_id)).status is TaskStatus.RUNNING  # type: ignore[union-attr]
        row = await on_c.tables.one("SELECT replica FROM swarm_tasks WHERE id = ?", (paused.task_id,))
        assert row is not None
        assert row[0] == "c", "c's paused pipeline taken over by the old leader"


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
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "b") as sb:
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


async def test_the_leaders_sweep_stops_recovering_steps_tasks_and_calls_once_it_no_longer_leads(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring: a Kazma replica leading on PostgreSQL judges c gone and starts recovering; its lease runs
    out as the recovery begins (a stall). What c runs now (back under its name) — a tool call, a plan step, a
    swarm task — is left running: each part asks whether this replica still leads before writing."""
    monkeypatch.setenv("KAZMA_REPLICA", "a")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    loaded = load_config_text(
        f"store: {{url: '{pg_dsn}'}}\napprovals: {{deadline_seconds: 600, approvers: ['telegram:111']}}\n", environ={}
    )
    app = await build_app(loaded, adapters=[], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
    await app.start()
    try:
        replication = app.replication
        executions = app.executions
        assert replication is not None
        assert executions is not None
        await _within(replication.lease.wait_leader())
        await app._leader_tasks.stop()  # its own sweeps out of the way: this test runs the recovery
        async with replica_store(pg_dsn, "c") as sc:  # what c, back under its name, runs now
            call = await ExecutionRecord(sc, replica="c").started(
                tool="shell", args_hash="h", request_id=None, conversation=CHAT, agent="builder", changes_state=True
            )
            c, _ = _executor(PlanStore(sc, replica="c"))
            plan = await c.start(CHAT, _plan(), PlanOrigin("ship it", REQUESTER))
            task = await SwarmTaskStore(sc, replica="c").admit(Pattern.DISPATCH, {"prompt": "p"}, owner="web:x")
            mark_lost = executions.mark_lost

            async def stalled(*args: Any, **kwargs: Any) -> Any:
                await replication.lease.stop()  # the stall outlasted its lease: another replica leads now
                return await mark_lost(*args, **kwargs)

            monkeypatch.setattr(executions, "mark_lost", stalled)
            await app._recover_replicas({"a"})

            outcome = await c.store.tables.one("SELECT outcome FROM tool_executions WHERE id = ?", (call,))
            assert outcome is not None
            assert outcome[0] is None, "c's call running now marked lost"
            loaded_plan = await c.store.load(plan.id)
            assert loaded_plan is not None
            assert loaded_plan.steps[1].status is StepStatus.IN_PROGRESS
            record = await SwarmTaskStore(sc).get(task.task_id)
            assert record is not None
            assert record.status is TaskStatus.RUNNING
    finally:
        await app.stop()


async def test_the_interrupted_line_does_not_say_a_replica_judged_gone_stopped(pg_dsn: str) -> None:
    """The leader's line for c's task said "the Kazma replica running it stopped" while c only was judged gone
    (cut off, paused) and may still run it: its watch then stops the task and says so. The line says what is
    known: judged gone, and what happens if it still runs."""
    cfg = swarm_config()
    async with replica_store(pg_dsn, "c") as sc, replica_store(pg_dsn, "b") as sb:
        left = await SwarmTaskStore(sc, replica="c").admit(Pattern.DISPATCH, {"prompt": "p"}, owner="web:x")
        leader = SwarmService(SwarmTaskStore(sb, replica="b"), {}, cfg, state=SwarmStateStore(sb))
        try:
            lines = await _within(leader.recover_gone(LIVE))
        finally:
            await leader.close()

    assert len(lines) == 1
    assert left.task_id in lines[0]
    assert "replica running it stopped" not in lines[0]
    assert "judged gone" in lines[0]
    assert "if it still runs, it stops the task" in lines[0]


async def test_a_step_in_backoff_on_a_replica_judged_gone_runs_once_whoever_moves_the_plan_on(pg_dsn: str) -> None:
    """Replica a: step 1 waits out its backoff (in a's memory), step 2 went on meanwhile and runs on a. a stalls and
    is judged gone: b fails step 2 as interrupted, takes the plan over, and its lead gives step 2 up, so b hands
    step 1 out. Then a's wait ends (a was only paused): it must not hand step 1 out a second time, nor run anything
    beside it, and what comes after step 1 runs once, on b."""
    async with replica_store(pg_dsn, "a") as sa, replica_store(pg_dsn, "b") as sb:
        a, on_a = _executor(PlanStore(sa, replica="a"))
        sleeps = hold_backoffs(a)
        steps = [StepSpec(index=1, title="build", assignee="builder", input="build"),
                 StepSpec(index=2, title="docs", assignee="researcher", input="docs", wait_for=[]),
                 StepSpec(index=3, title="ship", assignee="builder", input="ship", wait_for=[1])]  # fmt: skip
        plan = await a.start(CHAT, _plan(*steps), PlanOrigin("ship it", REQUESTER))
        await a.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        assert running(on_a, plan.id) == [(1, 1), (2, 1)]
        [waiting] = a._waits.values()

        b, on_b = _executor(PlanStore(sb, replica="b"))
        failed, actions = await _within(b.mark_interrupted({"b"}))
        assert failed == [(plan.id, 2)]
        await b.perform(actions)
        assert on_b.asked_lead == [(plan.id, 2)]
        assert running(on_b, plan.id) == []  # the lead decides first
        await b.lead_decided(plan.id, 2, 1)  # it gives step 2 up
        assert running(on_b, plan.id) == [(1, 2)]
        assert await b.store.owner(plan.id) == "b"

        sleeps.events[0].set()  # a goes on: its wait ends
        await _within(waiting)
        assert running(on_a, plan.id) == [(1, 1), (2, 1)], "a handed a step out beside b's"
        again, told = await _within(b.mark_interrupted({"b"}))  # the next sweep: nothing left to repair
        assert (again, told) == ([], [])
        await b.complete(plan.id, 1, StepResult(ok=True, summary="built"), attempt=2)
        assert running(on_b, plan.id) == [(1, 2), (3, 1)]
        assert on_a.violations == on_b.violations == []


class StallingStarts(PlanStore):
    """A replica's plan store whose next start of a step (pending -> in progress) waits at the gate: it read the
    plan idle and chose its step, and has not written yet."""

    def __init__(self, conn: PgStore, replica: str, gate: Gate) -> None:
        super().__init__(conn, replica=replica)
        self.gate: Gate | None = gate

    async def set_status(self, plan_id: str, index: int, expected: StepStatus, new: StepStatus, **kw: Any) -> bool:
        if self.gate is not None and expected is StepStatus.PENDING and new is StepStatus.IN_PROGRESS:
            gate, self.gate = self.gate, None
            await gate.through()
        return await super().set_status(plan_id, index, expected, new, **kw)


async def test_two_replicas_moving_a_plan_with_backoffs_at_once_never_start_two_of_its_steps(pg_dsn: str) -> None:
    """Replica a: steps 1 and 2 wait out backoffs (in a's memory), a person is asked step 3. The person's answer is
    taken on b, which knows of no backoff and chooses step 1; as it writes, step 2's wait ends on a, which chooses
    step 2 (step 1 still waits, for a). Each compare-and-set was on its own step: both ran, at once."""
    gate = Gate()
    async with replica_store(pg_dsn, "a") as sa, replica_store(pg_dsn, "b") as sb:
        a, on_a = _executor(PlanStore(sa, replica="a"))
        sleeps = hold_backoffs(a)
        steps = [StepSpec(index=1, title="build", assignee="builder", input="build"),
                 StepSpec(index=2, title="docs", assignee="researcher", input="docs", wait_for=[]),
                 StepSpec(index=3, title="region", assignee="user", input="which region?", wait_for=[]),
                 StepSpec(index=4, title="ship", assignee="builder", input="ship", wait_for=[1, 2, 3])]  # fmt: skip
        plan = await a.start(CHAT, _plan(*steps), PlanOrigin("ship it", REQUESTER))
        await a.complete(plan.id, 1, StepResult(ok=False, error="HTTP 429", transient=True), attempt=1)
        await a.complete(plan.id, 2, StepResult(ok=False, error="HTTP 503", transient=True), attempt=1)
        [question] = on_a.questions
        assert len(a._waits) == 2

        b, on_b = _executor(StallingStarts(sb, "b", gate))
        answering = asyncio.create_task(b.answer(question, "eu", actor=REQUESTER))
        await _within(gate.stalled.wait())  # b chose step 1 and is about to start it
        second = a._waits[(plan.id, 2)]
        sleeps.events[1].set()  # step 2's wait ends on a
        await _within(second)
        gate.open.set()
        await _within(answering)

        loaded = await b.store.load(plan.id)
        assert loaded is not None
        started = sorted(i for i, s in loaded.steps.items() if s.status is StepStatus.IN_PROGRESS)
        assert started == [2], f"steps {started} run at once"
        # b's start lost: step 1 is still pending, and runs once after its wait and step 2, on a
        assert loaded.steps[1].status is StepStatus.PENDING
        first = a._waits[(plan.id, 1)]
        sleeps.events[0].set()
        await _within(first)
        assert running(on_a, plan.id) == [(1, 1), (2, 1), (2, 2)]
        await a.complete(plan.id, 2, StepResult(ok=True, summary="docs"), attempt=2)
        assert running(on_a, plan.id)[-1] == (1, 2)
        assert running(on_b, plan.id) == []
        assert on_a.violations == on_b.violations == []
