"""The approval page as a Telegram Mini App, on the wire fake: a card's button opens it inside Telegram, Telegram
signs who opened it (``initData``, signed by the fake exactly as Telegram documents), and the page knows the
person without a console sign-in — while a tampered, expired or foreign-bot ``initData`` is refused and decides
nothing.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

import aiohttp
import pytest
from prometheus_client import REGISTRY
from yarl import URL

from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.web import WebAdapter
from kazma.approvals.model import Status
from kazma.bot.app import App, build_app
from kazma.bot.console.auth import SESSION_COOKIE
from kazma.bot.console.miniapp import APP_CSRF_COOKIE, MAX_AGE, InitDataRefused, verify_init_data
from kazma.bot.console.server import WebServer
from kazma.config import load_config_text
from tests.fakes.telegram import FakeTelegram

PUBLIC = "https://kazma.example.org"
ALICE, MALLORY = 111, 666
STRANGER = 999  # a Telegram user nobody named
GROUP = -1001234567890


@dataclass
class Running:
    app: App
    server: WebServer
    telegram: FakeTelegram
    base: str


@asynccontextmanager
async def kazma_with_telegram(tmp_path: Path, *, home: int, mini_app: str = "") -> AsyncIterator[Running]:
    telegram = FakeTelegram()
    await telegram.start()
    loaded = load_config_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        f"web: {{port: 0, public_url: '{PUBLIC}'}}\n"
        "people: {alice: {telegram: 111, web: alice}, mallory: {telegram: 666}}\n"
        "approvals: {approvers: [alice]}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{home}], home_chat: {home}, mini_app: '{mini_app}'}}}}\n",
        environ={},
    )
    web = WebAdapter()
    app = await build_app(
        loaded,
        adapters=[TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1)],
        web=web,
        poll_interval=0.05,
        workspace_root=tmp_path / "ws",
    )
    server = WebServer(app.console, web, host="127.0.0.1", port=0, token_path=tmp_path / "web-token")
    await app.start()
    await server.start()
    try:
        yield Running(app, server, telegram, server.url)
    finally:
        await server.stop()
        await app.stop()
        await telegram.stop()


def browser(base: str) -> aiohttp.ClientSession:
    # public_url is https:// (a TLS proxy in front): cookies are Secure, and this client stands in for the proxy
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True, treat_as_secure_origin=[base]))


async def open_in_telegram(
    http: aiohttp.ClientSession, base: str, request_id: str, init_data: str
) -> aiohttp.ClientResponse:
    """What the Mini App's page does in Telegram's webview: load, then hand Telegram's initData to Kazma."""
    page = await (await http.get(f"{base}/telegram/app?approval={request_id}")).text()
    csrf = re.search(r'data-csrf="([^"]+)"', page)
    assert csrf is not None, page
    verify = re.search(r'data-verify="([^"]+)"', page)
    assert verify is not None
    return await http.post(f"{base}{verify.group(1)}", json={"init_data": init_data, "csrf": csrf.group(1)})


def refused_count() -> float:
    return REGISTRY.get_sample_value("kazma_web_logins_total", {"outcome": "telegram_refused"}) or 0.0


async def test_a_private_card_opens_the_mini_app_and_telegram_names_the_person(tmp_path: Path) -> None:
    async with kazma_with_telegram(tmp_path, home=ALICE) as k, browser(k.base) as http:
        request = await k.app.service.open("shell", {"command": "rm -rf /srv/old"}, "agent:builder", "web:console")
        await k.telegram.wait_until(lambda: any(m.buttons for m in k.telegram.bot_messages(ALICE)), timeout=10)
        [card] = [m for m in k.telegram.bot_messages(ALICE) if m.buttons]
        opens = [b for b in card.buttons if "web_app" in b]
        assert opens == [
            {"text": "Open the whole call", "web_app": {"url": f"{PUBLIC}/telegram/app?approval={request.id}"}}
        ]

        signed = await open_in_telegram(http, k.base, request.id, k.telegram.mini_app_init_data(ALICE))
        assert signed.status == 200, await signed.text()
        assert (await signed.json())["next"] == f"/swarm?approval={request.id}"
        page = await (await http.get(f"{k.base}/swarm?approval={request.id}")).text()
        assert "alice (telegram:111, proven by Telegram)" in page
        csrf = re.search(r'<meta name="kazma-csrf" content="([^"]+)">', page)
        assert csrf is not None
        assert f'action="/approvals/{request.id}/decide"' in page
        decided = await http.post(
            f"{k.base}/approvals/{request.id}/decide", data={"csrf": csrf.group(1), "decision": "approve"}
        )
        assert "Approved. Recorded as alice (telegram:111)." in await decided.text()
        row = await k.app.service.store.get(request.id)
        assert row is not None
        # decided as the identity Telegram proved, on Telegram: the same as pressing the card's own button
        assert (row.status, row.decided_by, row.decided_via, row.decided_person) == (
            Status.APPROVED, "telegram:111", "telegram", "alice",
        )  # fmt: skip
        await k.telegram.wait_until(
            lambda: any(
                "APPROVED by alice (telegram:111) via telegram" in m.text and not m.buttons
                for m in k.telegram.bot_messages(ALICE)
            ),
            timeout=10,
        )


