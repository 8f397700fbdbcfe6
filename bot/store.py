"""The composition root's view of the store: every layer's migrations, applied at start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiosqlite
import structlog

from kazma.adapters.outbox import MIGRATIONS as OUTBOX
from kazma.adapters.outbox import PG_MIGRATIONS as OUTBOX_PG
from kazma.approvals.rules import MIGRATIONS as RULES
from kazma.approvals.rules import PG_MIGRATIONS as RULES_PG
from kazma.approvals.schema import MIGRATIONS as APPROVALS
from kazma.approvals.schema import PG_MIGRATIONS as APPROVALS_PG
from kazma.bot.api_store import MIGRATIONS as API_IDEMPOTENCY
from kazma.bot.api_store import PG_MIGRATIONS as API_IDEMPOTENCY_PG
from kazma.bot.audit_sink import MIGRATIONS as AUDIT_SINK
from kazma.bot.audit_sink import PG_MIGRATIONS as AUDIT_SINK_PG
from kazma.bot.chat_moves import MIGRATIONS as CHAT_MOVES
from kazma.bot.chat_moves import PG_MIGRATIONS as CHAT_MOVES_PG
from kazma.bot.console.accounts import MIGRATIONS as PEOPLE
from kazma.bot.console.accounts import PG_MIGRATIONS as PEOPLE_PG
from kazma.bot.console.sessions import MIGRATIONS as SESSIONS
from kazma.bot.console.sessions import PG_MIGRATIONS as SESSIONS_PG
from kazma.bot.inbound_claims import MIGRATIONS as INBOUND_CLAIMS
from kazma.bot.inbound_claims import PG_MIGRATIONS as INBOUND_CLAIMS_PG
from kazma.bot.leader_inbound import MIGRATIONS as LEADER_INBOUND
from kazma.bot.leader_inbound import PG_MIGRATIONS as LEADER_INBOUND_PG
from kazma.config import KazmaConfig
from kazma.config.errors import ConfigError, Problem
from kazma.config.metrics import count_failure
from kazma.config.store.database import Migration, open_database
from kazma.config.store.errors import is_busy
from kazma.engine.history import MIGRATIONS as HISTORY
from kazma.engine.history import PG_MIGRATIONS as HISTORY_PG
from kazma.engine.plan_store import MIGRATIONS as PLANS
from kazma.engine.plan_store import PG_MIGRATIONS as PLANS_PG
from kazma.engine.swarm.state_store import MIGRATIONS as SWARM_STATE
from kazma.engine.swarm.state_store import PG_MIGRATIONS as SWARM_STATE_PG
from kazma.engine.swarm.store import MIGRATIONS as SWARM
from kazma.engine.swarm.store import PG_MIGRATIONS as SWARM_PG
from kazma.engine.tools.executions import MIGRATIONS as EXECUTIONS
from kazma.engine.tools.executions import PG_MIGRATIONS as EXECUTIONS_PG
from kazma.engine.transcript import MIGRATIONS as TRANSCRIPT
from kazma.engine.transcript import PG_MIGRATIONS as TRANSCRIPT_PG

if TYPE_CHECKING:
    from kazma.config.store.postgres import PgStore

log = structlog.get_logger("kazma.store")


def all_migrations() -> list[Migration]:
    """Every layer's schema, in the order layers depend on each other."""
    return [
        *APPROVALS,
        *OUTBOX,
        *PLANS,
        *HISTORY,
        *SWARM,
        *SWARM_STATE,
        *CHAT_MOVES,
        *API_IDEMPOTENCY,
        *RULES,
        *TRANSCRIPT,
        *SESSIONS,
        *INBOUND_CLAIMS,
        *EXECUTIONS,
        *AUDIT_SINK,
        *PEOPLE,
        *LEADER_INBOUND,
    ]


def pg_migrations() -> list[Migration]:
    """Every layer's schema on PostgreSQL: the components and versions of :func:`all_migrations`, in its order."""
    return [
        *APPROVALS_PG,
        *OUTBOX_PG,
        *PLANS_PG,
        *HISTORY_PG,
        *SWARM_PG,
        *SWARM_STATE_PG,
        *CHAT_MOVES_PG,
        *API_IDEMPOTENCY_PG,
        *RULES_PG,
        *TRANSCRIPT_PG,
        *SESSIONS_PG,
        *INBOUND_CLAIMS_PG,
        *EXECUTIONS_PG,
        *AUDIT_SINK_PG,
        *PEOPLE_PG,
        *LEADER_INBOUND_PG,
    ]


