"""/healthz says each chat platform's state, and answers 503 only when no way to decide an approval is left:
on the real libraries against the wire fakes, over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from kazma.adapters import bus, kit
from kazma.adapters.contract import PlatformError
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.web import WebAdapter
from kazma.approvals import Decision
from kazma.approvals.model import Status
from kazma.bot import lifecycle
from kazma.bot.app import App
from kazma.bot.console.server import WebServer
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from tests.fakes.slack import FAKE_APP_TOKEN
from tests.fakes.telegram import Fault
from tests.platforms_support import SLACK_ADMIN, SLACK_CHANNEL, TG_ADMIN, TG_CHAT, Fakes, kazma_on, three_fakes


@contextlib.asynccontextmanager
async def served(app: App, folder: Path) -> AsyncIterator[str]:
    """``app``'s web server on 127.0.0.1; its address."""
    server = WebServer(app.console, WebAdapter(), host="127.0.0.1", port=0, token_path=folder / "web-token")
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()


async def healthz(url: str) -> tuple[int, list[str]]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as response:
        return response.status, (await response.text()).splitlines()


async def until(predicate: object, timeout: float = 20.0) -> None:
    assert callable(predicate)
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_a_platform_whose_start_is_being_retried_is_a_line_of_healthz_not_a_bare_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slack answered auth.test with 500 at the start and at every try since: its cards were posted with buttons
    whose presses reached nobody, and /healthz answered "ok" alone."""
    monkeypatch.setattr(bus, "START_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    async with three_fakes() as fakes:
        fakes.slack.fail("auth.test", "500", times=1_000_000)
        before = failure_count("platform_start", "slack")
        async with kazma_on(fakes, tmp_path / "k.db") as app, served(app, tmp_path) as url:
            await until(lambda: failure_count("platform_start", "slack") >= before + 3)
            status, lines = await healthz(url)
            assert status == 200  # Telegram and Discord still take presses
            assert lines[0] == "ok"
            assert "platform telegram: serving" in lines
            assert "platform discord: serving" in lines
            slack = next(line for line in lines if line.startswith("platform slack: "))
            assert slack.startswith("platform slack: not started, tried "), lines
            assert "trying again" in slack
            assert "500" in slack

            fakes.slack.heal("auth.test")  # Slack answers again
            assert isinstance(app.bus, bus.FanOutBus)
            fan_out = app.bus
            await until(lambda: all(p.takes_presses for p in fan_out.health()))
            status, lines = await healthz(url)
            assert (status, lines) == (
                200,
                ["ok", "platform telegram: serving", "platform slack: serving", "platform discord: serving"],
            )


SLACK_SIGN_IN = "  slack:\n    sign_in: {client_id: '1.2', client_secret: 'shh', team_id: 'T0FAKE'}\n"
HTTPS = "web: {port: 0, public_url: 'https://kazma.example'}"


@pytest.mark.parametrize(
    ("approvers", "edit", "console"),
    [
        pytest.param("", None, False, id="nobody-on-the-console"),
        pytest.param("['web:alice']", None, True, id="web"),
        # Sign in with Slack on: a Slack approver signs in to the console and decides there as slack:U…
        pytest.param(
            f"['slack:{SLACK_ADMIN}']", lambda text: text.replace("  slack:\n", SLACK_SIGN_IN), True, id="slack"
        ),
        # no sign-in with Slack: the console cannot prove them
        pytest.param(f"['slack:{SLACK_ADMIN}']", None, False, id="slack-no-sign-in"),
        # The Mini App (over https): Telegram signs who opened it from a card, whatever its polling does
        pytest.param(
            f"['telegram:{TG_ADMIN}']", lambda text: text.replace("web: {port: 0}", HTTPS), True, id="telegram"
        ),
        pytest.param(f"['telegram:{TG_ADMIN}']", None, False, id="telegram-no-https"),
    ],
)
async def test_healthz_is_503_only_when_no_platform_takes_presses_and_nobody_may_decide_on_the_console(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    approvers: str,
    edit: Callable[[str], str] | None,
    console: bool,
) -> None:
    """Telegram and Slack failing at every start, Discord's gateway closed for good (4014): no press on any card
    reached a decision, and /healthz answered "ok". With an approver who can sign in to the console a decision can
    still be made there: the platforms are lines, the status stays 200 (a load balancer taking Kazma out would stop
    that too). Counted were only web: approvers, while one signing in with Slack, or opening the Mini App from a
    Telegram card, decides there as well: 503 with somebody able to decide."""
    monkeypatch.setattr(bus, "START_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    # The ingress check would open the gateway again before /healthz is read: it waits here.
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)
    approvals = f", approvers: {approvers}" if approvers else ""
    async with three_fakes() as fakes:
        fakes.telegram.script("getMe", *[Fault("status", status=502, description="Bad Gateway")] * 10_000)
        fakes.slack.fail("auth.test", "500", times=1_000_000)
        async with (
            kazma_on(fakes, tmp_path / "k.db", approvals=approvals, edit=edit) as app,
            served(app, tmp_path) as url,
        ):
            lost = failure_count("ingress_lost", "discord")
            assert await fakes.discord.drop_gateway(code=4014) == 1
            await until(lambda: failure_count("ingress_lost", "discord") > lost)
            status, lines = await healthz(url)
            discord = next((line for line in lines if line.startswith("platform discord: ")), "")
            assert discord.startswith("platform discord: inbound connection not open ("), lines
            assert "PrivilegedIntentsRequired" in discord  # what discord.py says of 4014
            assert discord.endswith("opened again with backoff")
            assert any(line.startswith("platform telegram: not started, tried ") for line in lines), lines
            assert any(line.startswith("platform slack: not started, tried ") for line in lines), lines
            if console:
                assert (status, lines[0]) == (200, "ok")
            else:
                assert status == 503
                assert lines[0] == "not deciding: no chat platform takes presses and nobody may decide on the console"


async def test_telegram_polling_that_keeps_meeting_a_conflict_is_a_line_of_healthz_not_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process polling with the same token: every getUpdates answered 409 Conflict, logged and counted,
    polled again with backoff, and /healthz said 'platform telegram: serving' while no press came in from it."""
    monkeypatch.setattr(kit, "INBOUND_TROUBLE_AFTER", 2)
    async with three_fakes() as fakes:
        conflict = Fault("status", status=409, description="Conflict: terminated by other getUpdates request")
        fakes.telegram.script("getUpdates", *[conflict] * 10_000)
        failed = failure_count("poll", "telegram")
        async with kazma_on(fakes, tmp_path / "k.db") as app, served(app, tmp_path) as url:
            await until(lambda: failure_count("poll", "telegram") >= failed + 2)
            status, lines = await healthz(url)
            assert (status, lines[0]) == (200, "ok")  # Slack and Discord still take presses
            assert "platform slack: serving" in lines
            telegram = next((line for line in lines if line.startswith("platform telegram: ")), "")
            assert telegram.startswith("platform telegram: inbound failing (getUpdates (long polling) failed "), lines
            assert telegram.endswith("Telegram answered 409: Conflict: terminated by other getUpdates request)")


