"""What Kazma needs from a Slack app, written once: scopes, events, commands; and ``kazma setup slack-manifest``,
which turns them into an app manifest (paste it at api.slack.com/apps → Create New App → From a manifest).
``kazma doctor`` checks a running app against the same lists. Its registry entry names the command."""

from __future__ import annotations

import json
import sys
from typing import Any, Final
from urllib.parse import urlsplit

import click
import yaml

from kazma.adapters.chat_commands import CHAT_COMMANDS
from kazma.adapters.platform_cli import ConfigSource
from kazma.config.models import KazmaConfig
from kazma.config.platforms import is_loopback

# Bot token scopes Kazma cannot work without: post and edit its messages (cards included) and private
# notices, see @-mentions, read the served public and private channels, and take /swarm and /plan.
BOT_SCOPES: Final = ("app_mentions:read", "channels:history", "chat:write", "commands", "groups:history")
# Optional: agents post under their own names; without it their messages carry an "[agent]" prefix.
# Also optional: DMs with the lead (dm_policy) need im:history; files in and out need files:read, files:write;
# cards in people's direct messages (approvals.policies.<name>.to: {dm: …}) need im:write (conversations.open).
OPTIONAL_SCOPES: Final = ("chat:write.customize", "im:history", "im:write", "files:read", "files:write")
# For `kazma doctor` only: conversations.info tells whether the app is in the home channel (public, private).
DOCTOR_SCOPES: Final = ("channels:read", "groups:read")
BOT_EVENTS: Final = ("app_home_opened", "app_mention", "message.channels", "message.groups", "message.im")


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
    for command in CHAT_COMMANDS:
        entry: dict[str, Any] = {"command": f"/{command.name}", "description": command.summary, "should_escape": False}
        if command.usage:
            entry["usage_hint"] = command.usage
        if url:
            entry["url"] = url
        commands.append(entry)
    events: dict[str, Any] = {"bot_events": list(BOT_EVENTS)}
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
        "oauth_config": {"scopes": {"bot": [*BOT_SCOPES, *OPTIONAL_SCOPES, *DOCTOR_SCOPES]}},
        "settings": {
            "event_subscriptions": events,
            "interactivity": interactivity,
            "org_deploy_enabled": False,
            "socket_mode_enabled": socket,
            "token_rotation_enabled": False,
        },
    }


@click.command("slack-manifest")
@click.option("--name", default="Kazma", show_default=True, help="The app's name in Slack.")
@click.option(
    "--socket/--http",
    "socket_mode",
    default=None,
    help="Socket Mode, or HTTP request URLs (default: Socket Mode when platforms.slack.app_token is set).",
)
@click.option("--request-url", default=None, help="HTTP mode: the public https:// URL Slack posts to.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of YAML (both are accepted by Slack).")
@click.pass_obj
def slack_manifest_command(
    obj: ConfigSource, name: str, socket_mode: bool | None, request_url: str | None, as_json: bool
) -> None:
    """Print the Slack app manifest: scopes, events, interactivity and the /swarm and /plan commands.

    Paste it at https://api.slack.com/apps → Create New App → From a manifest. The scopes, events and
    transport come from kazma.yaml; HTTP request URLs are web.public_url's origin plus
    platforms.slack.http.path, unless --request-url says otherwise.
    """
    config = obj.load().config
    manifest = slack_manifest(config, name=name, socket_mode=socket_mode, request_url=request_url)
    socket = manifest["settings"]["socket_mode_enabled"]
    if not socket:
        url = request_url or slack_request_url(config)
        if not url.startswith("https://") or is_loopback(url):
            click.echo(
                f"note: Slack only posts to a public https:// URL, and {url} is not one: set web.public_url "
                "(or pass --request-url), or use Socket Mode (--socket)",
                err=True,
            )
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    else:
        click.echo(yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True), nl=False)
    if sys.stdout.isatty():
        steps = "enable Socket Mode's app-level token (connections:write) → " if socket else ""
        click.echo(f"# then: Install to Workspace → {steps}copy the tokens into the environment kazma.yaml reads")
