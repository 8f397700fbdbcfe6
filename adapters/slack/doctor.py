"""``kazma doctor`` on Slack: ``auth.test`` with the scopes the token was granted (Slack lists them in the
``x-oauth-scopes`` response header), in Socket Mode the app-level token, and ``conversations.info`` (its
``is_member``) for the home channel. Its registry entry names :func:`check`."""

from __future__ import annotations

from typing import Final

import httpx

from kazma.adapters.platform_cli import Check, Level, json_body, token_problems
from kazma.adapters.slack.errors import RETRYABLE_CODES
from kazma.adapters.slack.setup import BOT_SCOPES, OPTIONAL_SCOPES
from kazma.config.models import SlackConfig
from kazma.config.registry.slack import SPEC

SCOPES_HEADER: Final = "x-oauth-scopes"
# Slack errors that mean "this token is no good", as opposed to a server or network problem.
_REFUSALS: Final = frozenset(
    {"invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired", "not_allowed_token_type"}
)


def _slack_side(method: str, response: httpx.Response, error: str) -> str | None:
    """What to say when Slack itself failed to answer ``method`` (a 5xx, ``internal_error``, a rate limit): not a
    fault of the configuration, so no hint about a token or a setting (that sent people to fix what was right)."""
    if response.status_code < 500 and response.status_code != 429 and error not in RETRYABLE_CODES:
        return None
    return (
        f"{method} failed ({error}): Slack could not answer just now, which says nothing about the configuration; "
        "run `kazma doctor` again in a minute"
    )


async def check(config: SlackConfig, client: httpx.AsyncClient) -> list[Check]:
    name = "platform.slack"
    problems = token_problems(SPEC, config)
    if problems:
        return problems
    response = await client.post(
        f"{config.api_base_url}auth.test", headers={"Authorization": f"Bearer {config.bot_token}"}
    )
    body = json_body(response)
    if not body.get("ok"):
        error = str(body.get("error") or f"HTTP {response.status_code}")
        if (outage := _slack_side("auth.test", response, error)) is not None:
            return [Check(name, Level.FAIL, outage)]
        if error in _REFUSALS:
            fix = (
                "reinstall the app to the workspace and copy the Bot User OAuth Token (xoxb-) from OAuth & Permissions"
            )
            return [Check(name, Level.FAIL, f"platforms.slack.bot_token was refused by Slack ({error}): {fix}")]
        return [Check(name, Level.FAIL, f"auth.test failed ({error})")]
    if not body.get("bot_id"):
        return [
            Check(
                name,
                Level.FAIL,
                "platforms.slack.bot_token belongs to a person, not to the app's bot (auth.test names no bot): use "
                "the Bot User OAuth Token (xoxb-) from OAuth & Permissions",
            )
        ]
    checks = [_scopes(response)]
    if config.app_token:
        checks.append(await _app_token(config, client))
    who = f"{body.get('user', '?')} in {body.get('team', '?')}"
    checks.insert(0, Check(name, Level.OK, f"token accepted: {who}"))
    home = await home_check(config, client)
    return [*checks, *([home] if home else [])]


def _scopes(response: httpx.Response) -> Check:
    name = "platform.slack"
    header = response.headers.get(SCOPES_HEADER)
    if header is None:
        return Check(
            name,
            Level.WARN,
            f"Slack did not list the token's scopes (no {SCOPES_HEADER} header): compare OAuth & Permissions with "
            f"{', '.join(BOT_SCOPES)}",
        )
    granted = {scope.strip() for scope in header.split(",") if scope.strip()}
    missing = [scope for scope in BOT_SCOPES if scope not in granted]
    if missing:
        return Check(
            name,
            Level.FAIL,
            f"the bot token lacks the scope{'s' if len(missing) > 1 else ''} {', '.join(missing)}: add "
            f"{'them' if len(missing) > 1 else 'it'} under OAuth & Permissions → Bot Token Scopes (or create the "
            "app from `kazma setup slack-manifest`) and reinstall the app",
        )
    optional = [scope for scope in OPTIONAL_SCOPES if scope not in granted]
    note = f"; without {', '.join(optional)} agents post with an [agent] prefix" if optional else ""
    return Check(name, Level.OK, f"scopes granted: every one Kazma needs{note}")


async def _app_token(config: SlackConfig, client: httpx.AsyncClient) -> Check:
    """Socket Mode: the app-level token opens a connection URL (unused; Slack lets it expire)."""
    name = "platform.slack"
    response = await client.post(
        f"{config.api_base_url}apps.connections.open", headers={"Authorization": f"Bearer {config.app_token}"}
    )
    body = json_body(response)
    if body.get("ok"):
        return Check(name, Level.OK, "app token accepted: Socket Mode can connect")
    error = str(body.get("error") or f"HTTP {response.status_code}")
    if (outage := _slack_side("apps.connections.open", response, error)) is not None:
        return Check(name, Level.FAIL, outage)
    if error in _REFUSALS:
        return Check(
            name,
            Level.FAIL,
            f"platforms.slack.app_token was refused by Slack ({error}): create an app-level token with "
            "connections:write under Basic Information → App-Level Tokens",
        )
    return Check(
        name,
        Level.FAIL,
        f"apps.connections.open failed ({error}): is Socket Mode on (Settings → Socket Mode)?",
    )


async def home_check(config: SlackConfig, client: httpx.AsyncClient) -> Check | None:
    name = "platform.slack"
    channel = config.home_channel
    if not channel:
        return None
    response = await client.post(
        f"{config.api_base_url}conversations.info",
        headers={"Authorization": f"Bearer {config.bot_token}"},
        data={"channel": channel},
    )
    body = json_body(response)
    if not body.get("ok"):
        error = str(body.get("error") or f"HTTP {response.status_code}")
        if (outage := _slack_side("conversations.info", response, error)) is not None:
            return Check(name, Level.FAIL, f"home_channel {channel}: not checked: {outage}")
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
