from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kazma.config.store.database import (
    Migration,
    MigrationError,
    Tables,
    apply_migrations,
    connect,
    open_database,
    schema_versions,
)

NOTES_V1 = Migration("notes", 1, ("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)",))
NOTES_V2 = Migration("notes", 2, ("ALTER TABLE notes ADD COLUMN author TEXT",))


async def test_pragmas(tmp_path: Path) -> None:
    conn = await connect(tmp_path / "a" / "k.db", busy_timeout_ms=1234)
    try:
        assert (await (await conn.execute("PRAGMA journal_mode")).fetchone()) == ("wal",)
        assert (await (await conn.execute("PRAGMA synchronous")).fetchone()) == (2,)  # FULL
        assert (await (await conn.execute("PRAGMA busy_timeout")).fetchone()) == (1234,)
    finally:
        await conn.close()


async def test_migrations_apply_once_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    conn = await open_database(path, migrations=[NOTES_V1])
    await conn.execute("INSERT INTO notes (body) VALUES ('kept')")
    await conn.close()

    conn = await connect(path)
    try:
        applied = await apply_migrations(conn, [NOTES_V1, NOTES_V2])
        assert applied == [NOTES_V2]
        assert await apply_migrations(conn, [NOTES_V1, NOTES_V2]) == []
        assert await schema_versions(conn) == {"notes": 2}
        rows = await (await conn.execute("SELECT body, author FROM notes")).fetchall()
        assert [tuple(r) for r in rows] == [("kept", None)]
    finally:
        await conn.close()


@pytest.mark.parametrize(
    "statement",
    ["DROP TABLE notes", "ALTER TABLE notes RENAME TO old", "CREATE TABLE notes (id INTEGER)", "DELETE FROM notes"],
)
def test_non_additive_migrations_are_refused(statement: str) -> None:
    with pytest.raises(MigrationError, match=r"only CREATE \.\.\. IF NOT EXISTS"):
        Migration("notes", 3, (statement,))


async def test_versions_out_of_order_are_refused(tmp_path: Path) -> None:
    conn = await connect(tmp_path / "k.db")
    try:
        with pytest.raises(MigrationError, match="ascending"):
            await apply_migrations(conn, [NOTES_V2, NOTES_V1])
    finally:
        await conn.close()


async def test_failed_migration_leaves_nothing_half_applied(tmp_path: Path) -> None:
    broken = Migration("notes", 2, ("ALTER TABLE missing_table ADD COLUMN x TEXT",))
    conn = await connect(tmp_path / "k.db")
    try:
        with pytest.raises(Exception, match="no such table"):
            await apply_migrations(conn, [NOTES_V1, broken])
        assert await schema_versions(conn) == {}
        tables = await (await conn.execute("SELECT name FROM sqlite_master WHERE name='notes'")).fetchall()
        assert tables == []
    finally:
        await conn.close()


_OPENER = textwrap.dedent(
    """
    import asyncio, sys
    from kazma.config.store.database import Migration, open_database

    MIGRATIONS = [
        Migration("notes", 1, ("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)",)),
        Migration("notes", 2, ("ALTER TABLE notes ADD COLUMN author TEXT",)),
    ]

    async def main(path: str, who: str) -> None:
        sys.stdin.readline()  # both processes start, then go together
        conn = await open_database(path, migrations=MIGRATIONS)
        for i in range(200):
            await conn.execute("INSERT INTO notes (body, author) VALUES (?, ?)", (str(i), who))
        await conn.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_two_processes_open_and_migrate_the_same_new_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPENER, str(path), who], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for who in ("a", "b")
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err

    async def count() -> list[tuple[str, int]]:
        conn = await connect(path)
        try:
            rows = await (
                await conn.execute("SELECT author, COUNT(*) FROM notes GROUP BY author ORDER BY 1")
            ).fetchall()
            versions = await schema_versions(conn)
        finally:
            await conn.close()
        assert versions == {"notes": 2}
        return [(str(r[0]), int(r[1])) for r in rows]

    assert asyncio.run(count()) == [("a", 200), ("b", 200)]


async def test_a_transaction_cancelled_while_its_begin_waits_leaves_the_connection_usable(tmp_path: Path) -> None:
    conn = await open_database(tmp_path / "k.db")
    tables = Tables.of(conn)
    try:
        # The connection's thread is busy, so the BEGIN below waits in its queue when the caller is cancelled.
        busy = asyncio.ensure_future(
            conn.execute_fetchall(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000000)"
                " SELECT COUNT(*) FROM n"
            )
        )

        async def write() -> None:
            async with tables.transaction() as tx:
                await tx.run("CREATE TABLE IF NOT EXISTS t (x INTEGER)")

        writer = asyncio.create_task(write())
        async with asyncio.timeout(5):
            while not tables._lock.locked():  # the writer holds the lock: its BEGIN is queued behind the count
                await asyncio.sleep(0)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        await busy
        assert not conn.in_transaction  # the BEGIN that ran after the cancel was rolled back
        async with tables.transaction() as tx:  # and the next transaction starts
            await tx.run("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    finally:
        await conn.close()


def test_a_store_that_cannot_be_opened_leaves_no_thread_to_fail_after_the_loop(tmp_path: Path) -> None:
    """aiosqlite stops its worker thread after a failed connect without waiting for it: the command said its one
    line ("cannot open the SQLite store …: it is a folder"), asyncio.run closed the loop, and the thread's last
    answer then died on the closed loop, a RuntimeError traceback on stderr after the clean line."""
    (tmp_path / "folder").mkdir()
    failed: list[BaseException | None] = []
    before = threading.excepthook

    earlier = set(threading.enumerate())

    def workers_left() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in earlier and t.name.endswith("(_connection_worker_thread)")]

    async def attempt() -> None:
        with pytest.raises(sqlite3.OperationalError):
            await connect(tmp_path / "folder")
        assert workers_left() == []  # ended while the loop could still take its answer

    threading.excepthook = lambda args: failed.append(args.exc_value)
    try:
        asyncio.run(attempt())
        for thread in workers_left():
            thread.join(10)
    finally:
        threading.excepthook = before
    assert failed == []


async def test_a_read_that_fails_part_way_leaves_the_connection_seeing_later_commits(tmp_path: Path) -> None:
    # A text that is not UTF-8 (written around Kazma) fails a read after its first row. aiosqlite's cursor of that
    # read lived on in the exception's traceback with its statement unreset, so the connection kept its snapshot:
    # it never saw another commit (an approval decided elsewhere stayed "pending" to it for good).
    path = tmp_path / "k.db"
    conn = await connect(path)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, s TEXT, v INTEGER)")
        other.execute("INSERT INTO t VALUES (1, 'ok', 0), (2, CAST(X'ff64' AS TEXT), 0)")
        tables = Tables.of(conn)
        for _ in range(2):
            with pytest.raises(sqlite3.OperationalError, match="decode"):
                await tables.all("SELECT s FROM t ORDER BY id")
            with pytest.raises(sqlite3.OperationalError, match="decode"):
                await tables.one("SELECT s FROM t WHERE id = 2")
        for expected in (1, 2):
            other.execute("UPDATE t SET v = v + 1 WHERE id = 1")
            assert await tables.one("SELECT v FROM t WHERE id = 1") == (expected,)
    finally:
        other.close()
        await conn.close()
