"""A Kazma app on the Telegram fake with the tracker MCP server (tests/mcp_servers/tracker.py) as a tool source."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kazma.adapters.telegram import TelegramAdapter
from kazma.bot.app import App, build_app
from kazma.config import load_config_text
from kazma.config.models import MCPServerConfig
from kazma.engine.model import ScriptStep
from kazma.engine.scenario import PerAgentScript, agent_prompts
from kazma.engine.types import Message, ModelReply, ToolCall
from tests.fakes.telegram import FakeTelegram

TRACKER = Path(__file__).resolve().parent / "mcp_servers" / "tracker.py"
TG_CHAT = -1001
TG_ADMIN = 111


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def calls_logged(log: Path, tool: str = "create_issue") -> list[dict[str, Any]]:
    if not log.exists():
        return []
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [entry for entry in lines if entry["tool"] == tool]


def call(name: str, arguments: dict[str, Any], call_id: str = "c1") -> ModelReply:
    return ModelReply(content=None, tool_calls=(ToolCall(call_id, name, arguments, json.dumps(arguments)),))


@dataclass
class Seen:
    """What the lead's model was sent back after its tool calls."""

    tool_messages: list[str] = field(default_factory=list)

    def answer(self, messages: Sequence[Message]) -> ModelReply:
        text = next(str(m["content"]) for m in reversed(messages) if m["role"] == "tool")
        self.tool_messages.append(text)
        return ModelReply(content="lead done")


@asynccontextmanager
async def mcp_server_over_http(script: Path, *args: str) -> AsyncIterator[str]:
    """An MCP server script run over streamable HTTP in its own process (``script *args http PORT``); yields its
    URL once it answers."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), *args, "http", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            while True:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                break
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        await proc.wait()


def tracker_http(log: Path) -> AbstractAsyncContextManager[str]:
    """The tracker over streamable HTTP in its own process; yields its URL once it answers."""
    return mcp_server_over_http(TRACKER, str(log))


def tracker_log(tmp: Path) -> Path:
    """Where the tracker records its calls: a folder of its own, which a sandboxed tracker is given writable."""
    folder = tmp / "tracker"
    folder.mkdir(exist_ok=True)
    return folder / "calls.log"


def tracker_config(tmp: Path, **settings: Any) -> tuple[MCPServerConfig, Path]:
    """The tracker over stdio as a server config (sandboxed unless ``sandbox="none"``), and its log."""
    log = tracker_log(tmp)
    config = MCPServerConfig(command=sys.executable, args=[str(TRACKER), str(log)], writable=[log.parent], **settings)
    return config, log


def server_yaml(log: Path, *, url: str | None = None, call_timeout: float = 30) -> str:
    if url:
        return f"  tracker: {{url: '{url}', call_timeout_seconds: {call_timeout}}}\n"
    return (
        f"  tracker: {{command: '{sys.executable}', args: ['{TRACKER}', '{log}'], writable: ['{log.parent}'], "
        f"call_timeout_seconds: {call_timeout}}}\n"
    )


@asynccontextmanager
async def kazma_with_tracker(
    tmp: Path,
    lead_steps: list[ScriptStep],
    *,
    url: str | None = None,
    extra: str = "",
    call_timeout: float = 30,
    remember: bool = False,
) -> AsyncIterator[tuple[App, FakeTelegram, Path]]:
    log = tracker_log(tmp)
    servers = server_yaml(log, url=url, call_timeout=call_timeout) + extra
    async with kazma_with_mcp(tmp, lead_steps, servers, tools="tracker/*", remember=remember) as (app, telegram):
        yield app, telegram, log


@asynccontextmanager
async def kazma_with_mcp(
    tmp: Path, lead_steps: list[ScriptStep], servers: str, *, tools: str, remember: bool = False
) -> AsyncIterator[tuple[App, FakeTelegram]]:
    """Kazma on one Telegram group whose lead (scripted by ``lead_steps``) may use ``tools`` of the MCP servers
    that ``servers`` (``mcp_servers:`` entries, indented) configures."""
    telegram = FakeTelegram()
    await telegram.start()
    text = f"""
store: {{path: '{tmp / "state" / "kazma.db"}'}}
web: {{port: 0}}
approvals: {{deadline_seconds: 60, approvers: ["telegram:{TG_ADMIN}"], remember: {{enabled: {str(remember).lower()}}}}}
agents:
  lead: {{name: kazma, tools: ["{tools}"]}}
mcp_servers:
{servers}
platforms:
  telegram:
    token: '{telegram.token}'
    api_base_url: '{telegram.base_url}'
    chats: [{TG_CHAT}]
    home_chat: {TG_CHAT}
    admins: [{TG_ADMIN}]
"""
    loaded = load_config_text(text, environ={})
    provider = PerAgentScript({"kazma": lead_steps}, agent_prompts(loaded.config))
    adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1, request_timeout=2)
    app = await build_app(loaded, adapters=[adapter], provider=provider, poll_interval=0.05, workspace_root=tmp / "ws")
    await app.start()
    try:
        yield app, telegram
    finally:
        await app.stop()
        await telegram.stop()


def cards(telegram: FakeTelegram) -> list[str]:
    return [m.text for m in telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]


async def press(telegram: FakeTelegram, code: str) -> None:
    card = next(m for m in telegram.bot_messages(TG_CHAT) if m.buttons)
    data = next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(f":{code}"))
    query = telegram.push_callback(TG_CHAT, card.message_id, TG_ADMIN, str(data))
    await telegram.wait_for_answer(query, timeout=10)
