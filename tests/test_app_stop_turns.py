"""A clean stop while a conversation's turn runs: the turn (and its working sign) ends within the stop, before the
store closes, and what was cut is said. The turn went on until the event loop closed, after the store: a Telegram
message pushed to wake the long poll left ``inbound-telegram-…`` and ``working-telegram-…`` running past
``app.stop()``, writing to a closed store or dying as "Task was destroyed but it is pending"."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from kazma.adapters.telegram import TelegramAdapter
from kazma.bot.app import build_app
from kazma.config import load_config_text
from kazma.config.metrics import failure_count
from kazma.engine.types import Message, ModelReply, ToolSpec
from tests.fakes.telegram import FakeTelegram

CHAT = -1001
ADMIN = 111


class HeldModel:
    """A model that never answers: the turn waits in it until it is cancelled."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.cancelled = False

    @property
    def label(self) -> str:
        return "scripted: held"

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *, model: str | None = None
    ) -> ModelReply:
        self.asked.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


async def test_a_stop_ends_the_turn_in_flight_before_it_returns(tmp_path: Path) -> None:
    telegram = FakeTelegram()
    await telegram.start()
    try:
        loaded = load_config_text(
            f"""
store: {{path: '{tmp_path / "state" / "kazma.db"}'}}
platforms:
  telegram:
    token: '{telegram.token}'
    api_base_url: '{telegram.base_url}'
    chats: [{CHAT}]
    home_chat: {CHAT}
    admins: [{ADMIN}]
""",
            environ={},
        )
        model = HeldModel()
        adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1, request_timeout=2.0)
        before = asyncio.all_tasks()
        app = await build_app(loaded, provider=model, adapters=[adapter], workspace_root=tmp_path / "ws")
        app.turn_grace = 0.0  # the held turn never finishes: cut at once
        cut_before = failure_count("turn_cut_at_stop")
        await app.start()
        try:
            telegram.push_message(CHAT, ADMIN, "hello kazma", username="ops")
            async with asyncio.timeout(20):
                await model.asked.wait()
            running = {t.get_name() for t in asyncio.all_tasks()}
            assert any(name.startswith("inbound-telegram-") for name in running), running
        finally:
            await app.stop()
        left = {t.get_name() for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
        assert not {n for n in left if n.startswith(("inbound-", "working-", "plan-retry-"))}, left
        assert model.cancelled
        assert failure_count("turn_cut_at_stop") == cut_before + 1
    finally:
        await telegram.stop()
