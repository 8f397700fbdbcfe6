"""Plans in the web console: ``/plan`` shows the console conversation's plan and who a question waits for,
and a question is answered by replying to it or pressing a choice — by an operator (as a platform admin
would), never by a reader, whatever name the reader logged in with (tests/test_console_security.py)."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from kazma.engine.model import ScriptStep
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.types import Message, ModelReply
from tests.test_e2e_plans import call
from tests.test_web_server import OPERATOR, READER, console, until

CONVERSATION = "web:console"


def flashes(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


async def test_plan_in_the_console_and_its_question_answered_by_a_choice_once(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as reader, con.client() as operator:
        spec = PlanSpec(
            goal="pick a budget",
            steps=[StepSpec(index=1, title="budget", assignee="user", input="Which budget?")],
        )
        plan = await con.app.executor.start(CONVERSATION, spec, PlanOrigin("set it up", "web:bob"))
        await until(con.web, lambda: any("Which budget?" in m.text for m in con.web.messages()))
        [question] = [m for m in con.web.messages() if "Which budget?" in m.text]
        reader_csrf = await con.login(reader, "rita", READER)
        operator_csrf = await con.login(operator, "alice", OPERATOR)

        shown = flashes(
            await (await reader.post(f"{con.base}/console/send", data={"csrf": reader_csrf, "text": "/plan"})).text()
        )
        assert "[waiting_for_user] budget" in shown
        assert "Waiting for web:bob to answer: Which budget?" in shown

        # a reader replies: refused at the door, the step still waits
        replied = await reader.post(
            f"{con.base}/console/send", data={"csrf": reader_csrf, "text": "10k", "reply_to": question.id}
        )
        assert replied.status == 403
        await con.app.conversations.drain()  # the reply's turn has run
        loaded = await con.app.executor.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER

        # an operator answers as an admin would
        await operator.post(
            f"{con.base}/console/send", data={"csrf": operator_csrf, "text": "20k", "reply_to": question.id}
        )
        await con.app.conversations.drain()
        loaded = await con.app.executor.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.DONE
        assert loaded.steps[1].output_summary == "20k"

        shown = flashes(
            await (await reader.post(f"{con.base}/console/send", data={"csrf": reader_csrf, "text": "/plan"})).text()
        )
        assert "[done] budget" in shown


async def test_a_questions_choices_are_pressed_in_the_console_once_and_only_by_who_may_answer(tmp_path: Path) -> None:
    def resumed(messages: Sequence[Message]) -> ModelReply:
        return ModelReply(content="Going with " + ("us" if "A: us" in str(messages[-1]["content"]) else "??") + ".")

    scripts: dict[str, list[ScriptStep]] = {
        "builder": [
            call("ask_user", {"question": "Which region?", "choices": ["eu", "us"]}),
            ModelReply(content="Waiting."),
            resumed,
        ],
        "kazma": [ModelReply(content="Done.")],
    }
    async with console(tmp_path, scripts=scripts) as con, con.client() as reader, con.client() as operator:
        spec = PlanSpec(goal="deploy", steps=[StepSpec(index=1, title="deploy", assignee="builder", input="Deploy.")])
        plan = await con.app.executor.start(CONVERSATION, spec, PlanOrigin("deploy it", "web:bob"))
        await until(con.web, lambda: any(m.choices for m in con.web.messages()))
        [question] = [m for m in con.web.messages() if m.choices]
        assert [label for label, _ in question.choices] == ["eu", "us"]
        reader_csrf = await con.login(reader, "rita", READER)
        operator_csrf = await con.login(operator, "alice", OPERATOR)

        async def choose(client: aiohttp.ClientSession, csrf: str, choice: int) -> str:
            data = {"csrf": csrf, "message": question.id, "choice": str(choice)}
            return flashes(await (await client.post(f"{con.base}/console/choose", data=data)).text())

        refused = await choose(reader, reader_csrf, 0)
        assert "operators only: web:rita is a reader" in refused  # nothing resumed
        loaded = await con.app.executor.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER

        await choose(operator, operator_csrf, 1)
        await until(con.web, lambda: any("Going with us." in m.text for m in con.web.messages()))
        late = await choose(operator, operator_csrf, 0)  # a second press: the first answer stands
        assert "already" in late.lower()
        await con.app.conversations.drain()
        loaded = await con.app.executor.store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.DONE
        assert [e.kind for e in await con.app.executor.store.events(plan.id)] == ["asked", "answered"]