async def open_pg_store(
    config: KazmaConfig, *, application_name: str = "kazma", connect_timeout: float = 10.0
) -> PgStore:
    """Every component's backend on the configured PostgreSQL database, migrated.

    A server that cannot be reached (or refuses the login) is a :class:`ConfigError` naming ``store.url``
    without its password: the CLI says it in one line instead of a traceback.
    """
    url = config.store.postgres_url
    if url is None:
        raise ValueError("store.url is not a postgresql:// URL")
    from kazma.config.store.postgres import open_pg_store as open_pg  # psycopg only when PostgreSQL is used

    with _pg_unusable(config):
        return await open_pg(
            url, migrations=pg_migrations(), application_name=application_name, connect_timeout=connect_timeout
        )
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: the context manager may swallow)


@contextlib.contextmanager
def _pg_unusable(config: KazmaConfig) -> Iterator[None]:
    """A server that cannot be reached or refuses the login, as one ConfigError line without the password."""
    import psycopg  # only when PostgreSQL is used

    try:
        yield
    except (psycopg.OperationalError, psycopg.errors.InsufficientPrivilege, TimeoutError) as exc:
        said = " ".join((str(exc).strip() or type(exc).__name__).split())
        if config.store.secret:
            said = said.replace(config.store.secret, "***")
        raise ConfigError(
            config.source, [Problem("store.url", f"cannot use PostgreSQL at {config.store.redacted_url}: {said}")]
        ) from None


async def pg_store_made(config: KazmaConfig, *, connect_timeout: float = 10.0) -> bool:
    """Whether the PostgreSQL database holds Kazma's store (its ``kazma_schema`` table), changing nothing."""
    return await pg_schema_recorded(config, connect_timeout=connect_timeout) is not None


async def pg_schema_recorded(config: KazmaConfig, *, connect_timeout: float = 10.0) -> set[tuple[str, int]] | None:
    """The migrations the PostgreSQL store records as applied, or None when the database holds no Kazma store;
    read without changing anything."""
    url = config.store.postgres_url
    if url is None:
        raise ValueError("store.url is not a postgresql:// URL")
    import psycopg  # only when PostgreSQL is used

    with _pg_unusable(config):
        conn = await psycopg.AsyncConnection.connect(
            url, autocommit=True, connect_timeout=max(1, int(connect_timeout)), application_name="kazma-cli-check"
        )
        async with conn:
            cursor = await conn.execute("SELECT to_regclass('kazma_schema') IS NOT NULL")
            row = await cursor.fetchone()
            if not (row and row[0]):
                return None
            cursor = await conn.execute("SELECT component, version FROM kazma_schema")
            return {(str(found[0]), int(found[1])) for found in await cursor.fetchall()}
    raise AssertionError("unreachable")  # pragma: no cover


def sqlite_schema_recorded(path: Path) -> set[tuple[str, int]] | None:
    """The migrations the SQLite store at ``path`` records as applied, or None when it cannot be read here (no
    file, not a Kazma store, locked: :func:`require_existing_store` and ``open_store`` say which)."""
    if str(path) == ":memory:" or not path.is_file() or not_a_store(path) is not None:
        return None
    # A plain read-write connection, as in not_a_store: a mode=ro one leaves -wal and -shm behind.
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            rows = conn.execute("SELECT component, version FROM kazma_schema").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return {(str(row[0]), int(row[1])) for row in rows}


def schema_lag(config: KazmaConfig, recorded: set[tuple[str, int]]) -> str | None:
    """How a store whose ``recorded`` migrations are these is older than this Kazma, or None when it holds every
    one this Kazma applies (a newer store is fine: migrations are additive, an older release reads a newer store).
    """
    needed = [
        (m.component, m.version)
        for m in (pg_migrations() if config.store.backend == "postgresql" else all_migrations())
    ]
    missing = [f"{component} v{version}" for component, version in needed if (component, version) not in recorded]
    if not missing:
        return None
    named = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return f"at schema {len(needed) - len(missing)}, this Kazma needs {len(needed)} (missing {named})"


