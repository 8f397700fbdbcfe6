"""The composition root's view of the store: every layer's migrations, applied at start."""

from __future__ import annotations

from pathlib import Path

import aiosqlite

from kazma.adapters.outbox import MIGRATIONS as OUTBOX
from kazma.approvals.schema import MIGRATIONS as APPROVALS
from kazma.config import KazmaConfig
from kazma.config.database import Migration, open_database
from kazma.engine.history import MIGRATIONS as HISTORY
from kazma.engine.plan_store import MIGRATIONS as PLANS
from kazma.engine.swarm.store import MIGRATIONS as SWARM


def all_migrations() -> list[Migration]:
    """Every layer's schema, in the order layers depend on each other."""
    return [*APPROVALS, *OUTBOX, *PLANS, *HISTORY, *SWARM]


async def open_store(config: KazmaConfig, path: Path | None = None) -> aiosqlite.Connection:
    return await open_database(
        path or config.store.path,
        busy_timeout_ms=config.store.busy_timeout_ms,
        migrations=all_migrations(),
    )
