"""Card posts and edits kept while Slack or Discord refused the bot token, and what becomes of them after the
operator's restart with a new one: the real libraries against the wire fakes, one SQLite store across the restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

import tests.fakes.discord as fake_discord
from kazma.adapters import bus
from kazma.adapters.bus import REPOSTED, FanOutBus
from kazma.adapters.outbox import Outbox, PostJob
from kazma.adapters.telegram import TelegramAdapter
from kazma.approvals import Decision
from kazma.approvals.model import ApprovalRequest
from kazma.bot.app import App
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from tests.fakes.discord import HOME_CHANNEL_ID
from tests.fakes.telegram import Fault
from tests.platforms_support import SLACK_CHANNEL, TG_ADMIN, Fakes, kazma_on, three_fakes

ARGS = {"command": "make release"}


async def _refuse(fakes: Fakes, platform: str) -> None:
    """The platform's bot token is taken back while Kazma runs (Slack: revoked; Discord: reset in the Developer
    Portal, the gateway closed with 4004 and the login after it refused)."""
    if platform == "slack":
        fakes.slack.revoke(fakes.slack.bot_token)
        return
    refused = failure_count("token_refused", "discord")
    fakes.discord.token = "reset-in-the-developer-portal"
    assert await fakes.discord.drop_gateway(code=4004) == 1
    async with asyncio.timeout(20):  # said by the login after the close; Slack's, by the card's own post
        while failure_count("token_refused", "discord") == refused:
            await asyncio.sleep(0.02)


def _heal(fakes: Fakes, platform: str, token: str) -> None:
    """The operator put a token the platform takes in the configuration (the fake's own) before the restart."""
    if platform == "slack":
        del fakes.slack.revoked[fakes.slack.bot_token]
    else:
        fakes.discord.token = token


def _outbox(app: App) -> Outbox:
    assert isinstance(app.bus, FanOutBus)
    return app.bus.outbox


async def _until(predicate: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(20):
        while not await predicate():
            await asyncio.sleep(0.02)


async def _kept(app: App, request_id: str, platform: str) -> int:
    """Once ``request_id``'s post on ``platform`` waits in the outbox saying the token was refused: its attempts."""
    outbox = _outbox(app)
    found: list[int] = []

    async def kept() -> bool:
        found[:] = [a for r, p, a, e in await outbox.pending() if r == request_id and p == platform and e]
        return bool(found)

    await _until(kept)
    return found[0]


async def _worker_rounds(app: App, platform: str, monkeypatch: pytest.MonkeyPatch, rounds: int) -> None:
    """Let ``platform``'s bus worker go round ``rounds`` more times (each round drains its due posts)."""
    assert isinstance(app.bus, FanOutBus)
    fan_out = app.bus
    seen = 0
    next_due = fan_out._next_due

    async def counted(worker: bus._Worker) -> float:
        nonlocal seen
        if worker.adapter.name == platform:
            seen += 1
        return await next_due(worker)

    monkeypatch.setattr(fan_out, "_next_due", counted)

    async def enough() -> bool:
        return seen >= rounds

    await _until(enough)


def _cards_on(fakes: Fakes, platform: str) -> list[str]:
    """The text of every card on ``platform``'s home chat."""
    if platform == "slack":
        return [" ".join(m.texts()) for m in fakes.slack.channel(SLACK_CHANNEL) if m.blocks]
    return [str(m["embeds"]) for m in fakes.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]


async def _approve_from_telegram(app: App, request_id: str) -> None:
    """The Telegram admin approves ``request_id``, and that decision is the one that counts."""
    decided = await app.service.decide(request_id, Decision.APPROVE, actor=f"telegram:{TG_ADMIN}", platform="telegram")
    assert decided.won


async def _tried_by_another_replica(app: App, request_id: str, platform: str, error: str, *, due_in: float) -> None:
    """Another replica on ``app``'s store tried ``request_id``'s kept post on ``platform``: it recorded ``error``
    and the post is due again ``due_in`` seconds on."""
    outbox = _outbox(app)
    other = Outbox(outbox.tables, clock=outbox.clock, replica="other")
    row = await other.tables.one(
        "SELECT id, attempts FROM card_outbox WHERE request_id = ? AND platform = ?", (request_id, platform)
    )
    await other.retry_later(PostJob(int(row[0]), request_id, platform, int(row[1])), due_in, error)


def _reset_the_token_once_a_card_lands(fakes: Fakes) -> str:
    """Discord makes the next card on the home channel yet answers 500, and the bot token is reset before
    discord.py's own retry of the post (which meets 401): returns the token Discord took until then."""
    token = fakes.discord.token

    def reset() -> None:
        fakes.discord.token = "reset-in-the-developer-portal"

    fakes.discord.inject_fault("POST", rf"/channels/{HOME_CHANNEL_ID}/messages", "500-landed", after=reset)
    return token


async def _restarted_until_the_discord_cards_are_settled(fakes: Fakes, store: Path, request_id: str) -> None:
    """Kazma starts again on ``store`` and runs until ``request_id`` has a card on Discord and every one is settled."""
    async with kazma_on(fakes, store) as app:

        async def settled() -> bool:
            cards = [c for c in await app.service.store.cards(request_id) if c.platform == "discord"]
            return bool(cards) and all(c.settled_at for c in cards)

        await _until(settled)


@pytest.mark.parametrize("platform", ["slack", "discord"])
async def test_a_card_kept_while_the_token_was_refused_lands_after_the_restart_as_its_first_post(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    """While the platform refused the bot token, the bus tried the kept post again and again, each try failing at
    once in Kazma, and each counted as an attempt that may have landed a card unrecorded. After the operator's
    restart the card came to Slack marked "Posted again: … If an earlier copy is above, its buttons do nothing"
    (counted at ``card_reposted``), though no copy had ever left Kazma. Now a post that certainly landed nothing
    is no attempt, and nothing is tried with the refused token at all: the card lands as a first post."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        token = fakes.discord.token
        async with kazma_on(fakes, store) as app:
            refused = failure_count("token_refused", platform)
            await _refuse(fakes, platform)
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
            await _kept(app, request.id, platform)
            assert failure_count("token_refused", platform) == refused + 1
            tried = failure_count("card_post", platform)
            await _worker_rounds(app, platform, monkeypatch, 20)  # its backoff over many times
            assert await _kept(app, request.id, platform) == 0  # nothing went out: no attempt that may have landed
            assert failure_count("card_post", platform) == tried  # and nothing was tried again with that token
        _heal(fakes, platform, token)
        reposted = failure_count("card_reposted", platform)
        async with kazma_on(fakes, store) as app:

            async def posted() -> bool:
                return platform in [c.platform for c in await app.service.store.cards(request.id)]

            await _until(posted)
            (card,) = [c for c in await app.service.store.cards(request.id) if c.platform == platform]
            assert not card.reposted
        (shown,) = _cards_on(fakes, platform)
        assert REPOSTED.split(":")[0] not in shown
        assert failure_count("card_reposted", platform) == reposted


@pytest.mark.parametrize("platform", ["slack", "discord"])
async def test_a_kept_post_whose_request_was_decided_meanwhile_is_dropped_quietly_after_the_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, platform: str
) -> None:
    """A card kept while the platform refused the token, decided on Telegram meanwhile: after the restart Slack's
    post was said to be a card that "may be unsettled" (``bus.card_maybe_unsettled``, counted), and Discord's was
    posted by its nonce as a new card showing the outcome, though none of it had ever reached the platform. Now
    it is skipped, as any post whose request ended before it went: nothing on the platform, nothing said lost."""
    caplog.set_level(logging.INFO)
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        token = fakes.discord.token
        async with kazma_on(fakes, store) as app:
            await _refuse(fakes, platform)
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
            await _kept(app, request.id, platform)
            await _approve_from_telegram(app, request.id)
        _heal(fakes, platform, token)
        unsettled = failure_count("card_maybe_unsettled", platform)
        async with kazma_on(fakes, store) as app:
            outbox = _outbox(app)

            async def handled() -> bool:
                return not [r for r, p, _, _ in await outbox.pending() if r == request.id and p == platform]

            await _until(handled)
            assert [c.platform for c in await app.service.store.cards(request.id)].count(platform) == 0
        assert _cards_on(fakes, platform) == []
        assert failure_count("card_maybe_unsettled", platform) == unsettled
        assert not [r for r in caplog.records if r.getMessage() == "bus.card_maybe_unsettled"]


@pytest.mark.parametrize("platform", ["slack", "discord"])
async def test_an_edit_kept_while_the_token_was_refused_is_not_tried_until_the_restart_then_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    """A card on the platform decided on Telegram while the platform refused the token: its edit was tried again
    at every backoff for as long as Kazma ran, each try failing at once in Kazma yet counted at ``card_settle``,
    logged as ``bus.card_settle_failed`` and adding to the card's attempts. Now nothing is tried with the refused
    token; the edit waits unsettled in the store and lands after the restart."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        token = fakes.discord.token
        async with kazma_on(fakes, store) as app:
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)

            async def everywhere() -> bool:
                return len(await app.service.store.cards(request.id)) == 3

            await _until(everywhere)
            await _refuse(fakes, platform)
            await _approve_from_telegram(app, request.id)

            async def others_settled() -> bool:
                cards = await app.service.store.cards(request.id)
                return [c.platform for c in cards if not c.settled_at] == [platform]

            await _until(others_settled)
            tried = failure_count("card_settle", platform)
            await _worker_rounds(app, platform, monkeypatch, 20)  # its backoff over many times
            assert failure_count("card_settle", platform) <= tried + 1  # at most the try that met the refusal
        _heal(fakes, platform, token)
        async with kazma_on(fakes, store) as app:

            async def settled() -> bool:
                return all(c.settled_at for c in await app.service.store.cards(request.id))

            await _until(settled)
        assert not fakes.has_buttons(platform)
        assert "APPROVED" in fakes.card_text(platform)


async def test_a_card_post_and_edit_telegram_refuses_with_401_are_kept_and_land_once_the_token_is_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telegram answering a card's post, or a decided card's edit, 401 (the token revoked, fixed at BotFather
    while Kazma runs, or a passing 401: polling opens again by itself, no restart): the post was given up for good
    (``bus.card_post_gave_up``) and the card never came to Telegram, and the edit was given up so the decided card
    kept its buttons there. Now both wait and land once Telegram takes the token again; the post counts no attempt
    (a 401 landed nothing), so the card is not marked "Posted again"."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        fakes.telegram.script("sendMessage", Fault.server_error(401, "Unauthorized"))
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)

        async def on_telegram() -> bool:
            return "telegram" in [c.platform for c in await app.service.store.cards(request.id)]

        await _until(on_telegram)
        assert [c.status for c in fakes.telegram.calls_to("sendMessage")][:1] == [401]
        (card,) = [c for c in await app.service.store.cards(request.id) if c.platform == "telegram"]
        assert not card.reposted
        assert REPOSTED.split(":")[0] not in fakes.card_text("telegram")

        fakes.telegram.script("editMessageText", Fault.server_error(401, "Unauthorized"))
        await _approve_from_telegram(app, request.id)

        async def settled() -> bool:
            return all(c.settled_at for c in await app.service.store.cards(request.id))

        await _until(settled)
        assert [c.status for c in fakes.telegram.calls_to("editMessageText")][:1] == [401]
        assert not fakes.has_buttons("telegram")
        assert "APPROVED" in fakes.card_text("telegram")


async def test_a_discord_card_that_landed_before_discord_py_s_retry_met_a_401_is_found_and_settled(
    tmp_path: Path,
) -> None:
    """Discord made the card yet answered 500; discord.py tried the post again by itself, and that try met the
    bot token reset meanwhile (401). The whole call was taken as one that certainly did nothing: its attempt
    taken back, so when the request was decided while the token stayed refused, the post was skipped after the
    restart as one that never went, and the card that had landed kept live buttons for good. A 401 after a try
    that may have landed is no "nothing done": the restart finds the card by its nonce and edits it."""
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        token = _reset_the_token_once_a_card_lands(fakes)
        async with kazma_on(fakes, store) as app:
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
            assert await _kept(app, request.id, "discord") == 1  # the try that may have landed, counted
            assert fakes.has_buttons("discord")  # it did land, unrecorded
            await _approve_from_telegram(app, request.id)
        posts = fakes.discord.calls_to("POST", rf"/channels/{HOME_CHANNEL_ID}/messages")
        assert [c.status for c in posts] == [500, 401]  # discord.py's own retry, refused
        _heal(fakes, "discord", token)
        await _restarted_until_the_discord_cards_are_settled(fakes, store, request.id)
        assert len(_cards_on(fakes, "discord")) == 1  # the first message, given back by its nonce
        assert not fakes.has_buttons("discord")
        assert "APPROVED" in fakes.card_text("discord")


@pytest.mark.parametrize("history", ["readable", "refused", "failing"])
async def test_a_discord_card_whose_nonce_discord_forgot_by_the_restart_is_found_in_the_channel_and_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, history: str
) -> None:
    """As above, with the restart later than Discord keeps a nonce (minutes): posting again with the nonce made a
    second card, and the first, never recorded, kept live buttons. It is found among the channel's recent
    messages by the request id in its footer. A bot that may not read the history posts with the nonce, as
    before: while Discord keeps it, that finds the card still. A read that fails for a while (Discord's 503s)
    is tried again later: falling back to the nonce then made the second card all the same."""
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        token = _reset_the_token_once_a_card_lands(fakes)
        async with kazma_on(fakes, store) as app:
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
            assert await _kept(app, request.id, "discord") == 1
            await _approve_from_telegram(app, request.id)
        _heal(fakes, "discord", token)
        if history == "refused":
            fakes.discord.history_readable = False
        else:
            monkeypatch.setattr(fake_discord, "NONCE_SECONDS", 0.0)  # the restart came later than Discord keeps it
        if history == "failing":  # more 503s than discord.py's own retries of one read
            fakes.discord.inject_fault("GET", rf"/channels/{HOME_CHANNEL_ID}/messages", "503", times=6)
        await _restarted_until_the_discord_cards_are_settled(fakes, store, request.id)
        assert len(_cards_on(fakes, "discord")) == 1  # the first message, found
        assert not fakes.has_buttons("discord")
        assert "APPROVED" in fakes.card_text("discord")
        assert (fakes.discord.history_reads > 0) is (history != "refused")
        assert fakes.discord.nonce_replays == (1 if history == "refused" else 0)


