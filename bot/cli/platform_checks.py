"""``kazma doctor`` asks each platform that is on whether it accepts Kazma's tokens.

Telegram ``getMe``; Slack ``auth.test`` with the scopes the token was granted
(Slack lists them in the ``x-oauth-scopes`` response header) and, in Socket
Mode, the app-level token; Discord ``/users/@me`` and the application's flags
(the Message Content intent). Before any call, the shape of each secret is
checked for the usual mix-ups (:mod:`kazma.config.tokens`), since a platform
only answers "invalid_auth". Every problem is one line naming its fix; no
token ever appears in one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import httpx

from kazma.bot.cli.checks import Check, Level
from kazma.bot.cli.home_checks import discord_home, slack_home, telegram_home
from kazma.bot.cli.platform_setup import (
    DISCORD_MESSAGE_CONTENT_FLAGS,
    SLACK_BOT_SCOPES,
    SLACK_DM_SCOPE,
    SLACK_OPTIONAL_SCOPES,
)
from kazma.bot.logging import redact
from kazma.config import LoadedConfig, enabled_platforms
from kazma.config.models import DiscordConfig, KazmaConfig, SlackConfig, TelegramConfig
from kazma.config.platforms import console_warnings
from kazma.config.tokens import (
    discord_token_problem,
    slack_app_token_problem,
    slack_bot_token_problem,
    slack_signing_secret_problem,
    telegram_token_problem,
)

SCOPES_HEADER: Final = "x-oauth-scopes"
# Slack errors that mean "this token is no good", as opposed to a server or network problem.
_SLACK_REFUSALS: Final = frozenset(
    {"invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired", "not_allowed_token_type"}
)


def console_checks(loaded: LoadedConfig) -> list[Check]:
    config = loaded.config
    checks = [
        Check(
            "platform.web",
            Level.OK,
            f"console on {config.web.host}:{config.web.port}, linked as {config.web.public_url}",
        )
    ]
    checks += [Check("platform.web", Level.WARN, warning) for warning in console_warnings(config)]
    return checks


async def check_platforms(loaded: LoadedConfig, *, timeout: float) -> dict[str, list[Check]]:  # noqa: ASYNC109 - per request
    """Each platform that is on, asked at once; one list of lines per platform."""
    platforms = loaded.config.platforms
    slack_dms = dm_policies(loaded.config, "slack")
    checkers: dict[str, Callable[[httpx.AsyncClient], Awaitable[list[Check]]]] = {
        "telegram": lambda client: check_telegram(platforms.telegram, client),
        "slack": lambda client: check_slack(platforms.slack, client, dm_policies=slack_dms),
        "discord": lambda client: check_discord(platforms.discord, client),
    }
    names = [name for name in enabled_platforms(loaded) if name in checkers]
    async with httpx.AsyncClient(timeout=timeout) as client:
        results = await asyncio.gather(*(_guarded(name, checkers[name](client), timeout) for name in names))
    return dict(zip(names, results, strict=True))


async def _guarded(name: str, work: Awaitable[list[Check]], timeout: float) -> list[Check]:  # noqa: ASYNC109
    try:
        return await work
    except httpx.TimeoutException:
        return [Check(f"platform.{name}", Level.FAIL, f"no answer within {timeout:g} s: is the API address reachable?")]
    except httpx.HTTPError as exc:
        return [Check(f"platform.{name}", Level.FAIL, f"unreachable ({type(exc).__name__}: {redact(str(exc))})")]


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


# -- Telegram ------------------------------------------------------------------------------------


async def check_telegram(config: TelegramConfig, client: httpx.AsyncClient) -> list[Check]:
    name = "platform.telegram"
    problem = telegram_token_problem(config.token)
    if problem:
        return [Check(name, Level.FAIL, f"platforms.telegram.token {problem}")]
    checks: list[Check] = []
    if config.mode == "webhook" and not config.webhook.url.startswith("https://"):
        checks.append(
            Check(
                name,
                Level.FAIL,
                "platforms.telegram.webhook.url must be https://: Telegram posts updates over TLS only",
            )
        )
    response = await client.get(f"{config.api_base_url}/bot{config.token}/getMe")
    body = _json(response)
    if response.status_code in (401, 404):  # Telegram answers 404 for a token of no bot at all
        return [
            *checks,
            Check(
                name,
                Level.FAIL,
                f"platforms.telegram.token was refused by Telegram ({response.status_code} "
                f"{body.get('description') or response.reason_phrase}): copy it again from @BotFather "
                "(/mybots → API Token)",
            ),
        ]
    if response.status_code >= 400 or not body.get("ok"):
        detail = redact(str(body.get("description") or response.reason_phrase))
        return [*checks, Check(name, Level.FAIL, f"getMe failed (HTTP {response.status_code}: {detail})")]
    me = body.get("result") or {}
    privacy = (
        ""
        if me.get("can_read_all_group_messages")
        else "; privacy mode on: in groups it sees commands, @-mentions of it and replies to it"
    )
    checks.append(Check(name, Level.OK, f"token accepted: @{me.get('username', '?')}{privacy}"))
    home = await telegram_home(config, client, int(me.get("id") or 0))
    return [*checks, *([home] if home else [])]


# -- Slack ---------------------------------------------------------------------------------------


def dm_policies(config: KazmaConfig, platform: str) -> list[str]:
    """The policies whose cards go to people's direct messages on ``platform`` (approvals.policies.<name>.to)."""
    return [
        name
        for name in config.approvals.policies
        if any(t.platform == platform and t.user is not None for t in config.card_targets(name) or ())
    ]


