"""A plan step's tool starts only while its step is still that turn's, and a swarm task's only while the task
is still that run's, on both engines (see StepFence, TaskFence).

The check and the execution row are one statement: a step failed, run again, paused on a question, or run on
another replica writes no row, nor does a task ended elsewhere, moved to a new run, or run on another replica;
the call does not start (:class:`FencedOut`)."""

from __future__ import annotations

import pytest

from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import PlanStore
from kazma.engine.swarm.store import SwarmTaskStore, TaskRun
from kazma.engine.swarm.types import Pattern
from kazma.engine.tools.executions import ExecutionRecord, FencedOut
from tests.store_backends import Engine, open_store, raw_rows

CHAT = "telegram:-1"


async def _start(record: ExecutionRecord, plans: PlanStore, plan_id: str, attempt: int) -> str:
    return await record.started(
        tool="write_file",
        args_hash="h",
        request_id=None,
        conversation=CHAT,
        agent="builder",
        changes_state=True,
        scope=f"plan:{plan_id}:1:{attempt}",
        fence=plans.fence(plan_id, 1, attempt),
    )


async def test_a_tool_starts_only_while_its_step_is_its_turns(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        plans = PlanStore(conn, replica="c")
        record = ExecutionRecord(conn, replica="c")
        spec = PlanSpec(goal="g", steps=[StepSpec(index=1, title="build", assignee="builder", input="build")])
        plan = await plans.create(CHAT, spec, PlanOrigin("g", "telegram:111"))
        assert await plans.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS, count_attempt=True)

        first = await _start(record, plans, plan.id, 1)  # running, attempt 1, on c: it starts
        with pytest.raises(FencedOut):
            await _start(record, plans, plan.id, 2)  # not this attempt
        elsewhere = PlanStore(conn, replica="b")
        with pytest.raises(FencedOut):
            await _start(record, elsewhere, plan.id, 1)  # not the replica running it
        assert await plans.set_status(plan.id, 1, StepStatus.IN_PROGRESS, StepStatus.FAILED, failure_reason="x")
        with pytest.raises(FencedOut):
            await _start(record, plans, plan.id, 1)  # taken away

        rows = raw_rows(store_engine, "SELECT id, outcome, exit_code, error FROM tool_executions", ())
        assert rows == [(first, None, None, "")]


async def _start_task_tool(record: ExecutionRecord, tasks: SwarmTaskStore, run: TaskRun) -> str:
    return await record.started(
        tool="write_file",
        args_hash="h",
        request_id=None,
        conversation="swarm",
        agent="builder",
        changes_state=True,
        scope=f"swarm:{run.task_id}:1",
        task_id=run.task_id,
        fence=tasks.fence(lambda: run),
    )


async def test_a_swarm_tool_starts_only_while_its_task_is_its_runs(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        tasks = SwarmTaskStore(conn, replica="c")
        record = ExecutionRecord(conn, replica="c")
        run = await tasks.admit(Pattern.PIPELINE, {"prompt": "p"}, owner="web:x")

        first = await _start_task_tool(record, tasks, run)  # running, this run, on c: it starts
        with pytest.raises(FencedOut):
            await _start_task_tool(record, SwarmTaskStore(conn, replica="b"), run)  # not the replica running it
        assert await tasks.pause(run, "checkpoint:r1")
        with pytest.raises(FencedOut):
            await _start_task_tool(record, tasks, run)  # paused at a checkpoint
        resumed = await tasks.resume(run.task_id)
        with pytest.raises(FencedOut):
            await _start_task_tool(record, tasks, run)  # the run before the resume
        second = await _start_task_tool(record, tasks, resumed)
        assert await tasks.cancel(run.task_id, actor="telegram:111")
        with pytest.raises(FencedOut):
            await _start_task_tool(record, tasks, resumed)  # ended (cancelled elsewhere, or by the leader)

        rows = raw_rows(store_engine, "SELECT id FROM tool_executions ORDER BY started_at", ())
        assert sorted(rows) == sorted([(first,), (second,)])
