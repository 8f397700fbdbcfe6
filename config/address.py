"""Values at the seams: where a message goes or came from (:class:`Address`), and who someone is (:class:`Actor`).

A conversation is written ``<platform>:<chat>`` where it is stored or typed: the transcript's and the plans'
rows, a swarm route (``-> telegram:-100…``), an approval request's ``conversation``, a console URL. That text
is made by :attr:`Address.conversation` and read back by :meth:`Address.parse`, here and nowhere else (a test
greps the source for colons joined or split by hand); everything between the edges holds an :class:`Address`.
An actor (an identity) is ``<platform>:<user id>`` (``telegram:111``, ``web:alice``, ``cli:ops``), made and read
by :class:`Actor` alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from kazma.config.registry import ACTOR_PLATFORMS


class AddressError(ValueError):
    """Text that is not ``<platform>:<chat>``."""


@dataclass(frozen=True)
class Address:
    platform: str  # the registry's name: "telegram", "web"
    chat: str  # the platform's own chat or channel id, as text
    thread: str | None = None  # a thread inside the chat, where the platform has them; None: the chat itself

    @classmethod
    def parse(cls, text: str) -> Address:
        """``<platform>:<chat>`` (the chat may hold colons of its own); :class:`AddressError` with what it got.
        Whether the chat is one the platform could have is the registry's to say (``chat_id_problem``)."""
        platform, sep, chat = text.partition(":")
        if not sep or not platform:
            raise AddressError(f"expected '<platform>:<chat>', got {text[:80]!r}")
        return cls(platform, chat)

    @property
    def conversation(self) -> str:
        """The conversation's key, ``<platform>:<chat>``: a thread is part of its chat's conversation."""
        return f"{self.platform}:{self.chat}"

    def in_thread(self, thread: str | None) -> Address:
        return Address(self.platform, self.chat, thread)

    def __str__(self) -> str:
        return self.conversation


class ActorError(ValueError):
    """Text that is not ``<platform>:<user id>``."""


@dataclass(frozen=True, order=True)
class Actor:
    platform: str
    user: str

    @classmethod
    def parse(cls, text: str) -> Actor:
        platform, sep, user = text.partition(":")
        if not sep or platform not in ACTOR_PLATFORMS or not user.strip():
            raise ActorError(
                f"expected '<platform>:<user id>' (platform one of {', '.join(ACTOR_PLATFORMS)}), got {text!r}"
            )
        return cls(platform, user)

    def __str__(self) -> str:
        return f"{self.platform}:{self.user}"


def platform_of(actor: str) -> str:
    """The platform part of an actor string ('' when it has none)."""
    platform, sep, _ = actor.partition(":")
    return platform if sep else ""
