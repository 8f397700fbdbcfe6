"""Policy cards on Telegram, Slack and Discord (real libraries against the wire fakes): a two-person card shows
each review and ends on the one outcome; the requester is refused privately; a step-up card has no Approve.

What is attacked: a card still saying nothing after the first of two approvals (people cannot tell it is
waiting for them); alice's second door counting; the progress edit putting buttons back after the outcome;
a refusal of the requester leaking into the chat; an Approve button on a card whose policy needs a passkey.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.approvals.model import Decision, Status
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID
from tests.platforms_support import (
    PLATFORMS,
    SLACK_ADMIN,
    SLACK_CHANNEL,
    TG_ADMIN,
    TG_CHAT,
    Fakes,
    kazma_on,
    three_fakes,
)

# alice is the Telegram and the Slack admin (one person, two doors); bob is the Discord admin.
PEOPLE = f"""
people:
  alice: {{telegram: {TG_ADMIN}, slack: {SLACK_ADMIN}, web: alice}}
  bob: {{discord: "{ALICE_ID}", web: bob}}
  carol: {{telegram: 555}}
tools:
  shell: {{policy: two}}
"""
POLICIES = (
    ", approvers: [alice, bob, carol], policies: {two: {approve: 2}, two-no-self: {approve: 2, forbid_requester: true},"
    " passkey: {step_up: true, approvers: [alice, bob]}}"
)
ARGS = {"command": "make release"}


def _buttons(fakes: Fakes, platform: str) -> list[str]:
    """The decision codes of the card's buttons on ``platform`` (``a``, ``d``)."""
    if platform == "telegram":
        return [str(b.get("callback_data", "")).rsplit(":", 1)[-1]
                for m in fakes.telegram.bot_messages(TG_CHAT) for b in m.buttons if b.get("callback_data")]  # fmt: skip
    if platform == "slack":
        codes = []
        for message in fakes.slack.channel(SLACK_CHANNEL):
            block = message.block("kazma_actions")
            codes += [str(e["value"]).rsplit(":", 1)[-1] for e in (block or {}).get("elements", []) if "value" in e]
        return codes
    return [
        str(c["custom_id"]).rsplit(":", 1)[-1]
        for m in fakes.discord.channel_messages(HOME_CHANNEL_ID)
        for row in m.get("components", [])
        for c in row["components"]
        if "custom_id" in c
    ]


async def test_a_two_person_card_shows_each_review_everywhere_and_ends_on_one_outcome(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS))
        for platform in PLATFORMS:  # the policy is on the card from the start
            assert "0 of 2 approvals; waiting for: alice, bob, carol" in fakes.card_text(platform), platform

        await fakes.press("telegram", Decision.APPROVE)  # alice
        first = "1 of 2 approvals: alice on Telegram; waiting for: bob, carol"
        await fakes.wait(lambda: all(first in fakes.card_text(p) for p in PLATFORMS))
        assert all(fakes.has_buttons(p) for p in PLATFORMS)  # still waiting: every card keeps its buttons

        await fakes.press("slack", Decision.APPROVE)  # alice again, on Slack: one person counts once
        await fakes.wait(lambda: any("reviewed this already" in e.text for e in fakes.slack.ephemerals))
        assert (await app.service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]

        await fakes.press("discord", Decision.APPROVE)  # bob: the second person
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert (outcome.status, outcome.person) == (Status.APPROVED, "bob")
        await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS))
        for platform in PLATFORMS:
            text = fakes.card_text(platform)
            assert f"APPROVED by bob (discord:{ALICE_ID})" in text, platform
            assert "2 of 2 approvals: alice on Telegram, bob on Discord" in text, platform
            assert "waiting for" not in text, platform
        async with asyncio.timeout(20):  # every edit to the outcome on record; still no buttons after them
            while any(c.settled_at is None for c in await app.service.store.cards(request.id)):
                await asyncio.sleep(0.02)
        assert not any(fakes.has_buttons(p) for p in PLATFORMS)


async def test_the_requester_is_refused_privately_on_every_door(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        request = await app.service.open(
            "shell", ARGS, "agent:builder", "telegram:-1001", policy="two-no-self", started_by=f"telegram:{TG_ADMIN}"
        )
        await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS))
        posted = {p: fakes.card_text(p) for p in PLATFORMS}
        await fakes.press("telegram", Decision.APPROVE)  # alice asked (her message started the work)
        await fakes.telegram.wait_for_answer(fakes.last_query, timeout=10)
        answer = fakes.telegram.callback_answers[fakes.last_query]
        assert "You asked for this call" in str(answer["text"])
        await fakes.press("slack", Decision.APPROVE)  # her Slack door is her too
        await fakes.wait(lambda: any("You asked for this call" in e.text for e in fakes.slack.ephemerals))
        refusal = next(e for e in fakes.slack.ephemerals if "You asked for this call" in e.text)
        assert refusal.user == SLACK_ADMIN  # only she sees it
        assert (await app.service.store.get(request.id)).status is Status.PENDING  # type: ignore[union-attr]
        assert await app.service.store.reviews(request.id) == []
        # nothing said in any chat: no message mentions the refusal, and the cards did not change
        assert not [m for m in fakes.telegram.bot_messages(TG_CHAT) if "You asked" in m.text]
        assert not [m for m in fakes.slack.channel(SLACK_CHANNEL) if "You asked" in " ".join(m.texts())]
        assert {p: fakes.card_text(p) for p in PLATFORMS} == posted


async def test_a_step_up_card_has_no_approve_in_any_chat_and_deny_is_one_press(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        request = await app.service.open("deploy", {"env": "prod"}, "agent:builder", "telegram:-1001", policy="passkey")
        await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS))
        for platform in PLATFORMS:
            assert _buttons(fakes, platform) == ["d", "n"], (platform, _buttons(fakes, platform))
            assert "with your passkey" in fakes.card_text(platform), platform
            assert f"/swarm?approval={request.id}" in fakes.card_text(platform), platform
        # pressing Approve with forged data (the button is not there) is refused all the same
        forged = await app.service.decide_from_button(
            f"kz1:{request.id}:a", actor=f"telegram:{TG_ADMIN}", platform="telegram"
        )
        assert "with your passkey" in forged.message
        await fakes.press("slack", Decision.DENY)
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert outcome.status is Status.DENIED
        await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS))
