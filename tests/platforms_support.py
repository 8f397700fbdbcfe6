"""Three wire-level fakes, the three real adapters, and one Kazma app between them."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import discord

from kazma.adapters.contract import PlatformAdapter
from kazma.adapters.discord import DiscordAdapter
from kazma.adapters.slack import SlackAdapter
from kazma.adapters.telegram import TelegramAdapter
from kazma.approvals.model import Decision
from kazma.bot.app import App, build_app
from kazma.config import LoadedConfig, load_config_text
from tests.fakes.discord import ALICE_ID, HOME_CHANNEL_ID, FakeDiscord, FakeUser
from tests.fakes.slack import FAKE_BOT_TOKEN, FAKE_SIGNING_SECRET, FakeSlack
from tests.fakes.telegram import FakeTelegram

TG_CHAT = -1001
TG_ADMIN = 111
SLACK_CHANNEL = "C0HOME0001"
SLACK_ADMIN = "U0ADMIN01"
DISCORD_ADMIN = ALICE_ID
PLATFORMS = ("telegram", "slack", "discord")


@dataclass
class Fakes:
    telegram: FakeTelegram
    slack: FakeSlack
    discord: FakeDiscord

    def config_yaml(self, store: Path, *, deadline: int = 600, approvals: str = "", extra: str = "") -> str:
        """``approvals``: more keys of ``approvals:`` (``", policies: {…}"``); ``extra``: more top-level YAML."""
        return f"""
store: {{path: '{store}'}}
web: {{port: 0}}
approvals: {{deadline_seconds: {deadline}{approvals}}}
{extra}
platforms:
  telegram:
    token: '{self.telegram.token}'
    api_base_url: '{self.telegram.base_url}'
    chats: [{TG_CHAT}]
    home_chat: {TG_CHAT}
    admins: [{TG_ADMIN}]
  slack:
    bot_token: '{FAKE_BOT_TOKEN}'
    signing_secret: '{FAKE_SIGNING_SECRET}'
    api_base_url: '{self.slack.api_url}'
    http: {{port: 0}}
    channels: [{SLACK_CHANNEL}]
    home_channel: {SLACK_CHANNEL}
    admins: [{SLACK_ADMIN}]
  discord:
    token: '{self.discord.token}'
    api_base_url: '{self.discord.api_base}'
    gateway_url: '{self.discord.gateway_url}'
    channels: [{HOME_CHANNEL_ID}]
    home_channel: {HOME_CHANNEL_ID}
    admins: [{DISCORD_ADMIN}]
