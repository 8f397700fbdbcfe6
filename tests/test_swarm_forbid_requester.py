"""Swarm work runs for whoever asked for it: under a policy with ``forbid_requester`` that person may not approve a
dangerous call of any of its workers, whether they asked with ``/swarm`` or through the lead's ``dispatch_swarm``
(whose own card is theirs too). On the real Telegram library against the wire-level fake Bot API; only the
models are scripted.

A worker's turn was asked for by "swarm", not a person: no requester was on its card, and the one who started the
task approved its calls under a no-self policy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from kazma.approvals.model import Decision
from kazma.bot.app import App
from kazma.engine.model import ScriptStep
from kazma.engine.types import ModelReply
from tests.test_e2e_plans import ALICE, CHAT, call, kazma, said
from tests.test_plan_forbid_requester import BOB, refused_then_decided
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


async def test_who_sent_swarm_may_not_approve_its_workers_calls_under_a_no_self_policy(tmp_path: Path) -> None:
    scripts: dict[str, list[ScriptStep]] = {
        "builder": [call("shell", {"command": "echo hi"}), ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts, extra=POLICY) as (app, fake), _nothing_left_pending(app):
        fake.push_message(CHAT, BOB, "/swarm dispatch builder say hi", username="bob")
        await refused_then_decided(app, fake, "shell", asker=BOB, other=ALICE)
        await said(fake, "Said hi.")


async def test_who_asked_the_lead_may_approve_neither_its_dispatch_nor_the_workers_calls(tmp_path: Path) -> None:
    dispatch = {"pattern": "dispatch", "task": "say hi", "workers": ["builder"]}
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("dispatch_swarm", dispatch), ModelReply(content="Handed to the builder.")],
        "builder": [call("shell", {"command": "echo hi"}), ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts, extra=POLICY) as (app, fake), _nothing_left_pending(app):
        fake.push_message(CHAT, BOB, "@kazma have the builder say hi", username="bob")
        await refused_then_decided(app, fake, "dispatch_swarm", asker=BOB, other=ALICE)
        await refused_then_decided(app, fake, "shell", asker=BOB, other=ALICE)
        await said(fake, "Said hi.")


async def test_an_approved_dispatch_that_started_its_task_is_never_reported_as_not_run_after_a_restart(
    tmp_path: Path,
) -> None:
    # dispatch_swarm's approval was verified (execution_started) but its end never audited: the next start's
    # recovery found it "verified, never ended, no execution row" and told every card it did not run.
    dispatch = {"pattern": "dispatch", "task": "say hi", "workers": ["builder"]}
    scripts: dict[str, list[ScriptStep]] = {
        "kazma": [call("dispatch_swarm", dispatch), ModelReply(content="Handed to the builder.")],
        "builder": [ModelReply(content="Said hi.")],
    }
    async with kazma(tmp_path, scripts, extra=POLICY) as (app, fake), _nothing_left_pending(app):
        fake.push_message(CHAT, BOB, "@kazma have the builder say hi", username="bob")
        decided = await refused_then_decided(app, fake, "dispatch_swarm", asker=BOB, other=ALICE)
        await said(fake, "Handed to the builder.")
        events = [e.event for e in await app.service.store.events(decided.id)]
        assert "execution_finished" in events, events
        recovery = await app.service.recover(orphans=False)
        assert [r.id for r in recovery.never_ran] == []
        assert "execution_lost" not in [e.event for e in await app.service.store.events(decided.id)]