async def check_slack(
    config: SlackConfig, client: httpx.AsyncClient, *, dm_policies: Sequence[str] = ()
) -> list[Check]:
    """``dm_policies``: policies that send cards to people's Slack DMs, which needs im:write (conversations.open)."""
    name = "platform.slack"
    shapes = [
        ("bot_token", config.bot_token, slack_bot_token_problem),
        ("app_token", config.app_token, slack_app_token_problem),
        ("signing_secret", config.signing_secret, slack_signing_secret_problem),
    ]
    problems = [
        Check(name, Level.FAIL, f"platforms.slack.{key} {problem}")
        for key, value, judge in shapes
        if value and (problem := judge(value))
    ]
    if problems:
        return problems
    response = await client.post(
        f"{config.api_base_url}auth.test", headers={"Authorization": f"Bearer {config.bot_token}"}
    )
    body = _json(response)
    if not body.get("ok"):
        error = str(body.get("error") or f"HTTP {response.status_code}")
        if error in _SLACK_REFUSALS:
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
    checks = [_slack_scopes(response, dm_policies)]
    if config.app_token:
        checks.append(await _slack_app_token(config, client))
    who = f"{body.get('user', '?')} in {body.get('team', '?')}"
    checks.insert(0, Check(name, Level.OK, f"token accepted: {who}"))
    home = await slack_home(config, client)
    return [*checks, *([home] if home else [])]


def _slack_scopes(response: httpx.Response, dm_policies: Sequence[str] = ()) -> Check:
    name = "platform.slack"
    header = response.headers.get(SCOPES_HEADER)
    if header is None:
        return Check(
            name,
            Level.WARN,
            f"Slack did not list the token's scopes (no {SCOPES_HEADER} header): compare OAuth & Permissions with "
            f"{', '.join(SLACK_BOT_SCOPES)}",
        )
    granted = {scope.strip() for scope in header.split(",") if scope.strip()}
    missing = [scope for scope in SLACK_BOT_SCOPES if scope not in granted]
    if missing:
        return Check(
            name,
            Level.FAIL,
            f"the bot token lacks the scope{'s' if len(missing) > 1 else ''} {', '.join(missing)}: add "
            f"{'them' if len(missing) > 1 else 'it'} under OAuth & Permissions → Bot Token Scopes (or create the "
            "app from `kazma setup slack-manifest`) and reinstall the app",
        )
    if dm_policies and SLACK_DM_SCOPE not in granted:
        return Check(
            name,
            Level.FAIL,
            f"approvals.policies.{dm_policies[0]}.to sends cards to people's Slack direct messages, which needs the "
            f"{SLACK_DM_SCOPE} scope (conversations.open) the bot token lacks: add it under OAuth & Permissions → "
            "Bot Token Scopes and reinstall the app",
        )
    optional = [scope for scope in SLACK_OPTIONAL_SCOPES if scope not in granted]
    note = f"; without {', '.join(optional)} agents post with an [agent] prefix" if optional else ""
    return Check(name, Level.OK, f"scopes granted: every one Kazma needs{note}")


async def _slack_app_token(config: SlackConfig, client: httpx.AsyncClient) -> Check:
    """Socket Mode: the app-level token opens a connection URL (unused; Slack lets it expire)."""
    name = "platform.slack"
    response = await client.post(
        f"{config.api_base_url}apps.connections.open", headers={"Authorization": f"Bearer {config.app_token}"}
    )
    body = _json(response)
    if body.get("ok"):
        return Check(name, Level.OK, "app token accepted: Socket Mode can connect")
    error = str(body.get("error") or f"HTTP {response.status_code}")
    if error in _SLACK_REFUSALS:
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


# -- Discord -------------------------------------------------------------------------------------


async def check_discord(config: DiscordConfig, client: httpx.AsyncClient) -> list[Check]:
    name = "platform.discord"
    problem = discord_token_problem(config.token)
    if problem:
        return [Check(name, Level.FAIL, f"platforms.discord.token {problem}")]
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
    user = _json(me)
    if not user.get("bot"):
        return [Check(name, Level.FAIL, "platforms.discord.token is not a bot's token: use Bot → Reset Token")]
    app = await client.get(f"{config.api_base_url}/oauth2/applications/@me", headers=headers)
    if app.status_code >= 400:
        return [Check(name, Level.FAIL, f"/oauth2/applications/@me failed (HTTP {app.status_code})")]
    application = _json(app)
    checks = [
        Check(
            name,
            Level.OK,
            f"token accepted: {user.get('username', '?')} (application {application.get('id', '?')}; "
            "invite it with `kazma setup discord-invite`)",
        )
    ]
    if not int(application.get("flags") or 0) & DISCORD_MESSAGE_CONTENT_FLAGS:
        checks.append(
            Check(
                name,
                Level.FAIL,
                "the Message Content intent is off, and Discord refuses a connection that asks for it: Developer "
                "Portal → your application → Bot → Privileged Gateway Intents → Message Content Intent",
            )
        )
    home = await discord_home(config, client, str(user.get("id") or ""))
    return [*checks, *([home] if home else [])]
