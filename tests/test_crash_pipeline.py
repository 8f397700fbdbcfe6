"""SIGKILL in the middle of a /swarm pipeline: after a restart the task is interrupted, naming its step.

`kazma run` is a real process here, with the real Telegram adapter (fake Bot
API) and the real model provider (fake OpenAI-compatible server). The second
stage's model call hangs; the process is killed there.
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
from tests.fakes.openai import Completion, FakeOpenAI, Hang
from tests.fakes.telegram import FakeTelegram
from tests.process_support import run_kazma

CHAT = -1001


def asked(model: FakeOpenAI, prompt: str) -> int:
    return sum(1 for r in model.completions if r.body["messages"][0]["content"] == prompt)


@pytest.mark.slow
@pytest.mark.parametrize("latency", [0.0, 5.0], ids=["quick-start", "slow-start"])
async def test_sigkill_mid_pipeline_then_restart_reports_the_step(tmp_path: Path, latency: float) -> None:
    """``slow-start``: the restart's Telegram answers each call 5 s late, so its platforms are up well after
    the progress reporter's 3 s interval; the report of the interrupted task waits for them (it was sent to a
    Telegram adapter not started yet, and lost: found by the chaos matrix, swarm.step.started=hang on
    PostgreSQL)."""
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
    workers = load_config(config, environ={}).config.agents.workers
    researcher, builder = workers["researcher"].system_prompt, workers["builder"].system_prompt
    model.script(Completion(content="facts: the sky is blue"), Hang())
    first = await run_kazma(config, log)
    try:
        await telegram.wait_until(lambda: len(telegram.calls_to("getUpdates")) > 0, timeout=180)
        telegram.push_message(CHAT, 111, "/swarm pipeline quick collect facts", username="ops")
        await model.wait_for(lambda: asked(model, builder) == 1, timeout=180)
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()

    conn = await connect(store)
    tasks = SwarmTaskStore(conn)
    try:
        (running,) = await tasks.list(TaskStatus.RUNNING)  # on disk, RUNNING, when the process died
        telegram.latency = latency
        second = await run_kazma(config, log)
        try:
            await telegram.wait_until(
                lambda: any("was interrupted in" in m.text for m in telegram.bot_messages(CHAT)), timeout=180
            )
            record = await tasks.get(running.id)
            assert record is not None
            assert record.status is TaskStatus.INTERRUPTED
            assert "stage 2 (builder)" in (record.error or "")
            assert "outcome is unknown" in (record.error or "")
            journal = await tasks.journaled(running.id)
            assert [(s.idx, s.worker, s.ok) for s in journal] == [(0, "researcher", True)]
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), timeout=180)
        assert second.returncode == 0, log.read_text()[-3000:]
    finally:
        await conn.close()
        await model.stop()
        await telegram.stop()
    assert asked(model, researcher) == 1  # no step ran twice
    assert asked(model, builder) == 1
