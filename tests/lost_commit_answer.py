"""A store's tables whose commit of one kind of write is answered once with a transient error though it was made
(a connection lost as the database committed): the store tries the write again over the row it already made."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any


class LostCommitAnswer:
    """``tables``, wrapped: the first committed transaction (once :attr:`armed`) that ran a statement ``of`` picks
    out raises a transient error after its commit; every other call goes to ``tables``."""

    def __init__(self, tables: Any, of: Callable[[str], bool]) -> None:
        self.tables = tables
        self.of = of
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tables, name)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        seen: list[str] = []
        of = self.of

        class Seen:
            def __getattr__(self, name: str) -> Any:
                return getattr(db, name)

            async def run(self, sql: str, *args: Any) -> Any:
                if of(sql):
                    seen.append(sql)
                return await db.run(sql, *args)

        async with self.tables.transaction() as db:
            yield Seen()
        if self.armed and seen:
            self.armed = False
            raise sqlite3.OperationalError("disk I/O error (the commit's answer was lost)")
