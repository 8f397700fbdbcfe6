"""People: each person once, with their identities on every door, and groups of people (``people:``).

An identity is ``<platform>:<user id>`` (``telegram:111``, ``slack:U0123ABCD``, ``web:alice``); a person
is a name that owns some of them::

    people:
      alice: {telegram: 111, slack: U0ALICE01, discord: 222, web: alice, cli: alice}
      bob: {telegram: [333, 334], web: bob}
      groups:
        oncall: [alice, bob]

One identity belongs to at most one person, and every identity is well formed for its platform (the
patterns live in :mod:`kazma.config.registry`). ``approvals.approvers`` may then name a person or a group
instead of raw identities: naming a person lets every identity of theirs decide, each on its own door.
Everything that records a decision records the person beside the identity used, so an audit answers "who",
not only "which account", and a later rule can tell two people from one person pressing twice.

Parsing happens before the typed model is built (:func:`parse_people`), so every error names the key path
the person wrote (``people.bob.telegram``), not the model's inside.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from kazma.config.address import Actor, platform_of
from kazma.config.registry import ACTOR_PLATFORMS, CHAT_PLATFORMS, user_id_problem

PERSON_NAME: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")
GROUPS_KEY: Final = "groups"
PERSON_NAME_HINT: Final = "a person's or group's name is a lowercase letter then up to 31 of a-z, 0-9, '_', '-'"
# An identity on the first chat platform, for the examples in messages ("telegram: 111, "); none without one.
_EXAMPLE: Final = "".join(f"{spec.name}: {spec.example_user}, " for spec in list(CHAT_PLATFORMS.values())[:1])


def _error(path: str, message: str, **values: Any) -> PydanticCustomError:
    return PydanticCustomError("kazma_people", message, {"subpath": path, **values})


def _user_id(value: Any) -> str | None:
    """An id as written (YAML reads ``111`` as a number): its text, or None for anything that is no id."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _check_name(path: str, name: Any) -> str:
    if not isinstance(name, str) or not PERSON_NAME.fullmatch(name):
        raise _error(path, "{hint}, got {got}", hint=PERSON_NAME_HINT, got=repr(name))
    return name


def parse_people(raw: Any, *, where: str = "people") -> dict[str, dict[str, tuple[str, ...]]]:
    """``people:`` as written, checked and normalised to ``{"persons": {name: identities}, "groups": {…}}``.

    Raises a ``PydanticCustomError`` whose ``subpath`` is the whole key path (``people.bob.telegram[1]``).
    """
    if raw is None:
        return {"persons": {}, "groups": {}}
    if not isinstance(raw, Mapping):
        raise _error(where, "expected a mapping of people (name: their identities), got {got}", got=type(raw).__name__)
    persons: dict[str, tuple[str, ...]] = {}
    owners: dict[str, str] = {}  # identity -> the person who claimed it first
    for name, identities in raw.items():
        if name == GROUPS_KEY:
            continue
        path = f"{where}.{name}"
        _check_name(path, name)
        if not isinstance(identities, Mapping) or not identities:
            raise _error(
                path,
                "a person is a mapping of their identities (door: id), e.g. " + _EXAMPLE + "web: {name}; got {got}",
                name=name,
                got=repr(identities)[:60],
            )
        found: list[str] = []
        for platform, values in identities.items():
            key = f"{path}.{platform}"
            if platform not in ACTOR_PLATFORMS:
                raise _error(key, "unknown door (expected one of: {doors})", doors=", ".join(ACTOR_PLATFORMS))
            listed = values if isinstance(values, list) else [values]
            if not listed:
                raise _error(key, "expected an id or a list of ids, got an empty list")
            for position, value in enumerate(listed):
                at = f"{key}[{position}]" if isinstance(values, list) else key
                user = _user_id(value)
                problem = None if user is None else user_id_problem(platform, user)
                if user is None or problem is not None:
                    raise _error(
                        at, "{problem}, got {got}", problem=problem or f"expected a {platform} id", got=repr(value)
                    )
                identity = str(Actor(platform, user))
                owner = owners.get(identity)
                if owner is not None:
                    said = "this person lists it twice" if owner == name else f"it is already {owner}'s"
                    raise _error(
                        at, "{identity} is claimed twice: {said} (one identity belongs to one person)",
                        identity=identity, said=said,
                    )  # fmt: skip
                owners[identity] = name
                found.append(identity)
        persons[name] = tuple(found)
    groups: dict[str, tuple[str, ...]] = {}
    written = raw.get(GROUPS_KEY)
    if written is not None:
        if not isinstance(written, Mapping):
            raise _error(f"{where}.{GROUPS_KEY}", "expected a mapping of groups (name: [people]), got {got}",
                         got=type(written).__name__)  # fmt: skip
        for group, members in written.items():
            path = f"{where}.{GROUPS_KEY}.{group}"
            _check_name(path, group)
            if group in persons:
                raise _error(path, "{group} is a person's name too: a name means one person or one group",
                             group=repr(group))  # fmt: skip
            if not isinstance(members, list) or not members:
                raise _error(path, "a group is a list of people's names, e.g. [alice, bob], got {got}",
                             got=repr(members)[:60])  # fmt: skip
            for position, member in enumerate(members):
                if member not in persons:
                    raise _error(
                        f"{path}[{position}]", "unknown person {member} (people: {known})",
                        member=repr(member), known=", ".join(sorted(persons)) or "none configured",
                    )  # fmt: skip
            groups[group] = tuple(dict.fromkeys(members))
    return {"persons": persons, "groups": groups}


