"""What a store failure looks like, on either backend, for code that must survive one.

A press, a wait or a cancellation that meets a store it cannot reach must answer "not recorded, try again"
rather than fail: on SQLite that is ``sqlite3.Error`` (a lock, a vanished file) or ``OSError``; on
PostgreSQL any ``psycopg.Error`` (a lost connection, a server that refuses). psycopg is looked up, never
imported: a SQLite-only Kazma does not load it.
"""

from __future__ import annotations

import sqlite3
import sys


def store_errors() -> tuple[type[BaseException], ...]:
    psycopg = sys.modules.get("psycopg")
    extra: tuple[type[BaseException], ...] = (psycopg.Error,) if psycopg is not None else ()
    return (sqlite3.Error, OSError, *extra)


def simulated_failure(where: object, what: str) -> BaseException:
    """The error a failing store raises at ``where`` (a writer's transaction, a backend), for a failpoint's
    ``error`` action: psycopg's ``OperationalError`` on PostgreSQL, sqlite3's otherwise."""
    if type(where).__module__.startswith("kazma.config.store.p"):  # postgres, pg_tables: psycopg is loaded
        psycopg = sys.modules["psycopg"]
        return psycopg.OperationalError(f"{what}: the server closed the connection (failpoint)")  # type: ignore[no-any-return]
    return sqlite3.OperationalError(f"{what}: disk I/O error (failpoint)")


# SQLite's primary result codes for "another connection holds the lock" (SQLITE_BUSY, SQLITE_LOCKED).
_BUSY_CODES = (5, 6)


def is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says another connection holds the database's lock (worth waiting for), by SQLite's result
    code: a message is no test ("no such column: locked" is a schema error, not a lock). An error raised by
    Python code carries no code: then by SQLite's own words for it."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _BUSY_CODES
    return str(exc).startswith(("database is locked", "database table is locked"))


class WriteGivenUp(sqlite3.OperationalError):
    """A write given up at its caller's deadline before it could commit (another connection held the lock until
    then): nothing of it was committed, and nothing of it ever will be. A store error like any other to a caller
    that survives one; one with a deadline to keep (an approved call's start) is told in time, and may say "not
    recorded" knowing the record will not turn up later."""
