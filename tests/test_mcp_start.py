"""`kazma run` imports and starts optional machinery only when it is configured.

A real `kazma run` child, with a wrapper that writes the modules it has
imported when sent SIGUSR1 (it goes on serving). Without an API token nobody can
call ``/mcp``: the MCP SDK is never imported and ``/mcp`` still answers 401.
With one, the SDK's session manager starts (after the web server is up) and
serves ``tools/list``. Platform libraries come in only for the platforms
configured; Matrix and the PostgreSQL driver never on SQLite.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from tests.api_support import REQUESTER_TOKEN
from tests.child_env import child_env
from tests.fakes.telegram import FakeTelegram

CHILD = """
import os, signal, sys
def dump(*_):
    with open(os.environ["KAZMA_TEST_MODULES"] + ".part", "w") as out:
        out.write("\\n".join(sorted(sys.modules)))
    os.replace(os.environ["KAZMA_TEST_MODULES"] + ".part", os.environ["KAZMA_TEST_MODULES"])
signal.signal(signal.SIGUSR1, dump)
def dump_gc(*_):
    import gc
    with open(os.environ["KAZMA_TEST_MODULES"] + ".gc.part", "w") as out:
        out.write(" ".join(map(str, (*gc.get_threshold(), gc.get_freeze_count()))))
    os.replace(os.environ["KAZMA_TEST_MODULES"] + ".gc.part", os.environ["KAZMA_TEST_MODULES"] + ".gc")
signal.signal(signal.SIGUSR2, dump_gc)
from kazma.bot.cli import main
main(sys.argv[1:], prog_name="kazma")
"""
DEV_EXTRAS = ("twisted", "zope", "rich", "pygments", "greenlet")
OPTIONAL = (
    "mcp",
    "starlette",
    "webauthn",
    "jsonschema",
    "jwt",
    "mautrix",
    "psycopg",
    "psycopg_pool",
    "telegram",
    "discord",
    "slack_bolt",
    "slack_sdk",
)


@dataclass
class Running:
    url: str
    log: Path
    modules_file: Path
    process: asyncio.subprocess.Process

    async def modules(self) -> set[str]:
        """The top-level packages the child has imported, read now."""
        self.modules_file.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR1)
        async with asyncio.timeout(30):
            while not self.modules_file.exists():
                await asyncio.sleep(0.02)
        return {name.split(".")[0] for name in self.modules_file.read_text().split()}

    async def gc_state(self) -> tuple[int, ...]:
        """The child's garbage collector thresholds and the count of objects it froze, read now."""
        answer = self.modules_file.with_name(self.modules_file.name + ".gc")
        answer.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR2)
        async with asyncio.timeout(30):
            while not answer.exists():
                await asyncio.sleep(0.02)
        return tuple(int(n) for n in answer.read_text().split())

    def events(self) -> list[str]:
        found = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                found.append(str(json.loads(line).get("event")))
        return found


@asynccontextmanager
async def kazma_run(tmp: Path, yaml: str) -> AsyncIterator[Running]:
    config = tmp / "kazma.yaml"
    config.write_text(f"store: {{path: '{tmp / 'state' / 'k.db'}'}}\nweb: {{port: 0}}\n{yaml}")
    log = tmp / "kazma.log"
    modules = tmp / "modules.txt"
    env = child_env({"NO_PROXY": "127.0.0.1,localhost", "KAZMA_TEST_MODULES": str(modules)})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, "-c", str(config), "--log-format", "json", "run",
        stdout=asyncio.subprocess.DEVNULL, stderr=log.open("ab"), env=env,
    )  # fmt: skip
    try:
        async with asyncio.timeout(90):
            while "web.started" not in (text := log.read_text()):
                assert process.returncode is None, text[-3000:]
                await asyncio.sleep(0.05)
        url = next(json.loads(line)["url"] for line in text.splitlines() if '"web.started"' in line)
        yield Running(url, log, modules, process)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 60)


