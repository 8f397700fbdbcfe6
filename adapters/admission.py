"""What the inbound door lets in, as values read from a platform's configuration: the chats a platform
serves, who may write to the lead directly, and how many and how large files one message may carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kazma.adapters.contract import Attachment
from kazma.config.limits import DEFAULT_FILE_BYTES, DEFAULT_FILE_COUNT
from kazma.config.registry import EVERY_CHAT


@dataclass(frozen=True)
class Served:
    """The chats a platform serves: the listed ones and the home chat, or every chat when ``every``."""

    chats: frozenset[str]
    home: str | None
    every: bool = False

    def __contains__(self, chat: object) -> bool:
        return self.every or chat == self.home or chat in self.chats

    def moved(self, old: str, new: str) -> Served:
        """The same chats with ``old`` replaced by ``new`` (listed, home, or both)."""
        chats = frozenset(new if chat == old else chat for chat in self.chats)
        return Served(chats, new if self.home == old else self.home, every=self.every)

    @classmethod
    def of(cls, chats: Iterable[object], home: object | None) -> Served:
        """From a platform's configuration: its listed chats (``"*"``: every chat) and its home chat."""
        listed = list(chats)
        return cls(
            frozenset(str(chat) for chat in listed if chat != EVERY_CHAT),
            None if home in (None, "") else str(home),
            every=EVERY_CHAT in listed,
        )


@dataclass(frozen=True)
class DirectPolicy:
    """Who may talk to the lead in a direct message (``dm_policy``): nobody, or the actors in ``actors``."""

    actors: frozenset[str] = frozenset()

    def allows(self, actor: str) -> bool:
        return actor in self.actors

    @classmethod
    def of(cls, setting: object, approvers: Iterable[str]) -> DirectPolicy:
        """``"off"`` (nobody), ``"approvers"`` (``approvers``: this platform's approvers), or a list of actors."""
        if setting == "approvers":
            return cls(frozenset(approvers))
        if isinstance(setting, list | tuple | frozenset | set):
            return cls(frozenset(str(actor) for actor in setting))
        return cls()


def human_size(size: int) -> str:
    """Bytes as people read them (``10.0 MB``, ``1.5 KB``, ``100 bytes``): every refusal of a file says it so."""
    if size < 1024:
        return f"{size} bytes"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KB"
    return f"{size / (1024 * 1024):.1f} MB"


class FileTooLarge(Exception):
    """A file turned out larger than the bound once fetched (its platform did not declare its size)."""


@dataclass(frozen=True)
class FileBounds:
    """How many files one message may carry and how large each may be (``files:``)."""

    max_bytes: int = DEFAULT_FILE_BYTES
    max_count: int = DEFAULT_FILE_COUNT
    # The largest file the platform hands a bot (``platform`` names it), when that is less than files.max_bytes may
    # be: a file over it passed the bound here, and its fetch was refused as if it had been deleted.
    platform_max_bytes: int | None = None
    platform: str = ""

    def problem(self, attachments: Sequence[Attachment]) -> str | None:
        """Why these files are refused (a reply for the sender), or None when they are within the bounds."""
        if len(attachments) > self.max_count:
            if self.max_count == 0:
                return "Kazma does not accept files here (files.max_count is 0); nothing was saved."
            return (
                f"Not saved: {len(attachments)} files were sent with one message; Kazma accepts at most "
                f"{self.max_count} (files.max_count). Nothing was saved."
            )
        cap = self.platform_max_bytes
        for attachment in attachments:
            if attachment.size is not None and cap is not None and cap < self.max_bytes and attachment.size > cap:
                return (
                    f"Not saved: {attachment.name} is {human_size(attachment.size)}; {self.platform} hands a bot "
                    f"files up to {human_size(cap)}, so Kazma cannot fetch it (sending it again will not change that)."
                    " Nothing was saved."
                )
            if attachment.size is not None and attachment.size > self.max_bytes:
                return (
                    f"Not saved: {attachment.name} is {human_size(attachment.size)}; Kazma accepts files up to "
                    f"{human_size(self.max_bytes)} (files.max_bytes). Nothing was saved."
                )
        return None

    def bounded(self, attachment: Attachment) -> Attachment:
        """The same file, whose fetch refuses more than ``max_bytes`` (a size declared wrongly, or not at all)."""
        limit = self.max_bytes

        async def fetch() -> bytes:
            data = await attachment.fetch()
            if len(data) > limit:
                raise FileTooLarge(
                    f"Not saved: {attachment.name} is {human_size(len(data))}; "
                    f"Kazma accepts files up to {human_size(limit)}."
                )
            return data

        return Attachment(attachment.name, attachment.size, fetch)
