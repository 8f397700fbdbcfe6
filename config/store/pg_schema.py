"""PostgreSQL migrations: the same additive rule as SQLite's, plus the trigger functions PostgreSQL needs.

SQLite states a trigger's body inline; PostgreSQL calls a function, created or
replaced next to it. Replacing a function or trigger changes no data, so it
keeps the rule that a later release still reads an older database. Also the
statements a component has the writer prepare on its connections
(:func:`prepared`). Kept free of the driver: component schemas import this
without importing psycopg.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kazma.config.store.database import Migration

_ROUTINE = re.compile(r"^\s*CREATE\s+OR\s+REPLACE\s+(FUNCTION|TRIGGER)\b", re.IGNORECASE)


@dataclass(frozen=True)
class PgMigration(Migration):
    """A component's migration on PostgreSQL; ``component`` and ``version`` mirror its SQLite list."""

    def __post_init__(self) -> None:
        # Everything but the trigger functions and triggers is held to the SQLite rule.
        Migration(self.component, self.version, tuple(s for s in self.statements if not _ROUTINE.match(s)))


# Statements the PostgreSQL writer prepares (SQL PREPARE) on every connection it opens: the statement as a component
# writes it (``?`` placeholders) -> (the prepared statement's name, its parameters' types).
PREPARED: dict[str, tuple[str, tuple[str, ...]]] = {}


def prepared(name: str, sql: str, types: tuple[str, ...]) -> str:
    """``sql`` (returned as given), which a group sent as one string runs as ``EXECUTE name(…)``, its values the
    same literals, on a writer connection where ``PREPARE name`` succeeded when it opened (elsewhere, and in every
    other path, the statement itself). A statement sent as literals is parsed and planned again each time; a
    prepared one is planned once per session (custom plans for its first executions, then a generic one).
    ``types``: one PostgreSQL type per ``?``, in order."""
    if sql.count("?") != len(types):
        raise ValueError(f"{name}: {sql.count('?')} placeholders but {len(types)} types")
    PREPARED[sql] = (name, types)
    return sql
