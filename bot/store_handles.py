"""What each component of a running Kazma stores through: SQLite connections and their writer, or one PostgreSQL store.

On SQLite every component gets a connection of its own (SQLite serialises
writers across them, so one component's open statement never pins another's
transaction) and the approvals and the outbox share one group-committing
writer. On PostgreSQL every component shares one :class:`PgStore`: a pool for
reads and one writer whose groups hold everyone's writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiosqlite

from kazma.bot.store import open_pg_store, open_store
from kazma.config import KazmaConfig
from kazma.config.store.database import Tables, connect
from kazma.config.store.writer import StoreWriter

if TYPE_CHECKING:
    from kazma.config.store.postgres import PgStore


@dataclass
class StoreHandles:
    primary: aiosqlite.Connection | PgStore  # approvals, rules, chat moves, sessions, API keys, the dashboard
    outbox: aiosqlite.Connection | PgStore
    plans: aiosqlite.Connection | PgStore
    history: aiosqlite.Connection | PgStore
    swarm: aiosqlite.Connection | PgStore
    transcript: aiosqlite.Connection | PgStore
    pg: PgStore | None = None
    writer: StoreWriter | None = None  # SQLite's; PostgreSQL's belongs to ``pg``
    connections: list[aiosqlite.Connection] = field(default_factory=list)

    async def close(self) -> None:
        if self.writer is not None:
            await self.writer.close()
        for conn in self.connections:
            await conn.close()
        if self.pg is not None:
            await self.pg.close()


async def open_handles(config: KazmaConfig, *, replica: str) -> StoreHandles:
    """Every component's store, migrated, on the backend ``store.url`` names."""
    if config.store.backend == "postgresql":
        pg = await open_pg_store(config, application_name=f"kazma {replica}"[:40])
        return StoreHandles(pg, pg, pg, pg, pg, pg, pg=pg)
    conn = await open_store(config)
    path, busy = config.store.path, config.store.busy_timeout_ms
    outbox, plans, history, swarm, transcript = [await connect(path, busy_timeout_ms=busy) for _ in range(5)]
    writer = StoreWriter(path, busy_timeout_ms=busy)
    Tables.of(conn).use_writer(writer)
    Tables.of(outbox).use_writer(writer)  # card posts commit with the approvals
    return StoreHandles(
        conn,
        outbox,
        plans,
        history,
        swarm,
        transcript,
        writer=writer,
        connections=[conn, outbox, plans, history, swarm, transcript],
    )
