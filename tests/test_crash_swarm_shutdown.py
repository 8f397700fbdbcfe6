"""SIGTERM during a running /swarm task: the task ends cancelled (interrupted_by: shutdown), not interrupted.

The counterpart of ``test_crash_pipeline`` (SIGKILL still leaves ``interrupted``):
`kazma run` is a real process with the real Telegram adapter and model provider
pointed at local fakes; the worker's model call hangs while the process is stopped.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from kazma.config import load_config
from kazma.config.store.database import connect
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.types import TaskStatus
from kazma.engine.tools.executions import ExecutionSummary
from tests.fakes.openai import FakeOpenAI, Hang
from tests.fakes.telegram import FakeTelegram
from tests.process_support import run_kazma

CHAT = -1001
NOTHING_RAN = ExecutionSummary().as_json()  # the worker's model call hung: no tool was started


@pytest.mark.slow
async def test_sigterm_during_a_task_ends_it_cancelled_by_shutdown_and_a_restart_keeps_that(tmp_path: Path) -> None:
    telegram, model = FakeTelegram(), FakeOpenAI(models=("llama3.1",))
    await telegram.start()
    await model.start()
    config, log, store = tmp_path / "kazma.yaml", tmp_path / "kazma.log", tmp_path / "k.db"
    config.write_text(
        f"store: {{path: '{store}'}}\nweb: {{port: 0}}\n"
        f"model: {{base_url: '{model.base_url}', timeout_seconds: 600, max_retries: 0}}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{CHAT}], home_chat: {CHAT}, admins: [111]}}}}\n"
    )
    builder = load_config(config, environ={}).config.agents.workers["builder"].system_prompt
    model.script(Hang())
    conn = await connect(store)
    tasks = SwarmTaskStore(conn)
    try:
        first = await run_kazma(config, log)
        try:
            await telegram.wait_until(lambda: len(telegram.calls_to("getUpdates")) > 0, timeout=60)
            telegram.push_message(CHAT, 111, "/swarm dispatch builder write the script", username="ops")
            await model.wait_for(
                lambda: any(r.body["messages"][0]["content"] == builder for r in model.completions), timeout=60
            )
        finally:
            first.send_signal(signal.SIGTERM)
            await asyncio.wait_for(first.wait(), timeout=60)
        assert first.returncode == 0, log.read_text()[-3000:]
        (task,) = await tasks.list()
        assert task.status is TaskStatus.CANCELLED
        assert task.result == {"interrupted_by": "shutdown", "execution": NOTHING_RAN}
        second = await run_kazma(config, log)
        try:
            await telegram.wait_until(lambda: len(telegram.calls_to("getUpdates")) > 1, timeout=60)
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), timeout=60)
        record = await tasks.get(task.id)
        assert record is not None
        assert record.status is TaskStatus.CANCELLED  # the restart found nothing to call interrupted
        assert not any("was interrupted" in m.text for m in telegram.bot_messages(CHAT))
    finally:
        await conn.close()
        await model.stop()
        await telegram.stop()