async def _tools_list(url: str, token: str) -> httpx2.Response:
    async with httpx2.AsyncClient(trust_env=False, timeout=60) as http:
        return await http.post(
            f"{url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"},
        )


async def test_without_an_api_token_the_mcp_sdk_is_never_imported_and_mcp_still_refuses(tmp_path: Path) -> None:
    async with kazma_run(tmp_path, "") as running:
        refused = await _tools_list(running.url, REQUESTER_TOKEN)
        assert refused.status_code == 401
        loaded = await running.modules()
        assert not loaded & set(OPTIONAL), sorted(loaded & set(OPTIONAL))
        assert "mcp.endpoint_started" not in running.events()


async def test_structlog_and_httpx_extras_stay_out_even_when_installed(tmp_path: Path) -> None:
    """structlog imports Twisted, rich and greenlet, and httpx its rich/pygments command line, whenever they can be
    imported; the dev extra installs them all. `kazma run` imports none (bot/lean_imports.py): about
    20 MB of idle memory that a production install never had."""
    installed = [name for name in DEV_EXTRAS if importlib.util.find_spec(name) is not None]
    if not installed:
        pytest.skip("none of the dev extra's twisted, rich, pygments is installed here")
    async with kazma_run(tmp_path, "") as running:
        loaded = await running.modules()
    assert {"structlog", "httpx"} <= loaded  # the libraries that would pull them in were imported
    assert not loaded & set(DEV_EXTRAS), sorted(loaded & set(DEV_EXTRAS))


async def test_with_an_api_token_the_mcp_endpoint_starts_and_serves(tmp_path: Path) -> None:
    tokens = f"api: {{tokens: {{ci: {{token: '{REQUESTER_TOKEN}'}}}}}}\n"
    async with kazma_run(tmp_path, tokens) as running:
        async with asyncio.timeout(60):  # started in the background once the web server is up
            while "mcp.endpoint_started" not in running.events():
                await asyncio.sleep(0.05)
        assert "mcp" in await running.modules()
        listed = await _tools_list(running.url, REQUESTER_TOKEN)
        assert listed.status_code == 200, listed.text
        assert [tool["name"] for tool in listed.json()["result"]["tools"]] == ["request_approval"]


@asynccontextmanager
async def telegram_run(tmp_path: Path) -> AsyncIterator[Running]:
    """`kazma run` with Telegram alone (a fake), no API token: no MCP."""
    telegram = FakeTelegram()
    await telegram.start()
    try:
        yaml = (
            f"platforms:\n  telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}', "
            "chats: [-1001], home_chat: -1001, admins: [111]}\n"
        )
        async with kazma_run(tmp_path, yaml) as running:
            yield running
    finally:
        await telegram.stop()


async def test_only_the_configured_platform_s_library_is_imported(tmp_path: Path) -> None:
    async with telegram_run(tmp_path) as running:
        loaded = await running.modules()
    assert "telegram" in loaded
    assert not loaded & (set(OPTIONAL) - {"telegram"}), sorted(loaded & set(OPTIONAL))


async def test_a_started_run_holds_no_cryptography_and_collects_garbage_as_python_does(tmp_path: Path) -> None:
    """Until its first decision a started `kazma run` has signed nothing: cryptography (about 9 MB) is not
    imported, python-telegram-bot's passport support included. Once it serves, the collector's thresholds are
    Python's defaults again (its start ran with a large young generation: kazma.bot.start_gc), and what the start
    holds is frozen."""
    async with telegram_run(tmp_path) as running:
        async with asyncio.timeout(60):
            while "kazma is running" not in running.log.read_text():
                await asyncio.sleep(0.05)
        loaded = await running.modules()
        *thresholds, frozen = await running.gc_state()
    assert {"telegram", "structlog"} <= loaded
    assert "cryptography" not in loaded
    assert tuple(thresholds) == gc.get_threshold()  # this interpreter's defaults, as the child's were before it started
    # What the start made and holds is frozen: full collections of the serving process pass over it no more.
    assert frozen > 50_000, frozen
