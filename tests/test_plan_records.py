"""Issue 32: a plan step keeps a record of its latest attempt (model, tools with approval ids, start, finish,
tokens, reported cost, error) on both backends, shown by /plan; and files sent with the message that made a plan
reach its steps through PlanOrigin.files (write_plan fills it), not only as a note in the request text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from kazma.engine.executor import Action, PlanExecutor, StepResult
from kazma.engine.model import ScriptStep
from kazma.engine.plan import PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import MIGRATIONS, PG_MIGRATIONS, PlanStore
from kazma.engine.types import Message, ModelReply, ToolUse, Usage
from tests.store_backends import Engine, open_store
from tests.test_e2e_plans import call
from tests.test_web_server import OPERATOR, console, until

CONVERSATION = "web:console"


class Recorded:
    """The executor's hands: remembers each action (nothing is posted)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    async def perform(self, action: Action) -> None:
        self.actions.append(action)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_steps_record_is_kept_on_both_backends_and_shown_by_plan(store_engine: Engine) -> None:
    migrations = PG_MIGRATIONS if store_engine.postgres else MIGRATIONS
    async with open_store(store_engine, migrations=migrations) as conn:
        clock = Clock()
        store = PlanStore(conn, clock=clock)
        executor = PlanExecutor(store, Recorded(), lead_name="kazma", assignees={"builder"})
        spec = PlanSpec(goal="ship", steps=[StepSpec(index=1, title="build", assignee="builder", input="build it")])
        plan = await executor.start("telegram:-1", spec)
        started = await store.load(plan.id)
        assert started is not None
        assert started.steps[1].status is StepStatus.IN_PROGRESS
        assert started.steps[1].record.started_at == clock.now
        assert started.steps[1].record.finished_at is None

        clock.now += 12.5
        tools = (ToolUse("shell", True, "req-9"), ToolUse("http_get", True))
        result = StepResult(ok=True, summary="built", model="m-2", tools=tools, usage=Usage(120, 45, 0.0123))
        assert await executor.complete(plan.id, 1, result, attempt=1)
        done = await store.load(plan.id)
        assert done is not None
        record = done.steps[1].record
        assert (record.model, record.tools, record.usage) == ("m-2", tools, Usage(120, 45, 0.0123))
        assert (record.started_at, record.finished_at, record.seconds) == (clock.now - 12.5, clock.now, 12.5)
        shown = await executor.describe("telegram:-1")
        assert (
            "   model m-2 · tools: shell (approval req-9, ok), http_get (ok) · 12.5 s · 120 + 45 tokens, cost 0.0123"
        ) in shown.splitlines()


async def test_an_interrupted_step_keeps_its_start_and_no_finish(store_engine: Engine) -> None:
    migrations = PG_MIGRATIONS if store_engine.postgres else MIGRATIONS
    async with open_store(store_engine, migrations=migrations) as conn:
        store = PlanStore(conn, clock=Clock())
        executor = PlanExecutor(store, Recorded(), lead_name="kazma", assignees={"builder"})
        spec = PlanSpec(goal="ship", steps=[StepSpec(index=1, title="build", assignee="builder", input="x")])
        plan = await executor.start("telegram:-1", spec)
        await executor.mark_interrupted()
        loaded = await store.load(plan.id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.FAILED
        assert loaded.steps[1].record.started_at is not None
        assert loaded.steps[1].record.finished_at is None  # when it stopped is not known
        assert "running" in loaded.steps[1].record.line()


def upload(csrf: str, name: str, data: bytes, text: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("csrf", csrf)
    form.add_field("files", data, filename=name, content_type="application/octet-stream")
    form.add_field("text", text)
    return form


async def test_files_sent_with_a_request_reach_the_plan_and_its_steps_record_their_model(tmp_path: Path) -> None:
    plan_step = {
        "goal": "summarise the notes",
        "steps": [{"index": 1, "title": "read", "assignee": "researcher", "input": "Summarise the attached notes."}],
    }
    seen_by_researcher: list[str] = []

    def researcher(messages: Sequence[Message]) -> ModelReply:
        seen_by_researcher.append(str(messages[-1]["content"]))
        return ModelReply(content="three points", usage=Usage(40, 9, 0.0009), model="notes-model")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", plan_step), ModelReply(content="On it."), ModelReply(content="Done.")],
        "researcher": [researcher],
    }
    async with console(tmp_path, scripts=scripts) as con, con.client() as op:
        csrf = await con.login(op, "alice", OPERATOR)
        sent = await op.post(
            f"{con.base}/console/upload",
            data=upload(csrf, "notes.txt", b"one two three", "@kazma make a plan for these"),
            allow_redirects=False,
        )
        assert sent.status == 303
        await until(con.web, lambda: any(m.text == "three points" for m in con.web.messages()))
        plan_id = await con.app.executor.store.last_plan(CONVERSATION)
        assert plan_id is not None
        plan = await con.app.executor.store.load(plan_id)
        assert plan is not None
        assert plan.origin.files == ("incoming/notes.txt",)
        assert plan.origin.text == "@kazma make a plan for these"  # what the person wrote, without Kazma's note
        (dispatched,) = seen_by_researcher
        assert dispatched.count("incoming/notes.txt") == 1
        assert "Attached files (in the workspace): incoming/notes.txt" in dispatched
        await until(con.web, lambda: any(m.text == "Done." for m in con.web.messages()))
        shown = await (await op.post(f"{con.base}/console/send", data={"csrf": csrf, "text": "/plan"})).text()
        assert re.search(
            r"model notes-model · tools: no tools · did not run: no tool that changes anything was started"
            r" · \d+\.\d s · 40 \+ 9 tokens, cost 0\.0009",
            shown,
        )
