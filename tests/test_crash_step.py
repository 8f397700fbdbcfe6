"""SIGKILL while a sub-agent's step runs: after a restart the step is interrupted, never run twice.

`kazma run` runs as a real process with the real OpenAI-compatible provider
(pointed at a fake model server) and the real Telegram adapter (pointed at a
fake Bot API). The researcher's model call hangs, the process is killed,
and the restarted process must report the step as interrupted with an unknown
outcome and ask the lead — without dispatching it again.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from kazma.config import load_config
from kazma.config.store.database import connect
from kazma.engine.executor import INTERRUPTED
from kazma.engine.plan import StepStatus
from kazma.engine.plan_store import PlanStore
from kazma.engine.tools.executions import ExecutionSummary
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall, Hang
from tests.fakes.telegram import FakeTelegram
from tests.process_support import run_kazma

CHAT = -1001
PLAN = {
    "goal": "collect sources",
    "steps": [{"index": 1, "title": "research", "assignee": "researcher", "input": "Find three sources."}],
}


def bot_texts(fake: FakeTelegram) -> list[str]:
    return [m.text for m in fake.bot_messages(CHAT)]


def researcher_requests(model: FakeOpenAI, prompt: str) -> int:
    return sum(1 for r in model.completions if r.body["messages"][0]["content"] == prompt)


@pytest.mark.slow
async def test_sigkill_during_a_step_then_restart_reports_it_interrupted(tmp_path: Path) -> None:
    telegram = FakeTelegram()
    model = FakeOpenAI(models=("llama3.1",))
    await telegram.start()
    await model.start()
    config = tmp_path / "kazma.yaml"
    log = tmp_path / "kazma.log"
    store = tmp_path / "k.db"
    config.write_text(
        f"store: {{path: '{store}'}}\nweb: {{port: 0}}\n"
        f"model: {{base_url: '{model.base_url}', name: llama3.1, timeout_seconds: 600, max_retries: 0}}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{CHAT}], home_chat: {CHAT}, admins: [111]}}}}\n"
    )
    researcher_prompt = load_config(config, environ={}).config.agents.workers["researcher"].system_prompt
    model.script(
        Completion(tool_calls=(FakeToolCall("write_plan", json.dumps(PLAN)),)),  # the lead plans
        Completion(content="Plan made."),  # and announces it: the first dispatch follows this reply
        Hang(),  # the researcher's step: in flight when the process dies
        Completion(content="Step 1 was interrupted; I will ask the researcher again only if you want."),
    )
    first = await run_kazma(config, log)
    try:
        await telegram.wait_until(lambda: len(telegram.calls_to("getUpdates")) > 0, timeout=60)
        telegram.push_message(CHAT, 42, "@kazma find three sources", username="alice")
        await telegram.wait_until(lambda: any("@researcher" in t for t in bot_texts(telegram)), timeout=60)
        # the researcher's step has arrived and hangs
        await model.wait_for(lambda: len(model.completions) == 3, timeout=60)
        assert researcher_requests(model, researcher_prompt) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()

    conn = await connect(store)
    plans = PlanStore(conn)
    ((plan_id, index),) = await plans.with_steps_in(StepStatus.IN_PROGRESS)  # on disk before it ran
    second = await run_kazma(config, log)
    try:
        await telegram.wait_until(lambda: any("Step 1 was interrupted" in t for t in bot_texts(telegram)), timeout=60)
        plan = await plans.load(plan_id)
        assert plan is not None
        assert plan.steps[index].status is StepStatus.FAILED
        # no tool of the step had started: its ending says so (its model call hung)
        assert plan.steps[index].failure_reason == f"{INTERRUPTED} (tools: {ExecutionSummary().line()})"
        assert await plans.with_steps_in(StepStatus.IN_PROGRESS) == []
    finally:
        second.send_signal(signal.SIGTERM)
        await asyncio.wait_for(second.wait(), timeout=60)
        await conn.close()
        await model.stop()
        await telegram.stop()
    assert second.returncode == 0, log.read_text()[-3000:]
    assert sum("@researcher" in t for t in bot_texts(telegram)) == 1  # dispatched once, never again
    assert researcher_requests(model, researcher_prompt) == 1
