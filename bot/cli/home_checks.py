"""``kazma doctor``: does the home chat exist, is the bot in it, and may it post there (and, on Discord, attach files)?

Approval cards, reports and alerts go to the home chat; a token that works says nothing about it. Each check
is one line naming the fix. Asked with the bot's own token: Telegram ``getChat`` and ``getChatMember``; Slack
``conversations.info`` (its ``is_member``); Discord the channel, the server's roles and the bot's member
record, with the channel's permission overwrites applied as Discord applies them (discord.py's
``Permissions`` holds the bits).
"""

from __future__ import annotations

from typing import Any

import discord
import httpx

from kazma.bot.cli.checks import Check, Level
from kazma.bot.logging import redact
from kazma.config.models import DiscordConfig, SlackConfig, TelegramConfig

_TELEGRAM_IN = ("creator", "administrator", "member", "restricted")


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def telegram_home(config: TelegramConfig, client: httpx.AsyncClient, bot_id: int) -> Check | None:
    name = "platform.telegram"
    chat = config.home_chat
    if chat is None:
        return None  # platform_status already warns that it is not set
    base = f"{config.api_base_url}/bot{config.token}"
    found = await client.post(f"{base}/getChat", data={"chat_id": str(chat)})
    body = _json(found)
    if not body.get("ok"):
        said = redact(str(body.get("description") or f"HTTP {found.status_code}"))
        return Check(
            name,
            Level.FAIL,
            f"home_chat {chat}: Telegram says {said!r}: add the bot to that group (or fix the id: the "
            "platform.inbound_ignored log event shows the ids of chats it is in)",
        )
    info = body.get("result") or {}
    title = str(info.get("title") or info.get("username") or chat)
    asked = await client.post(f"{base}/getChatMember", data={"chat_id": str(chat), "user_id": str(bot_id)})
    member = _json(asked).get("result") or {}
    status = str(member.get("status") or "unknown")
    if status not in _TELEGRAM_IN:
        return Check(name, Level.FAIL, f"home_chat {chat} ({title}): the bot is not in it ({status}): add it again")
    if info.get("type") == "channel" and not (status == "creator" or member.get("can_post_messages")):
        return Check(
            name, Level.FAIL, f"home_chat {chat} ({title}) is a channel: make the bot an admin who may post messages"
        )
    if status == "restricted" and not member.get("can_send_messages"):
        return Check(name, Level.FAIL, f"home_chat {chat} ({title}): the bot may not send messages there")
    return Check(name, Level.OK, f"home_chat {chat} ({title}): the bot is in it ({status}) and may post")


async def slack_home(config: SlackConfig, client: httpx.AsyncClient) -> Check | None:
    name = "platform.slack"
    channel = config.home_channel
    if not channel:
        return None
    response = await client.post(
        f"{config.api_base_url}conversations.info",
        headers={"Authorization": f"Bearer {config.bot_token}"},
        data={"channel": channel},
    )
    body = _json(response)
    if not body.get("ok"):
        error = str(body.get("error") or f"HTTP {response.status_code}")
        if error == "missing_scope":
            return Check(
                name,
                Level.WARN,
                f"home_channel {channel}: not checked: the bot token lacks channels:read and groups:read (add them, "
                "or create the app from `kazma setup slack-manifest`)",
            )
        if error == "channel_not_found":
            return Check(
                name,
                Level.FAIL,
                f"home_channel {channel}: Slack knows no such channel the app can see: check the id (the channel's "
                "name → About), and for a private channel /invite the app there",
            )
        return Check(name, Level.FAIL, f"home_channel {channel}: conversations.info failed ({error})")
    info = body.get("channel") or {}
    label = f"home_channel {channel} (#{info.get('name', '?')})"
    if info.get("is_archived"):
        return Check(name, Level.FAIL, f"{label} is archived: nothing can be posted there")
    if not info.get("is_member"):
        return Check(name, Level.FAIL, f"{label}: the app is not in it: /invite the app in that channel")
    return Check(name, Level.OK, f"{label}: the app is in it and may post")


