"""A cancel made by another process (`kazma swarm cancel` in a terminal while `kazma run` runs the task, or another
replica hearing /swarm cancel) stops the task where it runs, its tools with it; the person is told what is true.

Before, the other process changed only the row: the process running the task was never told, and its pipeline ran
every remaining stage (tools included) while the person had been answered "cancelled; tools: did not run".

Two SwarmServices on one SQLite file stand for the two processes: A runs the task, B hears the cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from kazma.config.store.database import open_database
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.service import SwarmService
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore
from kazma.engine.swarm.types import Pattern, TaskStatus
from tests.test_swarm_service import Rig, request, rig, scripted_workers


async def until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(20):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


@asynccontextmanager
async def other_process(path: Path, a: Rig) -> AsyncIterator[SwarmCommands]:
    conn = await open_database(path, migrations=MIGRATIONS)
    b = SwarmService(SwarmTaskStore(conn), scripted_workers(), a.service.config)
    try:
        yield SwarmCommands(b, a.service.config)
    finally:
        await b.close()
        await conn.close()


async def cancel_from_b(commands: SwarmCommands, task_id: str) -> str:
    return await commands.run(f"cancel {task_id}", actor="telegram:111", platform="telegram", chat="-1001",
                              is_admin=True)  # fmt: skip


async def test_a_cancel_from_another_process_stops_the_running_stage_and_no_later_stage_runs(tmp_path: Path) -> None:
    gate = asyncio.Event()
    workers = scripted_workers()
    workers["researcher"].gate = gate  # stage 1 is working when the cancel comes
    path = tmp_path / "kazma.db"
    async with rig(path, workers=workers) as a:
        a.service.ended_poll_seconds = 0.05
        task_id = await a.service.submit(request(Pattern.PIPELINE, ["researcher", "builder", "validator"]))
        await until(lambda: bool(workers["researcher"].seen), "stage 1 started")
        async with other_process(path, a) as b:
            answer = await cancel_from_b(b, task_id)
        assert f"swarm task {task_id} cancelled by telegram:111" in answer
        # Not "tools: did not run": B cannot know what A's tools are doing.
        assert "the Kazma process running it stops it within" in answer, answer
        async with asyncio.timeout(20):
            record = await a.service.wait(task_id, 20)
        assert task_id not in a.service._running  # stopped in stage 1, its gate never opened
        gate.set()
        assert record is not None
        assert record.status is TaskStatus.CANCELLED
        assert workers["builder"].seen == []
        assert workers["validator"].seen == []
        await until(lambda: any("stopped here: it was ended elsewhere" in r for r in a.reports), "A said it")


async def test_a_stage_boundary_refused_by_the_row_stops_the_task_before_the_next_stage(tmp_path: Path) -> None:
    # The poll is out of the way: the refused journal write at the end of stage 1 is what stops it.
    gate = asyncio.Event()
    workers = scripted_workers()
    workers["researcher"].gate = gate
    path = tmp_path / "kazma.db"
    async with rig(path, workers=workers) as a:
        a.service.ended_poll_seconds = 3600
        task_id = await a.service.submit(request(Pattern.PIPELINE, ["researcher", "builder", "validator"]))
        await until(lambda: bool(workers["researcher"].seen), "stage 1 started")
        async with other_process(path, a) as b:
            await cancel_from_b(b, task_id)
        gate.set()  # stage 1 finishes; its journal write is refused (the row is cancelled)
        async with asyncio.timeout(20):
            record = await a.service.wait(task_id, 20)
        assert record is not None
        assert record.status is TaskStatus.CANCELLED
        assert workers["builder"].seen == []
        assert workers["validator"].seen == []
        assert task_id not in a.service._running
