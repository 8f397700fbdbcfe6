"""The console answers only to its own names: a DNS-rebinding page (its own name pointed at 127.0.0.1) is
refused on every route, while 127.0.0.1, localhost, the public URL's host and web.allowed_hosts are served."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from playwright.async_api import async_playwright
from yarl import URL

from kazma.config import ConfigError, load_config_text
from tests.test_web_server import console

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


async def test_a_rebound_name_reads_neither_metrics_nor_health_nor_starts_a_sign_in(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        port = URL(con.base).port
        address = f"http://127.0.0.1:{port}"  # where evil.example now resolves: the socket is ours
        # what the browser sends for the rebound page's own fetches: its name, and its origin, which are equal
        evil = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
        for method, path in (("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/login"),
                             ("POST", "/login/passkey/options"), ("GET", "/api/v1/openapi.json")):  # fmt: skip
            async with client.request(method, address + path, headers=evil, allow_redirects=False) as answer:
                assert answer.status == 421, (method, path, answer.status)
                text = await answer.text()
                assert "evil.example" in text
                assert "web.allowed_hosts" in text
                assert "kazma_" not in text  # nothing of the metrics
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"LOCALHOST.:{port}"):
            async with client.get(address + "/healthz", headers={"Host": host}) as answer:
                assert (answer.status, await answer.text()) == (200, "ok"), host
        async with client.get(con.base + "/metrics") as answer:  # reached by name, as a browser would
            assert answer.status == 200


async def test_the_public_name_and_allowed_hosts_are_served(tmp_path: Path) -> None:
    extra = "web: {public_url: 'https://kazma.example.org', allowed_hosts: [kazma-a, 'scrape.internal']}"
    async with console(tmp_path, extra=extra) as con, con.client() as client:
        port = URL(con.base).port
        address = f"http://127.0.0.1:{port}"
        for host in ("kazma.example.org", f"kazma.example.org:{port}", "KAZMA-A:8765", "scrape.internal"):
            async with client.get(address + "/healthz", headers={"Host": host}) as answer:
                assert answer.status == 200, host
        for host in ("example.org", "kazma.example.org.evil.example", "kazma-b:8765"):
            async with client.get(address + "/healthz", headers={"Host": host}) as answer:
                assert answer.status == 421, host


def test_allowed_hosts_are_names_not_urls() -> None:
    for bad in ("https://kazma.example.org", "kazma.example.org/path", "a b", ""):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            load_config_text(f"web: {{allowed_hosts: [{bad!r}]}}\n", environ={})
    loaded = load_config_text("web: {allowed_hosts: ['Kazma-A', 'kazma.internal:8765']}\n", environ={})
    assert loaded.config.web.allowed_hosts == ["kazma-a", "kazma.internal"]


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/install-test-deps)")
async def test_a_real_browser_on_a_name_pointed_at_us_reads_nothing(tmp_path: Path) -> None:
    # Chromium resolves evil.example to 127.0.0.1, as a rebinding attacker's DNS answers once the page is loaded
    async with console(tmp_path) as con, async_playwright() as pw:
        port = URL(con.base).port
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--no-proxy-server",
                  "--host-resolver-rules=MAP evil.example 127.0.0.1"],
        )  # fmt: skip
        try:
            page = await browser.new_page()
            landed = await page.goto(f"http://evil.example:{port}/login")
            assert landed is not None
            assert landed.status == 421
            # the page's own same-origin fetches, as its script would make them
            read = await page.evaluate("Promise.all(['/metrics', '/healthz'].map(p => fetch(p).then(r => r.status)))")
            assert read == [421, 421]
            ours = await page.goto(f"{con.base}/healthz")  # the console by its own name still answers
            assert ours is not None
            assert ours.status == 200
        finally:
            await browser.close()
