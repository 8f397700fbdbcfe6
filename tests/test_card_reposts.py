"""A card post tried again after an attempt that may have landed unrecorded (a crash between the platform's
answer and the record of its message id): never twice on Discord (the post's nonce), at most once more and
marked on Telegram and Slack, where a post cannot be made idempotent.

The earlier attempt is made the way a process that died made it: the real adapter posted the card, the outbox
counted the attempt, and nothing recorded the message id. Then the running bus posts what is due.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.adapters.bus import REPOSTED
from kazma.adapters.discord.adapter import card_nonce
from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import Status
from kazma.approvals.store import NewRequest, new_request_id
from kazma.bot.app import App
from kazma.config.store.database import connect
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import PLATFORMS, SLACK_CHANNEL, TG_CHAT, Fakes, kazma_on, three_fakes

ARGS = {"command": "make release"}


async def _posted_by_a_process_that_died(app: App, store: Path) -> str:
    """A pending request whose card each platform shows, counted as one attempt, its message ids unrecorded."""
    approvals = app.service.store
    new = NewRequest(new_request_id(), "shell", canonical_json(ARGS), args_hash(ARGS), "agent:builder",
                     "telegram:-1001", approvals.clock() + 600)  # fmt: skip
    request, _ = await approvals.insert_once(new)
    card = app.service.card(request)
    for adapter in app.bus.adapters.values():
        await adapter.post_card(card)
    conn = await connect(store)
    try:
        now = approvals.clock()
        await conn.executemany(
            "INSERT INTO card_outbox (request_id, platform, created_at, next_at, attempts) VALUES (?, ?, ?, ?, 1)",
            [(request.id, platform, now, now) for platform in PLATFORMS],
        )
    finally:
        await conn.close()
    return request.id


def _cards(fakes: Fakes, platform: str) -> list[str]:
    if platform == "telegram":
        return [m.text for m in fakes.telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]
    if platform == "slack":
        return [" ".join(m.texts()) for m in fakes.slack.channel(SLACK_CHANNEL) if m.block("kazma_actions")]
    return [str(m) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]


async def test_a_post_tried_again_is_one_card_on_discord_and_one_marked_copy_elsewhere(tmp_path: Path) -> None:
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        request_id = await _posted_by_a_process_that_died(app, store)
        assert all(len(_cards(fakes, p)) == 1 for p in PLATFORMS)
        app.bus.posts_waiting()  # type: ignore[union-attr]
        async with asyncio.timeout(20):
            while len(await app.service.store.cards(request_id)) < len(PLATFORMS):
                await asyncio.sleep(0.02)
        assert len(_cards(fakes, "discord")) == 1  # the nonce gave the first message back
        assert fakes.discord.nonce_replays == 1
        for platform in ("telegram", "slack"):
            first, again = _cards(fakes, platform)
            assert "Posted again" not in first
            assert "Posted again" in again, platform
        (discord_card,) = [c for c in await app.service.store.cards(request_id) if c.platform == "discord"]
        (message,) = [m for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]
        assert discord_card.message_id == message["id"]
        assert message["nonce"] == card_nonce(request_id, str(HOME_CHANNEL_ID))

        # the first Telegram copy's buttons do nothing; the marked one decides
        stale = next(m for m in fakes.telegram.bot_messages(TG_CHAT) if m.buttons)
        data = str(stale.buttons[0]["callback_data"])
        query = fakes.telegram.push_callback(TG_CHAT, stale.message_id, 111, data)
        answer = await fakes.telegram.wait_for_answer(query)
        assert "not on a card of that request" in str(answer.get("text"))
        assert (await app.service.store.get(request_id)).status is Status.PENDING  # type: ignore[union-attr]
        marked = [m for m in fakes.telegram.bot_messages(TG_CHAT) if m.buttons][-1]
        approve = next(str(b["callback_data"]) for b in marked.buttons if str(b["callback_data"]).endswith(":a"))
        fakes.telegram.push_callback(TG_CHAT, marked.message_id, 111, approve)
        outcome = await asyncio.wait_for(app.service.wait(request_id), timeout=20)
        assert outcome.status is Status.APPROVED


def test_the_mark_says_what_happened() -> None:
    assert "Posted again" in REPOSTED
    assert "buttons do nothing" in REPOSTED


async def test_a_card_posted_again_keeps_its_mark_when_it_settles(tmp_path: Path) -> None:
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        request_id = await _posted_by_a_process_that_died(app, store)
        app.bus.posts_waiting()  # type: ignore[union-attr]
        async with asyncio.timeout(20):
            while len(await app.service.store.cards(request_id)) < len(PLATFORMS):
                await asyncio.sleep(0.02)
        marked = [m for m in fakes.telegram.bot_messages(TG_CHAT) if m.buttons][-1]
        assert "Posted again" in marked.text
        approve = next(str(b["callback_data"]) for b in marked.buttons if str(b["callback_data"]).endswith(":a"))
        fakes.telegram.push_callback(TG_CHAT, marked.message_id, 111, approve)
        outcome = await asyncio.wait_for(app.service.wait(request_id), timeout=20)
        assert outcome.status is Status.APPROVED
        async with asyncio.timeout(20):
            while not all(c.settled_at for c in await app.service.store.cards(request_id)):
                await asyncio.sleep(0.02)
        settled = next(m for m in fakes.telegram.bot_messages(TG_CHAT) if m.message_id == marked.message_id)
        assert not settled.buttons
        assert "APPROVED" in settled.text
        assert "Posted again" in settled.text  # the edit to the outcome says it still
        slack_again = [" ".join(m.texts()) for m in fakes.slack.channel(SLACK_CHANNEL) if m.blocks][-1]
        assert "APPROVED" in slack_again.upper()
        assert "Posted again" in slack_again
        (discord_card,) = [m for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]
        assert "Posted again" not in str(discord_card)  # the nonce gave the first message back: one copy, unmarked
