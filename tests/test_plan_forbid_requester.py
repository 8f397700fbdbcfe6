"""A plan's steps run for the person who asked for the plan: under a policy with ``forbid_requester`` that person may
not approve a dangerous call of any of its steps, whichever agent makes it. On the real Telegram library against the
wire-level fake Bot API; only the model is scripted.

The steps' turns were asked for by "executor" (the lead's) or by the lead's ``@sub-agent`` message, neither a person:
no requester was on the card, and the one who asked for the plan approved its calls under a no-self policy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.approvals.model import ApprovalRequest, Status
from kazma.bot.app import App
from kazma.engine.model import ScriptStep
from kazma.engine.types import ModelReply
from tests.fakes.telegram import FakeTelegram
from tests.test_e2e_plans import ALICE, CHAT, call, kazma, said

BOB = 111  # the chat's admin: the other approver
POLICY = f"""
people:
  alice: {{telegram: {ALICE}}}
  bob: {{telegram: {BOB}}}
approvals:
  approvers: [alice, bob]
  policies:
    not-mine: {{forbid_requester: true}}
tools:
  shell: {{policy: not-mine}}
"""


PLAN = {"goal": "say hi", "steps": [{"index": 1, "title": "hi", "assignee": "builder", "input": "Say hi."}]}


async def refused_then_decided(app: App, fake: FakeTelegram, tool: str, *, asker: int, other: int) -> ApprovalRequest:
    """The pending card of ``tool``, asked for by ``asker``: their Approve is refused privately and changes nothing;
    ``other``'s decides."""
    async with asyncio.timeout(20):
        while not (found := [r for r in await app.service.store.requests(pending_only=True) if r.tool == tool]):
            await asyncio.sleep(0.02)
    [request] = found
    assert (request.policy, request.started_by) == ("not-mine", f"telegram:{asker}")  # who asked for the work
    await fake.wait_until(lambda: any(request.id in str(m.buttons) for m in fake.bot_messages(CHAT)), timeout=20)
    card = next(m for m in fake.bot_messages(CHAT) if request.id in str(m.buttons))
    approve = next(str(b["callback_data"]) for b in card.buttons if str(b["callback_data"]).endswith(":a"))

    answer = await fake.wait_for_answer(fake.push_callback(CHAT, card.message_id, asker, approve), timeout=10)
    assert "You asked for this call" in str(answer["text"])
    still = await app.service.store.get(request.id)
    assert still is not None
    assert still.status is Status.PENDING  # the asker's press counted for nothing

    await fake.wait_for_answer(fake.push_callback(CHAT, card.message_id, other, approve), timeout=10)
    decided = await app.service.store.get(request.id)
    assert decided is not None
    assert (decided.status, decided.decided_by) == (Status.APPROVED, f"telegram:{other}")
    return decided


async def test_who_asked_for_the_plan_may_not_approve_its_steps_calls_under_a_no_self_policy(tmp_path: Path) -> None:
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("write_plan", PLAN), ModelReply(content="Planned."), ModelReply(content="All done.")],
        "builder": [call("shell", {"command": "echo hi"}), ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts, extra=POLICY) as (app, fake):
        fake.push_message(CHAT, ALICE, "@kazma say hi, please", username="alice")
        await refused_then_decided(app, fake, "shell", asker=ALICE, other=BOB)
        await said(fake, "All done.")