@dataclass(frozen=True)
class Person:
    name: str
    identities: tuple[str, ...]  # "telegram:111", in the order written

    def on(self, platform: str) -> tuple[str, ...]:
        """This person's identities on ``platform`` (``telegram:111``, …)."""
        return tuple(i for i in self.identities if platform_of(i) == platform)


class PeopleConfig(BaseModel):
    """``people:`` once checked (see :func:`parse_people`): who is who, and the groups."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    persons: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @cached_property
    def _owner(self) -> dict[str, str]:
        return {identity: name for name, identities in self.persons.items() for identity in identities}

    def person(self, name: str) -> Person | None:
        identities = self.persons.get(name)
        return None if identities is None else Person(name, identities)

    def people(self) -> list[Person]:
        return [Person(name, identities) for name, identities in self.persons.items()]

    def person_of(self, identity: str) -> str | None:
        """The person who owns ``identity``, or None (an identity nobody named as theirs)."""
        return self._owner.get(identity)

    def knows(self, name: str) -> bool:
        """``name`` is a person or a group."""
        return name in self.persons or name in self.groups

    def members(self, name: str) -> tuple[str, ...]:
        """The people a person's or group's name stands for (empty for an unknown name)."""
        if name in self.persons:
            return (name,)
        return self.groups.get(name, ())

    def identities(self, reference: str) -> frozenset[str]:
        """Every identity ``reference`` stands for: a raw identity itself; a person's or group's, all of theirs."""
        if ":" in reference:
            return frozenset({reference})
        return frozenset(i for member in self.members(reference) for i in self.persons[member])

    def identities_on(self, reference: str, platform: str) -> frozenset[str]:
        return frozenset(i for i in self.identities(reference) if platform_of(i) == platform)


def person_key(people: PeopleConfig, identity: str) -> str:
    """Who pressed, for counting people: the person who owns ``identity``, or the identity itself when it is
    nobody's (two such identities are two people as far as Kazma can tell)."""
    return people.person_of(identity) or identity


def requester_key(people: PeopleConfig, started_by: str) -> str:
    """Who started the work, for comparing with :func:`person_key` of a presser (``forbid_requester``):
    ``started_by`` is a person's name as it stands, or an identity, counted as its person."""
    return started_by if ":" not in started_by else person_key(people, started_by)


def unknown_references(people: PeopleConfig, references: Iterable[str]) -> list[tuple[int, str]]:
    """(position, name) of each reference that is a name but no person or group."""
    return [(i, r) for i, r in enumerate(references) if ":" not in r and not people.knows(r)]