async def test_a_refused_card_post_try_is_logged_without_an_attempt_and_a_failed_one_with_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telegram answered a card post 401 twice (the try taken back: it certainly landed nothing), then 500 twice.
    ``bus.card_post_failed`` said ``attempt=1`` for each refused try and for the first 500 alike, so a reader
    counted three first attempts. A refused try is logged with no attempt and ``nothing_done``; a try that may
    have landed, with its number among those."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        _unpace_telegram(app, monkeypatch)
        unauthorized = Fault.server_error(401, "Unauthorized")
        fakes.telegram.script("sendMessage", unauthorized, unauthorized, Fault.server_error(), Fault.server_error())
        with capture_logs() as logs:
            request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)

            async def on_telegram() -> bool:
                return "telegram" in [c.platform for c in await app.service.store.cards(request.id)]

            await _until(on_telegram)
        failed = [
            (e["attempt"], e.get("nothing_done"))
            for e in logs
            if e["event"] == "bus.card_post_failed" and e["platform"] == "telegram" and e["request_id"] == request.id
        ]
        assert failed == [(None, True), (None, True), (1, False), (2, False)]
        assert [c.status for c in fakes.telegram.calls_to("sendMessage")][:5] == [401, 401, 500, 500, 200]


async def test_a_replica_with_a_refused_token_does_not_overwrite_a_newer_error_another_replica_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This replica's Slack token is refused; another replica on the store, whose token Slack takes, tries the
    kept post and Slack answers it 503. This replica wrote its own refusal over that error at its next poll, and
    again after every try of the other's: ``kazma doctor`` showed the refusal, not the newer, real error, and the
    row was rewritten all the time. The refusal is said once per post; what another replica wrote since stays."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        await _refuse(fakes, "slack")
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
        await _kept(app, request.id, "slack")
        newer = "slack card_post: HTTP 503 (service_unavailable)"
        await _tried_by_another_replica(app, request.id, "slack", newer, due_in=0.0)  # answered 503, due at once
        outbox = _outbox(app)
        await _worker_rounds(app, "slack", monkeypatch, 5)
        said = [e for r, p, _, e in await outbox.pending() if r == request.id and p == "slack"]
        assert said == [newer]


