"""Askers that go away: `kazma run` (a real process) with the API and /mcp, the three platform fakes, and the
askers themselves — a real MCP SDK client (in a process of its own, to be killed), `kazma mcp serve`,
`kazma approvals request --wait`.

The expected card text is written out here, not imported: these tests read the wire as a person would.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.audit_support import AUDIT_KEY
from tests.child_env import child_env
from tests.contract.harness import free_port
from tests.platforms_support import PLATFORMS, TG_ADMIN, TG_CHAT, Fakes
from tests.process_support import REPO

REQUESTER_TOKEN = "req-" + "w" * 40
API_YAML = f"""
api:
  tokens:
    ci: {{token: '{REQUESTER_TOKEN}', roles: [approval_requester]}}
"""
ASK: dict[str, Any] = {"tool": "deploy", "arguments": {"env": "prod", "version": 14}, "reason": "release"}

# A real MCP SDK client over streamable HTTP that asks and waits for ever: the test kills it mid-wait.
MCP_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def main(url, token, ask):
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=None, trust_env=False) as http,
            streamable_http_client(url, http_client=http) as streams,
            ClientSession(streams[0], streams[1]) as session,
        ):
            await session.initialize()
            print("asking", flush=True)
            print(await session.call_tool("request_approval", json.loads(ask)), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    """
)


def env() -> dict[str, str]:
    return child_env(
        {
            "NO_PROXY": "127.0.0.1,localhost",
            "KAZMA_API_TOKEN": REQUESTER_TOKEN,
        }
    )


class KazmaRun:
    """`kazma run` on a SQLite file (or, with ``store_url``, as one replica on PostgreSQL), serving the API."""

    def __init__(self, fakes: Fakes, folder: Path, name: str = "kazma", *, store_url: str | None = None) -> None:
        self.name = name
        self.web_port, self.slack_port = free_port(), free_port()
        self.config = folder / f"{name}.yaml"
        self.log = folder / f"{name}.log"
        self.store = folder / "k.db"  # on SQLite
        text = fakes.config_yaml(self.store)
        if store_url is not None:
            text = text.replace(f"store: {{path: '{self.store}'}}", f"store: {{url: '{store_url}'}}")
            assert store_url in text
        text = text.replace("web: {port: 0}", f"web: {{port: {self.web_port}, public_url: '{self.url}'}}")
        text = text.replace("http: {port: 0}", f"http: {{port: {self.slack_port}}}")
        self.config.write_text(text + API_YAML)
        self.replica_env: dict[str, str] = {}
        if store_url is not None:  # replicas share the console's tokens and the decision keys
            self.replica_env = {
                "KAZMA_REPLICA": name,
                "KAZMA_WEB_TOKEN": "o" * 40,
                "KAZMA_WEB_READER_TOKEN": "r" * 40,
                "KAZMA_DECISION_KEY": "k1:" + "d" * 40,
                "KAZMA_AUDIT_KEY": AUDIT_KEY,
            }
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", "-c", str(self.config), "--log-format", "json", "run",
            "--poll-interval", "2", "--no-pacing",
            stdout=asyncio.subprocess.DEVNULL, stderr=self.log.open("ab"), cwd=self.config.parent,
            env={**env(), **self.replica_env},
        )  # fmt: skip
        await until(self.serving, 60, f"{self.name} serving", self)

    async def serving(self) -> bool:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            try:
                return (await client.get(f"{self.url}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

    async def health(self) -> str:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            try:
                return (await client.get(f"{self.url}/healthz")).text
            except httpx.HTTPError:
                return ""

    async def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.process is None or self.process.returncode is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(sig)
        return await asyncio.wait_for(self.process.wait(), timeout=60)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


async def until(predicate: Any, timeout: float, what: str, *runs: KazmaRun) -> None:
    """Wait for ``predicate()`` (sync or async) to hold, at most ``timeout`` seconds; say what, with the logs."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {r.name}\n{r.tail()}" for r in runs)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        await asyncio.sleep(0.05)


async def mcp_client(url: str) -> asyncio.subprocess.Process:
    """The SDK client in its own process, asking ``ASK`` through ``url``/mcp and waiting."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", MCP_CLIENT, f"{url}/mcp", REQUESTER_TOKEN, json.dumps(ASK),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env(), cwd=REPO,
    )  # fmt: skip


async def cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kazma.bot.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env(), cwd=REPO,
    )  # fmt: skip


@dataclass(frozen=True)
class StaleButton:
    """An Approve button as a person's client still shows it after the card changed."""

    message_id: int
    data: str


def live_cards(fakes: Fakes) -> bool:
    return all(fakes.has_buttons(p) for p in PLATFORMS)


def stale_approve(fakes: Fakes) -> StaleButton:
    card = next(m for m in fakes.telegram.bot_messages(TG_CHAT) if m.buttons)
    data = next(str(b["callback_data"]) for b in card.buttons if str(b["callback_data"]).endswith(":a"))
    return StaleButton(card.message_id, data)


def withdrawn_everywhere(fakes: Fakes, why: str) -> bool:
    """Every platform's card lost its buttons and says it was withdrawn, and why, and that it is no denial."""
    if any(fakes.has_buttons(p) for p in PLATFORMS):
        return False
    texts = [" ".join(fakes.card_text(p).split()) for p in PLATFORMS]
    return all(f"withdrawn: {why}" in t and "not a denial" in t and "CANCELLED" in t for t in texts)


async def press_changes_nothing(fakes: Fakes, button: StaleButton) -> str:
    """Press the stale Approve; return what the presser was told (the caller checks the store too)."""
    query = fakes.telegram.push_callback(TG_CHAT, button.message_id, TG_ADMIN, button.data)
    answer = await fakes.telegram.wait_for_answer(query, timeout=30)
    assert not any(fakes.has_buttons(p) for p in PLATFORMS)
    return str(answer.get("text", ""))