async def test_a_group_card_opens_the_bots_mini_app_link_and_never_an_inline_web_app(tmp_path: Path) -> None:
    async with kazma_with_telegram(tmp_path, home=GROUP, mini_app="approve") as k, browser(k.base) as http:
        request = await k.app.service.open("shell", {"command": "ls"}, "agent:builder", "web:console")
        await k.telegram.wait_until(lambda: any(m.buttons for m in k.telegram.bot_messages(GROUP)), timeout=10)
        [card] = [m for m in k.telegram.bot_messages(GROUP) if m.buttons]
        assert not any("web_app" in b for b in card.buttons)  # Telegram refuses those in groups (the fake too)
        assert {"text": "Open the whole call", "url": f"https://t.me/kazma_bot/approve?startapp={request.id}"} in (
            card.buttons
        )
        # the Mini App made at @BotFather opens the landing page; Telegram passes the request id as start_param
        signed = await open_in_telegram(http, k.base, "", k.telegram.mini_app_init_data(ALICE, start_param=request.id))
        assert (await signed.json())["next"] == f"/swarm?approval={request.id}"
    async with kazma_with_telegram(tmp_path / "plain", home=GROUP) as k:
        request = await k.app.service.open("shell", {"command": "ls"}, "agent:builder", "web:console")
        await k.telegram.wait_until(lambda: any(m.buttons for m in k.telegram.bot_messages(GROUP)), timeout=10)
        [card] = [m for m in k.telegram.bot_messages(GROUP) if m.buttons]
        assert [b["text"] for b in card.buttons] == [
            "Approve",
            "Deny",
            "Deny with reason",
        ]  # no Mini App configured: the text link


def _tampered(init_data: str) -> str:
    fields = dict(parse_qsl(init_data))
    fields["user"] = fields["user"].replace(f'"id":{MALLORY}', f'"id":{ALICE}')
    return urlencode(fields)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("tampered", lambda fake: _tampered(fake.mini_app_init_data(MALLORY))),
        ("expired", lambda fake: fake.mini_app_init_data(ALICE, auth_date=int(time.time() - MAX_AGE - 60))),
        ("another bot", lambda fake: fake.mini_app_init_data(ALICE, bot_token="654321:ANOTHER-bots-token")),
        ("unsigned", lambda fake: urlencode({"user": '{"id":111}', "auth_date": str(int(time.time()))})),
    ],
)
async def test_initdata_telegram_did_not_sign_for_this_bot_now_is_refused_and_decides_nothing(
    tmp_path: Path, name: str, make: object
) -> None:
    async with kazma_with_telegram(tmp_path, home=ALICE) as k, browser(k.base) as http:
        request = await k.app.service.open("shell", {"command": "rm -rf /"}, "agent:builder", "web:console")
        before = refused_count()
        assert callable(make)
        answer = await open_in_telegram(http, k.base, request.id, make(k.telegram))
        assert answer.status == 403, name
        assert "Telegram did not vouch for this" in (await answer.json())["error"]
        assert refused_count() == before + 1
        assert SESSION_COOKIE not in {c.key for c in http.cookie_jar.filter_cookies(URL(k.base)).values()}
        page = await http.get(f"{k.base}/swarm?approval={request.id}", allow_redirects=False)
        assert (page.status, URL(page.headers["Location"]).path) == (302, "/login")
        decided = await http.post(f"{k.base}/approvals/{request.id}/decide", data={"decision": "approve"})
        assert decided.status == 401
        row = await k.app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        assert await k.app.service.store.events(request.id, event="decided") == []


