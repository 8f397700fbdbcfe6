"""The lead's reply that announces a plan comes before the plan's first dispatch, in the chat and in the transcript.

The lead writes the plan with a tool call in the middle of its turn; the plan is on disk at once, but its first
``@sub-agent`` message waits until the lead's reply ("Plan made: …") has been posted.
"""

from __future__ import annotations

from pathlib import Path

from kazma.engine.model import ScriptStep
from kazma.engine.plan import StepStatus
from kazma.engine.types import ModelReply
from tests.test_e2e_plans import ALICE, CHAT, call, kazma, said, texts

PLAN = {
    "goal": "say hello",
    "steps": [
        {"index": 1, "title": "research", "assignee": "researcher", "input": "How do we say hello portably?"},
        {"index": 2, "title": "build", "assignee": "builder", "input": "Write it."},
    ],
}


async def test_the_plan_is_announced_before_its_first_dispatch(tmp_path: Path) -> None:
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [
            call("write_plan", PLAN),
            ModelReply(content="Plan made: @researcher looks it up, then @builder writes it."),
            ModelReply(content="All done."),
        ],
        "researcher": [ModelReply(content="echo hello")],
        "builder": [ModelReply(content="written")],
    }
    async with kazma(tmp_path, scripts) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma say hello", username="alice")
        await said(fake, "All done.")
        said_in_chat = texts(fake)
        announced = next(i for i, t in enumerate(said_in_chat) if "Plan made:" in t)
        first_dispatch = next(i for i, t in enumerate(said_in_chat) if "@researcher How do we say hello" in t)
        assert announced < first_dispatch, said_in_chat
        # the transcript (what the console shows) keeps the same order
        kept = [entry.text for entry in await app.transcript.messages(f"telegram:{CHAT}")]
        announced = next(i for i, t in enumerate(kept) if "Plan made:" in t)
        first_dispatch = next(i for i, t in enumerate(kept) if "@researcher How do we say hello" in t)
        assert announced < first_dispatch, kept
        plan_id = await app.executor.store.last_plan(f"telegram:{CHAT}")
        assert plan_id is not None
        plan = await app.executor.store.load(plan_id)
        assert plan is not None
        assert [s.status for s in plan.steps.values()] == [StepStatus.DONE, StepStatus.DONE]
