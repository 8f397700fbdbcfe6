"""Who someone is, and what the configuration lets them do.

An actor (an *identity*) is ``<platform>:<user id>`` (``telegram:111``, ``slack:U0123``, ``web:alice``,
``cli:ops``): the form the audit trail records beside the person. ``people:`` says which identities are one
person (:mod:`kazma.config.people`); an identity nobody claimed is nobody's but its own. The
:class:`Roster` answers the questions the rest of Kazma asks — may this identity decide approvals here, may
it steer the swarm here, whose is it — in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kazma.config.address import Actor, ActorError, platform_of
from kazma.config.people import person_key
from kazma.config.registry import ACTOR_PLATFORMS, CHAT_PLATFORMS

if TYPE_CHECKING:
    from kazma.config.models import KazmaConfig


class Roster:
    """Approvers and operators, per platform, as the configuration names them.

    - Approvers on a chat platform: the ``approvals.approvers`` written for it
      plus that platform's ``admins``. On ``web`` and ``cli`` (which have no
      admin lists): the approvers written for them. An approver written as a
      person's or a group's name stands for every identity of theirs, each on
      its own platform.
    - Operators (who may steer the swarm): a chat platform's ``admins``; on
      ``web`` and ``cli``, the approvers written for them.

    An actor only counts on its own platform: the platform is what proved it
    (a press's sender, a passkey for ``web:``, a Telegram-signed Mini App for
    ``telegram:``), so a Slack admin id presented anywhere else proves nothing.
    """

    def __init__(self, config: KazmaConfig) -> None:
        self._config = config
        self.people = config.people
        written: dict[str, set[str]] = {}
        for reference in config.approvals.approvers:
            for actor in self.people.identities(reference):
                written.setdefault(platform_of(actor), set()).add(actor)
        self._admins = {name: spec.admins(config.platforms) for name, spec in CHAT_PLATFORMS.items()}
        self._approvers = {
            platform: frozenset(written.get(platform, set()) | self._admins.get(platform, frozenset()))
            for platform in ACTOR_PLATFORMS
        }
        self._operators = {
            platform: self._admins[platform] if platform in self._admins else self._approvers[platform]
            for platform in ACTOR_PLATFORMS
        }

    def approvers_for(self, platform: str) -> frozenset[str]:
        return self._approvers.get(platform, frozenset())

    def operators_for(self, platform: str) -> frozenset[str]:
        return self._operators.get(platform, frozenset())

    def admins_for(self, platform: str) -> frozenset[str]:
        """A chat platform's configured admins (empty for web and cli)."""
        return self._admins.get(platform, frozenset())

    def is_approver(self, actor: str, platform: str) -> bool:
        return platform_of(actor) == platform and actor in self.approvers_for(platform)

    def deciders(self, approvers: Sequence[str] = ()) -> frozenset[str]:
        """Every identity that may decide under a policy naming ``approvers`` (people, groups, identities);
        none named: every approver on every platform (today's rule)."""
        if not approvers:
            return frozenset(i for found in self._approvers.values() for i in found)
        return frozenset(i for reference in approvers for i in self.people.identities(reference))

    def may_decide(self, actor: str, platform: str, approvers: Sequence[str] = ()) -> bool:
        """``actor`` may decide under a policy naming ``approvers`` (none: :meth:`is_approver`), on its platform."""
        if not approvers:
            return self.is_approver(actor, platform)
        return platform_of(actor) == platform and actor in self.deciders(approvers)

    def is_admin(self, actor: str, platform: str) -> bool:
        return platform_of(actor) == platform and actor in self.admins_for(platform)

    def person_of(self, actor: str) -> str | None:
        """The person ``actor`` belongs to under ``people:``, or None."""
        return self.people.person_of(actor)

    def is_operator(self, actor: str, platform: str, *, is_admin: bool = False) -> bool:
        """``is_admin``: the platform itself said the author is an admin (set by the adapter from the roster)."""
        if is_admin:
            return True
        return platform_of(actor) == platform and actor in self.operators_for(platform)

    def human_operators(self) -> frozenset[str]:
        """Every configured operator, once per person: a person under ``people:`` counts once whatever their
        doors (their name stands for them); an identity nobody claimed counts as its own person.

        Erring towards "more than one" only makes the shared-operator refusal
        stricter, never looser.
        """
        found: set[str] = set()
        for approvers in self._approvers.values():
            found |= approvers
        for admins in self._admins.values():
            found |= admins
        return frozenset(person_key(self.people, identity) for identity in found)


__all__ = ["Actor", "ActorError", "Roster", "platform_of"]
