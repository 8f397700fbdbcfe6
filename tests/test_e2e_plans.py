"""Plans that recover, end to end on the real Telegram library against the wire-level fake Bot API.

Only the model is scripted (per agent). What is checked is what people and
agents really see: the dispatches, the question, who may answer it, and what
reaches the sub-agent when it goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.telegram import TelegramAdapter
from kazma.bot.app import App, build_app
from kazma.config import load_config_text
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from kazma.engine.model import ScriptStep
from kazma.engine.plan import Plan, StepStatus
from kazma.engine.scenario import PerAgentScript, agent_prompts
from kazma.engine.types import Message, ModelError, ModelReply, ToolCall
from tests.fakes.telegram import FakeTelegram, Fault
from tests.outside_writes import write_around

CHAT = -1001
ALICE = 42
STRANGER = 77


def call(name: str, arguments: Mapping[str, object]) -> ModelReply:
    return ModelReply(content=None, tool_calls=(ToolCall(name, name, dict(arguments), json.dumps(arguments)),))


@asynccontextmanager
async def kazma(
    tmp_path: Path, scripts: dict[str, list[ScriptStep]], *, extra: str = ""
) -> AsyncIterator[tuple[App, FakeTelegram]]:
    fake = FakeTelegram()
    await fake.start()
    loaded = load_config_text(
        f"""
store: {{path: '{tmp_path / "k.db"}'}}
web: {{port: 0}}
platforms:
  telegram:
    token: '{fake.token}'
    api_base_url: '{fake.base_url}'
    chats: [{CHAT}]
    home_chat: {CHAT}
    admins: [111]
{extra}""",
        environ={},
    )
    provider = PerAgentScript(scripts, agent_prompts(loaded.config))
    # no per-chat pacing: the fake does not rate-limit, and the test should not wait a second a message
    adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1, limiter=ChatRateLimiter(min_interval=0))
    app = await build_app(loaded, provider=provider, adapters=[adapter], poll_interval=0.05)
    await app.start()
    try:
        yield app, fake
    finally:
        await app.conversations.drain()
        await app.stop()
        await fake.stop()


def texts(fake: FakeTelegram) -> list[str]:
    return [m.text for m in fake.bot_messages(CHAT)]


async def said(fake: FakeTelegram, needle: str) -> None:
    await fake.wait_until(lambda: any(needle in t for t in texts(fake)), timeout=20)


DEPLOY_PLAN = {"goal": "deploy", "steps": [{"index": 1, "title": "deploy", "assignee": "builder", "input": "Deploy."}]}


def plan_of(goal: str, *steps: tuple[str, str, str]) -> dict[str, object]:
    """A plan as the lead writes it with ``write_plan``: ``steps`` are (title, assignee, input), numbered from 1."""
    return {
        "goal": goal,
        "steps": [
            {"index": index, "title": title, "assignee": assignee, "input": text}
            for index, (title, assignee, text) in enumerate(steps, start=1)
        ],
    }


def provider_breaks(messages: Sequence[Message]) -> ModelReply:
    """A turn whose model provider itself breaks: a bug inside Kazma, not a ``ModelError``."""
    raise RuntimeError("the provider broke")


def _answered_eu(messages: Sequence[Message]) -> ModelReply:
    return ModelReply(content="Deployed to eu." if "A: eu" in str(messages[-1]["content"]) else "??")


def _deploy_scripts(asks: ScriptStep) -> dict[str, list[ScriptStep]]:
    """The lead plans one step for the builder, which asks "Which region?" (``asks``) and, answered "eu", deploys."""
    return {
        "kazma": [call("write_plan", DEPLOY_PLAN), ModelReply(content="Planned."), ModelReply(content="Done.")],
        "builder": [asks, ModelReply(content="Waiting."), _answered_eu],
    }


async def last_plan(app: App) -> Plan:
    """The chat's current or last plan, as stored."""
    plan_id = await app.executor.store.last_plan(f"telegram:{CHAT}")
    assert plan_id is not None
    loaded = await app.executor.store.load(plan_id)
    assert loaded is not None
    return loaded


