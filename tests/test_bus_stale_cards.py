"""A card posted just before a crash, its message id never recorded, after the restart ended its request: it
must end showing that outcome like every other card, and never decide anything.

The crash is made the way a process that died makes it: the real adapters posted the card, the outbox counted
the attempt, nothing recorded the message ids; then the request ends as a restart ends it (cancelled). On
Discord the bus posts again with the same nonce, gets the first message back and settles it. Telegram and
Slack offer no such thing: the card is found when someone presses it, and that message is edited to the
outcome while the presser is told what stands.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.approvals.hashing import args_hash, canonical_json
from kazma.approvals.model import Decision, Status
from kazma.approvals.store import NewRequest, new_request_id
from kazma.bot.app import App
from kazma.config.store.database import connect
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import PLATFORMS, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, Fakes, kazma_on, three_fakes

ARGS = {"command": "make release"}
RESTARTED = "Kazma restarted before a decision"


async def _posted_then_ended_by_a_restart(app: App, store: Path) -> str:
    """A request whose card every platform shows, unrecorded, with one post attempt counted; then cancelled."""
    approvals = app.service.store
    new = NewRequest(new_request_id(), "shell", canonical_json(ARGS), args_hash(ARGS), "agent:builder",
                     "telegram:-1001", approvals.clock() + 600)  # fmt: skip
    request, _ = await approvals.insert_once(new)
    card = app.service.card(request)
    for adapter in app.bus.adapters.values():
        await adapter.post_card(card)
    await app.service.cancel(request.id, reason=RESTARTED)
    await _posts_attempted_unrecorded(app, store, request.id)
    return request.id


async def _posts_attempted_unrecorded(app: App, store: Path, request_id: str) -> None:
    """Each platform's post of ``request_id``'s card counted as attempted once, its message id never recorded
    (as a process that died mid-post leaves it); the bus is told to look."""
    conn = await connect(store)
    try:
        now = app.service.store.clock()
        await conn.executemany(
            "INSERT INTO card_outbox (request_id, platform, created_at, next_at, attempts) VALUES (?, ?, ?, ?, 1)",
            [(request_id, platform, now, now) for platform in PLATFORMS],
        )
    finally:
        await conn.close()
    app.bus.posts_waiting()  # type: ignore[union-attr]


async def _outbox_done(store: Path, request_id: str) -> bool:
    conn = await connect(store)
    try:
        async with conn.execute(
            "SELECT count(*) FROM card_outbox WHERE request_id = ? AND done_at IS NULL", (request_id,)
        ) as cursor:
            row = await cursor.fetchone()
    finally:
        await conn.close()
    return row is not None and row[0] == 0


async def _wait_for(check: object, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():  # type: ignore[operator]
            await asyncio.sleep(0.05)


def _discord_cards(fakes: Fakes) -> list[dict[str, object]]:
    return [m for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]


async def test_discord_finds_its_unrecorded_card_by_nonce_and_settles_it(tmp_path: Path) -> None:
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        request_id = await _posted_then_ended_by_a_restart(app, store)
        await fakes.wait(lambda: not fakes.has_buttons("discord"))
        (message,) = _discord_cards(fakes)  # the first message, found among the channel's: never a second card
        assert fakes.discord.history_reads >= 1
        assert fakes.discord.nonce_replays == 0  # not posted again (a bot that may not read history: its nonce)
        assert "CANCELLED" in fakes.card_text("discord")
        # the edit is on the wire before its record is written: wait for the record
        async with asyncio.timeout(10):
            while not (recorded := [c for c in await app.service.store.cards(request_id) if c.platform == "discord"]):
                await asyncio.sleep(0.02)
            while recorded[0].settled_at is None:
                await asyncio.sleep(0.02)
                recorded = [c for c in await app.service.store.cards(request_id) if c.platform == "discord"]
        assert [c.message_id for c in recorded] == [str(message["id"])]
        assert (await app.service.store.get(request_id)).status is Status.CANCELLED  # type: ignore[union-attr]


async def test_a_press_on_an_unrecorded_telegram_card_edits_it_to_the_outcome(tmp_path: Path) -> None:
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        request_id = await _posted_then_ended_by_a_restart(app, store)
        await _wait_for(lambda: _outbox_done(store, request_id))
        assert fakes.has_buttons("telegram")  # Telegram cannot find it: it stays live until someone presses it
        await fakes.press("telegram", Decision.APPROVE)
        answer = await fakes.telegram.wait_for_answer(fakes.last_query)
        assert "Already cancelled" in str(answer.get("text")), answer
        assert RESTARTED in str(answer.get("text"))
        await fakes.wait(lambda: not fakes.has_buttons("telegram"))
        (card,) = [m for m in fakes.telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]
        assert "CANCELLED" in card.text
        # the stale card decided nothing: the request stands as the restart ended it, the press audited as lost
        request = await app.service.store.get(request_id)
        assert request is not None
        assert request.status is Status.CANCELLED
        events = [e.event for e in await app.service.store.events(request_id)]
        assert events.count("decided") == 0
        assert "press_lost" in events[events.index("card_found") :]


async def test_a_press_on_an_unrecorded_slack_card_edits_it_to_the_outcome(tmp_path: Path) -> None:
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        request_id = await _posted_then_ended_by_a_restart(app, store)
        await _wait_for(lambda: _outbox_done(store, request_id))
        assert fakes.has_buttons("slack")
        await fakes.press("slack", Decision.APPROVE)
        await fakes.wait(lambda: not fakes.has_buttons("slack"))
        (card,) = [" ".join(m.texts()) for m in fakes.slack.channel(SLACK_CHANNEL) if m.blocks]
        assert "CANCELLED" in card
        request = await app.service.store.get(request_id)
        assert request is not None
        assert request.status is Status.CANCELLED
        assert [e.event for e in await app.service.store.events(request_id)].count("decided") == 0


async def test_an_approved_call_a_restart_kept_from_running_is_said_on_a_card_found_after_it(tmp_path: Path) -> None:
    """Approved, then the process stopped before the call ran, with its card posts unrecorded: the restart's
    recovery says "did not run"; the Discord card found by its nonce and the Telegram card found by a press say
    it too, though neither was a recorded card when recovery marked the request's cards."""
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        approvals = app.service.store
        new = NewRequest(new_request_id(), "shell", canonical_json(ARGS), args_hash(ARGS), "agent:builder",
                         "telegram:-1001", approvals.clock() + 600)  # fmt: skip
        request, _ = await approvals.insert_once(new)
        for adapter in app.bus.adapters.values():
            await adapter.post_card(app.service.card(request))
        await app.service.decide(request.id, Decision.APPROVE, actor=f"telegram:{TG_ADMIN}", platform="telegram")
        recovery = await app.service.recover()
        assert [r.id for r in recovery.never_ran] == [request.id]
        await _posts_attempted_unrecorded(app, store, request.id)
        await fakes.wait(lambda: not fakes.has_buttons("discord"))
        assert "did not run" in fakes.card_text("discord")
        await _wait_for(lambda: _outbox_done(store, request.id))
        await fakes.press("telegram", Decision.APPROVE)
        await fakes.wait(lambda: not fakes.has_buttons("telegram"))
        (card,) = [m for m in fakes.telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]
        assert "did not run" in card.text
        assert [e.event for e in await approvals.events(request.id)].count("decided") == 1
