"""``kazma doctor`` on Discord: ``/users/@me`` and the application's flags (the Message Content intent) accept
the token; the home channel, the server's roles and the bot's member record, with the channel's permission
overwrites applied as Discord applies them (discord.py's ``Permissions`` holds the bits), say it may post
there. Its registry entry names :func:`check`."""

from __future__ import annotations

from typing import Any

import discord
import httpx

from kazma.adapters.discord.setup import MESSAGE_CONTENT_FLAGS
from kazma.adapters.platform_cli import Check, Level, json_body, token_problems
from kazma.config.models import DiscordConfig
from kazma.config.registry.discord import SPEC


async def check(config: DiscordConfig, client: httpx.AsyncClient) -> list[Check]:
    name = "platform.discord"
    problems = token_problems(SPEC, config)
    if problems:
        return problems
    headers = {"Authorization": f"Bot {config.token}"}
    me = await client.get(f"{config.api_base_url}/users/@me", headers=headers)
    if me.status_code == 401:
        return [
            Check(
                name,
                Level.FAIL,
                "platforms.discord.token was refused by Discord (401 Unauthorized): Developer Portal → your "
                "application → Bot → Reset Token, and copy the new one",
            )
        ]
    if me.status_code >= 400:
        return [Check(name, Level.FAIL, f"/users/@me failed (HTTP {me.status_code})")]
    user = json_body(me)
    if not user.get("bot"):
        return [Check(name, Level.FAIL, "platforms.discord.token is not a bot's token: use Bot → Reset Token")]
    app = await client.get(f"{config.api_base_url}/oauth2/applications/@me", headers=headers)
    if app.status_code >= 400:
        return [Check(name, Level.FAIL, f"/oauth2/applications/@me failed (HTTP {app.status_code})")]
    application = json_body(app)
    checks = [
        Check(
            name,
            Level.OK,
            f"token accepted: {user.get('username', '?')} (application {application.get('id', '?')}; "
            "invite it with `kazma setup discord-invite`)",
        )
    ]
    if not int(application.get("flags") or 0) & MESSAGE_CONTENT_FLAGS:
        checks.append(
            Check(
                name,
                Level.FAIL,
                "the Message Content intent is off, and Discord refuses a connection that asks for it: Developer "
                "Portal → your application → Bot → Privileged Gateway Intents → Message Content Intent",
            )
        )
    home = await home_check(config, client, str(user.get("id") or ""))
    return [*checks, *([home] if home else [])]


# What Kazma does in the home channel, and why each one (as the invite screen names them).
_NEEDS = (
    ("view_channel", "View Channels", "see it"),
    ("send_messages", "Send Messages", "post cards and reports"),
    ("embed_links", "Embed Links", "cards are embeds"),
    ("read_message_history", "Read Message History", "find the card a press came from, or a crash left unrecorded"),
    ("attach_files", "Attach Files", "post files and cut calls whole"),
)


def channel_permissions(
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


async def home_check(config: DiscordConfig, client: httpx.AsyncClient, bot_id: str) -> Check | None:
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
    info = json_body(found)
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
    permissions = channel_permissions(
        guild_id=guild,
        roles=listed if isinstance(listed, list) else [],
        member_roles=[str(r) for r in json_body(member).get("roles") or []],
        member_id=bot_id,
        overwrites=list(info.get("permission_overwrites") or []),
    )
    missing = [(title, why) for flag, title, why in _NEEDS if not getattr(permissions, flag)]
    if missing:
        named = ", ".join(f"{title} ({why})" for title, why in missing)
        return Check(
            name,
            Level.FAIL,
            f"{label}: the bot lacks {named}: grant them to its role on that channel (Edit Channel → Permissions)",
        )
    return Check(name, Level.OK, f"{label}: the bot may post there, with embeds and files")
