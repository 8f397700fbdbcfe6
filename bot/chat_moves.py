"""Chats that changed their id on their platform, kept so that a restart still serves the new one.

A Telegram group made a supergroup gets a new chat id. The adapter follows it
at once; this table makes the move outlive the process until the operator has
updated ``kazma.yaml`` (the move is announced with the line to change), and is
applied to the adapters at every start. One small table, written through the
store's one access helper.
"""

from __future__ import annotations

import time
from typing import Final

import aiosqlite

from kazma.adapters.contract import ChatMove
from kazma.config.database import Migration, Tables

MIGRATIONS: Final = [
    Migration(
        "chat_moves",
        1,
        (
            """CREATE TABLE IF NOT EXISTS chat_moves (
                platform TEXT NOT NULL,
                old_chat TEXT NOT NULL,
                new_chat TEXT NOT NULL,
                moved_at REAL NOT NULL,
                PRIMARY KEY (platform, old_chat)
            )""",
        ),
    )
]


class ChatMoves:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.tables = Tables.of(conn)

    async def record(self, move: ChatMove) -> bool:
        """Keep ``move``; False when it was already kept (both chats announce the same move)."""
        changed = await self.tables.run(
            "INSERT OR IGNORE INTO chat_moves (platform, old_chat, new_chat, moved_at) VALUES (?, ?, ?, ?)",
            (move.platform, move.old, move.new, time.time()),
        )
        return changed == 1

    async def all(self) -> list[ChatMove]:
        """Every move, oldest first (a chat that moved twice is followed link by link)."""
        rows = await self.tables.all("SELECT platform, old_chat, new_chat FROM chat_moves ORDER BY moved_at, rowid")
        return [ChatMove(str(platform), str(old), str(new)) for platform, old, new in rows]
