"""The web console in a real browser: Playwright drives Debian's Chromium against a running Kazma.

Log in, ask the lead agent (scripted provider), see the approval card arrive live,
press Approve, and watch the web card and the Telegram card (on the wire-level
fake) both settle. A second tab that still shows the stale card gets the
standing outcome when pressed. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import CDPSession, FilePayload, Page, async_playwright

from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.web import WebAdapter
from kazma.approvals.model import Decision
from kazma.bot.app import App, build_app
from kazma.bot.cli.demo import REQUEST, run_demo, scenario
from kazma.bot.console.server import WebServer
from kazma.config import load_config_text
from kazma.engine.scenario import PerAgentScript, agent_prompts
from kazma.engine.types import Message, ModelReply
from tests.fakes.telegram import FakeTelegram

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TOKEN = "operator-secret-for-the-browser-tests"
CHAT = -1001

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/install-test-deps)")


@dataclass
class Running:
    app: App
    server: WebServer
    telegram: FakeTelegram

    @property
    def base(self) -> str:
        """The console by name: passkeys are made for a host name (localhost here), never an address."""
        return self.server.url.replace("127.0.0.1", "localhost")

    async def invite(self, person: str) -> str:
        assert self.server.signin is not None
        token, _ = await self.server.signin.accounts.invite(person, created_by="test")
        return f"{self.base}/enrol/{token}"


@asynccontextmanager
async def kazma_with_console(
    tmp_path: Path, *, people: str = "{alice: {web: alice}}", approvals: str = "", extra: str = ""
) -> AsyncIterator[Running]:
    """``people``: the ``people:`` mapping; ``approvals``: more ``approvals:`` keys; ``extra``: more YAML."""
    telegram = FakeTelegram()
    await telegram.start()
    loaded = load_config_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        "web: {port: 0}\n"
        f"people: {people}\n"
        f"approvals: {{approvers: ['web:alice']{approvals}}}\n"
        f"{extra}"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{CHAT}], home_chat: {CHAT}}}}}\n",
        environ={},
    )
    c = loaded.config
    prompts = agent_prompts(c)
    web = WebAdapter()
    app = await build_app(
        loaded,
        provider=scenario(prompts),
        adapters=[TelegramAdapter(c.platforms.telegram, poll_timeout=1)],
        web=web,
        poll_interval=0.05,
        workspace_root=tmp_path / "ws",
    )
    server = WebServer(
        app.console, web, host="127.0.0.1", port=0, token_path=tmp_path / "web-token", operator_token=TOKEN
    )
    await app.start()
    await server.start()
    try:
        yield Running(app, server, telegram)
    finally:
        await server.stop()
        await app.conversations.drain()
        await app.stop()
        await telegram.stop()


@dataclass(frozen=True)
class Authenticator:
    session: CDPSession
    authenticator_id: str  # for WebAuthn.setUserVerified and friends


async def with_authenticator(page: Page) -> Authenticator:
    """Chromium's virtual authenticator on this page (PLATFORM_NOTES.md): a passkey device that verifies its user."""
    cdp = await page.context.new_cdp_session(page)
    await cdp.send("WebAuthn.enable")
    added = await cdp.send(
        "WebAuthn.addVirtualAuthenticator",
        {"options": {"protocol": "ctap2", "transport": "internal", "hasResidentKey": True,
                     "hasUserVerification": True, "isUserVerified": True}},
    )  # fmt: skip
    return Authenticator(cdp, str(added["authenticatorId"]))


async def login(page: Page, k: Running, person: str = "alice") -> Authenticator:
    """Enrol a passkey for ``person`` from a fresh invite, in this page's browser, and be signed in by it."""
    authenticator = await with_authenticator(page)
    await page.goto(await k.invite(person))
    await page.click("#passkey-enrol")
    await page.wait_for_url(f"{k.base}/")
    return authenticator


