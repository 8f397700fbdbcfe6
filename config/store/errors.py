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
