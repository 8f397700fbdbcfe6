"""Kazma's console on 127.0.0.1 with no chat platform: the approvals API and the web door, for benches and tests
that talk to it over real HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from kazma.adapters.web import WebAdapter
from kazma.bot.app import App, build_app
from kazma.bot.console.server import WebServer
from kazma.config import load_config_text
from kazma.engine.model import ScriptedProvider

OPERATOR_TOKEN = "op-" + "p" * 40


@contextlib.asynccontextmanager
async def console_only(folder: Path, config_text: str) -> AsyncIterator[tuple[App, WebServer]]:
    """Kazma configured by ``config_text`` (a ``web:`` section with ``port: 0``), started with its web server."""
    loaded = load_config_text(config_text, environ={})
    web_adapter = WebAdapter()
    app = await build_app(
        loaded, adapters=[], web=web_adapter, provider=ScriptedProvider([]), workspace_root=folder / "ws"
    )
    await app.start()
    server = WebServer(
        app.console, web_adapter, host="127.0.0.1", port=0, token_path=folder / "web-token",
        operator_token=OPERATOR_TOKEN,
    )  # fmt: skip
    await server.start()
    try:
        yield app, server
    finally:
        await server.stop()
        await app.stop()
