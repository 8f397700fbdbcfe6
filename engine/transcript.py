"""Every conversation Kazma serves, as people saw it: what was said in, what Kazma posted out.

The agents' history (``history.py``) is what a model reads; this is what a person reads in the
console — every platform, direct messages included, kept across restarts, in the order it happened.
Text is stored as people saw it (fences already turned into "from" labels). Listeners hear each new
entry at once, so the console follows conversations live.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import aiosqlite
import structlog

from kazma.adapters.human_text import for_humans
from kazma.config.database import Migration, Tables
from kazma.config.metrics import count_failure
from kazma.engine.conversation import MessageSink

log = structlog.get_logger("kazma.transcript")

TEXT_LIMIT: Final = 20_000  # a person reads the start; the platform has the rest

MIGRATIONS = [
    Migration(
        "transcript",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS transcript (
                seq INTEGER PRIMARY KEY,
                conversation TEXT NOT NULL,
                platform TEXT NOT NULL,
                chat TEXT NOT NULL,
                message_id TEXT NOT NULL DEFAULT '',
                author TEXT NOT NULL,
                name TEXT NOT NULL,
                direction TEXT NOT NULL CHECK (direction IN ('in', 'out')),
                direct INTEGER NOT NULL DEFAULT 0,
                text TEXT NOT NULL,
                file_name TEXT,
                at REAL NOT NULL
            )
            """,
            "CREATE INDEX IF NOT EXISTS transcript_by_conversation ON transcript (conversation, seq)",
        ),
    )
]

Direction = Literal["in", "out"]


@dataclass(frozen=True)
class Entry:
    seq: int
    conversation: str  # "<platform>:<chat>"
    platform: str
    chat: str
    message_id: str
    author: str  # "telegram:111", "agent:kazma"
    name: str  # shown name: a person's, or the agent's
    direction: Direction
    direct: bool
    text: str
    file_name: str | None
    at: float


@dataclass(frozen=True)
class Working:
    """An agent is working in ``conversation`` (the console shows it for a few seconds)."""

    conversation: str


@dataclass(frozen=True)
class Summary:
    """One conversation in the console's list."""

    conversation: str
    platform: str
    chat: str
    direct: bool
    messages: int
    last_at: float
    last_text: str


def _entry(row: tuple[object, ...]) -> Entry:
    return Entry(
        int(str(row[0])), str(row[1]), str(row[2]), str(row[3]), str(row[4]), str(row[5]), str(row[6]),
        "in" if row[7] == "in" else "out", bool(row[8]), str(row[9]),
        None if row[10] is None else str(row[10]), float(str(row[11])),
    )  # fmt: skip