async def test_a_step_three_hops_down_sees_the_users_original_words(tmp_path: Path) -> None:
    plan = {
        "goal": "prepare the release",
        "steps": [
            {"index": 1, "title": "research", "assignee": "researcher", "input": "What goes into a release?"},
            {"index": 2, "title": "spec", "assignee": "refiner", "input": "Write the checklist."},
            {"index": 3, "title": "notes", "assignee": "builder", "input": "Write the release notes' title line."},
        ],
    }

    def title_line(messages: Sequence[Message]) -> ModelReply:
        # the builder only has what reached it: its own input and the fenced context
        quoted = re.findall(r"'([A-Z][a-z]+)'", str(messages[-1]["content"]))
        return ModelReply(content=f"Release notes: {quoted[0] if quoted else 'UNNAMED'}")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", plan), ModelReply(content="Planned."), ModelReply(content="All done.")],
        "researcher": [ModelReply(content="Changes, tests, notes.")],
        "refiner": [ModelReply(content="1. changes 2. tests 3. notes")],
        "builder": [title_line],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma please prepare the release we call 'Zanzibar'", username="alice")
        await said(fake, "[builder] Release notes:")
        assert any(t == "[builder] Release notes: Zanzibar" for t in texts(fake)), texts(fake)
        await said(fake, "All done.")
        view = await app.executor.describe(f"telegram:{CHAT}")
        assert "[done] notes" in view