def older_store_problem(config: KazmaConfig, where: str, lag: str) -> Problem:
    """The refusal of a command that only reads: it would otherwise upgrade, under an older Kazma that may be
    running on it, a store nobody asked to change."""
    return Problem(
        "store.url" if config.store.backend == "postgresql" else store_key(config),
        f"the Kazma store at {where} is {lag}: kazma store migrate (or kazma run) upgrades it; nothing changed",
    )


_SQLITE_HEADER = b"SQLite format 3\x00"


def store_key(config: KazmaConfig) -> str:
    """The setting that named the SQLite file, as a problem line names it."""
    return "store.url" if config.store.url else "store.path"


def not_a_store(path: Path) -> str | None:
    """Why the existing file at ``path`` is not a Kazma store, or None when it is one (or cannot be told here).

    Read before any connection that would change it: SQLite's own open switches a file to WAL, and the
    migrations would add Kazma's tables to whatever database the path names by mistake."""
    try:
        with path.open("rb") as file:
            header = file.read(len(_SQLITE_HEADER))
    except OSError:
        return None  # a folder, an unreadable file: open_store's own error says which
    if not header:
        return "the file is empty"
    if header != _SQLITE_HEADER:
        return "the file is not a SQLite database"
    # A plain read-write connection, not mode=ro: on a WAL file a read-only one leaves -wal and -shm behind,
    # while the last read-write connection to close removes them. Reading sqlite_master changes nothing.
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'kazma_schema'").fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return None  # locked, damaged: open_store's own error says what
    if row is None:
        return "a SQLite database without Kazma's tables (no kazma_schema)"
    return None