async def test_telegram_polling_ended_by_a_refused_token_is_opened_again_once_the_token_is_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telegram answering getUpdates 401 (the token refused, then good again: the operator fixed it at BotFather,
    or Telegram's 401 was a passing fault): python-telegram-bot's poller ended for good without a word to
    Kazma, the adapter still said it polled, so the ingress check never opened it again, and nothing came in
    from Telegram until a restart. Now the ended poller is an ingress not open: the check opens it again (with
    backoff while it keeps failing) and, once Telegram answers, a message sent then is answered."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.05)
    monkeypatch.setattr(lifecycle, "INGRESS_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app, served(app, tmp_path) as url:
        telegram = fakes.telegram
        await telegram.wait_for_call("getUpdates", answered=False)
        lost = failure_count("ingress_lost", "telegram")
        telegram.script("getUpdates", *[Fault.server_error(401, "Unauthorized")] * 10_000)
        telegram.push_message(TG_CHAT, TG_ADMIN, "wakes the long poll; the next ones meet the 401")

        def refused() -> int:
            return sum(1 for call in telegram.calls_to("getUpdates") if call.status == 401)

        # opened again and refused again, more than once: before, the first 401 was the last getUpdates
        await until(lambda: refused() >= 3)
        assert failure_count("ingress_lost", "telegram") >= lost + 3
        telegram.unscript("getUpdates")
        before = len(telegram.bot_messages(TG_CHAT))
        telegram.push_message(TG_CHAT, TG_ADMIN, "/approvals")
        await until(lambda: any("approval" in m.text.lower() for m in telegram.bot_messages(TG_CHAT)[before:]))
        status, lines = await healthz(url)
        assert status == 200
        assert "platform telegram: serving" in lines, lines


async def test_discord_refusing_the_token_on_a_post_is_healthz_off_and_later_cards_do_not_ask_it_again(
    tmp_path: Path,
) -> None:
    """The bot's token reset while Kazma ran, seen first by a card's post (a replica that does not hold the gateway
    sees it nowhere else): Discord answered 401, the card's Discord post was given up, and /healthz still said
    "platform discord: serving"; every later card asked Discord again with the refused token. Now /healthz says
    Discord is off because it refused the token and what to do, and later cards are not sent to it at all (their
    Discord posts wait for the restart), while Telegram and Slack show them."""
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app, served(app, tmp_path) as url:
        refused = failure_count("token_refused", "discord")
        fakes.discord.token = "reset-in-the-developer-portal"
        first = await app.service.open("shell", {"command": "make one"}, "agent:builder", "telegram:-1001")
        await until(lambda: failure_count("token_refused", "discord") > refused)
        posts = len(fakes.discord.calls_to("POST", r"/channels/\d+/messages"))
        assert [c.status for c in fakes.discord.calls_to("POST", r"/channels/\d+/messages")] == [401]
        discord = await _still_deciding_without(url, "discord")  # Telegram and Slack still take presses
        assert discord.startswith("platform discord: off, Discord refused the bot token (HTTP 401"), discord
        assert discord.endswith("put the new one in platforms.discord.token and restart Kazma")

        second = await app.service.open("shell", {"command": "make two"}, "agent:builder", "telegram:-1001")
        await until(lambda: "make two" in fakes.card_text("telegram") and "make two" in fakes.card_text("slack"))
        assert isinstance(app.bus, bus.FanOutBus)
        outbox = app.bus.outbox
        await until_async(lambda: _discord_post_refused(outbox, second.id))
        assert len(fakes.discord.calls_to("POST", r"/channels/\d+/messages")) == posts
        assert failure_count("token_refused", "discord") == refused + 1
        for request in (first, second):
            assert [c.platform for c in await app.service.store.cards(request.id)].count("discord") == 0


async def _discord_post_refused(outbox: object, request_id: str) -> bool:
    """Whether ``request_id``'s Discord card post was tried and waits in the outbox for the restart, refused."""
    pending = await outbox.pending()  # type: ignore[attr-defined]
    return any(r == request_id and p == "discord" and "refused the bot token" in str(e) for r, p, _, e in pending)


async def _still_deciding_without(url: str, platform: str) -> str:
    """/healthz answers 200 "ok" (the other platforms take presses): ``platform``'s line of it."""
    status, lines = await healthz(url)
    assert (status, lines[0]) == (200, "ok"), lines
    line = next((line for line in lines if line.startswith(f"platform {platform}: ")), "")
    assert line, lines
    return line


async def until_async(predicate: Callable[[], object], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():  # type: ignore[misc]
            await asyncio.sleep(0.02)


async def test_slack_refusing_the_bot_token_is_said_once_presses_still_decide_and_cards_wait_for_the_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The app's bot token revoked while Kazma ran (Slack answers every call with it ``token_revoked``): each card's
    Slack post was tried and given up with only "slack card_post: token_revoked", every later card asked Slack
    again with the refused token, nothing said the token was refused or what to do, and /healthz said
    "platform slack: serving". Now the refusal is said once (``slack.token_refused``, counted at
    ``token_refused``), /healthz says that presses on Slack still decide (they do) but its card posts and edits
    are refused, and how to fix it, and later cards are not sent to Slack,
    while Telegram and Discord show them. What Slack owes waits, not given up (given up, a card decided meanwhile
    kept its buttons on Slack after the operator's restart with a new token), and goes at the restart, not when
    the backoff of its refused tries runs out."""
    caplog.set_level(logging.INFO)
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        async with kazma_on(fakes, store) as app, served(app, tmp_path) as url:
            decided = await app.service.open("shell", {"command": "make it"}, "api:ci", "api:ci")
            async with asyncio.timeout(20):
                while "slack" not in [c.platform for c in await app.service.store.cards(decided.id)]:
                    await asyncio.sleep(0.02)
            refused = failure_count("token_refused", "slack")
            fakes.slack.revoke(fakes.slack.bot_token)
            first = await app.service.open("shell", {"command": "make one"}, "api:ci", "api:ci")
            await until(lambda: failure_count("token_refused", "slack") > refused)
            posts = len(fakes.slack.calls_to("chat.postMessage"))
            assert fakes.slack.calls_to("chat.postMessage")[-1].error == "token_revoked"
            slack = await _still_deciding_without(url, "slack")  # Telegram and Discord still take presses
            assert slack.startswith(
                "platform slack: presses still decide, card posts and edits refused: Slack refused the bot token "
                "(token_revoked"
            ), slack
            assert slack.endswith("put its Bot User OAuth Token (xoxb-) in platforms.slack.bot_token and restart Kazma")
            assert isinstance(app.bus, bus.FanOutBus)
            assert [h.takes_presses for h in app.bus.health() if h.platform == "slack"] == [True]

            second = await app.service.open("shell", {"command": "make two"}, "api:ci", "api:ci")
            await until(lambda: "make two" in fakes.card_text("telegram") and "make two" in fakes.card_text("discord"))
            # What /healthz says is so: a press on the Slack card shown before the refusal decides (it is signed
            # with the signing secret, not the token)
            await fakes.press("slack", Decision.APPROVE)
            async with asyncio.timeout(20):
                while (done := await app.service.store.get(decided.id)) is None or done.status is not Status.APPROVED:
                    await asyncio.sleep(0.02)
            assert done.decided_by == f"slack:{SLACK_ADMIN}"
            outbox = app.bus.outbox

            async def kept() -> bool:  # both Slack posts wait, each saying why
                waiting = {r: e for r, p, _, e in await outbox.pending() if p == "slack" and e}
                return all("Slack refused the bot token" in (waiting.get(r.id) or "") for r in (first, second))

            await until_async(kept)
            async with asyncio.timeout(20):  # shown decided where the token still works; Slack's edit waits
                while [c.platform for c in await app.service.store.cards(decided.id) if not c.settled_at] != ["slack"]:
                    await asyncio.sleep(0.02)
            assert len(fakes.slack.calls_to("chat.postMessage")) == posts  # nothing more went to Slack
            assert failure_count("token_refused", "slack") == refused + 1
            assert len([r for r in caplog.records if r.getMessage() == "slack.token_refused"]) == 1
            assert not [r for r in caplog.records if r.getMessage() == "bus.card_post_gave_up"]
        # Their backoff stretched to an hour (many refused tries): a restart must not wait it out
        with contextlib.closing(sqlite3.connect(store)) as db, db:
            db.execute("UPDATE card_outbox SET next_at = next_at + 3600 WHERE platform = 'slack' AND done_at IS NULL")
            db.execute("UPDATE approval_cards SET retry_at = retry_at + 3600 WHERE platform = 'slack' AND retry_at > 0")
        # the operator reinstalled the app, put its token in platforms.slack.bot_token and restarted Kazma
        del fakes.slack.revoked[fakes.slack.bot_token]
        async with kazma_on(fakes, store) as app:
            async with asyncio.timeout(20):  # at once, not when the backoff of its refused tries runs out
                while not all(c.settled_at for c in await app.service.store.cards(decided.id)):
                    await asyncio.sleep(0.02)
            assert isinstance(app.bus, bus.FanOutBus)
            outbox = app.bus.outbox
            async with asyncio.timeout(20):  # the kept posts are handled at once too (their requests ended)
                while [r for r, p, _, _ in await outbox.pending() if p == "slack"]:
                    await asyncio.sleep(0.02)


def _socket_mode(text: str) -> str:
    return text.replace("    http: {port: 0}\n", f"    http: {{port: 0}}\n    app_token: '{FAKE_APP_TOKEN}'\n")


async def _socket_open_then_the_bot_token_refused(fakes: Fakes, app: App) -> SlackAdapter:
    """Slack's socket open; then the bot token revoked, and the refusal known from a send Slack refused."""
    slack = app.bus.adapters["slack"]
    assert isinstance(slack, SlackAdapter)
    await until(lambda: fakes.slack.socket_connected and slack.ingress_running)
    fakes.slack.revoke(fakes.slack.bot_token)
    with pytest.raises(PlatformError):
        await slack.send_text(SLACK_CHANNEL, "the refusal, known")
    return slack


async def test_slack_s_socket_is_opened_again_while_the_bot_token_is_refused_and_its_presses_still_decide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Socket Mode: the socket comes over the app-level token, so presses still decide while Slack refuses the bot
    token. A leader's ingress check left out every platform that refused Kazma's setup (right for Discord, whose
    gateway is its token's), so a Slack socket not open then (its opening failed as the replica took the lead) was
    never opened again: no press came in until a restart. Now it is opened again, and /healthz says the presses
    decide."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.05)
    async with (
        three_fakes() as fakes,
        kazma_on(fakes, tmp_path / "k.db", edit=_socket_mode) as app,
        served(app, tmp_path) as url,
    ):
        slack = await _socket_open_then_the_bot_token_refused(fakes, app)
        opened = len(fakes.slack.calls_to("apps.connections.open"))
        await slack.stop_ingress()  # as after an opening that failed when this replica took the lead
        await until(lambda: len(fakes.slack.calls_to("apps.connections.open")) > opened and slack.ingress_running)
        await until(lambda: fakes.slack.socket_connected)
        line = await _still_deciding_without(url, "slack")
        assert line.startswith("platform slack: presses still decide, card posts and edits refused: "), line


async def test_slack_s_socket_opened_again_while_the_bot_token_is_refused_says_opening_not_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader opens a Slack socket again while Slack refuses the bot token (its presses outlive the refusal),
    but the "opening" mark left out every platform that refused Kazma's setup: while the socket was being opened,
    /healthz said it was not open, as of a socket nothing was opening."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.05)
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db", edit=_socket_mode) as app:
        slack = await _socket_open_then_the_bot_token_refused(fakes, app)
        opened = len(fakes.slack.calls_to("apps.connections.open"))
        fakes.slack.fail("apps.connections.open", "hang")
        await slack.stop_ingress()  # as after an opening that failed when this replica took the lead

        def slack_line() -> str:
            return next((h.state for h in app.bus.health() if h.platform == "slack"), "")

        await until(lambda: len(fakes.slack.calls_to("apps.connections.open")) > opened)
        assert slack_line().startswith("off, Slack refused the bot token"), slack_line()
        assert "; inbound connection opening since " in slack_line(), slack_line()
        fakes.slack.release_hangs()


async def _post_ended(outbox: object, request_id: str, platform: str) -> bool:
    """Whether ``request_id``'s card post on ``platform`` is no longer pending in the outbox (posted or given up)."""
    pending = await outbox.pending()  # type: ignore[attr-defined]
    return not [r for r, p, _, _ in pending if r == request_id and p == platform]


async def test_an_ingress_opened_again_says_why_it_was_not_open_while_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Discord closed the gateway with 4004 (discord.py does not reconnect after it): /healthz said "inbound
    connection not open (<Discord's close>)". While the ingress check opened it again (a new login, then the
    gateway waiting for READY) the line said only "inbound connection opening since ...": the reason was the
    adapter's own (a failed open is the bus's), and the adapter counts as running once an open begins, so it no
    longer said it. The opening line keeps why the connection was not open."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 0.05)
    monkeypatch.setattr(lifecycle, "INGRESS_RETRY", Backoff(base=0.05, cap=0.05, jitter=False))
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app, served(app, tmp_path) as url:
        lost = failure_count("ingress_lost", "discord")
        fakes.discord.gateway_open.clear()  # the open that follows waits here, before READY
        assert await fakes.discord.drop_gateway(code=4004) == 1
        await until(lambda: failure_count("ingress_lost", "discord") > lost)

        def discord_line() -> str:
            return next((h.state for h in app.bus.health() if h.platform == "discord"), "")

        await until(lambda: discord_line().startswith("inbound connection opening since "))
        _, lines = await healthz(url)
        discord = next((line for line in lines if line.startswith("platform discord: ")), "")
        assert discord.startswith("platform discord: inbound connection opening since "), lines
        assert "(it was not open: " in discord, lines
        assert "4004" in discord, lines
        fakes.discord.gateway_open.set()
        await until(lambda: discord_line() == "serving")


async def test_an_open_cancelled_before_it_ran_leaves_no_opening_line_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingress check cancelled (a stop, a lost lease) just after it marked Discord "opening" and before the open
    itself had run: the open's own cleanup never ran, and /healthz said "inbound connection opening since ..." of a
    gateway nothing was opening, until another open replaced the mark."""
    monkeypatch.setattr(lifecycle, "INGRESS_CHECK_SECONDS", 3600.0)  # nothing opens it again meanwhile
    async with three_fakes() as fakes, kazma_on(fakes, tmp_path / "k.db") as app:
        assert isinstance(app.bus, bus.FanOutBus)
        lost = failure_count("ingress_lost", "discord")
        assert await fakes.discord.drop_gateway(code=4004) == 1
        await until(lambda: failure_count("ingress_lost", "discord") > lost)
        opening = asyncio.create_task(app.bus.start_ingress())
        await asyncio.sleep(0)  # marked, the opens scheduled and not yet run
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await opening
        discord = next(h.state for h in app.bus.health() if h.platform == "discord")
        assert discord.startswith("inbound connection not open ("), discord
