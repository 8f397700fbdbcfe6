"""A throwaway PostgreSQL server that the test suite starts, owns and removes itself.

`PostgresServer` runs the real server binaries (Debian's ``postgresql`` package) in a temporary
directory, on a free 127.0.0.1 port with its socket in that directory. ``initdb`` and ``postgres``
refuse to run as root, so as root they run as the ``postgres`` system user (``runuser``) in a
directory given to that user; as anyone else they run directly.

The module is also a pytest plugin (registered in ``tests/conftest.py``): one server per test
process (so one per xdist worker), started the first time a test asks for it, and a fresh, empty
database per test (``pg_database`` / ``pg_dsn``), dropped afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

SUPERUSER = "kazma"
ADMIN_APPLICATION = "kazma-test-admin"
# PostgreSQL keeps at most NAMEDATALEN-1 bytes of an application_name; a longer one is cut
# silently and would never match in `terminate_client`.
MAX_APPLICATION_NAME_BYTES = 63
_START_ATTEMPTS = 3
# The timeout makes pg_terminate_backend wait until the backend has exited (PostgreSQL 14+).
_TERMINATE = (
    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
    " WHERE application_name = %s AND pid <> pg_backend_pid() AND (%s::text IS NULL OR datname = %s)"
)
_COMMAND_TIMEOUT = 120.0


class PostgresServerError(RuntimeError):
    """The server could not be found, created, started or stopped; the message carries the output."""


@dataclass(frozen=True)
class PgDatabase:
    """One database on a test server: its name and a DSN that reaches it over TCP."""

    name: str
    dsn: str


def find_bindir() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``: PATH, then ``pg_config --bindir``, then Debian's layout."""
    candidates: list[Path] = []
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("pg_ctl") is not None:
        # PATH may hold symlinks only; the real folder also holds `postgres`, which pg_ctl runs.
        candidates.append(Path(os.path.realpath(initdb)).parent)
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(done.stdout.strip()))
    debian = (Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin"))
    candidates += sorted(debian, key=lambda p: _version_key(p.parent.name), reverse=True)  # newest first
    for folder in candidates:
        if _has_binaries(folder):
            return folder
    return None


def _has_binaries(folder: Path) -> bool:
    return all((folder / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres"))


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _conf_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class PostgresServer:
    """A PostgreSQL server in a temporary directory, for tests only.

    Durability is off (``fsync``, ``synchronous_commit``, ``full_page_writes``): the data is thrown
    away at the end and a crash of the test machine loses nothing we keep. Transactions, locks,
    LISTEN/NOTIFY and every other behaviour are the real server's.
    """

    def __init__(self, *, bindir: Path | None = None, base_dir: Path | None = None) -> None:
        self._bindir = bindir
        self._base_dir = base_dir
        self._dir: Path | None = None
        self._port: int | None = None
        self._admin: psycopg.Connection[TupleRow] | None = None
        self._run_as: list[str] = []

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Create a cluster (``initdb``) and start the server; returns once it accepts connections."""
        if self._dir is not None:
            raise PostgresServerError("the server is already started")
        bindir = self._bindir or find_bindir()
        if bindir is None or not _has_binaries(bindir):
            where = str(bindir) if bindir else "PATH, `pg_config --bindir` or /usr/lib/postgresql/*/bin"
            raise PostgresServerError(
                f"PostgreSQL server binaries (initdb, pg_ctl, postgres) not found in {where}; "
                "install Debian's `postgresql` package (scripts/install-test-deps does)"
            )
        self._bindir = bindir
        self._run_as = self._user_prefix()
        self._dir = Path(tempfile.mkdtemp(prefix="kazma-pg-", dir=self._base_dir))
        atexit.register(self.stop)
        try:
            self._hand_over(self._dir)
            self._run([str(bindir / "initdb"), "-D", str(self.data_dir), "-A", "trust", "-U", SUPERUSER,
                       "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"], "initdb", self._dir)  # fmt: skip
            with (self.data_dir / "postgresql.conf").open("a", encoding="utf-8") as conf:
                conf.write(
                    "\n# kazma test server\n"
                    "listen_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = {_conf_string(str(self._dir))}\n"
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                )
            self._start_on_free_port(bindir)
        except BaseException:
            self.stop()
            raise

    def _start_on_free_port(self, bindir: Path) -> None:
        # The port is free when we look and could be taken before the server binds it (another
        # worker, another test): try again on a new port when the log says the bind failed.
        for attempt in range(1, _START_ATTEMPTS + 1):
            port = _free_port()
            try:
                self._run([str(bindir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_path),
                           "-o", f"-p {port}", "-w", "-t", "60", "start"], "pg_ctl start", self.directory)  # fmt: skip
            except PostgresServerError:
                if attempt < _START_ATTEMPTS and "could not bind" in self.log_text():
                    continue
                raise
            self._port = port
            return

    def stop(self) -> None:
        """Stop the server (``pg_ctl -m fast stop``) and remove its directory; safe to call twice."""
        directory, self._dir = self._dir, None
        if directory is None:
            return
        atexit.unregister(self.stop)
        try:
            if self._admin is not None:
                with contextlib.suppress(psycopg.Error):
                    self._admin.close()
                self._admin = None
            pid_file = directory / "data" / "postmaster.pid"
            # A pid file also after a failed start: pg_ctl may have given up waiting on a live server.
            if pid_file.exists() and self._bindir is not None:
                self._shut_down(self._bindir, directory / "data", pid_file)
        finally:
            self._port = None
            shutil.rmtree(directory, ignore_errors=True)

    def _shut_down(self, bindir: Path, data: Path, pid_file: Path) -> None:
        for mode in ("fast", "immediate"):
            try:
                self._run([str(bindir / "pg_ctl"), "-D", str(data), "-m", mode, "-w", "-t", "30", "stop"],
                          f"pg_ctl stop -m {mode}", data.parent)  # fmt: skip
                return
            except PostgresServerError:
                continue
        # Neither shutdown worked: kill the postmaster; its children notice and exit.
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- where it is --------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        if self._dir is None:
            raise PostgresServerError("the server is not started")
        return self._dir

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def port(self) -> int:
        if self._port is None:
            raise PostgresServerError("the server is not started")
        return self._port

    @property
    def dsn(self) -> str:
        """DSN of the maintenance database ``postgres`` (TCP, superuser ``kazma``, no password)."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except (OSError, PostgresServerError):
            return ""

    # -- databases and clients ----------------------------------------------------------------

    def create_database(self) -> PgDatabase:
        """A new, empty database (copied from ``template0``) with a unique name."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        self._admin_connection().execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        return PgDatabase(name=name, dsn=self.dsn_for(name))

    def drop_database(self, name: str) -> None:
        """Drop a database, ending any connection a test left open to it (``WITH (FORCE)``)."""
        self._admin_connection().execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )

    def database_exists(self, name: str) -> bool:
        row = self._admin_connection().execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        return row is not None

    @contextlib.contextmanager
    def database(self) -> Iterator[PgDatabase]:
        db = self.create_database()
        try:
            yield db
        finally:
            self.drop_database(db.name)

    def terminate_client(self, application_name: str, *, database: str | None = None) -> int:
        """End, from the server side, every connection whose ``application_name`` matches.

        This is what a replica sees when it loses its database: the backend is gone and the
        client's next read fails. Returns the number of backends ended; each one has exited
        when this returns (``pg_terminate_backend`` with a timeout waits for it).
        """
        if len(application_name.encode()) > MAX_APPLICATION_NAME_BYTES:
            raise ValueError(f"application_name longer than {MAX_APPLICATION_NAME_BYTES} bytes never matches")
        cur = self._admin_connection().execute(_TERMINATE, (application_name, database, database))
        rows = cur.fetchall()
        return sum(1 for (ended,) in rows if ended)

    def _admin_connection(self) -> psycopg.Connection[TupleRow]:
        if self._admin is None or self._admin.closed or self._admin.broken:
            self._admin = psycopg.connect(self.dsn, autocommit=True, application_name=ADMIN_APPLICATION)
        return self._admin

    # -- running the server binaries ----------------------------------------------------------

    @staticmethod
    def _user_prefix() -> list[str]:
        if os.geteuid() != 0:
            return []
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresServerError(
                "running as root, and the PostgreSQL server refuses to run as root, but there is no "
                "`postgres` system user to run it as (Debian's `postgresql` package creates it)"
            ) from None
        runuser = shutil.which("runuser")
        if runuser is None:
            raise PostgresServerError("running as root and `runuser` (util-linux) is missing")
        return [runuser, "-u", "postgres", "--"]

    def _hand_over(self, directory: Path) -> None:
        if not self._run_as:
            return
        user = pwd.getpwnam("postgres")
        os.chown(directory, user.pw_uid, user.pw_gid)

    def _run(self, argv: Sequence[str], what: str, cwd: Path) -> None:
        command = [*self._run_as, *argv]
        try:
            # cwd: the server's user may not be allowed into ours (root's home).
            done = subprocess.run(command, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, cwd=cwd)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresServerError(f"{what} failed: {' '.join(command)}: {exc}") from exc
        if done.returncode != 0:
            hint = ""
            if self._run_as and "Permission denied" in done.stderr:
                hint = "\n(as root the server runs as `postgres`, which must reach this folder: point TMPDIR elsewhere)"
            raise PostgresServerError(
                f"{what} failed (exit {done.returncode}): {' '.join(command)}\n"
                f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}--- server log\n{self.log_text()}{hint}"
            )


# -- pytest plugin ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for this test process (one per xdist worker), removed at the end."""
    server = PostgresServer()
    try:
        server.start()
    except PostgresServerError as exc:
        pytest.fail(f"could not start the test PostgreSQL server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_database(pg_server: PostgresServer) -> Iterator[PgDatabase]:
    """A fresh, empty database for this test alone, dropped afterwards (open connections included)."""
    with pg_server.database() as db:
        yield db


@pytest.fixture
def pg_dsn(pg_database: PgDatabase) -> str:
    """DSN of this test's own empty database."""
    return pg_database.dsn


async def every_pool_session_opened_now(pool: AsyncConnectionPool[Any], transaction_read_only: str) -> None:
    """The pool's sessions all replaced by ones opened now, as many as it holds (a pool opens sessions when it
    grows, when one was lost or grew old), each checked to say ``transaction_read_only``: no session opened
    before is left for a later use to land on."""
    await pool.drain()  # the ones out now are closed when they come back
    async with contextlib.AsyncExitStack() as held:
        for _ in range(pool.max_size):
            conn = await held.enter_async_context(pool.connection())
            cursor = await conn.execute("SHOW transaction_read_only")
            assert await cursor.fetchone() == (transaction_read_only,)