def require_existing_store(config: KazmaConfig, path: Path | None = None, *, missing_ok: bool = False) -> None:
    """Refuse a SQLite store.path that holds no Kazma store, creating nothing (``missing_ok``: only a file there
    that is not one).

    A command that only reads or acts on what Kazma recorded (approvals, rules, people, the audit log, the
    swarm's tasks) once made an empty store at a mistyped path and answered from it: "no approval requests",
    "no remembered approvals in force", exit 0, while Kazma's real store was elsewhere."""
    if config.store.backend != "sqlite":
        return
    store_path = path or config.store.path
    if str(store_path) == ":memory:":
        return
    key = store_key(config)
    if not store_path.exists():  # a link to nothing too: opening it made the file it points at
        if missing_ok:
            return
        above = next((p for p in store_path.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            said = f"cannot open the SQLite store {store_path}: {above} is a file, not a folder"
            raise ConfigError(config.source, [Problem(key, said)])
        raise ConfigError(
            config.source,
            [Problem(key, f"no Kazma store at {store_path}: kazma run creates it; check the path")],
        )
    why = not_a_store(store_path)
    if why is not None:
        raise ConfigError(config.source, [Problem(key, f"{store_path} is not a Kazma store: {why}; nothing changed")])


async def require_store(config: KazmaConfig, *, missing_ok: bool = False, current: bool = False) -> None:
    """:func:`require_existing_store` on either backend: on PostgreSQL a database without Kazma's schema is the
    missing file (an empty database got Kazma's schema from a read-only command), asked without changing it.

    ``current`` (the commands that only read): a store an older Kazma made, with fewer migrations applied, is
    refused too, left exactly as it was; opening it would migrate it under the older Kazma that may be running
    on it, for a command that writes nothing."""
    if config.store.backend != "postgresql":
        require_existing_store(config, missing_ok=missing_ok)
        recorded = sqlite_schema_recorded(config.store.path) if current else None
        where = str(config.store.path)
    elif missing_ok and not current:
        return  # nothing to ask the server: opening the store makes it or migrates it, as asked
    else:
        recorded = await pg_schema_recorded(config)
        where = config.store.redacted_url
        if recorded is None and not missing_ok:
            said = f"no Kazma store in {where}: kazma run creates it; check the URL"
            raise ConfigError(config.source, [Problem("store.url", said)])
    if current and recorded is not None and (lag := schema_lag(config, recorded)) is not None:
        raise ConfigError(config.source, [older_store_problem(config, where, lag)])


@contextlib.asynccontextmanager
async def store_for_command(
    config: KazmaConfig, *, create: bool = False, read_only: bool = False
) -> AsyncIterator[aiosqlite.Connection | PgStore]:
    """The configured store, migrated, for one CLI command: a SQLite connection or the PostgreSQL store.

    A command that reads or acts on what Kazma recorded refuses a store that does not exist (a SQLite file, a
    PostgreSQL database without Kazma's schema: :func:`require_store`) instead of creating an empty one.
    ``create`` is for the few documented to make it before ``kazma run`` does (``kazma people invite``, in the
    first steps). A file there that is not a Kazma store is refused either way. ``read_only``: a command that
    writes nothing also refuses a store an older Kazma made instead of migrating it (:func:`require_store`)."""
    await require_store(config, missing_ok=create, current=read_only)
    if config.store.backend == "postgresql":
        pg = await open_pg_store(config, application_name="kazma-cli")
        try:
            yield pg
        finally:
            await pg.close()
        return
    conn = await open_store(config)
    try:
        yield conn
    finally:
        await conn.close()


def prepare_state_dir(store_path: Path) -> Path:
    """The store's folder, private to Kazma's user (0700): it holds the store, the console tokens, the sessions."""
    state = store_path.parent
    if not state.exists():
        state.mkdir(parents=True, mode=0o700)
    elif state.stat().st_uid == os.getuid() and state.stat().st_mode & 0o077:
        os.chmod(state, 0o700)  # created before this rule, or by hand: tighten what is ours
    return state


def private_files(store_path: Path) -> None:
    """The store and its WAL files readable by Kazma's user only (0600)."""
    for path in (
        store_path,
        store_path.with_name(store_path.name + "-wal"),
        store_path.with_name(store_path.name + "-shm"),
    ):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_uid == os.getuid():
                os.chmod(path, 0o600)


async def open_store(config: KazmaConfig, path: Path | None = None) -> aiosqlite.Connection:
    """The SQLite store, migrated (a PostgreSQL store is opened with :func:`open_pg_store`)."""
    if path is None and config.store.backend != "sqlite":
        raise ValueError("store.url names PostgreSQL: open it with open_pg_store")
    store_path = path or config.store.path
    try:
        if str(store_path) != ":memory:":
            prepare_state_dir(store_path)
        conn = await open_database(
            store_path,
            busy_timeout_ms=config.store.busy_timeout_ms,
            migrations=all_migrations(),
        )
    except (OSError, sqlite3.DatabaseError) as exc:
        if isinstance(exc, sqlite3.OperationalError) and is_busy(exc):
            raise  # another process holds the lock: nothing is wrong with store.path
        # A store.path under a file, a folder where the file should be, a file that is not SQLite: every command
        # that opens the store (approvals list, people list, swarm status, run) ended in a traceback.
        if store_path.is_dir():
            said = "it is a folder"
        elif isinstance(exc, FileExistsError | NotADirectoryError) and exc.filename:
            said = f"{exc.filename} is a file, not a folder"
        else:
            said = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(
            config.source, [Problem("store.path", f"cannot open the SQLite store {store_path}: {said}")]
        ) from None
    if str(store_path) != ":memory:":
        private_files(store_path)
    return conn


class StoreWatch:
    """Notices the store file vanishing or being replaced under a running Kazma.

    SQLite keeps writing to the file it opened, even after it was deleted or
    swapped for another: decisions would land in a file nobody will ever read.
    The watch compares the path's inode with the one opened, every
    ``interval`` seconds, and calls ``on_lost`` once with the reason.
    """

    def __init__(self, path: Path, on_lost: Callable[[str], Awaitable[None]], *, interval: float = 2.0) -> None:
        self.path = path
        self.on_lost = on_lost
        self.interval = interval
        info = path.stat()
        self._identity = (info.st_dev, info.st_ino)
        self.lost: str | None = None

    def check(self) -> str | None:
        """Why the store is not the file Kazma opened any more, or None when it still is."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return f"the store file {self.path} was deleted while Kazma was running"
        except OSError as exc:
            return f"the store file {self.path} cannot be reached: {exc}"
        if (info.st_dev, info.st_ino) != self._identity:
            return f"the store file {self.path} was replaced by another file while Kazma was running"
        return None

    async def run(self) -> None:
        while self.lost is None:
            await asyncio.sleep(self.interval)
            reason = self.check()
            if reason is not None:
                self.lost = reason
                count_failure("store_lost")
                log.error("store.lost", path=str(self.path), reason=reason)
                await self.on_lost(reason)