async def test_a_sub_agent_asks_the_requester_a_strangers_reply_is_ignored_and_the_answer_resumes_it(
    tmp_path: Path,
) -> None:
    plan = {
        "goal": "deploy",
        "steps": [
            {"index": 1, "title": "deploy", "assignee": "builder", "input": "Deploy the service."},
            {"index": 2, "title": "check", "assignee": "validator", "input": "Check it is up."},
        ],
    }

    def resumed(messages: Sequence[Message]) -> ModelReply:
        last = str(messages[-1]["content"])
        region = "eu-west" if "A: eu-west" in last else "UNKNOWN"
        return ModelReply(content=f"Deployed to {region}.")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            ModelReply(content="Noted; the builder waits for alice."),
            ModelReply(content="Deployed and checked."),
        ],
        "builder": [
            call("ask_user", {"question": "Which region should I deploy to?"}),
            ModelReply(content="Waiting to hear the region."),
            resumed,
        ],
        "validator": [ModelReply(content="It is up.")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma deploy it please", username="alice")
        await said(fake, "Which region should I deploy to?")
        question = next(m for m in fake.bot_messages(CHAT) if "Which region" in m.text)
        assert f"for telegram:{ALICE}" in question.text
        plan_id = await app.executor.store.active_plan(f"telegram:{CHAT}")
        assert plan_id is not None

        # a stranger answers first: ignored (no resume, nothing said), the step still waits
        fake.push_message(CHAT, STRANGER, "us-east", reply_to=question.message_id)
        # somebody speaks without replying: that is talk to the lead, not an answer
        fake.push_message(CHAT, STRANGER, "@kazma eu-west")
        await said(fake, "Noted; the builder waits for alice.")
        loaded = await app.executor.store.load(plan_id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER

        fake.push_message(CHAT, ALICE, "eu-west", reply_to=question.message_id)
        await said(fake, "[builder] Deployed to eu-west.")
        await said(fake, "Deployed and checked.")
        loaded = await app.executor.store.load(plan_id)
        assert loaded is not None
        assert [s.status for s in loaded.steps.values()] == [StepStatus.DONE, StepStatus.DONE]
        kinds = [e.kind for e in await app.executor.store.events(plan_id)]
        assert kinds == ["asked", "answered"]


async def test_the_lead_repairs_a_failed_step_with_new_input_and_the_plan_goes_on(tmp_path: Path) -> None:
    plan = {
        "goal": "ship",
        "steps": [
            {"index": 1, "title": "research", "assignee": "researcher", "input": "Find the sources."},
            {"index": 2, "title": "fetch", "assignee": "refiner", "input": "Fetch from the main server."},
            {"index": 3, "title": "build", "assignee": "builder", "input": "Build it."},
            {"index": 4, "title": "check", "assignee": "validator", "input": "Check it."},
        ],
    }

    def unreachable(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("the main server is unreachable", permanent=True)

    def fetched(messages: Sequence[Message]) -> ModelReply:
        return ModelReply(content="Fetched from the mirror." if "use the mirror" in str(messages[-1]) else "??")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            call("retry_step", {"index": 2, "input": "Fetch it, but use the mirror."}),  # asked about step 2
            ModelReply(content="Retrying step 2 from the mirror."),
            ModelReply(content="Shipped."),
        ],
        "researcher": [ModelReply(content="Two sources.")],
        "refiner": [unreachable, fetched],
        "builder": [ModelReply(content="Built.")],
        "validator": [ModelReply(content="Checked.")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it", username="alice")
        await said(fake, "Plan: step 2 (fetch) runs again, with new input.")
        await said(fake, "[refiner] Fetched from the mirror.")
        await said(fake, "Shipped.")
        loaded = await last_plan(app)
        plan_id = loaded.id
        assert [s.status for s in loaded.steps.values()] == [StepStatus.DONE] * 4
        assert loaded.steps[2].attempts == 2
        dispatches = [t for t in texts(fake) if t.startswith("[kazma] @")]
        assert [d.split()[1] for d in dispatches] == ["@researcher", "@refiner", "@refiner", "@builder", "@validator"]
        assert [e.kind for e in await app.executor.store.events(plan_id)] == ["retried"]


async def test_a_plan_the_lead_writes_when_asked_about_a_failure_is_still_the_asking_persons(tmp_path: Path) -> None:
    # The lead's turn about a failed step runs as "executor": a plan written in it named "executor" as who asked
    # (forbid_requester then let the person approve its calls, only admins could answer its questions) and the
    # executor's prompt as the person's words.
    first = {"goal": "ship", "steps": [{"index": 1, "title": "fetch", "assignee": "refiner", "input": "Fetch it."}]}
    second = {"goal": "ship anew", "steps": [{"index": 1, "title": "build", "assignee": "builder", "input": "Go."}]}

    def unreachable(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("the server is unreachable", permanent=True)

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", first),
            ModelReply(content="Planned."),
            call("abort_plan", {"reason": "the server is gone"}),  # asked about step 1
            call("write_plan", second),
            ModelReply(content="A new plan."),
            ModelReply(content="Shipped."),
        ],
        "refiner": [unreachable],
        "builder": [ModelReply(content="Built.")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it please", username="alice")
        await said(fake, "[builder] Built.")
        loaded = await last_plan(app)
        assert loaded.goal == "ship anew"
        assert loaded.origin.requested_by == f"telegram:{ALICE}"
        assert loaded.origin.text == "@kazma ship it please"


async def test_an_answer_given_before_the_asking_turn_ends_leaves_the_step_to_the_resumed_turn(tmp_path: Path) -> None:
    # The answer resumed the step (same attempt) while the asking turn's closing line was being posted: that line
    # became the step's result, the next step started, and the real result came after and was dropped as stale.
    plan = {
        "goal": "deploy",
        "steps": [
            {"index": 1, "title": "deploy", "assignee": "builder", "input": "Deploy the service."},
            {"index": 2, "title": "check", "assignee": "validator", "input": "Check {{step_1.output_summary}}"},
        ],
    }
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", plan), ModelReply(content="Planned."), ModelReply(content="Report.")],
        "builder": [
            call("ask_user", {"question": "Which region?"}),
            ModelReply(content="Waiting for the region."),
            ModelReply(content="Deployed to us-east."),
        ],
        "validator": [ModelReply(content="It is up.")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        posting, running = app.conversations._post_result, app.conversations._run_step
        asking_turn_over = asyncio.Event()

        async def answered_first(message: Any, agent: Any, result: Any, stream: Any = None) -> None:
            if result.text == "Waiting for the region.":  # the asking turn's closing line: the answer comes first
                question = next(m for m in fake.bot_messages(CHAT) if "Which region?" in m.text)
                [asked] = await app.executor.store.open_questions(f"telegram:{CHAT}")
                fake.push_message(CHAT, ALICE, "us-east", reply_to=question.message_id)
                async with asyncio.timeout(20):
                    while (found := await app.executor.store.question(asked.id)) is None or found.status == "pending":
                        await asyncio.sleep(0.01)
            elif result.text == "Deployed to us-east.":  # the resumed turn ends after the asking one
                await asking_turn_over.wait()
            await posting(message, agent, result, stream)

        async def step_turn(*args: Any) -> None:
            await running(*args)
            asking_turn_over.set()  # (the first to end is the asking turn: the resumed one waits for it)

        app.conversations._post_result = answered_first  # type: ignore[method-assign]
        app.conversations._run_step = step_turn  # type: ignore[method-assign,assignment]
        fake.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        await said(fake, "Report.")
        loaded = await last_plan(app)
        assert loaded.steps[1].output_summary == "Deployed to us-east."
        check = next(t for t in texts(fake) if t.startswith("[kazma] @validator"))
        assert "Deployed to us-east." in check


async def test_a_question_the_platform_did_not_take_is_posted_again_while_it_is_open(tmp_path: Path) -> None:
    # A question whose post failed was only logged: nobody could answer it, and the plan waited for ever.
    def asks(messages: Sequence[Message]) -> ModelReply:
        fake_holder[0].script("sendMessage", *[Fault.server_error()] * 8)  # the platform fails from here on
        return call("ask_user", {"question": "Which region?"})

    fake_holder: list[FakeTelegram] = []
    scripts = _deploy_scripts(asks)
    async with kazma(tmp_path, scripts) as (app, fake):
        fake_holder.append(fake)
        app.conversations.question_backoff = Backoff(base=0.05, cap=0.2)
        fake.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        await said(fake, "Which region?")  # posted once the platform takes it again
        question = next(m for m in fake.bot_messages(CHAT) if "Which region?" in m.text)
        fake.push_message(CHAT, ALICE, "eu", reply_to=question.message_id)
        await said(fake, "[builder] Deployed to eu.")


async def test_a_question_whose_repost_meets_a_failing_store_is_posted_once_the_store_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The task posting a question again ended at the first store error (reading whether the question is still
    # open): the supervisor counted it, and the question stayed unseen, its plan waiting, until a restart.
    caplog.set_level(logging.WARNING)

    def asks(messages: Sequence[Message]) -> ModelReply:
        fake_holder[0].script("sendMessage", *[Fault.server_error()] * 1000)  # down until the test says
        return call("ask_user", {"question": "Which region?"})

    fake_holder: list[FakeTelegram] = []
    scripts = _deploy_scripts(asks)
    async with kazma(tmp_path, scripts) as (app, fake):
        fake_holder.append(fake)
        app.conversations.question_backoff = Backoff(base=0.05, cap=0.2)
        not_posted = failure_count("question_post")
        crashed = failure_count("conversation_task")
        fake.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        async with asyncio.timeout(20):
            while failure_count("question_post") == not_posted:  # the question is open, and nobody saw it
                await asyncio.sleep(0.02)
        db = tmp_path / "k.db"
        await write_around(db, ["ALTER TABLE plan_questions RENAME TO questions_elsewhere"])
        async with asyncio.timeout(20):
            while not (
                failure_count("conversation_task") > crashed
                or any(r.getMessage() == "plan.question_repost_failed" for r in caplog.records)
            ):
                await asyncio.sleep(0.02)
        await write_around(db, ["ALTER TABLE questions_elsewhere RENAME TO plan_questions"])
        fake.unscript("sendMessage")
        await said(fake, "Which region?")  # posted once the store and the platform are back, no restart
        question = next(m for m in fake.bot_messages(CHAT) if "Which region?" in m.text)
        fake.push_message(CHAT, ALICE, "eu", reply_to=question.message_id)
        await said(fake, "[builder] Deployed to eu.")
        assert failure_count("conversation_task") == crashed


async def test_a_question_posted_but_not_recorded_is_recorded_later_and_its_reply_answers_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The question was shown, but the store refused to record its message id: the error escaped the ask, the
    # question stayed without a message, and a reply to what people saw was never taken for its answer.
    caplog.set_level(logging.INFO)
    scripts = _deploy_scripts(call("ask_user", {"question": "Which region?"}))
    async with kazma(tmp_path, scripts) as (app, fake):
        app.conversations.question_backoff = Backoff(base=0.05, cap=0.2)
        db = tmp_path / "k.db"
        await write_around(
            db,
            [
                "CREATE TRIGGER refuse_posts BEFORE UPDATE OF message_id ON plan_questions"
                " BEGIN SELECT RAISE(ABORT, 'posts refused'); END"
            ],
        )
        fake.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        await said(fake, "Which region?")
        async with asyncio.timeout(20):
            while not any(r.getMessage() == "plan.question_post_unrecorded" for r in caplog.records):
                await asyncio.sleep(0.02)
        await write_around(db, ["DROP TRIGGER refuse_posts"])
        question = next(m for m in fake.bot_messages(CHAT) if "Which region?" in m.text)
        # The open question's row gets the id of the message people saw, and the retry that recorded it says so (its
        # line comes after the commit, so both are waited for); a timeout says what Kazma logged meanwhile.
        try:
            async with asyncio.timeout(20):
                while not (
                    any(
                        q.message_id == str(question.message_id)
                        for q in await app.executor.store.open_questions(f"telegram:{CHAT}")
                    )
                    and any(r.getMessage() == "plan.question_posted_late" for r in caplog.records)
                ):
                    await asyncio.sleep(0.02)
        except TimeoutError:
            seen = [r.getMessage() for r in caplog.records if r.name.startswith("kazma")]
            raise AssertionError(f"the question's post was never recorded; Kazma logged {seen}") from None
        fake.push_message(CHAT, ALICE, "eu", reply_to=question.message_id)
        await said(fake, "[builder] Deployed to eu.")
        asked = [t for t in texts(fake) if t.startswith("[kazma] Question from")]
        assert len(asked) == 1, asked  # recorded, never posted a second time


async def test_a_step_whose_turn_fails_inside_kazma_ends_failed_and_the_lead_decides(tmp_path: Path) -> None:
    # Something other than the model's or a tool's failure (here the model provider itself breaking: a bug, not a
    # ModelError) escaped the step's turn: nothing was posted, the step stayed in progress until a restart, and the
    # plan waited for it for good.
    plan = plan_of("ship", ("build", "builder", "Build it."))
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            call("abort_plan", {"reason": "the builder broke"}),  # asked about step 1
            ModelReply(content="Stopped: the builder broke."),
        ],
        "builder": [provider_breaks],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it", username="alice")
        await said(fake, "[builder] I could not finish: Kazma failed while working on this (an internal error, Runtime")
        await said(fake, "Stopped: the builder broke.")
        loaded = await last_plan(app)
        assert loaded.steps[1].status is StepStatus.FAILED


async def test_a_lead_turn_that_fails_inside_kazma_tells_the_person(tmp_path: Path) -> None:
    async with kazma(tmp_path, {"kazma": [provider_breaks, ModelReply(content="Here now.")]}) as (_app, fake):
        fake.push_message(CHAT, ALICE, "@kazma hello", username="alice")
        await said(fake, "Kazma failed while working on this (an internal error, RuntimeError)")
        assert not any("the provider broke" in t for t in texts(fake))  # the error's own text stays in the log
        fake.push_message(CHAT, ALICE, "@kazma hello again", username="alice")
        await said(fake, "Here now.")


async def test_a_tool_called_after_ask_user_in_the_same_turn_asks_nobody_to_approve_it(tmp_path: Path) -> None:
    # The step waits for the person's answer once ask_user returns: a write_file the same turn called after it
    # was put to an approver all the same (a card in the chat), and once approved it was refused at its start
    # ("its plan step was taken away"): a decision asked for a call that could never run, its ending misnamed.
    seen: list[str] = []

    def waits(messages: Sequence[Message]) -> ModelReply:
        seen.append(str(messages[-1]["content"]))
        return ModelReply(content="Waiting for the region.")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", DEPLOY_PLAN), ModelReply(content="Planned."), ModelReply(content="Noted.")],
        "builder": [
            call("ask_user", {"question": "Which region?"}),
            call("write_file", {"path": "region.txt", "content": "eu"}),
            waits,
        ],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        await fake.wait_until(
            lambda: any(t == "[builder] Waiting for the region." or "write_file" in t for t in texts(fake)), timeout=20
        )
        carded = await app.service.store.pending_of("write_file")
        for request in carded:  # (before: the turn waited on the card; denied so that it ends)
            await app.service.cancel(request.id, reason="test over")
        assert carded == []
        await said(fake, "[builder] Waiting for the region.")
        [told] = seen
        assert "waits for the answer" in told, told
        loaded = await last_plan(app)
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER


async def test_a_lead_step_whose_turn_fails_inside_kazma_ends_failed_and_the_lead_decides(tmp_path: Path) -> None:
    # A step assigned to the lead itself runs its turn apart from a sub-agent's: something other than a model's or a
    # tool's failure escaping it (the provider breaking: a bug, not a ModelError) went to the task's log only, the
    # step stayed in progress until a restart, and the plan waited for it for good, nothing said in the chat.
    plan = plan_of("ship", ("sum up", "kazma", "Sum it up."))
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            provider_breaks,  # the lead's own step
            call("abort_plan", {"reason": "the summary broke"}),  # asked about step 1
            ModelReply(content="Stopped: the summary broke."),
        ],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it", username="alice")
        await said(fake, "Stopped: the summary broke.")
        loaded = await last_plan(app)
        assert loaded.steps[1].status is StepStatus.FAILED
        assert loaded.status == "aborted"
        assert "Kazma failed while working on this (an internal error, RuntimeError)" in (
            loaded.steps[1].failure_reason or ""
        )


async def test_a_leads_turn_about_a_failed_step_that_fails_inside_kazma_tells_the_person(tmp_path: Path) -> None:
    # The executor's own turns of the lead (asked about a failed step, reporting the end) broke with nothing said:
    # the error reached the task's log only, the steps that needed the failed one were dropped and the plan ended
    # while the person was never told that the lead could not decide.
    plan = plan_of("ship", ("build", "builder", "Build it."))

    def refused(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("bad key", permanent=True)

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            provider_breaks,
            ModelReply(content="All ended."),
        ],
        "builder": [refused],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it", username="alice")
        await said(fake, "All ended.")
        await app.conversations.drain()
        assert any("Kazma failed while working on this (an internal error, RuntimeError)" in t for t in texts(fake))


async def test_a_step_for_an_agent_the_configuration_no_longer_has_fails_and_the_lead_decides(tmp_path: Path) -> None:
    # A plan outlives its configuration: restarted without the validator, its step was still posted as
    # "@validator …", no agent took it, the lead ran a turn on the post as if the lead itself had asked something,
    # and the step stayed in progress for good (the plan with it).
    plan = plan_of("deploy", ("region", "user", "Which region?"), ("check", "validator", "Check it is up."))
    first: dict[str, list[ScriptStep]] = {"kazma": [call("write_plan", plan), ModelReply(content="Planned.")]}
    async with kazma(tmp_path, first) as (_app, fake):
        fake.push_message(CHAT, ALICE, "@kazma deploy it", username="alice")
        await said(fake, "Which region?")
    without_validator = """
agents:
  workers:
    builder: {system_prompt: "You build."}
pipelines: {}
"""
    then: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("abort_plan", {"reason": "nobody checks any more"}),  # asked about step 2
            ModelReply(content="Stopped: nobody checks any more."),
        ],
    }
    async with kazma(tmp_path, then, extra=without_validator) as (app, fake):
        await said(fake, "Which region?")  # shown again at start
        question = next(m for m in fake.bot_messages(CHAT) if "Which region?" in m.text)
        fake.push_message(CHAT, ALICE, "eu", reply_to=question.message_id)
        await said(fake, "Stopped: nobody checks any more.")
        loaded = await last_plan(app)
        assert loaded.steps[2].status is StepStatus.FAILED
        assert "no agent named 'validator'" in (loaded.steps[2].failure_reason or "")
        assert not any(t.startswith("@validator") for t in texts(fake))  # nobody could take it up


async def test_aborting_a_plan_stops_its_running_step_and_its_card_no_longer_runs_anything(tmp_path: Path) -> None:
    # "Plan aborted" was said while the running step went on: its approval card stayed open, and approving it
    # after the abort wrote the file, the step's turn finished and its result was recorded as done.
    plan = plan_of("ship", ("write", "builder", "Write the notes."))
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            call("abort_plan", {"reason": "alice changed her mind"}),  # alice: stop
            ModelReply(content="Stopped."),
        ],
        "builder": [
            call("write_file", {"path": "notes.txt", "content": "notes"}),
            ModelReply(content="Written."),
        ],
    }
    # a card nobody settles ends by its deadline: the test ends (failing) instead of waiting ten minutes for it
    async with kazma(tmp_path, scripts, extra="approvals: {deadline_seconds: 15}") as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it", username="alice")
        await fake.wait_until(lambda: any(m.buttons for m in fake.bot_messages(CHAT)), timeout=20)
        card = next(m for m in fake.bot_messages(CHAT) if m.buttons)
        approve = next(str(b["callback_data"]) for b in card.buttons if str(b["callback_data"]).endswith(":a"))
        fake.push_message(CHAT, ALICE, "@kazma stop, I changed my mind", username="alice")
        await said(fake, "Plan aborted: alice changed her mind")
        await said(fake, "@builder stopped working on step 1 here (attempt 1): its plan was aborted")
        await fake.wait_until(lambda: not card.buttons, timeout=20)  # the card is settled: nothing to press
        await fake.wait_for_answer(fake.push_callback(CHAT, card.message_id, 111, approve), timeout=20)
        await app.conversations.drain()
        assert not any("Written." in t for t in texts(fake))
        loaded = await last_plan(app)
        assert loaded.status == "aborted"
        assert loaded.steps[1].status is StepStatus.FAILED
        reason = loaded.steps[1].failure_reason or ""
        assert reason.startswith("plan aborted while this step ran")
        assert "alice changed her mind" in reason
        assert "tools: did not run" in reason
        found = list(app.conversations.runner.workspace_root.rglob("notes.txt"))
        assert not found


