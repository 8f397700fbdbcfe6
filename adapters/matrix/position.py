"""Where the sync stands, kept on the homeserver in the bot account's own account data.

A position is the token a batch began at and, for each room, the last event of that batch passed there
(``rooms``). The adapter takes a batch's events in one at a time, in each room's order, so a room's mark says
that every event before it there was taken in too. The position is written after each event is taken in and
again, as the next token with no marks, once the batch is through: a process that stops anywhere in between
begins at the same batch (the homeserver answers the same events from the same token, the newer ones after
them) and skips in each room what is up to its mark, so a restart neither loses an event (the token moves on
only after the whole batch) nor repeats one. The record is one mark a room however long the batch (after an
outage a batch holds up to 2,000 events a room, read back).

A mark that is not among a room's events when the batch comes again was the oldest of a long gap cut short
(``GAP_LIMIT``: only the newest are read back): every event still there came after it.

An earlier Kazma listed every event of the batch it took in (``done``); such a list is read whole (a batch
after an outage holds far more than a thousand) and kept until that batch is through.

The account data lives with the account on the homeserver, so the next leader of a replica set reads the same
position, and nothing of it depends on Kazma's own store or its backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from mautrix.client import ClientAPI
from mautrix.errors import MNotFound

ACCOUNT_DATA_TYPE: Final = "org.kazma.sync"


@dataclass(frozen=True)
class Position:
    since: str
    rooms: Mapping[str, str] = field(default_factory=dict)  # room -> the last event of the batch passed there
    done: frozenset[str] = frozenset()  # an earlier Kazma's record: every event of the batch it took in

    def passed(self, room: str, event_id: str) -> Position:
        """This position with ``event_id`` (and every event before it in ``room``) passed."""
        return replace(self, rooms={**self.rooms, room: event_id})

    def after(self, room: str, events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """``room``'s ``events`` of this batch (oldest first) not passed yet."""
        mark = self.rooms.get(room)
        start = next((i + 1 for i, event in enumerate(events) if mark and event.get("event_id") == mark), 0)
        return [event for event in events[start:] if str(event.get("event_id", "")) not in self.done]


class SyncPosition:
    def __init__(self, client: ClientAPI) -> None:
        self.client = client

    async def load(self) -> Position | None:
        """The kept position; None before the first sync ever (or when the record is not one of ours)."""
        try:
            kept = dict(await self.client.get_account_data(ACCOUNT_DATA_TYPE))
        except MNotFound:
            return None
        since, rooms, done = kept.get("since"), kept.get("rooms", {}), kept.get("done", [])
        if not isinstance(since, str) or not since or not isinstance(rooms, dict) or not isinstance(done, list):
            return None
        marks = {str(room): str(event) for room, event in rooms.items() if isinstance(event, str)}
        return Position(since, marks, frozenset(str(event) for event in done))

    async def save(self, position: Position) -> None:
        # ``done`` is written (empty but for an earlier Kazma's list) so that a Kazma of before the marks, started
        # on this record, still reads where the batch began: it repeats what the marks say was taken in, and
        # loses nothing.
        record: dict[str, Any] = {"since": position.since, "rooms": dict(position.rooms), "done": sorted(position.done)}
        await self.client.set_account_data(ACCOUNT_DATA_TYPE, record)
