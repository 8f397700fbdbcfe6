"""Plans that recover, end to end on the real Telegram library against the wire-level fake Bot API: the
lead's ``replace_steps``, a question's choice buttons (decided once, only by who may answer) and ``/plan``.

The model is scripted per agent; what is checked is what people and agents see in the chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kazma.engine.model import ScriptStep
from kazma.engine.plan import StepStatus
from kazma.engine.types import Message, ModelError, ModelReply
from tests.fakes.telegram import FakeTelegram
from tests.test_e2e_plans import ALICE, CHAT, STRANGER, call, kazma, last_plan, said, texts


async def press(fake: FakeTelegram, message_id: int, user: int, data: str) -> dict[str, object]:
    """``user`` presses a button; Telegram's answer to the press (every press is answered)."""
    query = fake.push_callback(CHAT, message_id, user, data)
    return await fake.wait_for_answer(query, timeout=20)


async def test_the_lead_replaces_the_steps_after_a_failure_and_only_the_new_ones_run(tmp_path: Path) -> None:
    plan = {
        "goal": "ship",
        "steps": [
            {"index": 1, "title": "research", "assignee": "researcher", "input": "Find the sources."},
            {"index": 2, "title": "fetch", "assignee": "refiner", "input": "Fetch from the main server."},
            {"index": 3, "title": "build", "assignee": "builder", "input": "Build the old way."},
            {"index": 4, "title": "check", "assignee": "validator", "input": "Check the old build."},
        ],
    }
    new_steps = [
        {
            "index": 3,
            "title": "mirror build",
            "assignee": "builder",
            "input": "Build from the mirror.",
            "wait_for": [1],
        },
        {
            "index": 4,
            "title": "mirror check",
            "assignee": "validator",
            "input": "Check the mirror build.",
            "wait_for": [3],
        },
    ]

    def unreachable(messages: Sequence[Message]) -> ModelReply:
        raise ModelError("the main server is unreachable", permanent=True)

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", plan),
            ModelReply(content="Planned."),
            call("replace_steps", {"from_index": 3, "steps": new_steps}),  # asked about step 2
            ModelReply(content="Building from the mirror instead."),
            ModelReply(content="Shipped from the mirror."),
        ],
        "researcher": [ModelReply(content="Two sources.")],
        "refiner": [unreachable],
        "builder": [ModelReply(content="Built from the mirror.")],
        "validator": [ModelReply(content="Mirror build checked.")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma ship it", username="alice")
        await said(fake, "Plan: steps from 3 on replaced by 2 new steps.")
        await said(fake, "Shipped from the mirror.")
        loaded = await last_plan(app)
        plan_id = loaded.id
        assert [(s.spec.title, s.status) for s in loaded.steps.values()] == [
            ("research", StepStatus.DONE),
            ("fetch", StepStatus.FAILED),
            ("mirror build", StepStatus.DONE),
            ("mirror check", StepStatus.DONE),
        ]
        dispatches = [t for t in texts(fake) if t.startswith("[kazma] @")]
        assert [d.split()[1] for d in dispatches] == ["@researcher", "@refiner", "@builder", "@validator"]
        assert not any("the old" in d for d in dispatches), dispatches  # the replaced steps never ran
        assert any(d.startswith("[kazma] @builder Build from the mirror.") for d in dispatches), dispatches
        kinds = [e.kind for e in await app.executor.store.events(plan_id)]
        # the lead replaced what followed step 2 and did not repair step 2 itself: as its turn ends, step 2 is
        # given up (recorded as that turn ends, which may come after the new steps finished)
        assert kinds[0] == "replaced"
        assert set(kinds) <= {"replaced", "gave_up"}, kinds


async def test_a_questions_buttons_are_pressed_once_by_the_requester_and_plan_shows_the_wait(tmp_path: Path) -> None:
    plan = {
        "goal": "deploy",
        "steps": [{"index": 1, "title": "deploy", "assignee": "builder", "input": "Deploy the service."}],
    }

    def resumed(messages: Sequence[Message]) -> ModelReply:
        last = str(messages[-1]["content"])
        region = "us-east" if "A: us-east" in last else "UNKNOWN"
        return ModelReply(content=f"Deployed to {region}.")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", plan), ModelReply(content="Planned."), ModelReply(content="Deployed.")],
        "builder": [
            call("ask_user", {"question": "Which region?", "choices": ["eu-west", "us-east"]}),
            ModelReply(content="Waiting for the region."),
            resumed,
        ],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma deploy it please", username="alice")
        await said(fake, "Which region?")
        question = next(m for m in fake.bot_messages(CHAT) if "Which region?" in m.text)
        assert [b["text"] for b in question.buttons] == ["eu-west", "us-east"]
        data = [str(b["callback_data"]) for b in question.buttons]

        fake.push_message(CHAT, ALICE, "/plan")
        await said(fake, "[waiting_for_user] deploy")
        shown = next(t for t in texts(fake) if "[waiting_for_user] deploy" in t)
        assert "@builder" in shown
        assert f"Waiting for telegram:{ALICE} to answer: Which region?" in shown

        refused = await press(fake, question.message_id, STRANGER, data[0])
        assert refused["show_alert"] is True  # told privately; nothing said in the chat, nothing resumed
        plan_id = await app.executor.store.active_plan(f"telegram:{CHAT}")
        assert plan_id is not None
        loaded = await app.executor.store.load(plan_id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.WAITING_FOR_USER

        taken = await press(fake, question.message_id, ALICE, data[1])
        assert not taken.get("show_alert")
        late = await press(fake, question.message_id, ALICE, data[0])  # a second press: the first answer stands
        assert late["show_alert"] is True
        await said(fake, "[builder] Deployed to us-east.")
        await said(fake, "Deployed.")
        loaded = await app.executor.store.load(plan_id)
        assert loaded is not None
        assert loaded.steps[1].status is StepStatus.DONE
        assert [e.kind for e in await app.executor.store.events(plan_id)] == ["asked", "answered"]
        assert not any("Deployed to eu-west" in t for t in texts(fake))

        fake.push_message(CHAT, ALICE, "/plan")
        await said(fake, "[done] deploy")


async def test_files_a_step_writes_reach_the_next_step_with_the_requests_own_file(tmp_path: Path) -> None:
    plan = {
        "goal": "write the notes",
        "steps": [
            {"index": 1, "title": "write", "assignee": "builder", "input": "Write the notes."},
            {"index": 2, "title": "check", "assignee": "validator", "input": "Check {{step_1.output_files}}."},
        ],
    }

    def check(messages: Sequence[Message]) -> ModelReply:
        # the validator has only what reached it: its input and the fenced context of the request
        seen = str(messages[-1]["content"])
        found = [name for name in ("out/notes.md", "brief.txt") if name in seen]
        return ModelReply(content=f"Checked: {', '.join(found) or 'NOTHING'}.")

    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", plan), ModelReply(content="Planned."), ModelReply(content="Notes checked.")],
        "builder": [
            call("write_file", {"path": "out/notes.md", "content": "# Notes\n"}),
            ModelReply(content="Wrote the notes."),
        ],
        "validator": [check],
    }
    async with kazma(tmp_path, scripts, extra="tools: {write_file: write, allow_unapproved: [write_file]}\n") as (
        app,
        fake,
    ):
        fake.push_file(CHAT, ALICE, "brief.txt", b"what the notes must say", caption="@kazma write the notes")
        await said(fake, "Notes checked.")
        assert "[validator] Checked: out/notes.md, brief.txt." in texts(fake), texts(fake)
        loaded = await last_plan(app)
        assert loaded.steps[1].output_files == ["out/notes.md"]
        assert "(files: out/notes.md)" in await app.executor.describe(f"telegram:{CHAT}")