# What Kazma does in the home channel, and why each one (as the invite screen names them).
_DISCORD_NEEDS = (
    ("view_channel", "View Channels", "see it"),
    ("send_messages", "Send Messages", "post cards and reports"),
    ("embed_links", "Embed Links", "cards are embeds"),
    ("read_message_history", "Read Message History", "find the card a press came from"),
    ("attach_files", "Attach Files", "post files and cut calls whole"),
)


def discord_channel_permissions(
    *, guild_id: str, roles: list[dict[str, Any]], member_roles: list[str], member_id: str, overwrites: list[Any]
) -> discord.Permissions:
    """The member's permissions in the channel, computed as Discord documents: the @everyone role and the
    member's roles, then the channel's overwrites for @everyone, for their roles together, then for them."""
    by_id = {str(role.get("id")): int(role.get("permissions") or 0) for role in roles}
    value = by_id.get(guild_id, 0)
    for role in member_roles:
        value |= by_id.get(str(role), 0)
    permissions = discord.Permissions(value)
    if permissions.administrator:
        return discord.Permissions.all()

    def apply(allow: int, deny: int) -> None:
        permissions.value = (permissions.value & ~deny) | allow

    listed = [o for o in overwrites if isinstance(o, dict)]
    for overwrite in listed:
        if str(overwrite.get("id")) == guild_id:
            apply(int(overwrite.get("allow") or 0), int(overwrite.get("deny") or 0))
    allow = deny = 0
    for overwrite in listed:
        if int(overwrite.get("type") or 0) == 0 and str(overwrite.get("id")) in {str(r) for r in member_roles}:
            allow |= int(overwrite.get("allow") or 0)
            deny |= int(overwrite.get("deny") or 0)
    apply(allow, deny)
    for overwrite in listed:
        if int(overwrite.get("type") or 0) == 1 and str(overwrite.get("id")) == member_id:
            apply(int(overwrite.get("allow") or 0), int(overwrite.get("deny") or 0))
    return permissions


async def discord_home(config: DiscordConfig, client: httpx.AsyncClient, bot_id: str) -> Check | None:
    name = "platform.discord"
    channel = config.home_channel
    if channel is None:
        return None
    headers = {"Authorization": f"Bot {config.token}"}
    api = config.api_base_url
    found = await client.get(f"{api}/channels/{channel}", headers=headers)
    if found.status_code == 404:
        return Check(
            name,
            Level.FAIL,
            f"home_channel {channel}: Discord knows no such channel (Developer Mode → Copy Channel ID)",
        )
    if found.status_code == 403:
        return Check(
            name,
            Level.FAIL,
            f"home_channel {channel}: the bot cannot see it: invite it to that server with `kazma setup "
            "discord-invite`, or let its role view the channel",
        )
    if found.status_code >= 400:
        return Check(name, Level.FAIL, f"home_channel {channel}: HTTP {found.status_code}")
    info = _json(found)
    label = f"home_channel {channel} (#{info.get('name', '?')})"
    guild = str(info.get("guild_id") or "")
    if not guild:
        return Check(name, Level.FAIL, f"{label} is not a server channel")
    roles = await client.get(f"{api}/guilds/{guild}/roles", headers=headers)
    member = await client.get(f"{api}/guilds/{guild}/members/{bot_id}", headers=headers)
    if roles.status_code >= 400 or member.status_code >= 400:
        status = roles.status_code if roles.status_code >= 400 else member.status_code
        return Check(name, Level.FAIL, f"{label}: the bot is not in that server (HTTP {status}): invite it")
    listed = roles.json()
    permissions = discord_channel_permissions(
        guild_id=guild,
        roles=listed if isinstance(listed, list) else [],
        member_roles=[str(r) for r in _json(member).get("roles") or []],
        member_id=bot_id,
        overwrites=list(info.get("permission_overwrites") or []),
    )
    missing = [(title, why) for flag, title, why in _DISCORD_NEEDS if not getattr(permissions, flag)]
    if missing:
        named = ", ".join(f"{title} ({why})" for title, why in missing)
        return Check(
            name,
            Level.FAIL,
            f"{label}: the bot lacks {named}: grant them to its role on that channel (Edit Channel → Permissions)",
        )
    return Check(name, Level.OK, f"{label}: the bot may post there, with embeds and files")
