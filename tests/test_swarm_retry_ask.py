"""A `/swarm retry` that must be confirmed is confirmed on whichever replica hears the second ask.

A task that may have done part of its work (interrupted, or failed after its tools ran) is retried only when asked
twice within five minutes. The first ask was kept in the process that heard it: with replicas behind one store the
second ask (a Slack event, the console, `kazma swarm` in a terminal) reached another process, which asked again.
Several processes here are several SwarmServices, each on its own connection to one SQLite file.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from kazma.config.store.database import open_database
from kazma.engine.swarm.commands import ASK_AGAIN, CONFIRM_WINDOW, SwarmCommands
from kazma.engine.swarm.service import SwarmService
from kazma.engine.swarm.state_store import MIGRATIONS as STATE
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import MIGRATIONS, SwarmTaskStore
from kazma.engine.swarm.types import Pattern
from tests.swarm_rig import Rig, config, failures, rig
from tests.swarm_support import ScriptedWorker, store_locked

CFG = """
agents:
  workers:
    a: {system_prompt: "You are a.", expertise: [alpha]}
pipelines: {standard: [a]}
swarm: {retries: 0}
"""


def worker() -> ScriptedWorker:
    return ScriptedWorker("a")


async def interrupted(r: Rig) -> str:
    """A task a crash interrupted mid-step: its retry asks first."""
    record = await r.ended(await r.send("dispatch a go"))
    run = await r.service.store.admit(Pattern.DISPATCH, record.request, owner="telegram:111")
    await r.service.store.step(run, "a")
    assert [i.task_id for i in await r.service.store.recover()] == [run.task_id]
    return run.task_id


@asynccontextmanager
async def replica(path: Path, r: Rig) -> AsyncIterator[SwarmCommands]:
    conn = await open_database(path, migrations=[*MIGRATIONS, *STATE], busy_timeout_ms=5000)
    service = SwarmService(SwarmTaskStore(conn), {"a": worker()}, r.service.config, state=SwarmStateStore(conn))
    try:
        yield SwarmCommands(service, r.service.config)
    finally:
        await service.close()
        await conn.close()


async def say(commands: SwarmCommands, text: str) -> str:
    return await commands.run(text, actor="telegram:111", platform="telegram", chat="-1001", is_admin=True)


async def test_the_second_ask_on_another_replica_confirms_the_retry(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with rig(path, {"a": worker()}, config(CFG)) as a, replica(path, a) as b:
        task_id = await interrupted(a)
        asked = await a.send(f"retry {task_id}")
        assert ASK_AGAIN in asked
        confirmed = await say(b, f"retry {task_id}")
        assert confirmed.startswith(f"swarm task {task_id} retried as "), confirmed
        # used up: the next ask anywhere asks again
        assert ASK_AGAIN in await a.send(f"retry {task_id}")


async def test_asks_heard_at_once_by_many_replicas_each_confirm_one_ask_never_the_same_one_twice(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.db"
    async with rig(path, {"a": worker()}, config(CFG)) as a, AsyncExitStack() as stack:
        others = [await stack.enter_async_context(replica(path, a)) for _ in range(8)]
        task_id = await interrupted(a)
        assert ASK_AGAIN in await a.send(f"retry {task_id}")
        answers = await asyncio.gather(*(say(b, f"retry {task_id}") for b in others))
        retried = [answer for answer in answers if answer.startswith(f"swarm task {task_id} retried as ")]
        asked = [answer for answer in answers if ASK_AGAIN in answer]
        assert len(retried) + len(asked) == len(answers), answers
        # Nine asks in all, as nine one after another: ask, confirm, ask, confirm… An ask used by two
        # confirmations would show as more retries than asks before them.
        assert len(retried) == 4, answers
        assert len({answer.rsplit(None, 1)[1] for answer in retried}) == 4  # four tasks, not one told four times
        left = await a.service.state.tables.all(  # type: ignore[union-attr]
            "SELECT actor FROM swarm_retry_asks WHERE task_id = ?", (task_id,)
        )
        assert len(left) == 1  # the ninth ask waits for its confirmation


async def test_an_ask_older_than_the_window_is_not_a_confirmation_and_another_persons_is_not_either(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.db"
    conn = await open_database(path, migrations=STATE)
    now = [1000.0]
    state = SwarmStateStore(conn, clock=lambda: now[0])
    try:
        assert not await state.asked_again("telegram:111", "t1", CONFIRM_WINDOW)
        assert not await state.asked_again("telegram:222", "t1", CONFIRM_WINDOW)  # someone else's first ask
        now[0] += CONFIRM_WINDOW + 1
        assert not await state.asked_again("telegram:111", "t1", CONFIRM_WINDOW)  # too late: a first ask again
        now[0] += 10
        assert await state.asked_again("telegram:111", "t1", CONFIRM_WINDOW)
        assert not await state.asked_again("telegram:111", "t2", CONFIRM_WINDOW)  # per task
        # stale asks are dropped as new ones come: the table holds only what the window saw
        rows = await conn.execute_fetchall("SELECT actor, task_id FROM swarm_retry_asks ORDER BY actor")
        assert [tuple(row) for row in rows] == [("telegram:111", "t2")]
    finally:
        await conn.close()


async def test_an_ask_the_store_cannot_keep_is_said_and_counted_and_nothing_runs(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    before = failures("retry_ask")
    async with rig(path, {"a": worker()}, config(CFG)) as r:
        task_id = await interrupted(r)
        tasks = len(await r.service.store.list(limit=100))
        async with store_locked(path):
            answer = await r.send(f"retry {task_id}")
        assert "unavailable" in answer, answer
        assert "send again" in answer, answer
        assert len(await r.service.store.list(limit=100)) == tasks
    assert failures("retry_ask") == before + 1