async def test_a_person_telegram_names_who_is_no_approver_reads_but_cannot_decide(tmp_path: Path) -> None:
    async with kazma_with_telegram(tmp_path, home=ALICE) as k, browser(k.base) as http:
        request = await k.app.service.open("shell", {"command": "ls"}, "agent:builder", "web:console")
        signed = await open_in_telegram(http, k.base, request.id, k.telegram.mini_app_init_data(MALLORY))
        assert signed.status == 200
        page = await (await http.get(f"{k.base}/swarm?approval={request.id}")).text()
        assert "mallory (telegram:666, proven by Telegram)" in page
        assert "/decide" not in page
        csrf = re.search(r'<meta name="kazma-csrf" content="([^"]+)">', page)
        assert csrf is not None
        pressed = await http.post(
            f"{k.base}/approvals/{request.id}/decide", data={"csrf": csrf.group(1), "decision": "approve"}
        )
        assert "You (mallory (telegram:666)) are not an approver here" in await pressed.text()
        row = await k.app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING


async def test_a_telegram_user_nobody_named_opens_no_session_and_reads_nothing(tmp_path: Path) -> None:
    """Telegram vouches for every one of its users, and anyone can open a bot's Mini App: a stranger (under no
    person, no approver, no admin) is refused like at Sign in with Slack, and never reads the call's arguments."""
    async with kazma_with_telegram(tmp_path, home=ALICE) as k, browser(k.base) as http:
        request = await k.app.service.open(
            "shell", {"command": "curl -H 'Authorization: secret-4711' x"}, "agent:builder", "web:console"
        )
        before = refused_count()
        answer = await open_in_telegram(http, k.base, request.id, k.telegram.mini_app_init_data(STRANGER))
        assert answer.status == 403
        assert f"telegram:{STRANGER}, who is nobody this Kazma knows" in (await answer.json())["error"]
        assert refused_count() == before + 1
        assert SESSION_COOKIE not in {c.key for c in http.cookie_jar.filter_cookies(URL(k.base)).values()}
        page = await http.get(f"{k.base}/swarm?approval={request.id}", allow_redirects=False)
        assert (page.status, URL(page.headers["Location"]).path) == (302, "/login")
        assert "secret-4711" not in await page.text()
        for path in ("/conversations", "/"):
            assert (await http.get(f"{k.base}{path}", allow_redirects=False)).status == 302, path


def test_verify_init_data_checks_the_signature_the_age_and_the_bot() -> None:
    fake = FakeTelegram()
    now = time.time()
    data = fake.mini_app_init_data(ALICE, start_param="abcdefghijklmnopqrstuvwx", auth_date=int(now) - 10)
    visitor = verify_init_data(data, fake.token, now=now)
    assert (visitor.identity, visitor.start_param) == ("telegram:111", "abcdefghijklmnopqrstuvwx")
    with pytest.raises(InitDataRefused, match="not this bot's"):
        verify_init_data(data, "654321:another", now=now)
    with pytest.raises(InitDataRefused, match="s old"):
        verify_init_data(data, fake.token, now=now + MAX_AGE + 1)
    with pytest.raises(InitDataRefused, match="given twice"):
        verify_init_data(data + "&auth_date=1", fake.token, now=now)
    with pytest.raises(InitDataRefused, match="not configured"):
        verify_init_data(data, "", now=now)


async def test_the_mini_apps_csrf_cookie_is_host_prefixed_and_a_plain_one_opens_nothing(tmp_path: Path) -> None:
    # over https a sibling host may set a cookie for the whole domain: only a __Host- cookie is surely ours
    async with (
        kazma_with_telegram(tmp_path, home=ALICE) as k,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        init_data = k.telegram.mini_app_init_data(ALICE)
        for name, status in ((APP_CSRF_COOKIE, 403), (f"__Host-{APP_CSRF_COOKIE}", 200)):
            page = await http.get(f"{k.base}/telegram/app")
            [line] = page.headers.getall("Set-Cookie")
            parts = [p.strip() for p in line.split(";")]
            assert parts[0].startswith(f"__Host-{APP_CSRF_COOKIE}="), line
            assert "Secure" in parts
            assert "Path=/" in parts
            value = parts[0].partition("=")[2]
            answer = await http.post(
                f"{k.base}/telegram/app",
                json={"init_data": init_data, "csrf": value},
                headers={"Cookie": f"{name}={value}"},
            )
            assert answer.status == status, (name, await answer.text())
        dropped = [c for c in answer.headers.getall("Set-Cookie") if c.startswith(f"__Host-{APP_CSRF_COOKIE}=")]
        assert len(dropped) == 1
        assert "Max-Age=0" in dropped[0]
        assert "Secure" in dropped[0]
