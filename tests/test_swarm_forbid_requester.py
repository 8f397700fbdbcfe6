"""Swarm work runs for whoever asked for it: under a policy with ``forbid_requester`` that person may not approve a
dangerous call of any of its workers, whether they asked with ``/swarm`` or through the lead's ``dispatch_swarm``
(whose own card is theirs too). On the real Telegram library against the wire-level fake Bot API; only the
models are scripted.

A worker's turn was asked for by "swarm", not a person: no requester was on its card, and the one who started the
task approved its calls under a no-self policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from kazma.approvals.model import ApprovalRequest, Decision, Status
from kazma.bot.app import App
from kazma.engine.model import ScriptStep
from kazma.engine.types import ModelReply
from tests.fakes.telegram import FakeTelegram
from tests.test_e2e_plans import ALICE, CHAT, call, kazma, said
from tests.test_plan_forbid_requester import BOB
from tests.test_plan_forbid_requester import POLICY as PLAN_POLICY

# The plans' no-self policy, and for the lead's dispatch_swarm too; two approvers are two operators here
POLICY = PLAN_POLICY + "  dispatch_swarm: {policy: not-mine}\nswarm: {allow_shared_operators: true}\n"


@asynccontextmanager
async def _nothing_left_pending(app: App) -> AsyncIterator[None]:
    """A failed check denies what is still pending, so the app can stop and the failure is told (not a hang)."""
    try:
        yield
    except BaseException:
        for request in await app.service.store.requests(pending_only=True):
            await app.service.decide(request.id, Decision.DENY, actor=f"telegram:{ALICE}", platform="telegram")
        raise


async def _decided_by_alice_after_bob_is_refused(app: App, fake: FakeTelegram, tool: str) -> ApprovalRequest:
    """The pending card of ``tool``: Bob's Approve is refused privately and changes nothing; Alice's decides."""
    async with asyncio.timeout(20):
        while not (found := [r for r in await app.service.store.requests(pending_only=True) if r.tool == tool]):
            await asyncio.sleep(0.02)
    [request] = found
    assert (request.policy, request.started_by) == ("not-mine", f"telegram:{BOB}")
    await fake.wait_until(lambda: any(request.id in str(m.buttons) for m in fake.bot_messages(CHAT)), timeout=20)
    card = next(m for m in fake.bot_messages(CHAT) if request.id in str(m.buttons))
    approve = next(str(b["callback_data"]) for b in card.buttons if str(b["callback_data"]).endswith(":a"))

    answer = await fake.wait_for_answer(fake.push_callback(CHAT, card.message_id, BOB, approve), timeout=10)
    assert "You asked for this call" in str(answer["text"])
    still = await app.service.store.get(request.id)
    assert still is not None
    assert still.status is Status.PENDING  # his press counted for nothing

    await fake.wait_for_answer(fake.push_callback(CHAT, card.message_id, ALICE, approve), timeout=10)
    decided = await app.service.store.get(request.id)
    assert decided is not None
    assert (decided.status, decided.decided_by) == (Status.APPROVED, f"telegram:{ALICE}")
    return decided


async def test_who_sent_swarm_may_not_approve_its_workers_calls_under_a_no_self_policy(tmp_path: Path) -> None:
    scripts: dict[str, list[ScriptStep]] = {
        "builder": [call("shell", {"command": "echo hi"}), ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts, extra=POLICY) as (app, fake), _nothing_left_pending(app):
        fake.push_message(CHAT, BOB, "/swarm dispatch builder say hi", username="bob")
        await _decided_by_alice_after_bob_is_refused(app, fake, "shell")
        await said(fake, "Said hi.")


async def test_who_asked_the_lead_may_approve_neither_its_dispatch_nor_the_workers_calls(tmp_path: Path) -> None:
    dispatch = {"pattern": "dispatch", "task": "say hi", "workers": ["builder"]}
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("dispatch_swarm", dispatch), ModelReply(content="Handed to the builder.")],
        "builder": [call("shell", {"command": "echo hi"}), ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts, extra=POLICY) as (app, fake), _nothing_left_pending(app):
        fake.push_message(CHAT, BOB, "@kazma have the builder say hi", username="bob")
        await _decided_by_alice_after_bob_is_refused(app, fake, "dispatch_swarm")
        await _decided_by_alice_after_bob_is_refused(app, fake, "shell")
        await said(fake, "Said hi.")