async def test_a_rate_limited_step_runs_again_after_a_backoff_said_once_in_the_chat(tmp_path: Path) -> None:
    # A 429 from the sub-agent's model was dispatched again at once: three "@builder …" posts and three "I could not
    # finish: … 429" lines within milliseconds, the rate-limited model hit again each time, and the step failed.
    def rate_limited(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("429 rate limited", permanent=False, status=429, retry_after=30.0)

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", DEPLOY_PLAN), ModelReply(content="Planned."), ModelReply(content="Done.")],
        "builder": [rate_limited, ModelReply(content="Deployed.")],
    }
    waits: list[float] = []
    released = asyncio.Event()

    async def held(delay: float) -> None:  # the executor's retry wait, held until the test lets it end
        waits.append(delay)
        await released.wait()

    async with kazma(tmp_path, scripts) as (app, fake):
        app.executor.sleep = held
        fake.push_message(CHAT, ALICE, "@kazma deploy", username="alice")
        await said(fake, "Plan: step 1 (deploy) failed for a passing reason")
        notice = next(t for t in texts(fake) if "failed for a passing reason" in t)
        assert "429 rate limited" in notice
        assert "runs again in about 30 seconds (attempt 2 of 3)" in notice
        assert waits == [30.0]  # the model's Retry-After, longer than the first backoff
        await app.conversations.drain()
        assert len([t for t in texts(fake) if t.startswith("[kazma] @builder")]) == 1
        assert not [t for t in texts(fake) if "I could not finish" in t]
        assert (await last_plan(app)).steps[1].status is StepStatus.PENDING  # waits its turn, on disk
        released.set()
        await said(fake, "[builder] Deployed.")
        await said(fake, "Done.")
        loaded = await last_plan(app)
        assert loaded.steps[1].status is StepStatus.DONE
        assert loaded.steps[1].attempts == 2
        dispatches = [t for t in texts(fake) if t.startswith("[kazma] @builder")]
        assert len(dispatches) == 2
        # The second hand-off reads as a retry, not as the first one posted twice; the same mention
        # still reached the builder (it answered "Deployed." above).
        assert dispatches[0].startswith("[kazma] @builder Deploy.")
        assert "(try" not in dispatches[0]
        assert re.match(r"\[kazma\] @builder \(try 2 of 3\) Deploy\.", dispatches[1])


