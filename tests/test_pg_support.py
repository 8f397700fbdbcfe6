"""The test PostgreSQL server: a real, empty database per test, server-side kills, a clean teardown."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.child_env import child_env
from tests.pg_support import PgDatabase, PostgresServer, PostgresServerError

REPO = Path(__file__).resolve().parent.parent

# Databases handed to earlier tests in this process: each must be gone by the next test.
_earlier: list[PgDatabase] = []


def _user_tables(conn: psycopg.Connection[TupleRow]) -> list[str]:
    rows = conn.execute(
        "SELECT table_name FROM information_schema.tables"
        " WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY table_name"
    ).fetchall()
    return [str(name) for (name,) in rows]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("turn", [1, 2])
def test_each_test_gets_its_own_empty_database(pg_server: PostgresServer, pg_database: PgDatabase, turn: int) -> None:
    with psycopg.connect(pg_database.dsn, autocommit=True) as conn:
        assert _user_tables(conn) == []  # the other turn created `marker` in its own database
        conn.execute("CREATE TABLE marker (turn int)")
        conn.execute("INSERT INTO marker VALUES (%s)", (turn,))
        assert conn.execute("SELECT turn FROM marker").fetchall() == [(turn,)]
        encoding = conn.execute("SHOW server_encoding").fetchone()
        assert encoding == ("UTF8",)
    for earlier in _earlier:
        assert earlier.name != pg_database.name
        assert not pg_server.database_exists(earlier.name), "an earlier test's database was not dropped"
    _earlier.append(pg_database)


def test_parallel_databases_do_not_see_each_other(pg_server: PostgresServer, pg_dsn: str) -> None:
    """Two tests running at once on one server share nothing: rows, notifications, advisory locks."""
    with (
        pg_server.database() as other,
        psycopg.connect(pg_dsn, autocommit=True) as mine,
        psycopg.connect(other.dsn, autocommit=True) as theirs,
        psycopg.connect(other.dsn, autocommit=True) as their_listener,
    ):
        mine.execute("CREATE TABLE requests (id int)")
        assert _user_tables(theirs) == []
        # The leader lease: both tests take the same advisory lock key and both get it.
        assert mine.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)
        assert theirs.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)
        # Wake-ups: a NOTIFY in my database does not reach a LISTEN in theirs.
        their_listener.execute("LISTEN wake")
        mine.execute("NOTIFY wake, 'mine'")
        theirs.execute("NOTIFY wake, 'theirs'")
        payloads = [n.payload for n in their_listener.notifies(timeout=5, stop_after=1)]
        assert payloads == ["theirs"]
        assert [n.payload for n in their_listener.notifies(timeout=0)] == []


async def test_terminate_client_ends_that_clients_connection(
    pg_server: PostgresServer, pg_database: PgDatabase
) -> None:
    victim = await psycopg.AsyncConnection.connect(pg_database.dsn, autocommit=True, application_name="replica-a")
    bystander = await psycopg.AsyncConnection.connect(pg_database.dsn, autocommit=True, application_name="replica-b")
    try:
        await victim.execute("SELECT 1")
        ended = await asyncio.to_thread(pg_server.terminate_client, "replica-a", database=pg_database.name)
        assert ended == 1
        with pytest.raises(psycopg.OperationalError):
            await victim.execute("SELECT 1")
        assert victim.closed
        cur = await bystander.execute("SELECT 1")
        assert await cur.fetchone() == (1,)
        assert pg_server.terminate_client("replica-a", database=pg_database.name) == 0
    finally:
        await victim.close()
        await bystander.close()


def test_terminate_client_refuses_a_name_postgres_would_cut(pg_server: PostgresServer) -> None:
    with pytest.raises(ValueError, match="63 bytes"):
        pg_server.terminate_client("r" * 64)


def test_a_database_left_with_open_connections_is_still_dropped(pg_server: PostgresServer) -> None:
    with pg_server.database() as db:
        leaked = psycopg.connect(db.dsn, autocommit=True)
    assert not pg_server.database_exists(db.name)
    with pytest.raises(psycopg.OperationalError):
        leaked.execute("SELECT 1")
    leaked.close()


def test_server_is_gone_after_stop() -> None:
    server = PostgresServer()
    server.start()
    try:
        directory, port = server.directory, server.port
        with psycopg.connect(server.dsn) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("kazma",)
        assert _port_open(port)
    finally:
        server.stop()
    assert not directory.exists()
    assert not _port_open(port)
    server.stop()  # a second stop is harmless


def test_missing_binaries_are_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "base").mkdir()
    server = PostgresServer(bindir=tmp_path / "bin", base_dir=tmp_path / "base")
    with pytest.raises(PostgresServerError, match=r"initdb.*not found in .*bin.*`postgresql` package"):
        server.start()
    assert list((tmp_path / "base").iterdir()) == []  # nothing created, nothing left behind


@pytest.mark.slow
def test_failing_test_still_stops_the_server(tmp_path: Path) -> None:
    """A pytest run whose test fails still stops the server and removes its directory."""
    record = tmp_path / "server.txt"
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import os
            from pathlib import Path

            def test_fails(pg_server, pg_dsn):
                Path(os.environ["KAZMA_PG_RECORD"]).write_text(f"{pg_server.directory} {pg_server.port}")
                assert False, "this test fails on purpose"
            """
        )
    )
    env = child_env({"KAZMA_PG_RECORD": str(record)})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.pg_support", "-p", "no:cacheprovider",
         "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout
    directory, port = record.read_text().split()
    assert not Path(directory).exists()
    assert not _port_open(int(port))
