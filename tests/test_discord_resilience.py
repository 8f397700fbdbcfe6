"""Discord's rate limits and gateway drops, end to end: the real discord.py and Kazma against the wire fake."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kazma.adapters import bus
from kazma.adapters.bus import FanOutBus
from kazma.adapters.discord import DiscordAdapter
from kazma.adapters.discord import adapter as discord_adapter
from kazma.approvals.model import Decision, Status
from kazma.bot import lifecycle
from kazma.bot.app import App
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.platforms_support import DISCORD_ADMIN, Fakes, kazma_on, three_fakes

ARGS = {"command": "make release"}
HOME_POST = rf"/channels/{HOME_CHANNEL_ID}/messages"


async def discord_card_errors(app: App, request_id: str) -> list[str]:
    """The last errors the card outbox keeps for ``request_id``'s Discord card, once it keeps one (within 20 s)."""
    outbox = app.bus.outbox  # type: ignore[union-attr]

    async def told() -> list[str]:
        return [str(e) for r, p, _, e in await outbox.pending() if r == request_id and p == "discord" and e]

    async with asyncio.timeout(20):
        while not (errors := await told()):
            await asyncio.sleep(0.02)
    return errors


async def test_a_card_post_rate_limited_past_the_request_timeout_says_so_and_is_posted_later(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        adapter = app.bus.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        adapter.request_timeout = 0.2
        # Discord says "slow down" for longer than a request may take, every time, until it stops.
        fakes.discord.inject_fault("POST", HOME_POST, "429", retry_after=0.4, times=1000)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        errors = await discord_card_errors(app, request.id)
        assert "rate limited" in errors[0], errors
        assert "retry after 0.4 s" in errors[0]
        assert "no answer" not in errors[0]
        assert not fakes.posted("discord")
        fakes.discord.clear_faults()
        await fakes.wait(lambda: fakes.posted("discord") and fakes.has_buttons("discord"))
        async with asyncio.timeout(20):
            while not [c for c in await app.service.store.cards(request.id) if c.platform == "discord"]:
                await asyncio.sleep(0.02)
        cards = [m for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]
        assert len(cards) == 1


async def _settled(app: App, request_id: str) -> None:
    async with asyncio.timeout(20):
        while not all(c.settled_at for c in await app.service.store.cards(request_id)):
            await asyncio.sleep(0.02)


async def test_a_press_made_while_the_gateway_is_down_is_replayed_on_resume_and_decided_once(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        fake = fakes.discord
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        await fakes.wait(lambda: fakes.has_buttons("discord"))
        identifies = len(fake.identifies)
        fake.gateway_open.clear()  # discord.py's reconnect waits: the press is made while it is down
        assert await fake.drop_gateway() == 1
        await fakes.press("discord", Decision.APPROVE)
        (pressed,) = fake.dispatched("INTERACTION_CREATE")
        fake.gateway_open.set()
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert (outcome.status, outcome.decided_by) == (Status.APPROVED, f"discord:{DISCORD_ADMIN}")
        (resume,) = fake.resumes
        assert resume["outcome"] == "resumed"
        assert len(resume["replayed"]) == 1  # the press, sent after the seq discord.py had seen
        assert len(fake.identifies) == identifies  # resumed, not identified again
        # Discord may deliver an event again: the same press once more decides nothing more.
        await fake.dispatch("INTERACTION_CREATE", pressed)
        await fakes.wait(lambda: not fakes.has_buttons("discord"))
        await _settled(app, request.id)
        assert f"APPROVED by discord:{DISCORD_ADMIN}" in fakes.card_text("discord")
        assert len(await app.service.store.events(request.id, event="decided")) == 1
        assert await app.service.store.events(request.id, event="press_lost") == []
        acknowledged = [i for i in fake.interactions.values() if i.custom_id is not None]
        assert [i.callback_type for i in acknowledged] == [6]


async def test_after_an_invalid_session_the_gateway_identifies_again_and_a_new_press_decides(tmp_path: Path) -> None:
    """Discord cannot resume (op 9): what was dispatched while down is lost, as on Discord; discord.py identifies
    again (after its own 5 s wait) and the next press decides and edits the card."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        fake = fakes.discord
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        await fakes.wait(lambda: fakes.has_buttons("discord"))
        identifies = len(fake.identifies)
        fake.gateway_open.clear()
        assert await fake.drop_gateway() == 1
        fake.invalidate_sessions()
        fake.gateway_open.set()
        await fake.wait_until(lambda: len(fake.identifies) > identifies and fake.identified, timeout=20)
        assert [r["outcome"] for r in fake.resumes] == ["invalid"]
        await fakes.press("discord", Decision.DENY)
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert outcome.status is Status.DENIED
        await fakes.wait(lambda: not fakes.has_buttons("discord"))
        await _settled(app, request.id)
        assert len(await app.service.store.events(request.id, event="decided")) == 1


async def test_a_press_replayed_too_late_to_acknowledge_still_decides_once_and_edits_the_card(tmp_path: Path) -> None:
    """The gateway was down longer than Discord's window to answer a press: the replayed press cannot be
    acknowledged (10062), but the person did press it, so it decides, and the card shows it."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        fake = fakes.discord
        fake.interaction_window = 0.0  # any answer is too late
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        await fakes.wait(lambda: fakes.has_buttons("discord"))
        fake.gateway_open.clear()
        assert await fake.drop_gateway() == 1
        await fakes.press("discord", Decision.DENY)
        fake.gateway_open.set()
        outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
        assert (outcome.status, outcome.decided_by) == (Status.DENIED, f"discord:{DISCORD_ADMIN}")
        await fakes.wait(lambda: not fakes.has_buttons("discord"))
        await _settled(app, request.id)
        assert "DENIED" in fakes.card_text("discord")
        callbacks = fake.calls_to("POST", r"/interactions/\d+/[^/]+/callback")
        assert [c.status for c in callbacks] == [404]
        assert len(await app.service.store.events(request.id, event="decided")) == 1


async def test_a_gateway_that_discord_closes_for_good_is_logged_counted_and_reported_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Discord ends the session with a code discord.py does not reconnect after (4004: the token was reset while
    Kazma ran): the gateway task ended with the error and nobody looked at it. Nothing was logged above DEBUG,
    nothing counted, and the adapter still said its ingress ran: no press or message from Discord came in again,
    and a leader's ingress check (``ingress_missing``) never tried to open it again."""
    caplog.set_level(logging.WARNING)
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        adapter = app.bus.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        assert isinstance(app.bus, FanOutBus)
        assert app.bus.ingress_missing() == []
        lost = failure_count("ingress_lost", "discord")
        assert await fakes.discord.drop_gateway(code=4004) == 1
        async with asyncio.timeout(20):
            while failure_count("ingress_lost", "discord") == lost:
                await asyncio.sleep(0.02)
        assert not adapter.ingress_running
        assert app.bus.ingress_missing() == ["discord"]
        ended = [r for r in caplog.records if r.getMessage() == "discord.gateway_ended"]
        assert ended
        assert "4004" in str(getattr(ended[0], "error", ""))


@pytest.mark.parametrize("code", [4004, 4014])
async def test_a_gateway_discord_closed_for_good_is_opened_again_and_cards_made_meanwhile_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """Kazma alone on its store: after Discord closed the gateway with a code discord.py does not reconnect after,
    nothing opened it again until a restart. After 4004 (and 4010-4013) discord.py had closed its whole client too:
    every card posted meanwhile was given up for good with "RuntimeError: Session is closed"."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.1)
    # How seldom a 4014 is identified again is the next test's; here the fake allows the intent again at once.
    monkeypatch.setattr(discord_adapter, "SETUP_CLOSE_RETRY", 0.0)
    caplog.set_level(logging.WARNING)
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        adapter = app.bus.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        lost = failure_count("ingress_lost", "discord")
        assert await fakes.discord.drop_gateway(code=code) == 1
        async with asyncio.timeout(20):
            while failure_count("ingress_lost", "discord") == lost:
                await asyncio.sleep(0.02)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")

        def identified() -> int:
            return len([i for i in fakes.discord.identifies if "rejected" not in i])

        async with asyncio.timeout(30):  # identified again, and the card is out
            while not (identified() == 2 and "Approval needed" in fakes.card_text("discord")):
                await asyncio.sleep(0.05)
        assert adapter.ingress_running
        gave_up = [r for r in caplog.records if r.getMessage() == "bus.card_post_gave_up"]
        assert gave_up == [], [getattr(r, "error", "") for r in gave_up]
        assert not [r for r in caplog.records if "Session is closed" in str(getattr(r, "error", ""))]
        assert [c.platform for c in await app.service.store.cards(request.id)].count("discord") == 1


async def test_a_request_timeout_in_discord_py_s_pause_after_a_5xx_says_discord_answered_it(tmp_path: Path) -> None:
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        adapter = app.bus.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        adapter.request_timeout = 0.2
        # discord.py pauses 1 s before it tries a 500 again: the request timeout ends that pause, not a wait for bytes
        fakes.discord.inject_fault("POST", HOME_POST, "500", times=1000)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        errors = await discord_card_errors(app, request.id)
        assert f"Discord answered POST /api/v10{HOME_POST} with 500" in errors[0], errors
        assert "ran out before discord.py tried again" in errors[0], errors
        assert "no answer" not in errors[0], errors


def refused_logins(fakes: Fakes) -> int:
    """The logins Discord refused: ``GET /users/@me`` answered 401 (discord.py's ``Client.login``)."""
    return sum(1 for call in fakes.discord.calls_to("GET", "/users/@me") if call.status == 401)


async def test_a_token_reset_while_running_stops_discord_until_the_operator_acts_and_cards_land_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The bot's token reset in the Developer Portal while Kazma ran: Discord closed the gateway with 4004, and the
    new login with the same token was refused too. Every ingress check (up to every 30 s, for ever) logged in
    again with that token, every card post on Discord asked for yet another login and was kept as retryable for
    ever, and only /healthz's "inbound connection not open" hinted at it. Now the refusal is said once
    (``discord.token_refused``, counted at ``token_refused``), nothing logs in or posts with that token again, and
    a card's Discord post fails at once saying the operator must set a new token (kept for after the restart, see
    below), while the same card lands on Telegram."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.01)
    monkeypatch.setattr(lifecycle, "INGRESS_RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    caplog.set_level(logging.INFO)
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        assert isinstance(app.bus, FanOutBus)
        checks = 0
        missing = app.bus.ingress_missing

        def counted() -> list[str]:
            nonlocal checks
            checks += 1
            return missing()

        monkeypatch.setattr(app.bus, "ingress_missing", counted)
        refused = failure_count("token_refused", "discord")
        await _refuse_the_token(app, fakes)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        errors = await discord_card_errors(app, request.id)  # its Discord post failed, and waits for a restart
        await fakes.wait(lambda: "Approval needed" in fakes.card_text("telegram"))
        seen = checks
        async with asyncio.timeout(20):  # many more ingress checks, each of which logged in again before
            while checks < seen + 50:
                await asyncio.sleep(0.01)
        assert refused_logins(fakes) == 1
        assert failure_count("token_refused", "discord") == refused + 1
        said = [r for r in caplog.records if r.getMessage() == "discord.token_refused"]
        assert len(said) == 1
        assert "refused the bot token" in errors[0], errors
        assert "platforms.discord.token" in errors[0], errors
        assert fakes.card_text("discord") == ""
        assert not fakes.discord.calls_to("POST", HOME_POST)  # tried many times, nothing sent with that token
        assert "Approval needed" in fakes.card_text("slack")
        assert [c.platform for c in await app.service.store.cards(request.id)].count("discord") == 0
        assert app.bus.ingress_missing() == []  # nothing for the check to open: Discord is off until a restart


async def test_a_gateway_closed_for_an_intent_is_identified_again_seldom_enough_to_keep_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Message Content intent switched off in the Developer Portal while Kazma ran: Discord closed the gateway
    with 4014, and every ingress check (up to every 30 s) opened it again, each time one more IDENTIFY refused
    with 4014: 2,880 a day, while Discord allows a bot 1,000 session starts a day and resets the token of one that
    goes past them. Now it is opened again at most every ``SETUP_CLOSE_RETRY`` seconds, and still without a
    restart once the operator switches the intent back on."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.01)
    monkeypatch.setattr(lifecycle, "INGRESS_RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        adapter = app.bus.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        lost = failure_count("ingress_lost", "discord")
        fakes.discord.message_content_intent = False
        assert await fakes.discord.drop_gateway(code=4014) == 1
        async with asyncio.timeout(20):
            while failure_count("ingress_lost", "discord") == lost:
                await asyncio.sleep(0.02)
        tries = failure_count("ingress_start", "discord")
        async with asyncio.timeout(20):  # many ingress checks, each of which identified again before
            while failure_count("ingress_start", "discord") < tries + 30:
                await asyncio.sleep(0.01)
        assert [i for i in fakes.discord.identifies if "rejected" in i] == []
        assert isinstance(app.bus, FanOutBus)
        assert app.bus.ingress_missing() == ["discord"]  # not open, and opened again later

        fakes.discord.message_content_intent = True  # the operator switched it back on
        monkeypatch.setattr(discord_adapter, "SETUP_CLOSE_RETRY", 0.0)  # and the wait is over
        async with asyncio.timeout(20):
            while not adapter.ingress_running:
                await asyncio.sleep(0.02)
        assert len(fakes.discord.identifies) == 2


async def test_attack_a_401_from_a_proxy_before_discord_does_not_take_discord_off(tmp_path: Path) -> None:
    """A proxy between Kazma and Discord answering a card post with its own 401 sign-in page (HTML, not Discord's
    JSON) was taken as Discord refusing the bot token: Discord went off until a restart, every later card on it
    given up. That post fails; the next card lands on Discord."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        refused = failure_count("token_refused", "discord")
        fakes.discord.inject_fault("POST", HOME_POST, "401-proxy")
        first = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
        async with asyncio.timeout(20):
            while not [c for c in fakes.discord.calls_to("POST", HOME_POST) if c.status == 401]:
                await asyncio.sleep(0.02)
        second = await app.service.open("shell", {"command": "make test"}, "agent:builder", "telegram:-1001")
        async with asyncio.timeout(20):
            while not [c for c in await app.service.store.cards(second.id) if c.platform == "discord"]:
                await asyncio.sleep(0.02)
        assert failure_count("token_refused", "discord") == refused
        assert first.id != second.id


async def _refuse_the_token(app: App, fakes: Fakes) -> None:
    """The bot's token reset in the Developer Portal while Kazma ran: the gateway closed with 4004, and the login
    after it refused."""
    refused = failure_count("token_refused", "discord")
    fakes.discord.token = "reset-in-the-developer-portal"
    assert await fakes.discord.drop_gateway(code=4004) == 1
    async with asyncio.timeout(20):
        while failure_count("token_refused", "discord") == refused:
            await asyncio.sleep(0.02)


async def test_attack_a_policy_only_discord_shows_fails_closed_once_discord_refused_the_token(tmp_path: Path) -> None:
    """Once Discord refused the bot token while Kazma ran, a request under a policy whose cards only Discord shows
    was still opened (the bus counted Discord as able to show cards): its only card was given up, and it waited
    for its deadline with nobody shown it. As after a start Discord refused, nothing can show its card now: the
    request is refused (fails closed), while a policy other platforms show goes on."""
    only = f', policies: {{discord-only: {{to: ["discord:{HOME_CHANNEL_ID}"]}}}}'
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db", approvals=only) as app:
        assert app.bus.can_show_cards("discord-only")
        await _refuse_the_token(app, fakes)
        assert not app.bus.can_show_cards("discord-only")
        assert app.bus.can_show_cards(None)


async def test_attack_cards_and_edits_due_while_discord_refused_the_token_land_after_a_restart_with_a_new_one(
    tmp_path: Path,
) -> None:
    """Once Discord refused the bot token while Kazma ran, a card's Discord post was given up for good, and so was
    the edit of a Discord card whose request was decided meanwhile: after the operator set the new token and
    restarted Kazma, as the refusal told them to, the card never came to Discord, and the decided one still showed
    its buttons there. They wait now, as for a platform whose start was refused, and land after the restart (the
    card of the request still waiting with its buttons)."""
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        async with kazma_on(fakes, store) as app:
            decided = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001")
            async with asyncio.timeout(20):
                while not [c for c in await app.service.store.cards(decided.id) if c.platform == "discord"]:
                    await asyncio.sleep(0.02)
            await _refuse_the_token(app, fakes)
            assert (
                await app.service.decide(decided.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
            ).won
            # durable: still pending after the restart (an orphan's card may be skipped, cancelled before its post)
            waiting = await app.service.open(
                "shell", {"command": "make test"}, "agent:builder", "telegram:-1001", durable=True
            )
            errors = await discord_card_errors(app, waiting.id)
            assert "refused the bot token" in errors[0], errors
            async with asyncio.timeout(20):  # the decision is shown where the token still works
                while not all(
                    c.settled_at for c in await app.service.store.cards(decided.id) if c.platform != "discord"
                ):
                    await asyncio.sleep(0.02)
        # the operator put the new token (the fake's own now) in platforms.discord.token and restarted Kazma
        async with kazma_on(fakes, store) as app:
            await _settled(app, decided.id)
            async with asyncio.timeout(20):
                while not [c for c in await app.service.store.cards(waiting.id) if c.platform == "discord"]:
                    await asyncio.sleep(0.02)
        cards = [m for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]
        assert len(cards) == 2
        # the decided one shows its outcome without buttons; the waiting one takes presses
        assert cards[0]["embeds"][0]["title"].split()[:2] == ["✅", "APPROVED"]
        assert cards[0].get("components") == []
        assert "make test" in str(cards[1]["embeds"])
        assert cards[1].get("components")