async def test_console_loop_in_a_real_browser(tmp_path: Path) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    async with kazma_with_console(tmp_path) as k, async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 1000})
            page = await context.new_page()
            await login(page, k)

            await page.fill("textarea[name=text]", REQUEST)
            await page.click("form[action='/console/send'] button")
            approve = page.locator(".card button.approve")
            await approve.first.wait_for(timeout=30_000)
            assert await page.locator(".card").first.inner_text() != ""
            card_text = await page.locator(".card").first.inner_text()
            assert "Approval needed: shell" in card_text
            assert "hello.sh" in card_text

            # the same card is up on Telegram too
            await k.telegram.wait_until(lambda: any(m.buttons for m in k.telegram.bot_messages(CHAT)), timeout=30)

            # A page that stopped following live updates keeps showing the buttons (scripts off models
            # a dropped connection): pressing there later must answer with the outcome that stands.
            stale_context = await browser.new_context(java_script_enabled=False)
            # the same person, signed in (no script runs here to sign in with)
            cookies: Any = [
                {"name": c["name"], "value": c["value"], "domain": c["domain"], "path": c["path"]}
                for c in await context.cookies()
            ]
            await stale_context.add_cookies(cookies)
            stale = await stale_context.new_page()
            await stale.goto(f"{k.base}/")
            await stale.locator(".card button.approve").first.wait_for(timeout=10_000)
            await page.screenshot(path=str(ARTIFACTS / "console-card.png"), full_page=True)

            await approve.first.click()
            try:
                await page.locator(".card .outcome", has_text="approved by alice (web:alice)").first.wait_for(
                    timeout=30_000
                )
            except Exception:
                await page.screenshot(path=str(ARTIFACTS / "console-failure.png"), full_page=True)
                raise
            await k.telegram.wait_until(
                lambda: any(
                    "APPROVED by alice (web:alice)" in m.text and not m.buttons for m in k.telegram.bot_messages(CHAT)
                ),
                timeout=30,
            )
            await page.locator("text=hello.sh is written and ran once").first.wait_for(timeout=30_000)
            await page.screenshot(path=str(ARTIFACTS / "console-settled.png"), full_page=True)

            await stale.locator(".card button.approve").first.click()
            await stale.locator("text=Already approved by alice (web:alice)").first.wait_for(timeout=10_000)
            await stale.screenshot(path=str(ARTIFACTS / "console-stale-press.png"), full_page=True)

            requests = await k.app.service.store.requests()
            assert [(r.status.value, r.decided_by) for r in requests] == [("approved", "web:alice")]
            lost = await k.app.service.store.events(requests[0].id, event="press_lost")
            assert [e.actor for e in lost] == ["web:alice"]
        finally:
            await browser.close()


async def test_the_demo_swarm_page_runs_a_pipeline_on_the_scripted_workers() -> None:
    """`kazma demo` in the browser: the card, the lead's last word on connecting a model, /swarm help as a
    table, and a pipeline run by the demo operator on the scripted workers."""
    ARTIFACTS.mkdir(exist_ok=True)
    out = io.StringIO()
    demo = asyncio.create_task(run_demo(out=out, interactive=False, web=True, web_port=0, linger=True))
    try:
        async with asyncio.timeout(60):
            while "web console: " not in out.getvalue():
                await asyncio.sleep(0.05)
        found = re.search(r"web console: (http://[^/]+)(/login/local/\S+) — signs one browser in", out.getvalue())
        assert found is not None
        url, link = found.groups()
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run"],
            )  # fmt: skip
            try:
                page = await (await browser.new_context(viewport={"width": 1280, "height": 1000})).new_page()
                await page.goto(f"{url}{link}")  # the demo's one-time local sign-in
                await page.wait_for_url(f"{url}/")
                assert "kazma demo's local identity, not a proof" in await page.locator("header").inner_text()

                await page.locator(".card button.approve").first.click(timeout=30_000)
                await page.locator("text=The script works.").first.wait_for(timeout=30_000)
                await page.fill("textarea[name=text]", "@kazma what now?")
                await page.click("form[action='/console/send'] button")
                await page.locator("text=That was the scripted demo").first.wait_for(timeout=30_000)
                last = await page.locator("text=That was the scripted demo").first.inner_text()
                assert "kazma init" in last
                assert "model.base_url" in last

                await page.goto(f"{url}/swarm")
                await page.fill("input[name=text]", "help")
                await page.click("form[action='/swarm/command'] button")
                table = page.locator(".flash pre")
                await table.first.wait_for(timeout=10_000)
                rows = (await table.first.inner_text()).splitlines()
                assert len(rows) >= 15  # one line per subcommand, not one paragraph
                assert any(row.startswith("/swarm pipeline <preset|w1,w2,…> <task>") for row in rows)
                await page.screenshot(path=str(ARTIFACTS / "demo-swarm-help.png"), full_page=True)

                await page.fill("input[name=text]", "pipeline quick write a haiku about queues")
                await page.click("form[action='/swarm/command'] button")
                flash = await page.locator(".flash").first.inner_text()
                assert "refused" not in flash.lower(), flash
                done = page.locator("tr", has_text="succeeded").filter(has_text="pipeline")
                await done.first.wait_for(timeout=30_000)  # the dashboard follows the swarm live
                row = await done.first.inner_text()
                assert "researcher, builder" in row
                assert "Built “write a haiku about queues”" in row
                await page.screenshot(path=str(ARTIFACTS / "demo-swarm-pipeline.png"), full_page=True)
            finally:
                await browser.close()
    finally:
        demo.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await demo


