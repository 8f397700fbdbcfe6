"""Where the sync stands, kept on the homeserver in the bot account's own account data.

A position is the token a batch began at and the events of that batch already handed to the kit. It is
written after each event is taken in and again, as the next token with nothing done, once the batch is
through: a process that stops anywhere in between begins at the same batch and skips what it took in, so a
restart neither loses an event (the token moves on only after the whole batch) nor repeats one (what was
taken in is listed). The account data lives with the account on the homeserver, so the next leader of a
replica set reads the same position, and nothing of it depends on Kazma's own store or its backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from mautrix.client import ClientAPI
from mautrix.errors import MNotFound

ACCOUNT_DATA_TYPE: Final = "org.kazma.sync"
MAX_DONE: Final = 1000  # a batch holds at most a timeline limit per room; far more is a corrupt record


@dataclass(frozen=True)
class Position:
    since: str
    done: tuple[str, ...]


class SyncPosition:
    def __init__(self, client: ClientAPI) -> None:
        self.client = client

    async def load(self) -> Position | None:
        """The kept position; None before the first sync ever (or when the record is not one of ours)."""
        try:
            kept = dict(await self.client.get_account_data(ACCOUNT_DATA_TYPE))
        except MNotFound:
            return None
        since, done = kept.get("since"), kept.get("done")
        if not isinstance(since, str) or not since or not isinstance(done, list):
            return None
        return Position(since, tuple(str(event) for event in done[:MAX_DONE]))

    async def save(self, position: Position) -> None:
        record: dict[str, Any] = {"since": position.since, "done": list(position.done)}
        await self.client.set_account_data(ACCOUNT_DATA_TYPE, record)
