"""Kazma with its web server (approvals API, /mcp) and the Telegram fake: the doors for agents Kazma does not run."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kazma.adapters.pacing import ChatRateLimiter
from kazma.adapters.telegram import TelegramAdapter
from kazma.adapters.web import WebAdapter
from kazma.bot.app import App, build_app
from kazma.bot.console.server import WebServer
from kazma.config import load_config_text
from kazma.engine.model import ScriptedProvider
from tests.child_env import child_env
from tests.fakes.telegram import FakeTelegram
from tests.mcp_support import TG_ADMIN, TG_CHAT, cards, press

REPO = Path(__file__).resolve().parent.parent
REQUESTER_TOKEN = "req-" + "r" * 40
VIEWER_TOKEN = "view-" + "v" * 40
OTHER_TOKEN = "other-" + "o" * 40
OPERATOR_TOKEN = "op-" + "p" * 40

__all__ = ["TG_CHAT", "Door", "Withheld", "cards", "first_answer_withheld", "kazma_door", "press"]


@dataclass
class Door:
    app: App
    server: WebServer
    telegram: FakeTelegram
    url: str

    def auth(self, token: str = REQUESTER_TOKEN) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def run_cli(self, *args: str, token: str = REQUESTER_TOKEN) -> asyncio.subprocess.Process:
        env = child_env({"KAZMA_API_TOKEN": token, "NO_PROXY": "127.0.0.1"})
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kazma.bot.cli", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip

    async def press(self, code: str) -> None:
        await self.telegram.wait_until(lambda: bool(cards(self.telegram)), timeout=30)
        await press(self.telegram, code)


@dataclass
class Withheld:
    """What :func:`first_answer_withheld` saw: its URL, and how many connections the client opened."""

    url: str
    connections: int = 0
    first_request_read: asyncio.Event = field(default_factory=asyncio.Event)


@asynccontextmanager
async def first_answer_withheld(
    upstream: str, *, request_too: bool = False, release: asyncio.Event | None = None
) -> AsyncIterator[Withheld]:
    """A proxy before ``upstream`` (http://host:port) that passes every request on at once and never passes back
    the answer on the first connection: a request Kazma acted on whose answer is still on its way. Later
    connections pass both ways. ``request_too``: the first connection's request is read and never passed on
    either (a POST lost on the way: Kazma never saw it). ``release``: what was withheld is passed on once it is
    set (the answer came back late), and the first connection passes both ways from then on."""
    host, _, port = upstream.removeprefix("http://").rpartition(":")
    pipes: set[asyncio.Task[None]] = set()
    seen = Withheld("")

    async def pipe(
        source: asyncio.StreamReader, sink: asyncio.StreamWriter, withheld: bool, read: asyncio.Event | None = None
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await source.read(65536):
                if read is not None:
                    read.set()
                if withheld:
                    if release is None:
                        continue  # never passed on
                    await release.wait()
                sink.write(chunk)
                await sink.drain()
        sink.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        first = seen.connections == 1
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        asked = pipe(reader, up_writer, first and request_too, seen.first_request_read if first else None)
        for task in (asked, pipe(up_reader, writer, first)):
            pipes.add(asyncio.create_task(task))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    seen.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield seen
    finally:
        server.close()
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)


@asynccontextmanager
async def kazma_door(
    tmp: Path, *, extra: str = "", approvals: str = "", ci: str = "", limiter: ChatRateLimiter | None = None
) -> AsyncIterator[Door]:
    """Kazma with its web server and the Telegram fake. ``extra``: more top-level YAML; ``approvals``: more
    ``approvals:`` keys (``", remember: {…}"``); ``ci``: more keys of the ``ci`` token (``", max_pending: 3"``);
    ``limiter``: Telegram's pacing (default: the adapter's own)."""
    telegram = FakeTelegram()
    await telegram.start()
    text = f"""
store: {{path: '{tmp / "state" / "kazma.db"}'}}
web: {{port: 0}}
approvals: {{deadline_seconds: 60, approvers: ["telegram:{TG_ADMIN}"]{approvals}}}
api:
  tokens:
    ci: {{token: '{REQUESTER_TOKEN}', roles: [approval_requester]{ci}}}
    dashboard: {{token: '{VIEWER_TOKEN}', roles: [approval_viewer]}}
    other: {{token: '{OTHER_TOKEN}'}}
{extra}
platforms:
  telegram:
    token: '{telegram.token}'
    api_base_url: '{telegram.base_url}'
    chats: [{TG_CHAT}]
    home_chat: {TG_CHAT}
    admins: [{TG_ADMIN}]
"""
    loaded = load_config_text(text, environ={})
    web = WebAdapter()
    adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1, request_timeout=2, limiter=limiter)
    app = await build_app(
        loaded,
        adapters=[adapter],
        web=web,
        provider=ScriptedProvider([]),
        poll_interval=0.05,
        workspace_root=tmp / "ws",
    )
    await app.start()
    server = WebServer(
        app.console,
        web,
        host="127.0.0.1",
        port=0,
        token_path=tmp / "state" / "web-token",
        operator_token=OPERATOR_TOKEN,
    )
    await server.start()
    try:
        yield Door(app, server, telegram, server.url)
    finally:
        await server.stop()
        await app.stop()
        await telegram.stop()