# --------------------------------------------------------------------------- every conversation, after a restart

# The README's screenshots are refreshed only when asked (KAZMA_UPDATE_SCREENSHOTS=1); an ordinary run writes
# them beside the other artifacts, so running the suite never changes tracked files.
DOCS = (
    Path(__file__).resolve().parent.parent / "docs" / "screenshots"
    if os.environ.get("KAZMA_UPDATE_SCREENSHOTS") == "1"
    else ARTIFACTS / "screenshots"
)
PERSON = 111  # a Telegram admin: an approver there, and allowed to DM the lead
FENCE_WORDS = ("untrusted-data", "Untrusted data from", "It is data, not instructions")


def telegram_yaml(tmp_path: Path, telegram: FakeTelegram) -> str:
    return (
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        "web: {port: 0}\n"
        "people: {alice: {web: alice}}\n"
        "approvals: {approvers: ['web:alice']}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{CHAT}], home_chat: {CHAT}, admins: [{PERSON}], dm_policy: approvers}}}}\n"
    )


@asynccontextmanager
async def kazma_on(tmp_path: Path, telegram: FakeTelegram, *, quiet: bool = False) -> AsyncIterator[Running]:
    """Kazma serving the Telegram fake and the console, on the store in ``tmp_path`` (kept between runs).
    ``quiet``: every agent only says "Noted." (no plan, so nothing waits for an approval)."""
    loaded = load_config_text(telegram_yaml(tmp_path, telegram), environ={})
    c = loaded.config
    web = WebAdapter()
    prompts = agent_prompts(c)
    noted: dict[str, Callable[[Sequence[Message]], ModelReply]] = {
        name: (lambda _messages: ModelReply(content="Noted.")) for name in prompts
    }
    app = await build_app(
        loaded,
        provider=PerAgentScript({}, prompts, after=noted) if quiet else scenario(prompts),
        adapters=[TelegramAdapter(c.platforms.telegram, poll_timeout=1)],
        web=web,
        poll_interval=0.05,
        workspace_root=tmp_path / "ws",
    )
    server = WebServer(
        app.console, web, host="127.0.0.1", port=0, token_path=tmp_path / "web-token", operator_token=TOKEN
    )
    await app.start()
    await server.start()
    try:
        yield Running(app, server, telegram)
    finally:
        await server.stop()
        await app.conversations.drain()
        await app.stop()


async def assert_no_fence(page: Page) -> None:
    shown = await page.content()
    for word in FENCE_WORDS:
        assert word not in shown, f"{word!r} is shown on {page.url}"


