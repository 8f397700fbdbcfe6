"""The platform registry: everything Kazma knows about a chat platform before it loads its library.

Configuration validation, adapter construction, the swarm's roles, the
``-> platform:chat`` route check, log redaction, ``kazma init`` and
``kazma doctor`` all read this one table; adding a platform is one entry (a
module of this package, discovered) plus one adapter package under
``kazma.adapters`` that passes the contract suite, and its settings' section
in ``config/models.py``.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

_WEB_CHAT: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The people on the console and the terminal: a console login is what the console's sign-in names; a CLI login
# is the operating system's user name. Each chat platform's own ids are its entry's (a module of this package).
_WEB_LOGIN: Final = re.compile(r"[a-z0-9_.-]{1,32}")
_CLI_LOGIN: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")


def _web_chat(chat: str) -> bool:
    return bool(_WEB_CHAT.fullmatch(chat))


TokenJudge = Callable[[str], str | None]


@dataclass(frozen=True)
class InitMode:
    """One way a platform's events can arrive, as ``kazma init`` offers it (a platform's first is its default)."""

    name: str  # as the flag takes it: "socket"
    secrets: tuple[str, ...]  # the environment variables it reads besides the token's
    settings: str  # the lines ``kazma init`` writes for it under the platform's section


@dataclass(frozen=True)
class InitSetup:
    """What ``kazma init`` asks about a platform (flags ``--<platform>-user`` and ``--<platform>-<chat>``, the
    chat word being its chats key's: chat, channel) and the hints it gives."""

    user_flag_help: str  # "Your Telegram user id."
    chat_flag_help: str  # "The Telegram group Kazma serves (e.g. -1001234567890)."
    user_hint: str  # how a person finds their own id there
    chat_hint: str  # how they find the chat's id there
    modes: tuple[InitMode, ...] = ()  # more than one: the flag --<platform>-mode and a question
    mode_flag_help: str = ""
    mode_prompt: str = ""


@dataclass(frozen=True)
class PlatformSpec:
    """One chat platform: where its settings live, how its ids look, which adapter serves it."""

    order: int  # where it is listed among the platforms (the order people are asked in)
    name: str  # "telegram": the prefix of its actors ("telegram:<user id>") and conversations
    title: str  # "Telegram", for people
    token_key: str  # the key under platforms.<name> whose emptiness turns the platform off
    home_key: str  # the key naming the chat for cards, reports and alerts
    chats_key: str  # the key listing the chats served
    is_chat_id: Callable[[str], bool]
    chat_id_hint: str  # what a chat id looks like, said when one is wrong
    is_user_id: Callable[[str], bool]  # a person's id on this platform (the part after "telegram:")
    user_id_hint: str  # what a user id looks like, said when one is wrong
    example_user: str  # a well-formed user id, for examples in messages
    adapter: str  # "module:Class", imported only when the platform is on (each library is heavy)
    spaces_key: str | None = None  # the key listing the servers served, where the platform has servers
    # Its secrets: the keys under platforms.<name> (dotted into sub-sections) that hold one, never logged; the
    # environment variable ``kazma init`` refers to for each, and a value shaped like one to validate with.
    secrets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # secret key -> environment variable
    placeholders: dict[str, str] = field(default_factory=dict)  # environment variable -> a value of its shape
    # What a token looks like: judges of a pasted value (the usual mix-ups, one sentence naming the fix), and a
    # pattern that finds one inside a library's log line (a URL with the token in its path), redacted there.
    token_judges: dict[str, TokenJudge] = field(default_factory=dict)
    log_token_pattern: str | None = None
    noisy_loggers: tuple[str, ...] = ()  # its library's chatty per-request loggers, kept at WARNING
    init: InitSetup | None = None  # what ``kazma init`` asks about it; None: init does not offer it
    transport: Callable[[Any], str] = lambda section: "gateway"  # how events arrive, said by `config check`
    # "module:function" asking the platform whether it accepts Kazma's tokens (kazma doctor); "": none.
    doctor: str = ""
    setup_commands: dict[str, str] = field(default_factory=dict)  # `kazma setup <name>` -> "module:command"
    failpoints: tuple[str, ...] = ()  # the fault-injection points its adapter names (config/failpoints.py)
    # Optional libraries its library imports whenever installed that these settings never use: hidden while
    # its adapter is imported (bot/lean_imports.py), they cost neither memory nor start-up time.
    unused_imports: Callable[[Any], tuple[str, ...]] = lambda section: ()

    @property
    def chat_word(self) -> str:
        """What the platform calls a chat, as its chats key says it: "chat", "channel"."""
        return self.chats_key.removesuffix("s")

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

    def secret_values(self, platforms: Any) -> list[str]:
        """The values of this platform's secrets in a ``PlatformsConfig`` (empty ones left out)."""
        found = []
        for key in self.secrets:
            value: Any = self.section(platforms)
            for part in key.split("."):
                value = getattr(value, part)
            if value:
                found.append(str(value))
        return found


def load_named(reference: str) -> Any:
    """What a registry entry names as ``"module:attribute"`` (its adapter, doctor check, setup commands), imported
    now: the entries name them so that a platform's library loads only when it is used."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _discovered() -> dict[str, PlatformSpec]:
    """Every chat platform: each module of this package holds one entry, ``SPEC`` (a new platform is a new
    module here and its package under ``kazma.adapters``; nothing lists them)."""
    specs: list[PlatformSpec] = []
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            spec = importlib.import_module(f"{__name__}.{module.name}").SPEC
            assert isinstance(spec, PlatformSpec), module.name
            specs.append(spec)
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.order)}


CHAT_PLATFORMS: Final[dict[str, PlatformSpec]] = _discovered()

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
