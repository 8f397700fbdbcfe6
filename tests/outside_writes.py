"""Writes to a SQLite store made around Kazma, from a test whose event loop may be running a live Kazma.

Parts of Kazma hold SQLite's write lock across event-loop turns (``BEGIN IMMEDIATE``, statements awaited on
aiosqlite, ``COMMIT``). A blocking write made on the loop itself would wait for a commit that cannot come until
the loop runs again, and give up after the busy timeout ("database is locked"). So the write runs in a thread;
the loop goes on, Kazma commits, and the write gets the lock.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Statement = tuple[str, Sequence[Any]]


async def write_around(path: Path | str, statements: Iterable[Statement | str], *, timeout: float = 30.0) -> None:
    """Run ``statements`` (SQL, or SQL with its parameters) in order on a connection of their own to ``path``, off
    the event loop, committed as ``with sqlite3.connect(path) as raw:`` commits them; then close it.

    ``timeout``: how long to wait for the write lock. Longer than SQLite's 5 s: a busy machine may keep a live
    Kazma's transactions going a while, and a test that wants the lock refused makes its own connection."""
    await asyncio.to_thread(_write_now, str(path), [(s, ()) if isinstance(s, str) else s for s in statements], timeout)


def _write_now(path: str, statements: list[Statement], timeout: float) -> None:
    raw = sqlite3.connect(path, timeout=timeout)
    try:
        with raw:  # committed when every statement ran, rolled back if one failed
            for sql, params in statements:
                raw.execute(sql, params)
    finally:
        raw.close()
