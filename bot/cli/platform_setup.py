"""What Kazma needs from each platform's app settings, written once: scopes, events, commands, permissions.

``kazma setup slack-manifest`` turns the Slack half into an app manifest (paste
it at api.slack.com/apps → Create New App → From a manifest), ``kazma setup
discord-invite`` the Discord half into an invite URL, and ``kazma doctor``
checks a running app against the same lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import discord

from kazma.config.models import KazmaConfig

# -- Slack ---------------------------------------------------------------------------------------

# Bot token scopes Kazma cannot work without: post and edit its messages (cards included) and private
# notices, see @-mentions, read the served public and private channels, and take /swarm and /plan.
SLACK_BOT_SCOPES: Final = ("app_mentions:read", "channels:history", "chat:write", "commands", "groups:history")
# Optional: agents post under their own names; without it their messages carry an "[agent]" prefix.
# Also optional: DMs with the lead (dm_policy) need im:history; files in and out need files:read, files:write.
SLACK_OPTIONAL_SCOPES: Final = ("chat:write.customize", "im:history", "files:read", "files:write")
# For `kazma doctor` only: conversations.info tells whether the app is in the home channel (public, private).
SLACK_DOCTOR_SCOPES: Final = ("channels:read", "groups:read")
SLACK_BOT_EVENTS: Final = ("app_home_opened", "app_mention", "message.channels", "message.groups", "message.im")
SLACK_COMMANDS: Final = (
    ("/swarm", "Drive the agent swarm", "help | status | pipeline quick <task>"),
    ("/plan", "Show this channel's current plan", ""),
)


def slack_request_url(config: KazmaConfig) -> str:
    """Where Slack posts events, presses and commands in HTTP mode: the public origin plus ``http.path``.

    Behind a TLS reverse proxy the public origin is the console's (``web.public_url``), with the
    Slack path routed to ``http.host:http.port``.
    """
    public = urlsplit(config.web.public_url)
    return f"{public.scheme}://{public.netloc}{config.platforms.slack.http.path}"


def slack_manifest(
    config: KazmaConfig, *, name: str = "Kazma", socket_mode: bool | None = None, request_url: str | None = None
) -> dict[str, Any]:
    """The Slack app manifest for this configuration: Socket Mode when ``app_token`` is set, HTTP otherwise."""
    socket = bool(config.platforms.slack.app_token) if socket_mode is None else socket_mode
    url = None if socket else (request_url or slack_request_url(config))
    commands: list[dict[str, Any]] = []
    for command, description, usage in SLACK_COMMANDS:
        entry: dict[str, Any] = {"command": command, "description": description, "should_escape": False}
        if usage:
            entry["usage_hint"] = usage
        if url:
            entry["url"] = url
        commands.append(entry)
    events: dict[str, Any] = {"bot_events": list(SLACK_BOT_EVENTS)}
    interactivity: dict[str, Any] = {"is_enabled": True}
    if url:
        events = {"request_url": url, **events}
        interactivity["request_url"] = url
    return {
        "_metadata": {"major_version": 1, "minor_version": 1},
        "display_information": {
            "name": name,
            "description": "An AI agent team's bus: plans, sub-agents and approvals in this workspace",
        },
        "features": {
            "bot_user": {"display_name": name.lower(), "always_online": True},
            # the Home tab lists what waits for a decision; the Messages tab is where people DM the app
            # (dm_policy), and Slack lets nobody write there unless it is on and writable
            "app_home": {
                "home_tab_enabled": True,
                "messages_tab_enabled": True,
                "messages_tab_read_only_enabled": False,
            },
            "slash_commands": commands,
        },
        "oauth_config": {"scopes": {"bot": [*SLACK_BOT_SCOPES, *SLACK_OPTIONAL_SCOPES, *SLACK_DOCTOR_SCOPES]}},
        "settings": {
            "event_subscriptions": events,
            "interactivity": interactivity,
            "org_deploy_enabled": False,
            "socket_mode_enabled": socket,
            "token_rotation_enabled": False,
        },
    }


# -- Discord -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiscordPermission:
    name: str  # as the Developer Portal and the invite screen say it
    flag: str  # discord.py's name for it (a ``discord.Permissions`` attribute), which holds the bit
    why: str

    @property
    def value(self) -> int:
        value: int = getattr(discord.Permissions, self.flag).flag
        return value

    @property
    def bit(self) -> int:
        return self.value.bit_length() - 1


# Exactly what the adapter does in a served channel.
DISCORD_PERMISSIONS: Final = (
    DiscordPermission("View Channels", "view_channel", "see the served channels"),
    DiscordPermission("Send Messages", "send_messages", "post replies, dispatches and approval cards"),
    DiscordPermission("Embed Links", "embed_links", "approval cards are embeds"),
    DiscordPermission("Attach Files", "attach_files", "post files: an agent's output, a call too long for its card"),
    DiscordPermission(
        "Read Message History", "read_message_history", "reply to a message and find the card a press came from"
    ),
    DiscordPermission(
        "Manage Webhooks", "manage_webhooks", "agents post under their own names (optional: else an [agent] prefix)"
    ),
    DiscordPermission("Use Application Commands", "use_application_commands", "/swarm and /plan"),
    DiscordPermission(
        "Send Messages in Threads", "send_messages_in_threads", "answer in the thread a conversation started in"
    ),
)
DISCORD_SCOPES: Final = ("bot", "applications.commands")
# Application flags saying the Message Content intent is on: GATEWAY_MESSAGE_CONTENT (verified apps, 100+
# servers) or GATEWAY_MESSAGE_CONTENT_LIMITED (the toggle on the Bot page, under 100 servers).
DISCORD_MESSAGE_CONTENT_FLAGS: Final = (1 << 18) | (1 << 19)


def _chosen(webhooks: bool) -> list[DiscordPermission]:
    return [p for p in DISCORD_PERMISSIONS if webhooks or p.flag != "manage_webhooks"]


def discord_permission_set(*, webhooks: bool = True) -> discord.Permissions:
    return discord.Permissions(**dict.fromkeys((p.flag for p in _chosen(webhooks)), True))


def discord_permissions(*, webhooks: bool = True) -> int:
    return discord_permission_set(webhooks=webhooks).value


def discord_invite_url(client_id: int | str, *, webhooks: bool = True) -> str:
    if not str(client_id).isdigit():
        raise ValueError(f"a Discord application id is a number, got {client_id!r}")
    return discord.utils.oauth_url(
        client_id, permissions=discord_permission_set(webhooks=webhooks), scopes=DISCORD_SCOPES
    )


def discord_permission_lines(*, webhooks: bool = True) -> list[str]:
    """The integer, explained: one line per permission with its value and why Kazma needs it."""
    chosen = _chosen(webhooks)
    width = max(len(str(p.value)) for p in chosen)
    lines = [f"permissions={discord_permissions(webhooks=webhooks)} is the sum of:"]
    lines += [f"  {p.value:>{width}}  (1 << {p.bit:<2})  {p.name}: {p.why}" for p in chosen]
    return lines
