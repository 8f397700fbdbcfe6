"""The ``kazma.yaml`` that ``kazma init`` writes: the shipped templates, filled in with the operator's answers.

The templates live in ``kazma/bot/templates/`` (package data, so a wheel
install has them). The result makes the operator an approver everywhere they
are — each platform that is on and the web console — names every served chat
explicitly, and refers to secrets only as ``${VAR}``. It is validated with the
real loader before anyone sees it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Final

from kazma.config import ConfigError, load_config_text
from kazma.config.address import Actor
from kazma.config.registry import CHAT_PLATFORMS, InitMode, user_id_problem

DEFAULT_PUBLIC_URL: Final = "http://localhost:8765"
DEFAULT_MODEL_URL: Final = "http://127.0.0.1:11434/v1"
DEFAULT_MODEL: Final = "llama3.1"
WEB_LOGIN: Final = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # what the console's login form accepts
# The variable each platform's section reads its token from (its registry entry names it).
SECRETS: Final = {name: (spec.env[spec.token_key],) for name, spec in CHAT_PLATFORMS.items()}
PLACEHOLDER_SECRETS: Final = {  # shaped like the real thing, to validate the result without them
    variable: value for spec in CHAT_PLATFORMS.values() for variable, value in spec.placeholders.items()
}


class _Template(string.Template):
    # YAML and ${VAR} references use "$"; "@" cannot start a plain YAML scalar, so it is free for placeholders
    delimiter = "@"


def _template(name: str) -> _Template:
    return _Template(resources.files("kazma.bot").joinpath("templates", name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Presence:
    """The operator on one chat platform: their user id, and the chat Kazma serves there (None: not known yet)."""

    user: str
    chat: str | None = None


class InitAnswers:
    """The operator's answers: their console login, where things are, and their presence on each chat platform
    that is on, by the platform's name (``InitAnswers("alice", telegram=Presence("111"))``, or ``present=``)."""

    def __init__(
        self,
        web_login: str,
        *,
        public_url: str = DEFAULT_PUBLIC_URL,
        model_url: str = DEFAULT_MODEL_URL,
        model_name: str = DEFAULT_MODEL,
        modes: Mapping[str, str] | None = None,
        cli_login: str | None = None,
        present: Mapping[str, Presence] | None = None,
        **presences: Presence | None,
    ) -> None:
        presences = {**(present or {}), **presences}
        unknown = sorted(set(presences) - set(CHAT_PLATFORMS))
        if unknown:
            raise TypeError(f"no chat platform named {', '.join(unknown)} (one of {', '.join(CHAT_PLATFORMS)})")
        self.web_login = web_login
        self.public_url = public_url
        self.model_url = model_url
        self.model_name = model_name
        # The way each platform's events arrive, by its name, where it offers more than one (its first: default).
        self.modes: Mapping[str, str] = dict(modes or {})
        # The system user who runs `kazma` here: `kazma approvals approve` decides as cli:<login>. None: not known.
        self.cli_login = cli_login
        self._presences = {name: found for name, found in presences.items() if found is not None}
        self.platforms: tuple[str, ...] = tuple(name for name in CHAT_PLATFORMS if name in self._presences)

    def presence(self, platform: str) -> Presence:
        return self._presences[platform]

    def mode(self, platform: str) -> InitMode | None:
        """The chosen way the platform's events arrive; None where it offers no choice."""
        setup = CHAT_PLATFORMS[platform].init
        if setup is None or not setup.modes:
            return None
        chosen = self.modes.get(platform, setup.modes[0].name)
        return next(mode for mode in setup.modes if mode.name == chosen)

    @property
    def secrets(self) -> list[str]:
        """The environment variables the written file needs before ``kazma run``."""
        names = [name for platform in self.platforms for name in SECRETS[platform]]
        for platform in self.platforms:
            mode = self.mode(platform)
            names += mode.secrets if mode else ()
        return names

    @property
    def person(self) -> str:
        """The operator's name under ``people:``: their console login, as a person's name is written."""
        name = re.sub(r"[^a-z0-9_-]", "-", self.web_login.lower())
        return name if name[:1].isalpha() else f"op-{name}"[:32]

    @property
    def approvers(self) -> list[tuple[str, str]]:
        """(actor, where) for every identity of the operator, the console first."""
        found = [(str(Actor("web", self.web_login.lower())), "the web console")]
        found += [(str(Actor(p, self.presence(p).user)), CHAT_PLATFORMS[p].title) for p in self.platforms]
        if self.cli_login is not None and user_id_problem("cli", self.cli_login) is None:
            found.append((str(Actor("cli", self.cli_login)), "the command line (`kazma approvals approve`)"))
        return found