async def test_a_replica_whose_telegram_token_is_refused_does_not_overwrite_a_newer_error_another_replica_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, for Telegram's 401 on a card post: this replica wrote its refusal over every other waiting post's
    error at each refused try, so during a rolling token change ``kazma doctor`` showed the stale replica's 401 on
    the posts the replica whose token works was failing for a real reason (here a 502), and hid that reason."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))  # its hold ends at once
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        _unpace_telegram(app, monkeypatch)
        fakes.telegram.token = "revoked-at-botfather"
        first, second = (await _four_opened(app))[:2]
        for request in (first, second):
            await _kept(app, request.id, "telegram")
        newer = "telegram card_post: HTTP 502 (Bad Gateway)"
        await _tried_by_another_replica(app, second.id, "telegram", newer, due_in=1000.0)  # 502, due much later
        outbox = _outbox(app)
        tried = len(fakes.telegram.calls_to("sendMessage"))

        async def refused_again() -> bool:  # this replica's own tries of the posts still due here, each a 401
            return len(fakes.telegram.calls_to("sendMessage")) >= tried + 3

        await _until(refused_again)
        said = [e for r, p, _, e in await outbox.pending() if r == second.id and p == "telegram"]
        assert said == [newer]


async def test_after_the_restart_the_kept_edits_of_decided_cards_go_before_the_kept_posts(tmp_path: Path) -> None:
    """Slack refused the token while a card on it was decided and more cards were opened: after the restart the
    kept posts went first, one a second in Slack's pacing, and the decided card kept its live-looking buttons
    behind all of them. An edit goes before the next post, as for a decision made while Kazma runs."""
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        async with kazma_on(fakes, store) as app:
            decided = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)

            async def everywhere() -> bool:
                return len(await app.service.store.cards(decided.id)) == 3

            await _until(everywhere)
            await _refuse(fakes, "slack")
            kept = []
            for n in range(2):
                command = {"command": f"make {n}"}
                kept.append(await app.service.open("shell", command, "agent:builder", "telegram:-1001", durable=True))
            for request in kept:
                await _kept(app, request.id, "slack")
            won = await app.service.decide(decided.id, Decision.APPROVE, actor=f"telegram:{TG_ADMIN}",
                                           platform="telegram")  # fmt: skip
            assert won.won
        _heal(fakes, "slack", "")
        calls = len(fakes.slack.calls)
        async with kazma_on(fakes, store) as app:

            async def all_done() -> bool:
                cards = await app.service.store.cards(decided.id)
                posted = [await app.service.store.cards(r.id) for r in kept]
                return all(c.settled_at for c in cards) and all("slack" in [c.platform for c in p] for p in posted)

            await _until(all_done)
        order = [c.method for c in fakes.slack.calls[calls:] if c.method in ("chat.update", "chat.postMessage")]
        assert order == ["chat.update", "chat.postMessage", "chat.postMessage"]


