"""Swarm progress is said in the order it happened, and a task's ending once where its result is delivered.

Progress lines are gathered (a few seconds at a time, for the platforms' rate limits) while a task's result is
posted at once: the result used to arrive before its own "started" line, and a home chat the result went to
read "succeeded" twice (the result, then the gathered ending line). Now the gathered lines go out before the
result, and the ending line is left out of the home chat that hears the result itself — the other home chats
still get it. Checked on the service (a real SQLite store, scripted workers) and on the wiring (the real bus
over the three platforms' adapters and wire fakes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from kazma.config.store.database import open_database
from kazma.engine.swarm.service import CoalescingReporter, ProgressLine, SwarmService
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore
from kazma.engine.swarm.types import SwarmRequest
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import SLACK_CHANNEL, TG_CHAT, kazma_on, three_fakes
from tests.swarm_rig import config
from tests.swarm_support import ScriptedWorker

ORIGIN = "telegram:-1001"


async def no_sleep(_: float) -> None:
    return


async def test_progress_goes_out_before_the_result_and_the_ending_is_marked_heard_where_it_is_delivered(
    tmp_path: Path,
) -> None:
    said: list[str] = []  # "report" and "deliver", in the order sent
    reports: list[list[ProgressLine]] = []
    delivered: list[tuple[str, str]] = []

    async def report(text: str) -> None:
        said.append("report")
        reports.append([ProgressLine(line) for line in text.splitlines()])

    async def report_lines(lines: Sequence[ProgressLine]) -> None:
        said.append("report")
        reports.append(list(lines))

    async def deliver(target: str, text: str) -> None:
        said.append("deliver")
        delivered.append((target, text))

    conn = await open_database(tmp_path / "k.db", migrations=MIGRATIONS)
    service = SwarmService(
        SwarmTaskStore(conn),
        {"researcher": ScriptedWorker("researcher")},
        config(),
        # an hour between batches: only the flush before the result can send the "started" line in time
        reporter=CoalescingReporter(report, interval=3600, send_lines=report_lines),
        deliver=deliver,
        sleep=no_sleep,
    )
    try:
        task_id = await service.submit(
            SwarmRequest("dispatch", ("researcher",), "look", "telegram:111", conversation=ORIGIN)
        )
        async with asyncio.timeout(20):
            while "deliver" not in said:
                await asyncio.sleep(0.01)
    finally:
        await service.close()
        await conn.close()

    assert said.index("report") < said.index("deliver"), said  # the progress first, then the result
    before = [line for batch in reports[: said.index("deliver")] for line in batch]
    started = next(line for line in before if f"swarm task {task_id} started" in line.text)
    ending = next(line for line in before if line.text.startswith(f"swarm task {task_id} succeeded"))
    assert started.heard_in is None  # news everywhere
    assert ending.heard_in == ORIGIN  # said by the result itself there
    [(target, text)] = delivered
    assert target == ORIGIN
    assert text.startswith(f"swarm task {task_id} succeeded:")


async def test_the_home_chat_that_gets_the_result_is_not_told_the_ending_twice(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        reporter = app.swarm.reporter
        assert reporter is not None
        reporter.add("swarm task t1 started: dispatch with researcher")
        reporter.add("swarm task t1 succeeded: done (tools: none)", heard_in=f"telegram:{TG_CHAT}")
        await reporter.flush()

        def telegram() -> list[str]:
            return [m.text for m in fakes.telegram.bot_messages(TG_CHAT)]

        def slack() -> list[str]:
            return [m.text for m in fakes.slack.channel(SLACK_CHANNEL)]

        def discord() -> list[str]:
            return [str(m.get("content", "")) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)]

        await fakes.wait(lambda: bool(telegram()) and bool(slack()) and bool(discord()))
        assert not any("succeeded" in t for t in telegram())  # heard there with the result itself
        assert any("started" in t for t in telegram())
        assert any("started" in t and "succeeded" in t for t in slack())  # the other homes hear the ending
        assert any("started" in t and "succeeded" in t for t in discord())
