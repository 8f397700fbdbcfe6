"""A clean stop (or a cancel) that lands after a task's ending is stored, while it is being said, says that
ending — never "cancelled" for a task the store calls succeeded (found by the chaos matrix's swarm scenario:
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
    delivering = asyncio.Event()

    async def report(text: str) -> None:
        reports.append(text)

    async def deliver(target: str, text: str) -> None:
        if not delivering.is_set():  # the first delivery is still on its way when the stop comes
            delivering.set()
            await asyncio.Event().wait()
        delivered.append(text)

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
    finally:
        await service.close()  # the clean stop, mid-delivery
        await conn.close()
    said = "\n".join([*reports, *delivered])
    assert f"swarm task {task_id} cancelled" not in said
    assert any(f"swarm task {task_id} succeeded" in text and "the script is written" in text for text in delivered)
