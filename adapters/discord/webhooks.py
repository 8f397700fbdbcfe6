"""Agents posting under their own names on Discord: one webhook of the bot's per channel, found or made
once, and used only while Discord accepts it (a refusal falls back to the bot's own posts, prefixed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import discord
import structlog

from kazma.adapters.contract import PlatformError
from kazma.adapters.discord.render import NO_MENTIONS

log = structlog.get_logger("kazma.adapters.discord")

WEBHOOK_NAME: Final = "Kazma"


class AgentWebhooks:
    """The bot's webhook per channel (``None``: none may be used there); ``rest`` is the adapter's REST call."""

    def __init__(self, rest: Callable[[str, Any], Awaitable[Any]]) -> None:
        self._rest = rest
        self._webhooks: dict[int, discord.Webhook | None] = {}
        self._webhook_locks: dict[int, asyncio.Lock] = {}

    def clear(self) -> None:
        self._webhooks.clear()
        self._webhook_locks.clear()

    async def send(
        self, webhook: discord.Webhook, channel_id: int, chunks: Sequence[str], *, agent: str, thread_id: int | None
    ) -> str | None:
        """Post as ``agent`` through the channel webhook; None means "use the bot instead".

        Only a definite refusal of the first chunk falls back (e.g. a deleted
        webhook or a name Discord does not allow); after a timeout or 5xx the
        message may have been posted, so the error is raised rather than risk a
        duplicate.
        """
        first: str | None = None
        thread = discord.Object(thread_id) if thread_id is not None else discord.utils.MISSING
        for chunk in chunks:
            try:
                message = await self._rest(
                    "send",
                    lambda chunk=chunk: webhook.send(
                        chunk, username=agent, allowed_mentions=NO_MENTIONS, wait=True, thread=thread
                    ),
                )
            except PlatformError as exc:
                if first is not None or exc.retryable:
                    raise
                log.warning("discord.webhook_unavailable", channel=channel_id, error=str(exc))
                self._webhooks.pop(channel_id, None)
                return None
            first = first or str(message.id)
        log.info("discord.sent", chat=str(channel_id), agent=agent, message_id=first, via="webhook")
        return first

    async def for_channel(self, client: discord.Client | None, channel_id: int) -> discord.Webhook | None:
        """The bot's own webhook in this channel, found or created once; None when not allowed."""
        if channel_id in self._webhooks:
            return self._webhooks[channel_id]
        lock = self._webhook_locks.setdefault(channel_id, asyncio.Lock())
        async with lock:
            if channel_id in self._webhooks:
                return self._webhooks[channel_id]
            channel = client.get_channel(channel_id) if client else None
            if channel is None and client is not None:
                # No gateway cache (a replica that is not the leader): the channel over REST. Without its
                # guild's members the permission is not known; a refusal below says it instead.
                try:
                    channel = await self._rest("webhook", lambda: client.fetch_channel(channel_id))
                except PlatformError as exc:
                    if exc.retryable:
                        return None  # not cached: try again next time
            me = channel.guild.me if isinstance(channel, discord.TextChannel) else None
            hook: discord.Webhook | None = None
            if isinstance(channel, discord.TextChannel) and client and client.user:
                if me is not None and not channel.permissions_for(me).manage_webhooks:
                    self._webhooks[channel_id] = None
                    return None
                try:
                    # Reuse our webhook across restarts: a channel holds at most 15.
                    existing = await self._rest("webhook", channel.webhooks)
                    bot_id = client.user.id
                    hook = next(
                        (h for h in existing if h.token and h.user and h.user.id == bot_id and h.name == WEBHOOK_NAME),
                        None,
                    )
                    if hook is None:
                        hook = await self._rest(
                            "webhook",
                            lambda: channel.create_webhook(name=WEBHOOK_NAME, reason="Kazma agent identities"),
                        )
                except PlatformError as exc:
                    if exc.retryable:
                        return None  # not cached: try again next time
                    hook = None
            self._webhooks[channel_id] = hook
            return hook