"""

    # -- reading cards ---------------------------------------------------------------------------

    def card_text(self, platform: str) -> str:
        """Everything visible on the (single) card of that platform, or '' when none is posted."""
        if platform == "telegram":
            cards = [m for m in self.telegram.bot_messages(TG_CHAT) if "Approval needed" in m.text]
            return cards[-1].text if cards else ""
        if platform == "slack":
            found = [" ".join(m.texts()) for m in self.slack.channel(SLACK_CHANNEL) if m.blocks]
            return found[-1] if found else ""
        messages = [m for m in self.discord.channel_messages(HOME_CHANNEL_ID) if m.get("embeds")]
        if not messages:
            return ""
        return _discord_text(messages[-1])

    def has_buttons(self, platform: str) -> bool:
        if platform == "telegram":
            return any(m.buttons for m in self.telegram.bot_messages(TG_CHAT))
        if platform == "slack":
            return any(m.block("kazma_actions") for m in self.slack.channel(SLACK_CHANNEL))
        return any(m.get("components") for m in self.discord.channel_messages(HOME_CHANNEL_ID))

    def posted(self, platform: str) -> bool:
        return bool(self.card_text(platform))

    async def wait(self, predicate: Any, timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)

    # -- pressing --------------------------------------------------------------------------------

    async def press(self, platform: str, decision: Decision, *, user: str | int | None = None) -> str:
        """Press a card button as ``user`` (default: that platform's admin); return the button data."""
        code = decision.code
        if platform == "telegram":
            card = next(m for m in self.telegram.bot_messages(TG_CHAT) if m.buttons)
            data = str(next(b["callback_data"] for b in card.buttons if str(b["callback_data"]).endswith(f":{code}")))
            self.last_query = self.telegram.push_callback(TG_CHAT, card.message_id, int(user or TG_ADMIN), data)
            return data
        if platform == "slack":
            msg = next(m for m in self.slack.channel(SLACK_CHANNEL) if m.block("kazma_actions"))
            block = msg.block("kazma_actions")
            assert block is not None
            action = "kazma_approve" if decision is Decision.APPROVE else "kazma_deny"
            value = str(next(e["value"] for e in block["elements"] if e["action_id"] == action))
            assert self.slack_events_url is not None
            await self.slack.post_block_action(
                self.slack_events_url,
                action_id=action,
                value=value,
                user=str(user or SLACK_ADMIN),
                channel=SLACK_CHANNEL,
                message_ts=msg.ts,
            )
            return value
        message = next(m for m in self.discord.channel_messages(HOME_CHANNEL_ID) if m.get("components"))
        custom = next(
            c["custom_id"]
            for row in message["components"]
            for c in row["components"]
            if str(c["custom_id"]).endswith(f":{code}")
        )
        presser = self.discord.alice if user is None else FakeUser(int(user), f"user{user}")
        await self.discord.press_button(int(message["id"]), str(custom), user=presser)
        return str(custom)

    slack_events_url: str | None = None
    last_query: str = ""


def _discord_text(message: dict[str, Any]) -> str:
    parts = [str(message.get("content") or "")]
    for embed in message.get("embeds", []):
        parts += [str(embed.get("title", "")), str(embed.get("description", ""))]
        parts += [f"{f.get('name', '')} {f.get('value', '')}" for f in embed.get("fields", [])]
        footer = embed.get("footer") or {}
        parts.append(str(footer.get("text", "")))
    # what a person sees: markdown escapes are not shown
    return re.sub(r"\\([*_`~|>\\])", r"\1", " ".join(parts))


@asynccontextmanager
async def three_fakes() -> AsyncIterator[Fakes]:
    telegram, slack, fake_discord = FakeTelegram(), FakeSlack(), FakeDiscord()
    saved = (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
    await asyncio.gather(telegram.start(), slack.start(), fake_discord.start())
    try:
        yield Fakes(telegram, slack, fake_discord)
    finally:
        await asyncio.gather(telegram.stop(), slack.stop(), fake_discord.stop(), return_exceptions=True)
        discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = saved


def adapters_for(loaded: LoadedConfig, *, request_timeout: float = 2.0) -> list[PlatformAdapter]:
    p = loaded.config.platforms
    return [
        TelegramAdapter(p.telegram, poll_timeout=1, request_timeout=request_timeout),
        SlackAdapter(p.slack, request_timeout=max(1, int(request_timeout))),
        DiscordAdapter(p.discord, guild_ready_timeout=0.05, request_timeout=request_timeout),
    ]


@asynccontextmanager
async def kazma_on(
    fakes: Fakes,
    store: Path,
    *,
    request_timeout: float = 2.0,
    approvals: str = "",
    extra: str = "",
    edit: Callable[[str], str] | None = None,
) -> AsyncIterator[App]:
    """``edit``: changes the configuration's YAML text (a key inside a platform's, or web's, mapping)."""
    text = fakes.config_yaml(store, approvals=approvals, extra=extra)
    loaded = load_config_text(text if edit is None else edit(text), environ={})
    adapters = adapters_for(loaded, request_timeout=request_timeout)
    app = await build_app(loaded, adapters=adapters, poll_interval=0.05, workspace_root=store.parent / "ws")
    await app.start()
    slack = next(a for a in adapters if isinstance(a, SlackAdapter))
    fakes.slack_events_url = slack.events_url
    try:
        yield app
    finally:
        await app.stop()