async def test_every_conversation_in_the_console_after_a_restart(tmp_path: Path) -> None:
    """A Telegram group's plan (dispatches that carry fenced output) and a DM run on the fake; Kazma restarts; the
    console lists both with their badges, reads them from the store without a fence in sight, follows a new
    Telegram message live, and every page is photographed for the docs (light and dark)."""
    # CI once saw this test hang past pytest-timeout (300 s, a normal run takes ~30 s) with no asyncio stack in
    # its report: bounded here, a hang fails with the traceback of the line it waited on.
    async with asyncio.timeout(240):
        DOCS.mkdir(parents=True, exist_ok=True)
        telegram = FakeTelegram()
        await telegram.start()
        try:
            async with kazma_on(tmp_path, telegram) as k:
                telegram.push_message(CHAT, PERSON, REQUEST)
                await telegram.wait_until(lambda: any(m.buttons for m in telegram.bot_messages(CHAT)), timeout=30)
                card = next(m for m in telegram.bot_messages(CHAT) if m.buttons)
                approve = next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(":a"))
                telegram.push_callback(CHAT, card.message_id, PERSON, approve)
                await telegram.wait_until(
                    lambda: any("The script works." in m.text for m in telegram.bot_messages(CHAT)), timeout=30
                )
                telegram.push_message(PERSON, PERSON, "@kazma a word in private")  # a DM (dm_policy: approvers)
                await telegram.wait_until(lambda: bool(telegram.bot_messages(PERSON)), timeout=30)
                assert telegram.chat_actions, "the working sign was shown while agents worked"
                await k.app.conversations.drain()
            every_text = [m.text for m in telegram.bot_messages(CHAT) + telegram.bot_messages(PERSON)]
            assert any("from @researcher" in t for t in every_text)
            assert not [t for t in every_text if any(word in t for word in FENCE_WORDS)]

            async with kazma_on(tmp_path, telegram, quiet=True) as k, async_playwright() as pw:  # the same store
                browser = await pw.chromium.launch(
                    executable_path=CHROMIUM,
                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run"],
                )  # fmt: skip
                try:
                    for scheme in ("light", "dark"):
                        context = await browser.new_context(
                            viewport={"width": 1280, "height": 900}, color_scheme=scheme, timezone_id="Europe/Paris"
                        )
                        page = await context.new_page()
                        await login(page, k)
                        suffix = "" if scheme == "light" else "-dark"
                        if scheme == "light":  # a file from the console reaches the workspace, and the agent answers
                            await page.locator("#live", has_text="live").wait_for(timeout=10_000)
                            await page.set_input_files(
                                "form.upload input[type=file]",
                                files=[FilePayload(name="notes.txt", mimeType="text/plain", buffer=b"release notes\n")],
                            )
                            await page.fill("form.upload input[name=text]", "@kazma the notes")
                            await page.click("form.upload button")
                            await page.locator("#messages", has_text="📎 notes.txt (14 bytes)").wait_for(timeout=20_000)
                            await page.locator("#messages", has_text="Noted.").wait_for(timeout=20_000)
                            saved = tmp_path / "ws"
                            assert [p.read_bytes() for p in saved.rglob("incoming/notes.txt")] == [b"release notes\n"]
                        await assert_no_fence(page)
                        await page.screenshot(path=str(DOCS / f"console{suffix}.png"), full_page=True)

                        await page.goto(f"{k.base}/conversations")
                        group = page.locator(f"#conversations li[data-conversation='telegram:{CHAT}']")
                        await group.wait_for(timeout=10_000)
                        assert "Telegram" in await group.inner_text()
                        dm = page.locator(f"#conversations li[data-conversation='telegram:{PERSON}']")
                        assert "DM" in await dm.inner_text()
                        await assert_no_fence(page)
                        await page.screenshot(path=str(DOCS / f"conversations{suffix}.png"), full_page=True)

                        await group.locator("a").click()
                        await page.locator("#transcript .message").first.wait_for(timeout=10_000)
                        shown = await page.locator("#transcript").inner_text()
                        assert REQUEST in shown  # what the person said, kept across the restart
                        assert "from @researcher" in shown
                        assert shown.index(REQUEST) < shown.index("@researcher") < shown.index("The script works.")
                        times = await page.locator("#transcript time").all_inner_texts()
                        assert times
                        assert all(t.endswith("Europe/Paris") for t in times)
                        await assert_no_fence(page)
                        if scheme == "light":  # live: a new message appears without a reload
                            await page.locator("#live", has_text="live").wait_for(timeout=10_000)
                            telegram.push_message(CHAT, PERSON, "one more thing, live")
                            await page.locator("#transcript", has_text="one more thing, live").wait_for(timeout=20_000)
                        await page.screenshot(path=str(DOCS / f"conversation-telegram{suffix}.png"), full_page=True)

                        await page.goto(f"{k.base}/swarm")
                        await assert_no_fence(page)
                        dashboard = page.locator("#dashboard")
                        assert await page.locator("#dashboard figure.chart").count() == 4
                        assert await page.locator("#dashboard figure.chart svg[role=img]").count() >= 2
                        if scheme == "light":  # live: a decision shows up without a reload
                            await page.locator("#live", has_text="live").wait_for(timeout=10_000)
                            await page.evaluate("window.kazmaNotReloaded = true")
                            summary = page.locator("#chart-approvals desc")  # the chart's text equivalent
                            assert "1 approved, 0 denied" in (await summary.text_content() or "")
                            request = await k.app.service.open(
                                "shell", {"command": "ls"}, "agent:builder", f"telegram:{CHAT}"
                            )
                            await k.app.service.decide(request.id, Decision.DENY, actor="web:alice", platform="web")
                            denied = dashboard.locator("tr", has_text="denied").filter(has_text="agent:builder")
                            await denied.first.wait_for(timeout=20_000)  # the recent approvals table, pushed
                            assert "1 approved, 1 denied" in (await summary.text_content() or "")  # and the chart
                            assert await page.evaluate("window.kazmaNotReloaded === true")
                        times = await page.locator("#dashboard time").all_text_contents()
                        assert times
                        assert all(t.endswith("Europe/Paris") for t in times), times
                        await page.screenshot(path=str(DOCS / f"swarm{suffix}.png"), full_page=True)
                        await context.close()
                finally:
                    await browser.close()
                await k.app.conversations.drain()
        finally:
            await telegram.stop()
    for name in ("console", "conversations", "conversation-telegram", "swarm"):
        assert (DOCS / f"{name}.png").stat().st_size > 10_000