def _unpace_telegram(app: App, monkeypatch: pytest.MonkeyPatch) -> FanOutBus:
    """Telegram's group pacing off (it would make each round seconds long); the bus, known a FanOutBus."""
    assert isinstance(app.bus, FanOutBus)
    telegram = app.bus.adapters["telegram"]
    assert isinstance(telegram, TelegramAdapter)
    pacing = telegram.pacing.limiter
    monkeypatch.setattr(pacing, "min_interval", 0.0)  # the group's pacing would make each round seconds long
    monkeypatch.setattr(pacing, "per_window", None)
    return app.bus


async def _four_opened(app: App) -> list[ApprovalRequest]:
    return [
        await app.service.open("shell", {"command": f"make {n}"}, "agent:builder", "telegram:-1001", durable=True)
        for n in range(4)
    ]


async def test_a_telegram_401_on_one_kept_post_puts_back_the_other_due_posts_untried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telegram refusing the token for good (revoked at BotFather) while several card posts wait: each pass of the
    bus tried every due post, each answered 401, so a minute's retries sent one refused call per pending card
    (and each took its turn in the group's pacing, counted and logged). The first 401 of a pass says the token is
    refused; the other posts due then wait the same longest backoff, untried, saying why."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=1000, cap=1000, jitter=False))  # nothing falls due by itself
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        bus_of_app = _unpace_telegram(app, monkeypatch)
        fakes.telegram.token = "revoked-at-botfather"
        requests = await _four_opened(app)
        for request in requests:
            await _kept(app, request.id, "telegram")
        tried = len(fakes.telegram.calls_to("sendMessage"))
        await bus_of_app._due_now(["telegram"])  # all four due at once, as their backoffs ending together
        await _worker_rounds(app, "telegram", monkeypatch, 3)
        assert len(fakes.telegram.calls_to("sendMessage")) - tried == 1  # four, before: one per waiting card
        pending = [(a, e) for r, p, a, e in await _outbox(app).pending() if p == "telegram"]
        assert len(pending) == 4
        assert all(a == 0 and e and "InvalidToken" in e for a, e in pending)
        # ... held by this process alone: in the shared rows they stay due, for a replica whose token works
        assert len(await _outbox(app).due("telegram")) == 4


async def test_a_telegram_401_on_one_card_edit_holds_the_other_edits_untried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telegram refusing the token for good while several decided cards wait for their edit: each scan tried every
    due edit, each answered 401, one refused call per unsettled card at every backoff. The first 401 of a scan
    holds the other decided cards' edits by the same wait, untried."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=1000, cap=1000, jitter=False))  # nothing falls due by itself
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        bus_of_app = _unpace_telegram(app, monkeypatch)
        requests = await _four_opened(app)

        async def everywhere() -> bool:
            return all([len(await app.service.store.cards(r.id)) == 3 for r in requests])

        await _until(everywhere)
        fakes.telegram.token = "revoked-at-botfather"
        failed = failure_count("card_settle", "telegram")
        for request in requests:
            await _approve_from_telegram(app, request.id)

        async def each_failed() -> bool:
            # ... and the bus is done with each decision's edit (its refusal handled, not only counted)
            done = not bus_of_app._workers["telegram"].to_settle
            return done and failure_count("card_settle", "telegram") >= failed + len(requests)

        await _until(each_failed)
        tried = len(fakes.telegram.calls_to("editMessageText"))
        await bus_of_app._due_now(["telegram"])  # all four due at once, as their backoffs ending together
        await _worker_rounds(app, "telegram", monkeypatch, 3)  # a scan every poll interval (0.05 s here)
        assert len(fakes.telegram.calls_to("editMessageText")) - tried == 1  # four, before: one per decided card
        unsettled = [c for r in requests for c in await app.service.store.cards(r.id) if c.platform == "telegram"]
        assert len(unsettled) == 4
        assert not any(c.settled_at for c in unsettled)
        # ... held by this process alone: in the shared rows they stay due, for a replica whose token works
        due = await app.service.store.unsettled_cards("telegram", due_by=bus_of_app.clock())
        assert len(due) == 4


async def test_healthz_says_telegram_refuses_the_cards_token_until_a_card_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telegram in webhook mode answering every card post 401 (the token revoked): the posts wait and are tried
    again, yet /healthz said "serving", and nothing there told the operator no card reached Telegram. It says the
    refusal until a card lands again."""
    monkeypatch.setattr(bus, "RETRY", Backoff(base=0.01, cap=0.01, jitter=False))
    hook = "mode: webhook\n    webhook: {url: 'https://bot.example.org/telegram', secret_token: 's3cret'}"

    def webhook(text: str) -> str:
        admins = f"    admins: [{TG_ADMIN}]"
        return text.replace(admins, f"{admins}\n    {hook}", 1)

    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db", edit=webhook) as app:
        assert isinstance(app.bus, FanOutBus)
        fan_out = app.bus
        assert [h.state for h in fan_out.health() if h.platform == "telegram"] == ["serving"]
        good = fakes.telegram.token
        fakes.telegram.token = "revoked-at-botfather"
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)
        await _kept(app, request.id, "telegram")
        (health,) = [h for h in fan_out.health() if h.platform == "telegram"]
        assert health.state == (
            "serving; card posts and edits refused (telegram card_post: InvalidToken: Unauthorized): they wait,"
            " tried again with backoff"
        )
        fakes.telegram.token = good

        async def landed() -> bool:
            return "telegram" in [c.platform for c in await app.service.store.cards(request.id)]

        await _until(landed)
        assert [h.state for h in fan_out.health() if h.platform == "telegram"] == ["serving"]


async def test_a_scan_that_fails_every_time_does_not_hold_the_posts_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The due scan goes before the posts. A scan failing every time it runs (a card row it cannot read: here the
    store's read of unsettled cards raising) raised out of the worker's round before the posts, so while its
    retry time stayed due no card was posted on the platform at all. The posts go all the same."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:

        async def unreadable(platform: str | None = None, *, due_by: float | None = None) -> list[object]:
            raise RuntimeError("a card row the scan cannot read")

        assert isinstance(app.bus, FanOutBus)
        fan_out = app.bus
        worker = fan_out._workers["slack"]
        failed = failure_count("bus_worker", "slack")
        monkeypatch.setattr(app.service.store, "unsettled_cards", unreadable)

        async def failing() -> bool:
            # The scan has failed, and is due again by the time the card's post wakes the worker.
            failing = failure_count("bus_worker", "slack") > failed
            return failing and worker.asleep_until is not None and fan_out.clock() >= worker.scan_at

        await _until(failing)
        request = await app.service.open("shell", ARGS, "agent:builder", "telegram:-1001", durable=True)

        async def everywhere() -> bool:
            return len(await app.service.store.cards(request.id)) == 3

        await _until(everywhere)
        assert "Approval needed" in fakes.card_text("slack")
        assert failure_count("bus_worker", "slack") > failed + 1  # the scan's failure is still counted
