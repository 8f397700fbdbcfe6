"""Slack's entry in the platform registry: its settings, ids, secrets and their shape, and setup hints."""

from __future__ import annotations

import re
from typing import Final

from kazma.config.registry import InitMode, InitSetup, PlatformSpec
from kazma.config.tokens import pasted_badly

_CHANNEL: Final = re.compile(r"[CGD][A-Z0-9]{2,31}")
_USER: Final = re.compile(r"[UW][A-Z0-9]{1,31}")  # U, or W on Enterprise Grid


def is_chat_id(chat: str) -> bool:
    return bool(_CHANNEL.fullmatch(chat))


def is_user_id(user: str) -> bool:
    return bool(_USER.fullmatch(user))


def bot_token_problem(token: str) -> str | None:
    """``bot_token`` takes the Bot User OAuth Token (``xoxb-``; ``xoxe.xoxb-`` with token rotation)."""
    badly = pasted_badly(token)
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


def app_token_problem(token: str) -> str | None:
    """``app_token`` (Socket Mode) takes an app-level token (``xapp-``) with ``connections:write``."""
    badly = pasted_badly(token)
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


def signing_secret_problem(secret: str) -> str | None:
    badly = pasted_badly(secret)
    if badly:
        return badly
    if secret.startswith(("xox", "xapp-")):
        return "is a token, not the signing secret: copy Basic Information → App Credentials → Signing Secret"
    return None


SPEC: Final = PlatformSpec(
    order=2,
    name="slack",
    title="Slack",
    token_key="bot_token",  # noqa: S106 - the name of a setting, not a secret
    home_key="home_channel",
    chats_key="channels",
    is_chat_id=is_chat_id,
    chat_id_hint="a Slack channel id is C, G or D followed by capital letters and digits, e.g. C0123ABCD",
    is_user_id=is_user_id,
    user_id_hint="a Slack user id is U (or W) followed by capital letters and digits, e.g. U0123ABCD",
    example_user="U0123ABCD",
    adapter="kazma.adapters.slack:SlackAdapter",
    secrets=("bot_token", "app_token", "signing_secret", "sign_in.client_secret"),
    env={"bot_token": "SLACK_BOT_TOKEN", "app_token": "SLACK_APP_TOKEN", "signing_secret": "SLACK_SIGNING_SECRET"},
    placeholders={
        "SLACK_BOT_TOKEN": "xoxb-placeholder",
        "SLACK_APP_TOKEN": "xapp-placeholder",
        "SLACK_SIGNING_SECRET": "placeholder",
    },
    token_judges={
        "bot_token": bot_token_problem,
        "app_token": app_token_problem,
        "signing_secret": signing_secret_problem,
    },
    log_token_pattern=r"\b(?:xox[abpers]|xapp)-[A-Za-z0-9-]+",  # noqa: S106 - a pattern that finds tokens, not one
    init=InitSetup(
        user_flag_help="Your Slack member id (U…).",
        chat_flag_help="The Slack channel Kazma serves (C…).",
        user_hint="a Slack member id looks like U0123ABCD (your profile → ⋮ → Copy member ID)",
        chat_hint="/invite the app, then the channel's name → About shows its id",
        modes=(
            InitMode(
                "socket",
                ("SLACK_APP_TOKEN",),
                "    app_token: ${SLACK_APP_TOKEN}  # xapp-: Socket Mode (Basic Information → App-Level Tokens, "
                "connections:write)",
            ),
            InitMode(
                "http",
                ("SLACK_SIGNING_SECRET",),
                "    signing_secret: ${SLACK_SIGNING_SECRET}  # Basic Information → App Credentials → Signing Secret\n"
                "    http: {host: 127.0.0.1, port: 3000, path: /slack/events}"
                "  # public: <public_url origin>/slack/events",
            ),
        ),
        mode_flag_help="Socket Mode (default) or HTTP.",
        mode_prompt="Slack transport",
    ),
    transport=lambda section: "Socket Mode" if section.app_token else "HTTP events",
    doctor="kazma.adapters.slack.doctor:check",
    setup_commands={"slack-manifest": "kazma.adapters.slack.setup:slack_manifest_command"},
)
