"""Cards go where a policy says (``approvals.policies.<name>.to``), on the real libraries against the wire fakes.

What is attacked: a card routed to one person's direct messages leaking into the home chats (where everyone
in the group would see the call and its buttons); a press on a card in alice's DM by somebody else — an
approver too — counting (forged button data, or the card forwarded); a press carrying that request's button
data from a message that is no card of it; the DM card not settling to the one outcome like every card.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kazma.adapters.contract import RoutesCards
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import Status
from kazma.approvals.policy import SafetyPolicy
from kazma.approvals.store import NewRequest, Rules, new_request_id
from kazma.bot.app import App, build_app
from kazma.config import load_config_text
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID, FakeUser
from tests.fakes.slack import direct_channel
from tests.platforms_support import (
    SLACK_ADMIN,
    SLACK_CHANNEL,
    TG_ADMIN,
    TG_CHAT,
    Fakes,
    adapters_for,
    kazma_on,
    three_fakes,
)

BOB_TG = 333
CAROL_SLACK = "U0CAROL01"
CAROL_DISCORD = 333333333333333333
# alice is the Telegram and Slack admin; bob (Telegram, Discord) and carol (Slack, Discord) may decide too.
PEOPLE = f"""
people:
  alice: {{telegram: {TG_ADMIN}, slack: {SLACK_ADMIN}, web: alice}}
  bob: {{telegram: {BOB_TG}, discord: "{ALICE_ID}", web: bob}}
  carol: {{slack: {CAROL_SLACK}, discord: "{CAROL_DISCORD}"}}
