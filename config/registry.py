"""The platform registry: everything Kazma knows about a chat platform before it loads its library.

Configuration validation, adapter construction, the swarm's roles and the
``-> platform:chat`` route check all read this one table; adding a platform is
one entry here plus one adapter package under ``kazma.adapters`` that passes
the contract suite.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

_INT64_MAX: Final = 2**63 - 1
_UINT64_MAX: Final = 2**64 - 1
_TELEGRAM_CHAT: Final = re.compile(r"-?[1-9][0-9]{0,18}")
_SLACK_CHANNEL: Final = re.compile(r"[CGD][A-Z0-9]{2,31}")
_DISCORD_ID: Final = re.compile(r"[1-9][0-9]{0,19}")
_WEB_CHAT: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The people on each door: a Telegram user id is positive (groups are negative chats, never people); a Slack
# user id starts U (or W on Enterprise Grid); a console login is what the console's sign-in names; a CLI login
# is the operating system's user name.
_TELEGRAM_USER: Final = re.compile(r"[1-9][0-9]{0,18}")
_SLACK_USER: Final = re.compile(r"[UW][A-Z0-9]{1,31}")
_WEB_LOGIN: Final = re.compile(r"[a-z0-9_.-]{1,32}")
_CLI_LOGIN: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")


def _telegram_chat(chat: str) -> bool:
    return bool(_TELEGRAM_CHAT.fullmatch(chat)) and abs(int(chat)) <= _INT64_MAX


def _slack_channel(chat: str) -> bool:
    return bool(_SLACK_CHANNEL.fullmatch(chat))


def _discord_id(chat: str) -> bool:
    return bool(_DISCORD_ID.fullmatch(chat)) and int(chat) <= _UINT64_MAX


def _web_chat(chat: str) -> bool:
    return bool(_WEB_CHAT.fullmatch(chat))


def _telegram_user(user: str) -> bool:
    return bool(_TELEGRAM_USER.fullmatch(user)) and int(user) <= _INT64_MAX


def _slack_user(user: str) -> bool:
    return bool(_SLACK_USER.fullmatch(user))


@dataclass(frozen=True)
class PlatformSpec:
    """One chat platform: where its settings live, how its ids look, which adapter serves it."""

    name: str  # "telegram": the prefix of its actors ("telegram:<user id>") and conversations
    title: str  # "Telegram", for people
    token_key: str  # the key under platforms.<name> whose emptiness turns the platform off
    home_key: str  # the key naming the chat for cards, reports and alerts
    chats_key: str  # the key listing the chats served
    is_chat_id: Callable[[str], bool]
    chat_id_hint: str  # what a chat id looks like, said when one is wrong
    is_user_id: Callable[[str], bool]  # a person's id on this platform (the part after "telegram:")
    user_id_hint: str  # what a user id looks like, said when one is wrong
    adapter: str  # "module:Class", imported only when the platform is on (each library is heavy)

    def section(self, platforms: Any) -> Any:
        """This platform's settings out of a ``PlatformsConfig``."""
        return getattr(platforms, self.name)

    def token(self, platforms: Any) -> str:
        return str(getattr(self.section(platforms), self.token_key))

    def home(self, platforms: Any) -> str | None:
        value = getattr(self.section(platforms), self.home_key)
        return None if value in (None, "") else str(value)

    def admins(self, platforms: Any) -> frozenset[str]:
        """The platform's admins as actors (``telegram:111``)."""
        return frozenset(f"{self.name}:{uid}" for uid in self.section(platforms).admins)


CHAT_PLATFORMS: Final[dict[str, PlatformSpec]] = {
    spec.name: spec
    for spec in (
        PlatformSpec(
            name="telegram",
            title="Telegram",
            token_key="token",  # noqa: S106 - the name of a setting, not a secret
            home_key="home_chat",
            chats_key="chats",
            is_chat_id=_telegram_chat,
            chat_id_hint="a Telegram chat id is a non-zero integer, negative for groups, e.g. -1001234567890",
            is_user_id=_telegram_user,
            user_id_hint="a Telegram user id is a positive integer, e.g. 111222333",
            adapter="kazma.adapters.telegram:TelegramAdapter",
        ),
        PlatformSpec(
            name="slack",
            title="Slack",
            token_key="bot_token",  # noqa: S106 - the name of a setting, not a secret
            home_key="home_channel",
            chats_key="channels",
            is_chat_id=_slack_channel,
            chat_id_hint="a Slack channel id is C, G or D followed by capital letters and digits, e.g. C0123ABCD",
            is_user_id=_slack_user,
            user_id_hint="a Slack user id is U (or W) followed by capital letters and digits, e.g. U0123ABCD",
            adapter="kazma.adapters.slack:SlackAdapter",
        ),
        PlatformSpec(
            name="discord",
            title="Discord",
            token_key="token",  # noqa: S106 - the name of a setting, not a secret
            home_key="home_channel",
            chats_key="channels",
            is_chat_id=_discord_id,
            chat_id_hint="a Discord channel id is a positive number, e.g. 123456789012345678",
            is_user_id=_discord_id,
            user_id_hint="a Discord user id is a positive number, e.g. 123456789012345678",
            adapter="kazma.adapters.discord:DiscordAdapter",
        ),
    )
}

# In a platform's chats/channels: every chat the bot is added to is served.
EVERY_CHAT: Final = "*"
WEB: Final = "web"
CLI: Final = "cli"
# Where a person can be: every chat platform, the web console and the terminal.
ACTOR_PLATFORMS: Final = (*CHAT_PLATFORMS, WEB, CLI)
# Where a result can be sent: every chat platform and the web console.
ROUTE_PLATFORMS: Final = (*CHAT_PLATFORMS, WEB)
WEB_CHAT_HINT: Final = "a web console chat is 1 to 64 letters, digits, '-' or '_'"
WEB_LOGIN_HINT: Final = "a console login is 1 to 32 of a-z, 0-9, '_', '.', '-'"
CLI_LOGIN_HINT: Final = "a command-line login is the system user name: 1 to 32 letters, digits, '_', '.', '-'"


def user_id_problem(platform: str, user: str) -> str | None:
    """None when ``user`` is a well-formed id of a person on ``platform``; otherwise what one looks like."""
    spec = CHAT_PLATFORMS.get(platform)
    if spec is not None:
        return None if spec.is_user_id(user) else spec.user_id_hint
    if platform == WEB:
        return None if _WEB_LOGIN.fullmatch(user) else WEB_LOGIN_HINT
    if platform == CLI:
        return None if _CLI_LOGIN.fullmatch(user) else CLI_LOGIN_HINT
    return f"unknown platform {platform!r} (one of {', '.join(ACTOR_PLATFORMS)})"


def chat_id_problem(platform: str, chat: str) -> str | None:
    """None when ``chat`` is a well-formed chat id on ``platform``; otherwise what one looks like."""
    spec = CHAT_PLATFORMS.get(platform)
    if spec is not None:
        return None if spec.is_chat_id(chat) else spec.chat_id_hint
    if platform == WEB:
        return None if _web_chat(chat) else WEB_CHAT_HINT
    return f"unknown platform {platform!r} (one of {', '.join(ROUTE_PLATFORMS)})"
