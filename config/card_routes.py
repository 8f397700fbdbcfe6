"""Where a policy's approval cards go (``approvals.policies.<name>.to``).

Absent, every chat platform's home chat shows the card (the rule before policies could route). Written, it is
a list of places, each either a chat the platform serves, ``"telegram:-1001234567890"``, or direct messages
to people, ``{dm: alice, via: telegram}`` (``via`` left out: every chat platform that is on where they have an
identity; ``dm`` may name a group, meaning each member). A card in a direct message is bound to the person it
was sent to: a press on it by anyone else decides nothing, whatever the button says.

The entries are parsed here before the typed model holds them, so each error names the key the person wrote
(``approvals.policies.ops.to[1].via``); whether a chat is served, a person known and reachable, and allowed to
decide under the policy, is checked once the whole configuration is read (:func:`route_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic_core import PydanticCustomError

from kazma.config.address import Actor, Address, AddressError
from kazma.config.people import PeopleConfig
from kazma.config.registry import CHAT_PLATFORMS, EVERY_CHAT, chat_id_problem

# "via", not "on": YAML 1.1 (PyYAML) reads a bare on as true.
DM_KEYS = ("dm", "via")


@dataclass(frozen=True)
class ChatRoute:
    """A chat that shows the card: ``telegram:-1001234567890``."""

    platform: str
    chat: str

    def __str__(self) -> str:
        return Address(self.platform, self.chat).conversation


@dataclass(frozen=True)
class DmRoute:
    """Direct messages to ``dm`` (a person or a group) on ``via`` (empty: wherever they can be reached)."""

    dm: str
    via: tuple[str, ...] = ()


RouteEntry = ChatRoute | DmRoute


@dataclass(frozen=True)
class CardTarget:
    """One place a request's card is posted on ``platform``.

    ``chat`` None and ``user`` None: the platform's home chat. ``user``: a direct message to that user id (the
    adapter finds the chat), bound to ``person``.
    """

    platform: str
    chat: str | None = None
    user: str | None = None
    person: str | None = None


class _Deciders(Protocol):
    def may_decide(self, actor: str, platform: str, approvers: Sequence[str] = ()) -> bool: ...


class _Config(Protocol):
    """What routing reads of the configuration (``KazmaConfig``; typed here so nothing imports the models)."""

    @property
    def people(self) -> PeopleConfig: ...

    @property
    def platforms(self) -> Any: ...

    @property
    def roster(self) -> _Deciders: ...


class _Policy(Protocol):
    @property
    def to(self) -> list[RouteEntry] | None: ...

    @property
    def approvers(self) -> list[str]: ...


def _error(subpath: str, message: str, **values: Any) -> PydanticCustomError:
    return PydanticCustomError("kazma_route", message, {"subpath": subpath, **values} if subpath else values)


def parse_route_entry(value: Any) -> RouteEntry:
    """One entry of ``to:`` as written: ``"<platform>:<chat id>"`` or ``{dm: <person or group>, via: …}``."""
    if isinstance(value, ChatRoute | DmRoute):
        return value
    if isinstance(value, str):
        try:
            written = Address.parse(value)
        except AddressError:
            written = Address("", "")
        platform, chat = written.platform, written.chat
        if platform not in CHAT_PLATFORMS:
            raise _error(
                "",
                "expected a chat '<platform>:<chat id>' (platform one of {platforms}) or {dm: <person>, via: "
                "<platform>}, got {got}",
                platforms=", ".join(CHAT_PLATFORMS),
                got=repr(value),
            )
        problem = chat_id_problem(platform, chat.strip())
        if problem is not None:
            raise _error("", "{problem}, got {got}", problem=problem, got=repr(value))
        return ChatRoute(platform, chat.strip())
    if isinstance(value, Mapping):
        if True in value:  # `on: telegram` as YAML 1.1 reads it
            raise _error("on", "unknown key: a platform is named with via (YAML reads a bare 'on' as true)")
        unknown = sorted(str(k) for k in value if k not in DM_KEYS)
        if unknown:
            raise _error(unknown[0], "unknown key (expected one of: dm, via)")
        person = value.get("dm")
        if not isinstance(person, str) or not person:
            raise _error("dm", "expected the name of a person or a group under people:, got {got}", got=repr(person))
        written = value.get("via", [])
        listed = written if isinstance(written, list) else [written]
        for position, platform in enumerate(listed):
            if platform not in CHAT_PLATFORMS:
                where = f"via[{position}]" if isinstance(written, list) else "via"
                raise _error(where, "expected a chat platform (one of {platforms}), got {got}",
                             platforms=", ".join(CHAT_PLATFORMS), got=repr(platform))  # fmt: skip
        return DmRoute(person, tuple(dict.fromkeys(str(p) for p in listed)))
    raise _error(
        "", "expected a chat '<platform>:<chat id>' or {dm: <person>, via: <platform>}, got {got}",
        got=type(value).__name__,
    )  # fmt: skip


def _served(config: _Config, platform: str, chat: str) -> bool:
    spec = CHAT_PLATFORMS[platform]
    section = spec.section(config.platforms)
    listed = [str(c) for c in getattr(section, spec.chats_key)]
    return chat == spec.home(config.platforms) or chat in listed or EVERY_CHAT in listed


def _platform_on(config: _Config, platform: str) -> bool:
    return bool(CHAT_PLATFORMS[platform].token(config.platforms))


def _dm_platforms(config: _Config, person: str, route: DmRoute) -> tuple[str, ...]:
    """Where ``person`` gets the card under ``route``: the platforms it names, or every one that is on where they
    have an identity."""
    if route.via:
        return route.via
    return tuple(p for p in CHAT_PLATFORMS if _platform_on(config, p) and config.people.identities_on(person, p))


def route_problems(config: _Config, name: str, policy: _Policy) -> list[tuple[str, str]]:
    """Why ``policy``'s ``to:`` cannot be followed, as (problem, key under ``approvals.policies.<name>``)."""
    if policy.to is None:
        return []
    if not policy.to:
        return [(f"policy {name} sends its cards nowhere: list chats or people, or leave 'to' out for every "
                 "platform's home chat", "to")]  # fmt: skip
    found: list[tuple[str, str]] = []
    people = config.people
    roster = config.roster
    for position, entry in enumerate(policy.to):
        key = f"to[{position}]"
        if isinstance(entry, ChatRoute):
            if not _platform_on(config, entry.platform):
                found.append((f"{entry} is on {entry.platform}, which is off (platforms.{entry.platform} has no "
                              "token)", key))  # fmt: skip
            elif not _served(config, entry.platform, entry.chat):
                spec = CHAT_PLATFORMS[entry.platform]
                found.append((
                    f"{entry.platform} does not serve chat {entry.chat} (add it to platforms.{entry.platform}."
                    f"{spec.chats_key} or make it the {spec.home_key})",
                    key,
                ))  # fmt: skip
            continue
        if not people.knows(entry.dm):
            known = ", ".join([*people.persons, *people.groups]) or "none configured"
            found.append((f"unknown person or group {entry.dm!r} (people: {known})", f"{key}.dm"))
            continue
        for platform in entry.via:
            if not _platform_on(config, platform):
                found.append((f"{platform} is off (platforms.{platform} has no token)", f"{key}.via"))
        for person in people.members(entry.dm):
            platforms = _dm_platforms(config, person, entry)
            if not platforms:
                found.append((f"{person} has no identity on a chat platform that is on (add people.{person}."
                              "<platform>)", f"{key}.dm"))  # fmt: skip
            for platform in platforms:
                ids = sorted(people.identities_on(person, platform))
                if not ids:
                    found.append((f"{person} has no {platform} identity under people: (add people.{person}."
                                  f"{platform})", f"{key}.via" if entry.via else f"{key}.dm"))  # fmt: skip
                elif not any(roster.may_decide(i, platform, policy.approvers) for i in ids):
                    found.append((f"{person} may not decide under policy {name} on {platform}, so a card sent to "
                                  "them could never be pressed (see its approvers)", f"{key}.dm"))  # fmt: skip
    return found


def card_targets(config: _Config, policy: _Policy | None) -> tuple[CardTarget, ...] | None:
    """Every place a card under ``policy`` is posted; None: every platform's home chat (no ``to:`` written)."""
    if policy is None or policy.to is None:
        return None
    found: dict[CardTarget, None] = {}
    for entry in policy.to:
        if isinstance(entry, ChatRoute):
            found[CardTarget(entry.platform, entry.chat)] = None
            continue
        for person in config.people.members(entry.dm):
            for platform in _dm_platforms(config, person, entry):
                for identity in sorted(config.people.identities_on(person, platform)):
                    found[CardTarget(platform, user=Actor.parse(identity).user, person=person)] = None
    return tuple(found)
