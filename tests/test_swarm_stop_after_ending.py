"""A clean stop (or a cancel) that lands after a task's ending is stored, while it is being said, says that
ending, once — never "cancelled" for a task the store calls succeeded (found by the chaos matrix's swarm scenario:
its rig stops ``kazma run`` as soon as the store shows the task ended)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.config import load_config_text
from kazma.config.store.database import open_database
from kazma.engine.swarm.commands import SwarmCommands
from kazma.engine.swarm.service import CoalescingReporter, SwarmService
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore
from kazma.engine.swarm.types import TaskStatus, WorkerResult
from tests.swarm_support import ScriptedWorker

CONFIG = """
approvals: {approvers: ["telegram:111"], deadline_seconds: 600}
platforms: {telegram: {admins: [111]}}
"""


async def test_a_stop_while_the_stored_result_is_delivered_says_the_result_not_cancelled(tmp_path: Path) -> None:
    cfg = load_config_text(CONFIG).config
    conn = await open_database(tmp_path / "s.db", migrations=list(MIGRATIONS), busy_timeout_ms=50)
    reports: list[str] = []
    delivered: list[str] = []
    delivering, release = asyncio.Event(), asyncio.Event()

    async def report(text: str) -> None:
        reports.append(text)

    async def deliver(target: str, text: str) -> None:
        delivered.append(text)  # the platform has the message; its answer is on its way when the stop comes
        delivering.set()
        await release.wait()

    async def no_sleep(_: float) -> None:
        return

    worker = ScriptedWorker("builder", [WorkerResult("builder", True, "the script is written")])
    service = SwarmService(
        SwarmTaskStore(conn, sleep=no_sleep),
        {"builder": worker},
        cfg,
        reporter=CoalescingReporter(report, interval=0),
        deliver=deliver,
        sleep=no_sleep,
    )
    try:
        answer = await SwarmCommands(service, cfg).run(
            "dispatch builder write the script", actor="telegram:111", platform="telegram", chat="-1001", is_admin=True
        )
        task_id = answer.split()[2]
        async with asyncio.timeout(20):
            await delivering.wait()
        record = await service.store.get(task_id)
        assert record is not None
        assert record.status is TaskStatus.SUCCEEDED  # stored before it is said
        run = service._running[task_id]
        closing = asyncio.create_task(service.close())  # the clean stop, mid-delivery
        async with asyncio.timeout(20):
            while not run.cancelling() and not run.done():
                await asyncio.sleep(0.01)
        release.set()  # the platform answers the post
        await asyncio.wait_for(closing, 20)
    finally:
        release.set()
        await service.close()
        await conn.close()
    said = "\n".join([*reports, *delivered])
    print("DEBUG", reports, delivered)
    assert f"swarm task {task_id} cancelled" not in said
    results = [text for text in delivered if f"swarm task {task_id} succeeded" in text]
    assert len(results) == 1, delivered
    assert "the script is written" in results[0]
