"""Telegram's entry in the platform registry: its settings, ids, secrets and their shape, and setup hints."""

from __future__ import annotations

import re
from typing import Final

from kazma.config.registry import InitSetup, PlatformSpec
from kazma.config.tokens import pasted_badly

_INT64_MAX: Final = 2**63 - 1
_CHAT: Final = re.compile(r"-?[1-9][0-9]{0,18}")
_USER: Final = re.compile(r"[1-9][0-9]{0,18}")  # positive: groups are negative chats, never people
_TOKEN: Final = re.compile(r"[0-9]+:[A-Za-z0-9_-]+")


def is_chat_id(chat: str) -> bool:
    return bool(_CHAT.fullmatch(chat)) and abs(int(chat)) <= _INT64_MAX


def is_user_id(user: str) -> bool:
    return bool(_USER.fullmatch(user)) and int(user) <= _INT64_MAX


def token_problem(token: str) -> str | None:
    """A BotFather token is ``<bot id>:<secret>``, e.g. ``123456789:AAE…``."""
    badly = pasted_badly(token)
    if badly:
        return badly
    if token.lower().startswith("bot") and _TOKEN.fullmatch(token[3:]):
        return "starts with 'bot': that prefix belongs to the API URL, not the token; remove it"
    if not _TOKEN.fullmatch(token):
        return (
            "does not look like a BotFather token (<bot id>:<secret>, e.g. 123456789:AAE…): "
            "copy it again from @BotFather (/mybots → API Token)"
        )
    return None


SPEC: Final = PlatformSpec(
    order=1,
    name="telegram",
    title="Telegram",
    token_key="token",  # noqa: S106 - the name of a setting, not a secret
    home_key="home_chat",
    chats_key="chats",
    is_chat_id=is_chat_id,
    chat_id_hint="a Telegram chat id is a non-zero integer, negative for groups, e.g. -1001234567890",
    is_user_id=is_user_id,
    user_id_hint="a Telegram user id is a positive integer, e.g. 111222333",
    example_user="111",
    adapter="kazma.adapters.telegram:TelegramAdapter",
    secrets=("token", "webhook.secret_token"),
    env={"token": "TELEGRAM_BOT_TOKEN"},
    placeholders={"TELEGRAM_BOT_TOKEN": "1:placeholder"},
    token_judges={"token": token_problem},
    # The Bot API puts the token in the URL's path ("/bot<id>:<secret>/getMe"), which libraries log.
    log_token_pattern=r"(?<=/bot)[0-9]+:[A-Za-z0-9_-]+",  # noqa: S106 - a pattern that finds tokens, not one
    noisy_loggers=("telegram.ext.Updater",),
    init=InitSetup(
        user_flag_help="Your Telegram user id.",
        chat_flag_help="The Telegram group Kazma serves (e.g. -1001234567890).",
        user_hint="a Telegram user id is a number (@userinfobot tells you yours)",
        chat_hint="add the bot to the group; the platform.inbound_ignored log event (platform=telegram) shows its id",
    ),
    transport=lambda section: f"{section.mode} mode",
    doctor="kazma.adapters.telegram.doctor:check",
    failpoints=("telegram.inbox",),  # the webhook inbox, among replicas
    # python-telegram-bot's webhook server ([webhooks] extra): long polling never starts it. And its Telegram
    # Passport decryption, which imports cryptography whenever it is installed (Kazma's audit signatures need it):
    # Kazma passes no passport key, and cryptography's binding is about 9 MB of a started `kazma run`'s memory
    # until the first checkpoint is signed (approvals/checkpoints.py imports it then).
    unused_imports=lambda section: ("cryptography",) if section.mode == "webhook" else ("tornado", "cryptography"),
)
