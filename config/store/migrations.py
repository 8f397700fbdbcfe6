"""Applying migrations, once for both backends: versions per component, under a lock, in order, recorded.

Every layer that keeps state owns its migrations (additive only: a later release must still read an older
store and an older release must not trip over a newer one). :func:`run_migrations` is the one algorithm; a
:class:`MigrationBackend` supplies only what differs between SQLite and PostgreSQL: how the work is made
exclusive (SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's advisory lock in one transaction) and how a statement runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

log = structlog.get_logger("kazma.store")

# Only additive changes: a later release must still read an older file and an
# older release must not trip over a newer one.
# Dropping an index is allowed too: an index holds no data, and an older release reads the file without it.
_ADDITIVE = re.compile(
    r"^\s*(CREATE\s+(TABLE|INDEX|UNIQUE\s+INDEX|VIEW|TRIGGER)\s+IF\s+NOT\s+EXISTS"
    r"|ALTER\s+TABLE\s+\S+\s+ADD\s+COLUMN|DROP\s+INDEX\s+IF\s+EXISTS)\b",
    re.IGNORECASE,
)
# The statements of the record, in the dialect both backends share (``?`` placeholders).
_RECORDED = "SELECT component, version FROM kazma_schema"
_RECORD = "INSERT INTO kazma_schema (component, version, applied_at) VALUES (?, ?, ?)"


class MigrationError(Exception):
    """A migration is not additive, or its versions are not in order."""


@dataclass(frozen=True)
class Migration:
    component: str
    version: int
    statements: tuple[str, ...]

    def __post_init__(self) -> None:
        for statement in self.statements:
            if not _ADDITIVE.match(statement):
                first = statement.strip().splitlines()[0] if statement.strip() else "(empty)"
                raise MigrationError(
                    f"{self.component} v{self.version}: only CREATE ... IF NOT EXISTS, "
                    f"ALTER TABLE ... ADD COLUMN and DROP INDEX IF EXISTS are allowed, got: {first}"
                )


class MigrationBackend(Protocol):
    """What one backend does its own way while migrations are applied."""

    @property
    def name(self) -> str:
        """The backend as the log names it."""
        ...

    def exclusive(self) -> AbstractAsyncContextManager[None]:
        """One transaction that no other process migrates beside, with the ``kazma_schema`` table in place."""
        ...

    async def execute(self, sql: str, params: Sequence[object] = ()) -> None:
        """Run one statement (``?`` placeholders when ``params`` are given)."""
        ...

    async def fetch(self, sql: str) -> list[Sequence[Any]]:
        """The rows of one query."""
        ...


def check_order(migrations: Sequence[Migration]) -> list[Migration]:
    """The migrations as given, once each component's versions are known to be unique, ascending and from 1."""
    by_component: dict[str, list[int]] = {}
    for migration in migrations:
        by_component.setdefault(migration.component, []).append(migration.version)
    for component, versions in by_component.items():
        if versions != sorted(set(versions)) or versions[0] < 1:
            raise MigrationError(f"{component}: versions must be unique, ascending and start at 1, got {versions}")
    return list(migrations)


async def run_migrations(backend: MigrationBackend, migrations: Iterable[Migration]) -> list[Migration]:
    """Apply every migration not yet recorded, in order, each recorded in the same transaction; the ones applied now.

    A process that waited for the lock finds what the other applied recorded and applies none of it; a
    migration that fails leaves nothing of the transaction behind.
    """
    ordered = check_order(list(migrations))
    applied: list[Migration] = []
    async with backend.exclusive():
        done = {(str(row[0]), int(row[1])) for row in await backend.fetch(_RECORDED)}
        for migration in ordered:
            if (migration.component, migration.version) in done:
                continue
            for statement in migration.statements:
                await backend.execute(statement)
            await backend.execute(_RECORD, (migration.component, migration.version, time.time()))
            applied.append(migration)
    # One line at the default level (a first start applies dozens, which once buried `kazma doctor`'s
    # checklist); each migration at debug.
    for migration in applied:
        log.debug("store.migration_applied", backend=backend.name, component=migration.component,
                  version=migration.version)  # fmt: skip
    if applied:
        components = {m.component: m.version for m in applied}
        log.info("store.migrated", backend=backend.name, applied=len(applied),
                 versions=", ".join(f"{k} v{v}" for k, v in components.items()))  # fmt: skip
    return applied
