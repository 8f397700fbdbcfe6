"""A card in a direct message is its person's, checked in the press's own transaction, on SQLite and PostgreSQL.

What is attacked: bob (an approver under the policy) pressing alice's DM card with its real button data, at
its real place, over and over while alice presses; a press that does not say where it came from slipping past
the binding; a bound card changing who may decide anywhere else (an unbound card in a group still takes any
approver's press).
"""

from __future__ import annotations

import asyncio

from kazma.approvals import Decision, PressVerdict
from tests.approvals_support import RecordingPublisher, approval_service
from tests.policy_support import policy_config
from tests.store_backends import Engine

ALICE, BOB = "telegram:111", "telegram:333"
ALICE_DM = "111"
PRESSES = 50


async def test_only_the_person_a_dm_card_was_sent_to_decides_with_it(store_engine: Engine) -> None:
    async with approval_service(store_engine.where, config=policy_config(), publisher=RecordingPublisher()) as service:
        request = await service.open("shell", {"command": "make release"}, "agent:builder", "telegram:-1001")
        assert (request.approve_needed, request.policy) == (2, "two")
        await service.store.record_card(request.id, "telegram", ALICE_DM, "7", bound_to="alice")
        approve = f"kz1:{request.id}:a"

        # bob, at the card's place, many times, while alice presses once: bob never counts, alice once
        bobs = [
            service.decide_from_button(approve, actor=BOB, platform="telegram", chat=ALICE_DM, message_id="7")
            for _ in range(PRESSES)
        ]
        alices = service.decide_from_button(approve, actor=ALICE, platform="telegram", chat=ALICE_DM, message_id="7")
        *refused, counted = await asyncio.gather(*bobs, alices)
        assert {r.verdict for r in refused} == {PressVerdict.REFUSED}
        assert all("sent to another person" in r.message for r in refused)
        assert counted.verdict is PressVerdict.COUNTED
        assert [(r.reviewer, r.actor) for r in await service.store.reviews(request.id)] == [("alice", ALICE)]

        # a press that says nothing of where it was is held to the cards it could be from: only alice's here
        blind = await service.decide_from_button(approve, actor=BOB, platform="telegram")
        assert blind.verdict is PressVerdict.REFUSED
        assert "sent to another person" in blind.message
        assert len(await service.store.reviews(request.id)) == 1

        # a card in a group is anyone's who may decide: bob approves there, and that decides it, once
        await service.store.record_card(request.id, "telegram", "-1001", "8")
        won = await service.decide_from_button(approve, actor=BOB, platform="telegram", chat="-1001", message_id="8")
        assert won.verdict is PressVerdict.WON
        stored = await service.store.get(request.id)
        assert stored is not None
        assert (stored.status.value, stored.decided_person) == ("approved", "bob")
        decided = [e for e in await service.store.events(request.id) if e.event == "decided"]
        assert len(decided) == 1
        late = await service.decide(request.id, Decision.DENY, actor=ALICE, platform="telegram")
        assert late.verdict is PressVerdict.LOST
