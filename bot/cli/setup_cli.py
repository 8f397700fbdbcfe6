"""``kazma setup``: the platform settings Kazma needs, printed ready to paste."""

from __future__ import annotations

import json
import sys

import click
import httpx
import yaml

from kazma.bot.cli.context import Context
from kazma.bot.cli.platform_setup import (
    discord_invite_url,
    discord_permission_lines,
    slack_manifest,
    slack_request_url,
)
from kazma.config.platforms import is_loopback


@click.group()
def setup() -> None:
    """Platform app settings: a Slack app manifest, a Discord invite URL."""


@setup.command("slack-manifest")
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
    obj: Context, name: str, socket_mode: bool | None, request_url: str | None, as_json: bool
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


@setup.command("discord-invite")
@click.option(
    "--client-id",
    default=None,
    help="The application id (default: asked from Discord with platforms.discord.token).",
)
@click.option("--no-webhooks", is_flag=True, help="Leave out Manage Webhooks (agents then post with a prefix).")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for Discord.")
@click.pass_obj
def discord_invite_command(obj: Context, client_id: str | None, no_webhooks: bool, timeout: float) -> None:
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


def _discord_application_id(obj: Context, timeout: float) -> str:
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