def _yaml_scalar(value: str) -> str:
    """A value the loader reads back as this exact text (ids are digits, a minus and letters only)."""
    return value if re.fullmatch(r"-?[A-Za-z0-9][A-Za-z0-9_.:/-]*", value) else "'" + value.replace("'", "''") + "'"


def _platform_block(answers: InitAnswers, platform: str) -> str:
    presence = answers.presence(platform)
    if presence.chat is None:
        setup = CHAT_PLATFORMS[platform].init
        where = setup.chat_hint if setup else CHAT_PLATFORMS[platform].chat_id_hint
        chats, home = f"[]  # not known yet ({where}): put it here and below", ""
    else:
        chat = _yaml_scalar(presence.chat)
        chats, home = f'[{chat}]  # served; nothing else is ("*" would serve every chat the bot is in)', chat
    mode = answers.mode(platform)
    values = {
        "chats": chats,
        "home": home,
        "user": _yaml_scalar(presence.user),
        "transport": mode.settings if mode else "",
    }
    return _template(f"{platform}.yaml.in").substitute(values)


def render(answers: InitAnswers) -> str:
    """The commented ``kazma.yaml`` for these answers; raises :class:`ConfigError` if it would not load."""
    if not WEB_LOGIN.fullmatch(answers.web_login):
        raise ValueError(f"a console login is 1 to 32 letters, digits, '.', '_' or '-', got {answers.web_login!r}")
    person = answers.person
    identities = "\n".join(
        f"    {identity.platform}: {_yaml_scalar(identity.user)}  # you, in {where}"
        for identity, where in ((Actor.parse(actor), where) for actor, where in answers.approvers)
    )
    people = (
        "people:\n"
        "  # Each person once, with their identity on every door: every decision records who made it, and\n"
        "  # `kazma people invite <name>` prints the one-time link that enrols their passkey for the console.\n"
        f"  {person}:\n{identities}\n"
    )
    approvers = f"    - {person}  # you, on every door under people.{person}"
    # One person with an identity on each door is one operator (people: says so): the swarm's steering is not
    # shared between people, so swarm.allow_shared_operators stays off.
    swarm = ""
    if answers.platforms:
        platforms = "platforms:\n" + "".join(_platform_block(answers, p) for p in answers.platforms)
    else:
        platforms = (
            "platforms: {}  # none yet: the web console is the whole product. To add one, see the README's\n"
            '               # "Platform setup", or run `kazma init --force` again.'
        )
    proxies = ""
    if answers.public_url.startswith("https://"):
        proxies = (
            "\n  # The TLS proxy on this machine: its X-Forwarded-For names who logs in (README: Behind a TLS\n"
            "  # reverse proxy). A proxy elsewhere: its address instead.\n"
            '  trusted_proxies: ["127.0.0.1", "::1"]'
        )
    text = _template("kazma.yaml.in").substitute(
        public_url=_yaml_scalar(answers.public_url.rstrip("/")),
        trusted_proxies=proxies,
        model_url=answers.model_url,
        model_name=answers.model_name,
        approvers=approvers,
        people=people,
        swarm=swarm,
        platforms=platforms.rstrip("\n"),
    )
    text = re.sub(r"\n{3,}", "\n\n", text)
    load_config_text(text, name="kazma.yaml", environ=PLACEHOLDER_SECRETS)  # raises ConfigError with its lines
    return text


__all__ = ["ConfigError", "InitAnswers", "Presence", "render"]
