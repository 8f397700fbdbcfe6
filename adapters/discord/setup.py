"""What Kazma needs from a Discord application, written once: the permissions it uses and why, and ``kazma setup
discord-invite``, which turns them into an invite URL. ``kazma doctor`` checks a running app against the same
list. Its registry entry names the command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import click
import discord
import httpx

from kazma.adapters.platform_cli import ConfigSource


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
PERMISSIONS: Final = (
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
SCOPES: Final = ("bot", "applications.commands")
# Application flags saying the Message Content intent is on: GATEWAY_MESSAGE_CONTENT (verified apps, 100+
# servers) or GATEWAY_MESSAGE_CONTENT_LIMITED (the toggle on the Bot page, under 100 servers).
MESSAGE_CONTENT_FLAGS: Final = (1 << 18) | (1 << 19)


def _chosen(webhooks: bool) -> list[DiscordPermission]:
    return [p for p in PERMISSIONS if webhooks or p.flag != "manage_webhooks"]


def discord_permission_set(*, webhooks: bool = True) -> discord.Permissions:
    return discord.Permissions(**dict.fromkeys((p.flag for p in _chosen(webhooks)), True))


def discord_permissions(*, webhooks: bool = True) -> int:
    return discord_permission_set(webhooks=webhooks).value


def discord_invite_url(client_id: int | str, *, webhooks: bool = True) -> str:
    if not str(client_id).isdigit():
        raise ValueError(f"a Discord application id is a number, got {client_id!r}")
    return discord.utils.oauth_url(client_id, permissions=discord_permission_set(webhooks=webhooks), scopes=SCOPES)


def discord_permission_lines(*, webhooks: bool = True) -> list[str]:
    """The integer, explained: one line per permission with its value and why Kazma needs it."""
    chosen = _chosen(webhooks)
    width = max(len(str(p.value)) for p in chosen)
    lines = [f"permissions={discord_permissions(webhooks=webhooks)} is the sum of:"]
    lines += [f"  {p.value:>{width}}  (1 << {p.bit:<2})  {p.name}: {p.why}" for p in chosen]
    return lines


@click.command("discord-invite")
@click.option(
    "--client-id",
    default=None,
    help="The application id (default: asked from Discord with platforms.discord.token).",
)
@click.option("--no-webhooks", is_flag=True, help="Leave out Manage Webhooks (agents then post with a prefix).")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for Discord.")
@click.pass_obj
def discord_invite_command(obj: ConfigSource, client_id: str | None, no_webhooks: bool, timeout: float) -> None:
    """Print the invite URL with exactly the permissions Kazma uses, and what each one is for."""
    if client_id is None:
        client_id = _discord_application_id(obj, timeout)
    try:
        url = discord_invite_url(client_id, webhooks=not no_webhooks)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(url)
    for line in discord_permission_lines(webhooks=not no_webhooks):
        click.echo(line)


def _discord_application_id(obj: ConfigSource, timeout: float) -> str:
    loaded = obj.load()
    discord = loaded.config.platforms.discord
    if not discord.token:
        unset = [var for where, var in loaded.unset_secrets if where == "platforms.discord.token"]
        how = f"export {unset[0]}" if unset else "set platforms.discord.token"
        raise click.UsageError(
            "give --client-id (Developer Portal → your application → General Information → Application ID), "
            f"or {how} so it can be asked from Discord"
        )
    try:
        response = httpx.get(
            f"{discord.api_base_url}/oauth2/applications/@me",
            headers={"Authorization": f"Bot {discord.token}"},
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise click.ClickException(
            f"could not ask Discord for the application id ({type(exc).__name__}); give --client-id"
        ) from None
    if response.status_code != 200:
        raise click.ClickException(
            f"Discord refused the token (HTTP {response.status_code}): `kazma doctor` says why; or give --client-id"
        )
    return str(response.json().get("id", ""))
