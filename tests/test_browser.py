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
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.async_api import Page, async_playwright

from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.web import WebAdapter
from kazma.bot.app import App, build_app
from kazma.bot.console.server import WebServer
from kazma.bot.demo import REQUEST, run_demo, scenario
from kazma.config import load_config_text
from kazma.engine.scenario import agent_prompts
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


@asynccontextmanager
async def kazma_with_console(tmp_path: Path) -> AsyncIterator[Running]:
    telegram = FakeTelegram()
    await telegram.start()
    loaded = load_config_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        "web: {port: 0}\n"
        "approvals: {approvers: ['web:alice']}\n"
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
    server = WebServer(app, web, host="127.0.0.1", port=0, token_path=tmp_path / "web-token", operator_token=TOKEN)
    await app.start()
    await server.start()
    try:
        yield Running(app, server, telegram)
    finally:
        await server.stop()
        await app.conversations.drain()
        await app.stop()
        await telegram.stop()


async def login(page: Page, url: str) -> None:
    await page.goto(f"{url}/login")
    await page.fill("input[name=name]", "alice")
    await page.fill("input[name=token]", TOKEN)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{url}/")


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
            await login(page, k.server.url)

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
            stale = await stale_context.new_page()
            await login(stale, k.server.url)
            await stale.locator(".card button.approve").first.wait_for(timeout=10_000)
            await page.screenshot(path=str(ARTIFACTS / "console-card.png"), full_page=True)

            await approve.first.click()
            try:
                await page.locator(".card .outcome", has_text="approved by web:alice").first.wait_for(timeout=30_000)
            except Exception:
                await page.screenshot(path=str(ARTIFACTS / "console-failure.png"), full_page=True)
                raise
            await k.telegram.wait_until(
                lambda: any("approved by web:alice" in m.text and not m.buttons for m in k.telegram.bot_messages(CHAT)),
                timeout=30,
            )
            await page.locator("text=hello.sh is written and ran once").first.wait_for(timeout=30_000)
            await page.screenshot(path=str(ARTIFACTS / "console-settled.png"), full_page=True)

            await stale.locator(".card button.approve").first.click()
            await stale.locator("text=Already approved by web:alice").first.wait_for(timeout=10_000)
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
        found = re.search(r"web console: (\S+)/login — log in as 'demo' with token (\S+)", out.getvalue())
        assert found is not None
        url, token = found.groups()
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run"],
            )  # fmt: skip
            try:
                page = await (await browser.new_context(viewport={"width": 1280, "height": 1000})).new_page()
                await page.goto(f"{url}/login")
                await page.fill("input[name=name]", "demo")
                await page.fill("input[name=token]", token)
                await page.click("button[type=submit]")
                await page.wait_for_url(f"{url}/")

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
                await done.first.wait_for(timeout=30_000)  # the page reloads itself every 5 s
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