class TranscriptStore:
    def __init__(self, conn: aiosqlite.Connection, *, clock: Callable[[], float] = time.time) -> None:
        self.tables = Tables.of(conn)
        self.clock = clock
        self._listeners: set[asyncio.Queue[Entry | Working]] = set()

    async def record(
        self,
        platform: str,
        chat: str,
        *,
        author: str,
        name: str,
        text: str,
        direction: Direction,
        message_id: str = "",
        direct: bool = False,
        file_name: str | None = None,
    ) -> Entry:
        """Keep one message (text as people see it) and tell the listeners."""
        shown = for_humans(text)[:TEXT_LIMIT]
        conversation = f"{platform}:{chat}"
        at = self.clock()
        async with self.tables.transaction() as db:
            row = await db.one(
                "INSERT INTO transcript (conversation, platform, chat, message_id, author, name, direction, direct,"
                " text, file_name, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
                (conversation, platform, chat, message_id, author, name, direction, int(direct), shown, file_name, at),
            )
        entry = Entry(int(row[0]), conversation, platform, chat, message_id, author, name, direction, direct, shown,
                      file_name, at)  # fmt: skip
        self._tell(entry)
        return entry

    def working(self, conversation: str) -> None:
        """Tell the listeners an agent is working in ``conversation`` (nothing is stored)."""
        self._tell(Working(conversation))

    def _tell(self, item: Entry | Working) -> None:
        for queue in list(self._listeners):
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:  # a stalled page loses live updates, not the record
                self._listeners.discard(queue)

    async def conversations(self) -> list[Summary]:
        """Every conversation, the most recently active first."""
        rows = await self.tables.all(
            "SELECT t.conversation, t.platform, t.chat, MAX(t.direct), COUNT(*), MAX(t.at),"
            " (SELECT l.text FROM transcript l WHERE l.conversation = t.conversation ORDER BY l.seq DESC LIMIT 1)"
            " FROM transcript t GROUP BY t.conversation, t.platform, t.chat ORDER BY MAX(t.seq) DESC"
        )
        return [
            Summary(str(r[0]), str(r[1]), str(r[2]), bool(r[3]), int(r[4]), float(r[5]), str(r[6] or "")) for r in rows
        ]

    async def messages(self, conversation: str, *, limit: int = 500) -> list[Entry]:
        """The newest ``limit`` messages of one conversation, in the order they happened."""
        rows = await self.tables.all(
            "SELECT seq, conversation, platform, chat, message_id, author, name, direction, direct, text, file_name,"
            " at FROM transcript WHERE conversation = ? ORDER BY seq DESC LIMIT ?",
            (conversation, limit),
        )
        return [_entry(tuple(r)) for r in reversed(rows)]

    async def follow(self) -> AsyncIterator[Entry | Working]:
        """Every entry recorded from now on, and working signs (the console's live view)."""
        queue: asyncio.Queue[Entry | Working] = asyncio.Queue(maxsize=1000)
        self._listeners.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._listeners.discard(queue)


class Bus(MessageSink, Protocol):
    """What the recording sink forwards to (the fan-out bus, or the null bus): messages, files, the working sign."""

    async def send_file(
        self, platform: str, chat: str, name: str, data: bytes, *, agent: str | None = None, thread: str | None = None
    ) -> str | None: ...

    async def working(self, platform: str, chat: str, *, thread: str | None = None) -> bool: ...


class RecordingSink:
    """The bus, with every message that reached a platform kept in the transcript (as people saw it).

    A transcript that cannot be written is logged and counted; the message was sent all the same.
    """

    def __init__(self, bus: Bus, store: TranscriptStore) -> None:
        self.bus = bus
        self.store = store

    async def _keep(self, platform: str, chat: str, agent: str | None, text: str, message_id: str | None,
                    file_name: str | None = None) -> None:  # fmt: skip
        if message_id is None:
            return  # not posted: nothing for people to read
        name = agent or "kazma"
        try:
            await self.store.record(platform, chat, author=f"agent:{name}", name=name, text=text, direction="out",
                                    message_id=message_id, file_name=file_name)  # fmt: skip
        except Exception as exc:
            count_failure("transcript")
            log.warning("transcript.record_failed", platform=platform, chat=chat, error=str(exc))

    async def send_text(
        self, platform: str, chat: str, text: str, *, agent: str | None = None, thread: str | None = None
    ) -> str | None:
        message_id = await self.bus.send_text(platform, chat, text, agent=agent, thread=thread)
        await self._keep(platform, chat, agent, text, message_id)
        return message_id

    async def send_choices(
        self,
        platform: str,
        chat: str,
        text: str,
        choices: Sequence[tuple[str, str]],
        *,
        agent: str | None = None,
        thread: str | None = None,
    ) -> str | None:
        message_id = await self.bus.send_choices(platform, chat, text, choices, agent=agent, thread=thread)
        labels = " · ".join(label for label, _ in choices)
        await self._keep(platform, chat, agent, f"{text}\n[{labels}]" if labels else text, message_id)
        return message_id

    async def send_file(
        self, platform: str, chat: str, name: str, data: bytes, *, agent: str | None = None, thread: str | None = None
    ) -> str | None:
        message_id = await self.bus.send_file(platform, chat, name, data, agent=agent, thread=thread)
        await self._keep(platform, chat, agent, f"{name} ({len(data)} bytes)", message_id, file_name=name)
        return message_id

    async def working(self, platform: str, chat: str, *, thread: str | None = None) -> bool:
        self.store.working(f"{platform}:{chat}")
        return await self.bus.working(platform, chat, thread=thread)
