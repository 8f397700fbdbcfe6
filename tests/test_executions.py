"""The execution record on both engines: a row committed before a tool starts, finished when it ends, and rows a
dead process left running read "lost" — started, not finished: they may have run."""

from __future__ import annotations

from typing import Any

from kazma.engine.tools.executions import Ended, ExecutionRecord, Outcome, step_scope, task_scope
from tests.store_backends import Engine, open_store, raw_rows


async def test_rows_before_and_after_and_what_each_ending_says(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        record = ExecutionRecord(conn, replica="a")
        common: dict[str, Any] = {"conversation": "telegram:-1001", "agent": "builder", "request_id": "r1"}
        shell = await record.started(
            tool="shell", args_hash="h1", changes_state=True, scope=task_scope("t1", 1), task_id="t1", **common
        )
        # committed before the tool runs: another connection sees the row, not finished
        ((outcome, finished),) = raw_rows(
            store_engine, "SELECT outcome, finished_at FROM tool_executions WHERE id = ?", (shell,)
        )
        assert (outcome, finished) == (None, None)
        read = await record.started(
            tool="read_file", args_hash="h2", changes_state=False, scope=task_scope("t1", 1), task_id="t1", **common
        )
        await record.finished(read, Ended.OK)
        summary = await record.summary_of_task("t1")
        assert summary.outcome is Outcome.MAY_HAVE_RUN
        assert summary.line() == "may have run: shell (started, not finished)"  # read_file is not what it is about

        await record.finished(shell, Ended.FAILED, exit_code=2, error="exit 2")
        await record.finished(shell, Ended.OK)  # an ending is written once
        summary = await record.summary_of_task("t1")
        assert summary.line() == "ran: shell (exit 2)"
        assert summary.changed_state

        step = step_scope("p1", 0, 1)
        await record.started(tool="write_file", args_hash="h3", changes_state=True, scope=step, **common)
        assert (await record.summary_of_scope(step_scope("p1", 0))).outcome is Outcome.MAY_HAVE_RUN
        assert (await record.summary_of_scope(step_scope("p1", 1))).outcome is Outcome.DID_NOT_RUN


async def test_rows_a_dead_process_left_are_lost_and_the_same_call_is_found(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        mine, theirs = ExecutionRecord(conn, replica="a"), ExecutionRecord(conn, replica="b")
        common: dict[str, Any] = {"conversation": "web:c", "agent": "builder", "request_id": None}
        common["changes_state"] = True
        left_by_b = await theirs.started(tool="shell", args_hash="same", **common)
        running_here = await mine.started(tool="shell", args_hash="other", **common)
        lost = await mine.mark_lost(live={"a"})  # among replicas: b is gone, a lives
        assert [e.id for e in lost] == [left_by_b]
        earlier = await mine.may_have_run("shell", "same", "web:c")
        assert earlier is not None
        assert earlier.ended is Ended.LOST
        assert await mine.may_have_run("shell", "same", "web:other") is None  # another conversation's call
        await mine.finished(running_here, Ended.OK)
        assert await mine.may_have_run("shell", "other", "web:c") is None  # it finished: nothing to ask about
        assert [e.id for e in await mine.mark_lost(None)] == []  # a start: nothing else is left running
