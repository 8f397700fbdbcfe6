"""Conversation history per (conversation, agent): persisted, bounded, with a marker where it was cut."""

from __future__ import annotations

import time
from collections.abc import Callable

import aiosqlite

from kazma.config.database import Migration, Tables
from kazma.engine.types import Message

MIGRATIONS = [
    Migration(
        "history",
        1,
        (
            """
            CREATE TABLE IF NOT EXISTS agent_history (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                conversation TEXT NOT NULL,
                agent TEXT NOT NULL,
                role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
                content TEXT NOT NULL,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                created_at REAL NOT NULL
            )
            """,
            "CREATE INDEX IF NOT EXISTS agent_history_lookup ON agent_history (conversation, agent, seq)",
        ),
    )
]


class HistoryStore:
    """Only the text of finished exchanges is kept: tool calls stay inside their turn."""

    def __init__(
        self, conn: aiosqlite.Connection, *, max_messages: int = 40, clock: Callable[[], float] = time.time
    ) -> None:
        self.conn = conn
        self.max_messages = max_messages
        self.clock = clock
        self.tables = Tables.of(conn)

    async def append(
        self,
        conversation: str,
        agent: str,
        role: str,
        content: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        await self.tables.run(
            "INSERT INTO agent_history (conversation, agent, role, content, prompt_tokens, completion_tokens,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (conversation, agent, role, content, prompt_tokens, completion_tokens, self.clock()),
        )

    async def recent(self, conversation: str, agent: str) -> list[Message]:
        """The newest messages, oldest first; if older ones were left out, a marker says how many."""
        async with self.tables.locked() as db:
            row = await db.one(
                "SELECT COUNT(*) FROM agent_history WHERE conversation = ? AND agent = ?", (conversation, agent)
            )
            total = int(row[0]) if row else 0
            rows = await db.all(
                "SELECT role, content FROM agent_history WHERE conversation = ? AND agent = ?"
                " ORDER BY seq DESC LIMIT ?",
                (conversation, agent, self.max_messages),
            )
        messages: list[Message] = [{"role": str(r[0]), "content": str(r[1])} for r in reversed(rows)]
        dropped = total - len(rows)
        if dropped > 0:
            marker = f"[{dropped} earlier messages of this conversation were dropped to keep the history bounded]"
            messages.insert(0, {"role": "user", "content": marker})
        return messages

    async def usage(self, conversation: str) -> tuple[int, int]:
        row = await self.tables.one(
            "SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0)"
            " FROM agent_history WHERE conversation = ?",
            (conversation,),
        )
        return (int(row[0]), int(row[1])) if row else (0, 0)
