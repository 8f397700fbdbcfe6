"""What each platform's secrets look like, and the mix-ups people make pasting them.

The platforms answer a wrong token with a bare "invalid_auth" or 401; the
shape of what was pasted usually says exactly which token it really is (a
Slack user token, the app-level token in the bot token's place, a Discord
token copied with its ``Bot`` prefix). Each function returns one sentence that
names the likely mix-up and the fix, or None when the shape is plausible. Only
shapes are judged here; whether the platform accepts the token is for
``kazma doctor`` to ask.
"""

from __future__ import annotations

import re
from typing import Final

_TELEGRAM: Final = re.compile(r"[0-9]+:[A-Za-z0-9_-]+")
_SPACE: Final = re.compile(r"\s")


def _pasted_badly(value: str) -> str | None:
    if _SPACE.search(value):
        return "contains spaces or a line break: copy it again, without anything around it"
    if value[:1] in "'\"<":
        return "starts with a quote or '<': write the token alone (YAML quotes are not part of it)"
    return None


def telegram_token_problem(token: str) -> str | None:
    """A BotFather token is ``<bot id>:<secret>``, e.g. ``123456789:AAE…``."""
    badly = _pasted_badly(token)
    if badly:
        return badly
    if token.lower().startswith("bot") and _TELEGRAM.fullmatch(token[3:]):
        return "starts with 'bot': that prefix belongs to the API URL, not the token; remove it"
    if not _TELEGRAM.fullmatch(token):
        return (
            "does not look like a BotFather token (<bot id>:<secret>, e.g. 123456789:AAE…): "
            "copy it again from @BotFather (/mybots → API Token)"
        )
    return None


def slack_bot_token_problem(token: str) -> str | None:
    """``bot_token`` takes the Bot User OAuth Token (``xoxb-``; ``xoxe.xoxb-`` with token rotation)."""
    badly = _pasted_badly(token)
    if badly:
        return badly
    if token.startswith(("xoxb-", "xoxe.xoxb-")):
        return None
    if token.startswith("xapp-"):
        return (
            "is the app-level token (xapp-), which belongs in app_token (SLACK_APP_TOKEN); bot_token takes the "
            "Bot User OAuth Token (xoxb-) from OAuth & Permissions"
        )
    if token.startswith(("xoxp-", "xoxe.xoxp-")):
        return (
            "is a user token (xoxp-): Kazma would act as that person; use the Bot User OAuth Token (xoxb-) "
            "from OAuth & Permissions"
        )
    if token.startswith("xoxe-"):
        return "is a refresh token (xoxe-): use the Bot User OAuth Token (xoxb-) from OAuth & Permissions"
    return "is not a bot token (expected xoxb-…): copy the Bot User OAuth Token from OAuth & Permissions"


def slack_app_token_problem(token: str) -> str | None:
    """``app_token`` (Socket Mode) takes an app-level token (``xapp-``) with ``connections:write``."""
    badly = _pasted_badly(token)
    if badly:
        return badly
    if token.startswith("xapp-"):
        return None
    if token.startswith(("xoxb-", "xoxe.xoxb-")):
        return (
            "is the bot token (xoxb-), which belongs in bot_token; app_token takes an app-level token (xapp-) "
            "from Basic Information → App-Level Tokens, with connections:write"
        )
    return (
        "is not an app-level token (expected xapp-…): create one under Basic Information → App-Level Tokens "
        "with connections:write"
    )


def slack_signing_secret_problem(secret: str) -> str | None:
    badly = _pasted_badly(secret)
    if badly:
        return badly
    if secret.startswith(("xox", "xapp-")):
        return "is a token, not the signing secret: copy Basic Information → App Credentials → Signing Secret"
    return None


def discord_token_problem(token: str) -> str | None:
    """A bot token is three dot-separated parts; Kazma adds the ``Bot `` authorisation prefix itself."""
    for prefix in ("Bot ", "Bearer ", "bot "):
        if token.startswith(prefix):
            return f"starts with '{prefix.strip()} ': Kazma adds that prefix itself; put only the token in the setting"
    badly = _pasted_badly(token)
    if badly:
        return badly
    if re.fullmatch(r"[A-Za-z0-9_-]{32}", token):
        return "looks like the OAuth2 client secret (32 characters, no dots): the bot token is under Bot → Reset Token"
    return None