async def test_a_stop_during_a_step_s_backoff_ends_the_wait_and_leaves_the_step_pending_for_the_next_start(
    tmp_path: Path,
) -> None:
    # The wait's task ran on past app.stop(): one ending during the shutdown moved its plan on against a closing
    # store ("plan.retry_failed"), one still waiting died with the event loop ("Task was destroyed").
    def rate_limited(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("429 rate limited", permanent=False, status=429, retry_after=30.0)

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", DEPLOY_PLAN), ModelReply(content="Planned.")],
        "builder": [rate_limited],
    }
    ended = asyncio.Event()

    async def held(delay: float) -> None:  # the executor's retry wait, never let end by the test
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    before = asyncio.all_tasks()
    async with kazma(tmp_path, scripts) as (app, fake):
        app.executor.sleep = held
        fake.push_message(CHAT, ALICE, "@kazma deploy", username="alice")
        await said(fake, "Plan: step 1 (deploy) failed for a passing reason")
        await app.conversations.drain()
        assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("plan-retry-")]
    assert ended.is_set()  # cancelled by the stop, not left to the event loop's end
    left = [t.get_name() for t in asyncio.all_tasks() - before if t.get_name().startswith("plan-retry-")]
    assert left == []


async def test_a_step_in_backoff_lets_the_next_step_go_on_and_the_chat_says_it_in_order(tmp_path: Path) -> None:
    # What people read while step 1 waits out its backoff: why and when, then step 2's hand-off (it does not need
    # step 1), then step 1 again marked as its second try, and step 3 (which needs step 1) only after it.
    def rate_limited(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("429 rate limited", permanent=False, status=429, retry_after=30.0)

    plan = {
        "goal": "release",
        "steps": [
            {"index": 1, "title": "deploy", "assignee": "builder", "input": "Deploy."},
            {"index": 2, "title": "notes", "assignee": "researcher", "input": "Write notes.", "wait_for": []},
            {"index": 3, "title": "announce", "assignee": "builder", "input": "Announce.", "wait_for": [1]},
        ],
    }
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", plan), ModelReply(content="Planned."), ModelReply(content="Done.")],
        "builder": [rate_limited, ModelReply(content="Deployed."), ModelReply(content="Announced.")],
        "researcher": [ModelReply(content="Notes written.")],
    }
    released = asyncio.Event()

    async def held(delay: float) -> None:  # the executor's retry wait, held until the test lets it end
        await released.wait()

    async with kazma(tmp_path, scripts) as (app, fake):
        app.executor.sleep = held
        fake.push_message(CHAT, ALICE, "@kazma release", username="alice")
        await said(fake, "[researcher] Notes written.")
        await app.conversations.drain()
        notice = next(t for t in texts(fake) if "failed for a passing reason" in t)
        assert "runs again in about 30 seconds at the earliest (attempt 2 of 3)" in notice
        assert "Meanwhile step 2 (notes), which does not need it, goes on; step 1 waits for it to end." in notice
        assert not [t for t in texts(fake) if "I could not finish" in t]
        assert (await last_plan(app)).steps[1].status is StepStatus.PENDING
        released.set()
        await said(fake, "Done.")
        handed = [t for t in texts(fake) if t.startswith("[kazma] @")]
        assert [re.sub(r"^\[kazma\] ", "", t).split("\n")[0] for t in handed] == [
            "@builder Deploy.",
            "@researcher Write notes.",
            "@builder (try 2 of 3) Deploy.",
            "@builder Announce.",
        ]
        order = texts(fake)
        assert order.index(notice) < order.index(handed[1])  # said before step 2 goes on
        loaded = await last_plan(app)
        assert [s.status for s in loaded.steps.values()] == [StepStatus.DONE] * 3
