"""SIGKILL while a step waits for a person's answer: after a restart the question is shown again, and
answering it resumes the step where it stopped.

`kazma run` runs as a real process with the real OpenAI-compatible provider
(pointed at a fake model server, scripted per agent) and the real Telegram
adapter (pointed at a fake Bot API).
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from kazma.config import load_config
from kazma.config.store.database import connect
from kazma.engine.plan import StepStatus
from kazma.engine.plan_store import PlanStore
from tests.fakes.openai import Completion, FakeOpenAI, FakeToolCall
from tests.fakes.telegram import FakeTelegram
from tests.process_support import run_kazma

CHAT = -1001
ALICE = 42
PLAN = {
    "goal": "deploy",
    "steps": [{"index": 1, "title": "deploy", "assignee": "builder", "input": "Deploy the service."}],
}
QUESTION = "Which region should I deploy to?"


def bot_texts(fake: FakeTelegram) -> list[str]:
    return [m.text for m in fake.bot_messages(CHAT)]


@pytest.mark.slow
async def test_sigkill_while_a_question_waits_then_restart_shows_it_again_and_the_answer_resumes(
    tmp_path: Path,
) -> None:
    telegram = FakeTelegram()
    model = FakeOpenAI(models=("llama3.1",))
    await telegram.start()
    await model.start()
    config = tmp_path / "kazma.yaml"
    log = tmp_path / "kazma.log"
    store = tmp_path / "k.db"
    config.write_text(
        f"store: {{path: '{store}'}}\nweb: {{port: 0}}\n"
        f"model: {{base_url: '{model.base_url}', name: llama3.1, timeout_seconds: 60, max_retries: 0}}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{CHAT}], home_chat: {CHAT}, admins: [111]}}}}\n"
    )
    agents = load_config(config, environ={}).config.agents
    lead, builder = agents.lead.system_prompt, agents.workers["builder"].system_prompt
    model.script_agent(
        lead,
        Completion(tool_calls=(FakeToolCall("write_plan", json.dumps(PLAN)),)),
        Completion(content="Planned: the builder deploys."),
        Completion(content="The deploy is done."),  # after the restart, the plan's report
    )
    model.script_agent(
        builder,
        Completion(tool_calls=(FakeToolCall("ask_user", json.dumps({"question": QUESTION})),)),
        Completion(content="Waiting for the region."),
    )
    first = await run_kazma(config, log)
    try:
        await telegram.wait_until(lambda: len(telegram.calls_to("getUpdates")) > 0, timeout=60)
        telegram.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        await telegram.wait_until(lambda: any(QUESTION in t for t in bot_texts(telegram)), timeout=60)
        await telegram.wait_until(lambda: any("Waiting for the region." in t for t in bot_texts(telegram)), timeout=60)
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()

    conn = await connect(store)
    plans = PlanStore(conn)
    [waiting] = await plans.open_questions(f"telegram:{CHAT}")
    assert (waiting.question, waiting.answerer) == (QUESTION, f"telegram:{ALICE}")
    asked_before = sum(QUESTION in t for t in bot_texts(telegram))

    # after the restart the builder goes on from its answer
    model.script_agent(builder, Completion(content="Deployed to eu-west."))
    second = await run_kazma(config, log)
    try:
        await telegram.wait_until(lambda: sum(QUESTION in t for t in bot_texts(telegram)) > asked_before, timeout=60)
        again = [m for m in telegram.bot_messages(CHAT) if QUESTION in m.text][-1]
        async with asyncio.timeout(30):
            while (row := await plans.question(waiting.id)) is None or row.message_id != str(again.message_id):
                await asyncio.sleep(0.05)  # the re-shown question is recorded as the one to reply to
        plan = await plans.load(waiting.plan_id)
        assert plan is not None
        assert plan.steps[1].status is StepStatus.WAITING_FOR_USER  # not failed as interrupted

        telegram.push_message(CHAT, ALICE, "eu-west", reply_to=again.message_id)
        await telegram.wait_until(lambda: any("Deployed to eu-west." in t for t in bot_texts(telegram)), timeout=60)
        await telegram.wait_until(lambda: any("The deploy is done." in t for t in bot_texts(telegram)), timeout=60)
        plan = await plans.load(waiting.plan_id)
        assert plan is not None
        assert plan.steps[1].status is StepStatus.DONE
        resumed = [
            r for r in model.completions if r.body["messages"][0]["content"] == builder and "A: eu-west" in r.raw_body
        ]
        assert len(resumed) == 1  # the answer reached the builder, once
    finally:
        second.send_signal(signal.SIGTERM)
        await asyncio.wait_for(second.wait(), timeout=60)
        await conn.close()
        await model.stop()
        await telegram.stop()
    assert second.returncode == 0, log.read_text()[-3000:]