"""
POLICIES = (
    ", approvers: [alice, bob, carol], policies: {"
    "alice-dm: {to: [{dm: alice, via: telegram}]},"
    " both-dm: {approve: 2, to: [{dm: alice, via: slack}, {dm: bob, via: discord}]}}"
)
ARGS = {"command": "systemctl restart billing"}


async def _posts_done(app: App, request_id: str) -> list[tuple[str, str]]:
    """Wait until every card post of ``request_id`` is done; (platform, outcome) of each outbox row."""
    async with asyncio.timeout(20):
        while True:
            rows = await app.service.store.tables.all(
                "SELECT platform, outcome, done_at FROM card_outbox WHERE request_id = ? ORDER BY platform",
                (request_id,),
            )
            if rows and all(r[2] is not None for r in rows):
                return [(str(r[0]), str(r[1])) for r in rows]
            await asyncio.sleep(0.02)


def _cards_anywhere_but(fakes: Fakes, dm_chats: dict[str, Any]) -> list[str]:
    """Every approval card on the fakes outside the given DM chats (by platform)."""
    found = []
    for chat, sent in fakes.telegram._chats.items():
        if chat != dm_chats.get("telegram"):
            found += [f"telegram {chat}" for m in sent.values() if m.from_bot and "Approval needed" in m.text]
    for channel, posted in fakes.slack.messages.items():
        if channel != dm_chats.get("slack"):
            found += [f"slack {channel}" for p in posted.values() if p.block("kazma_actions")]
    for message in fakes.discord.messages.values():
        if int(message["channel_id"]) != dm_chats.get("discord") and message.get("embeds"):
            found.append(f"discord {message['channel_id']}")
    return found


async def test_a_policy_routed_to_one_persons_dm_posts_there_and_nowhere_else(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="alice-dm")
        assert await _posts_done(app, request.id) == [("telegram", "posted")]  # no post queued on Slack, Discord
        dm = fakes.telegram.bot_messages(TG_ADMIN)
        assert len(dm) == 1
        assert "systemctl restart billing" in dm[0].text
        assert dm[0].buttons
        assert _cards_anywhere_but(fakes, {"telegram": TG_ADMIN}) == []
        assert not fakes.telegram.bot_messages(TG_CHAT)
        assert not fakes.slack.channel(SLACK_CHANNEL)
        assert not fakes.discord.channel_messages(HOME_CHANNEL_ID)
        (card,) = await app.service.store.cards(request.id)
        assert (card.platform, card.chat, card.bound_to) == ("telegram", str(TG_ADMIN), "alice")

        data = next(str(b["callback_data"]) for b in dm[0].buttons if str(b["callback_data"]).endswith(":a"))
        fakes.telegram.push_callback(TG_ADMIN, dm[0].message_id, TG_ADMIN, data)
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert (outcome.status, outcome.person) == (Status.APPROVED, "alice")
        await fakes.wait(lambda: not fakes.telegram.bot_messages(TG_ADMIN)[0].buttons)
        assert "APPROVED by alice" in fakes.telegram.bot_messages(TG_ADMIN)[0].text
        assert _cards_anywhere_but(fakes, {"telegram": TG_ADMIN}) == []


async def test_a_dm_card_telegram_refuses_because_she_never_pressed_start_is_said_in_the_home_chat_once(
    tmp_path: Path,
) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        fakes.telegram.not_started.add(TG_ADMIN)
        first = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="alice-dm")
        assert await _posts_done(app, first.id) == [("telegram", "failed")]
        await fakes.wait(
            lambda: any("did not get the approval card" in m.text for m in fakes.telegram.bot_messages(TG_CHAT))
        )
        (notice,) = [m.text for m in fakes.telegram.bot_messages(TG_CHAT)]
        assert notice.startswith("alice did not get the approval card for shell in a direct message on Telegram")
        assert "pressed Start" in notice
        assert "console's Approvals page" in notice
        (note,) = await app.service.store.tables.all(
            "SELECT last_error FROM card_outbox WHERE request_id = ?", (first.id,)
        )
        assert "has not started a private chat with the bot" in str(note[0])
        # a second request refused the same way is not said again
        second = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="alice-dm")
        assert await _posts_done(app, second.id) == [("telegram", "failed")]
        # she presses Start: the next card reaches her, and the home chat heard of her once
        fakes.telegram.not_started.discard(TG_ADMIN)
        third = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="alice-dm")
        assert await _posts_done(app, third.id) == [("telegram", "posted")]
        assert len(fakes.telegram.bot_messages(TG_ADMIN)) == 1
        assert len(fakes.telegram.bot_messages(TG_CHAT)) == 1


async def test_a_press_on_alices_dm_card_by_anyone_else_decides_nothing(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="alice-dm")
        await _posts_done(app, request.id)
        (card,) = fakes.telegram.bot_messages(TG_ADMIN)
        approve = next(str(b["callback_data"]) for b in card.buttons if str(b["callback_data"]).endswith(":a"))

        # bob may decide under the policy, but the card is alice's: his forged press on it is refused
        query = fakes.telegram.push_callback(TG_ADMIN, card.message_id, BOB_TG, approve)
        answer = await fakes.telegram.wait_for_answer(query, timeout=10)
        assert "sent to another person" in str(answer["text"])
        # the same data from a message in the group that is no card of the request
        query = fakes.telegram.push_callback(TG_CHAT, 1, BOB_TG, approve)
        answer = await fakes.telegram.wait_for_answer(query, timeout=10)
        assert "not on a card of that request" in str(answer["text"])
        stored = await app.service.store.get(request.id)
        assert stored is not None
        assert stored.status is Status.PENDING
        assert await app.service.store.reviews(request.id) == []
        refused = [e for e in await app.service.store.events(request.id) if e.event == "press_refused"]
        assert any("direct message" in (e.detail or "") for e in refused)
        assert card.buttons  # the card still waits for alice

        # bob's Deny on it is refused the same way; alice's own press decides, once
        deny = approve[:-1] + "d"
        query = fakes.telegram.push_callback(TG_ADMIN, card.message_id, BOB_TG, deny)
        await fakes.telegram.wait_for_answer(query, timeout=10)
        fakes.telegram.push_callback(TG_ADMIN, card.message_id, TG_ADMIN, approve)
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert (outcome.status, outcome.person) == (Status.APPROVED, "alice")
        await fakes.wait(lambda: not fakes.telegram.message(TG_ADMIN, card.message_id).buttons)


async def test_dm_cards_on_slack_and_discord_each_bound_and_settled_to_one_outcome(tmp_path: Path) -> None:
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="both-dm")
        assert await _posts_done(app, request.id) == [("discord", "posted"), ("slack", "posted")]
        slack_dm = direct_channel(SLACK_ADMIN)
        discord_dm = fakes.discord.dm_channel(fakes.discord.alice)
        assert _cards_anywhere_but(fakes, {"slack": slack_dm, "discord": discord_dm}) == []
        (on_slack,) = [m for m in fakes.slack.channel(slack_dm) if m.block("kazma_actions")]
        (on_discord,) = [m for m in fakes.discord.channel_messages(discord_dm) if m.get("components")]
        bound = {(c.platform, c.chat): c.bound_to for c in await app.service.store.cards(request.id)}
        assert bound == {("slack", slack_dm): "alice", ("discord", str(discord_dm)): "bob"}

        block = on_slack.block("kazma_actions")
        assert block is not None
        value = str(next(e["value"] for e in block["elements"] if e["action_id"] == "kazma_approve"))
        assert fakes.slack_events_url is not None
        # carol may decide under the policy, but this card is alice's: her press on it is refused, nothing recorded
        await fakes.slack.post_block_action(fakes.slack_events_url, action_id="kazma_approve", value=value,
                                            user=CAROL_SLACK, channel=slack_dm, message_ts=on_slack.ts)  # fmt: skip
        await fakes.wait(lambda: any(e.user == CAROL_SLACK for e in fakes.slack.ephemerals))
        (refusal,) = [e for e in fakes.slack.ephemerals if e.user == CAROL_SLACK]
        assert "sent to another person" in refusal.text
        assert await app.service.store.reviews(request.id) == []

        await fakes.slack.post_block_action(fakes.slack_events_url, action_id="kazma_approve", value=value,
                                            user=SLACK_ADMIN, channel=slack_dm, message_ts=on_slack.ts)  # fmt: skip
        await fakes.wait(lambda: len(fakes.slack.calls_to("chat.update")) >= 1)
        custom = next(
            str(c["custom_id"]) for row in on_discord["components"] for c in row["components"]
            if str(c["custom_id"]).endswith(":a")
        )  # fmt: skip
        # carol's press on bob's Discord DM card is refused the same way: still one review
        pressed = await fakes.discord.press_button(int(on_discord["id"]), custom, user=FakeUser(CAROL_DISCORD, "carol"))
        followup = await fakes.discord.wait_for_call("POST", rf"/webhooks/\d+/{pressed.token}")
        assert "sent to another person" in str(followup.json["content"])
        assert [r.reviewer for r in await app.service.store.reviews(request.id)] == ["alice"]
        await fakes.discord.press_button(int(on_discord["id"]), custom)  # bob (the fake's "alice" user)
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert (outcome.status, outcome.person) == (Status.APPROVED, "bob")
        assert [r.reviewer for r in await app.service.store.reviews(request.id)] == ["alice", "bob"]
        await fakes.wait(lambda: not fakes.slack.message(slack_dm, on_slack.ts).block("kazma_actions"))
        await fakes.wait(lambda: not fakes.discord.messages[int(on_discord["id"])].get("components"))


async def test_a_policy_routed_to_chats_posts_in_those_chats_only(tmp_path: Path) -> None:
    other = -1002
    async with three_fakes() as fakes:
        yaml = fakes.config_yaml(
            tmp_path / "k.db",
            approvals=POLICIES.replace("policies: {", f'policies: {{chats: {{to: ["telegram:{other}", '
                                       f'"slack:{SLACK_CHANNEL}"]}},'),
            extra=PEOPLE,
        ).replace(f"chats: [{TG_CHAT}]", f"chats: [{TG_CHAT}, {other}]")  # fmt: skip
        loaded = load_config_text(yaml, environ={})
        adapters = adapters_for(loaded)
        app = await build_app(loaded, adapters=adapters, poll_interval=0.05, workspace_root=tmp_path / "ws")
        await app.start()
        try:
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", policy="chats")
            assert await _posts_done(app, request.id) == [("slack", "posted"), ("telegram", "posted")]
            assert _cards_anywhere_but(fakes, {"telegram": other, "slack": SLACK_CHANNEL}) == []
            (card,) = fakes.telegram.bot_messages(other)
            assert card.buttons
            assert fakes.slack.channel(SLACK_CHANNEL)
            assert {(c.platform, c.chat, c.bound_to) for c in await app.service.store.cards(request.id)} == {
                ("telegram", str(other), None),
                ("slack", SLACK_CHANNEL, None),
            }
            approve = next(str(b["callback_data"]) for b in card.buttons if str(b["callback_data"]).endswith(":a"))
            fakes.telegram.push_callback(other, card.message_id, BOB_TG, approve)  # any approver, in a chat
            outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
            assert (outcome.status, outcome.person) == (Status.APPROVED, "bob")
            await fakes.wait(lambda: not fakes.telegram.message(other, card.message_id).buttons)
            await fakes.wait(lambda: not any(m.block("kazma_actions") for m in fakes.slack.channel(SLACK_CHANNEL)))
        finally:
            await app.stop()


async def test_a_dm_card_a_crash_left_unrecorded_is_found_in_that_dm_never_in_the_home_channel(tmp_path: Path) -> None:
    """Discord gives an unrecorded post back by its nonce once the request ended: the post tried again goes
    where the policy sends the card (bob's DM), so the found card settles there and nothing lands at home."""
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=PEOPLE) as app,
    ):
        approvals = app.service.store
        new = NewRequest(new_request_id(), "shell", canonical_json(ARGS), args_hash(ARGS), "agent:builder",
                         "telegram:-1001", approvals.clock() + 600, rules=Rules("both-dm", 2, 1))  # fmt: skip
        request, _ = await approvals.insert_once(new)
        discord_adapter = app.bus.adapters["discord"]
        assert isinstance(discord_adapter, RoutesCards)
        dm = await discord_adapter.direct_chat(str(ALICE_ID))  # bob's DM: posted, then the process died
        await discord_adapter.post_card_in(app.service.card(request), dm)
        await app.service.cancel(request.id, reason="Kazma restarted before a decision")
        now = approvals.clock()
        writer = await approvals.tables.writer()
        await writer.submit(
            lambda tx: tx.run(
                "INSERT INTO card_outbox (request_id, platform, created_at, next_at, attempts) VALUES (?, ?, ?, ?, 1)",
                (request.id, "discord", now, now),
            )
        )
        app.bus.posts_waiting()  # type: ignore[union-attr]
        await fakes.wait(lambda: not any(m.get("components") for m in fakes.discord.channel_messages(int(dm))))
        (found,) = [m for m in fakes.discord.channel_messages(int(dm)) if m.get("embeds")]
        assert "CANCELLED" in str(found["embeds"])
        assert (fakes.discord.history_reads, fakes.discord.nonce_replays) == (1, 0)  # found in that DM's messages
        assert not fakes.discord.channel_messages(HOME_CHANNEL_ID)
        assert [(c.chat, c.bound_to) for c in await approvals.cards(request.id)] == [(dm, "bob")]


async def test_a_call_whose_cards_can_go_nowhere_connected_is_refused_at_once(tmp_path: Path) -> None:
    """Fail closed per policy: Telegram did not start, so a policy that sends its cards only to alice's Telegram
    DM has no card anywhere: its calls are refused at once (nothing opened, nothing waiting for a deadline),
    while the default policy, whose cards Slack and Discord show, still asks."""
    async with three_fakes() as fakes:
        await fakes.telegram.stop()  # Telegram is down when Kazma starts
        extra = PEOPLE + "tools: {shell: {policy: alice-dm}}\n"
        async with kazma_on(fakes, tmp_path / "k.db", approvals=POLICIES, extra=extra) as app:
            assert app.bus.can_show_cards()
            assert not app.bus.can_show_cards("alice-dm")
            verdict = await SafetyPolicy(app.service).check(
                "shell", ARGS, requested_by="agent:builder", conversation="slack:C0HOME0001"
            )
            assert not verdict.allowed
            assert "no platform can show an approval card" in verdict.reason
            assert await app.service.store.requests() == []
