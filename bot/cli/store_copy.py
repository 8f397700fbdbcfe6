"""Moving a SQLite store into PostgreSQL: every table of every component, in one transaction, verified.

The target must hold no Kazma rows (a database never used, or one migrated by Kazma and left empty). The
PostgreSQL migrations are applied first (their own transaction: a copy that fails leaves an empty, migrated
database, fit for the next attempt); then every table of :func:`~kazma.bot.store.all_migrations` is copied
with ``COPY … FROM STDIN`` in one transaction, identity sequences are moved past the copied ids (and past
SQLite's AUTOINCREMENT high-water marks), the migrations keep the times the source applied them, and each
table is read back from both sides: the row count and a content hash computed the same way on both (each
value read as the PostgreSQL column's kind, each row hashed, the sorted row hashes hashed) must match.

The source is read in one read transaction of its own (WAL gives it a snapshot): a store that a running
Kazma is still writing is copied as it stood at one instant. Stop Kazma first all the same: anything it
writes after that instant stays behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import structlog
from psycopg import sql

from kazma.bot.store import all_migrations, not_a_store, pg_migrations
from kazma.config.env import substitute
from kazma.config.store.database import Migration, open_database
from kazma.config.store.pg_text import nul_safe
from kazma.config.store.postgres import apply_pg_migrations

log = structlog.get_logger("kazma.store")

_CREATE_TABLE = re.compile(r"^\s*CREATE\s+TABLE\s+IF\s+NOT\s+EXISTS\s+(\w+)", re.IGNORECASE)
_FLOAT_TYPES = frozenset({"double precision", "real", "numeric"})
_INT_TYPES = frozenset({"integer", "bigint", "smallint"})
# Per table on the target: (column, data type, is an identity column), in column order.
Columns = dict[str, list[tuple[str, str, bool]]]


class CopyError(Exception):
    """The copy cannot be made or did not verify; the message is one line, with no password in it."""


@dataclass(frozen=True)
class TableCopy:
    """One table, as read back from both sides after the copy."""

    table: str
    source_rows: int
    target_rows: int
    source_hash: str
    target_hash: str

    @property
    def matches(self) -> bool:
        return self.source_rows == self.target_rows and self.source_hash == self.target_hash


@dataclass(frozen=True)
class CopyReport:
    source: str
    target: str  # the URL without its password
    tables: tuple[TableCopy, ...]

    @property
    def ok(self) -> bool:
        return all(t.matches for t in self.tables)

    @property
    def rows(self) -> int:
        return sum(t.source_rows for t in self.tables)

    def lines(self) -> list[str]:
        """The per-table summary people read."""
        width = max([len("table"), *(len(t.table) for t in self.tables)])
        out = [f"copied {self.source} -> {self.target}", f"{'table':<{width}}  {'rows':>8}  sha256"]
        for t in self.tables:
            verdict = "ok" if t.matches else f"MISMATCH: target has {t.target_rows} rows, sha256 {t.target_hash[:16]}"
            out.append(f"{t.table:<{width}}  {t.source_rows:>8}  {t.source_hash[:16]}  {verdict}")
        if self.ok:
            out.append(f"{len(self.tables)} tables, {self.rows} rows: every count and hash matches")
        else:
            bad = ", ".join(t.table for t in self.tables if not t.matches)
            out.append(f"verification failed for {bad}")
        return out


def tables_in(migrations: Iterable[Migration]) -> list[str]:
    """Every table the migrations create, in their order (which is the order of their foreign keys)."""
    names: list[str] = []
    for migration in migrations:
        for statement in migration.statements:
            match = _CREATE_TABLE.match(statement)
            if match and match.group(1) not in names:
                names.append(match.group(1))
    return names


def expand_url(text: str, environ: Mapping[str, str]) -> str:
    """``${VAR}`` / ``${VAR:-default}`` in ``text`` from ``environ``, as in kazma.yaml; a missing one is refused."""
    done = substitute(text, environ)
    if done.missing:
        names = ", ".join(f"${{{name}}}" for _, name in done.missing)
        raise CopyError(f"--to names {names}, which is not set in the environment")
    url = str(done.tree)
    if url.partition("://")[0].lower() not in ("postgresql", "postgres"):
        raise CopyError("--to must be a postgresql:// URL")
    return url


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (what every message shows)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unreadable URL)"
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _scrub(message: str, url: str) -> str:
    """An error's first line, with the URL's password taken out should a library have quoted it."""
    line = (message.strip().splitlines() or [""])[0]
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return line.replace(password, "***") if password else line


# -- reading both sides the same way ------------------------------------------------------------------


def _kind(data_type: str) -> str:
    if data_type in _FLOAT_TYPES:
        return "float"
    if data_type in _INT_TYPES:
        return "int"
    return "text"


def _canonical(value: Any, kind: str) -> Any:
    if value is None:
        return None
    if kind == "float":
        return float(value)
    if kind == "int":
        return int(value)
    return str(value)


def table_hash(rows: Iterable[Sequence[Any]], kinds: Sequence[str]) -> tuple[int, str]:
    """(row count, SHA-256): each row's values as ``kinds`` say, as compact JSON, hashed; the sorted hashes hashed.

    Independent of row order, so neither engine's collation matters.
    """
    digests: list[bytes] = []
    for row in rows:
        values = [_canonical(v, k) for v, k in zip(row, kinds, strict=True)]
        digests.append(hashlib.sha256(json.dumps(values, ensure_ascii=False, separators=(",", ":")).encode()).digest())
    digests.sort()
    return len(digests), hashlib.sha256(b"".join(digests)).hexdigest()


@dataclass(frozen=True)
class _Table:
    name: str
    columns: tuple[str, ...]  # as on PostgreSQL, in its order
    kinds: tuple[str, ...]
    identity: tuple[str, ...]  # identity columns, whose sequences move past the copied ids
    source_select: str  # the SQLite SELECT yielding ``columns`` in order


async def _target_tables(
    conn: psycopg.AsyncConnection[Any], names: Sequence[str]
) -> dict[str, list[tuple[str, str, bool]]]:
    cursor = await conn.execute(
        "SELECT table_name, column_name, data_type, is_identity = 'YES' FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = ANY(%s) ORDER BY table_name, ordinal_position",
        (list(names),),
    )
    found: Columns = {}
    for table, column, data_type, identity in await cursor.fetchall():
        found.setdefault(str(table), []).append((str(column), str(data_type), bool(identity)))
    return found


def _plan(
    source: sqlite3.Connection, names: Sequence[str], target: Mapping[str, list[tuple[str, str, bool]]]
) -> list[_Table]:
    tables: list[_Table] = []
    for name in names:
        if name not in target:
            raise CopyError(f"table {name} is missing on the target after its migrations")
        source_columns = {str(row[1]) for row in source.execute(f"PRAGMA table_info({name})")}
        columns = tuple(c for c, _, _ in target[name])
        # ``rowid`` on PostgreSQL is SQLite's implicit row id made a column: read it by that name.
        missing = [c for c in columns if c not in source_columns and c != "rowid"]
        extra = sorted(source_columns - set(columns))
        if missing or extra:
            raise CopyError(
                f"table {name} differs between the engines: only on PostgreSQL {missing}, only on SQLite {extra}"
            )
        tables.append(
            _Table(
                name,
                columns,
                tuple(_kind(t) for _, t, _ in target[name]),
                tuple(c for c, _, identity in target[name] if identity),
                f"SELECT {', '.join(columns)} FROM {name}",  # noqa: S608 - names from our own migrations
            )
        )
    return tables


async def _kazma_rows(conn: psycopg.AsyncConnection[Any], names: Sequence[str]) -> list[str]:
    """The tables among ``names`` that exist on the target and hold rows."""
    held: list[str] = []
    for name in names:
        cursor = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,))
        row = await cursor.fetchone()
        if row is None or not row[0]:
            continue
        cursor = await conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(sql.Identifier(name)))
        row = await cursor.fetchone()
        if row is not None and row[0]:
            held.append(name)
    return held


def _refuse_if_held(held: Sequence[str], target: str) -> None:
    if held:
        raise CopyError(
            f"the target {target} already holds Kazma data (in {', '.join(held)}): copy only into an empty database"
        )


async def _copy_table(conn: psycopg.AsyncConnection[Any], source: sqlite3.Connection, table: _Table) -> None:
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table.name), sql.SQL(", ").join(sql.Identifier(c) for c in table.columns)
    )
    async with conn.cursor() as cursor, cursor.copy(statement) as copy:
        for row in source.execute(table.source_select):
            await copy.write_row(row)


async def _advance_identities(conn: psycopg.AsyncConnection[Any], source: sqlite3.Connection, table: _Table) -> None:
    """Each identity sequence past the largest id copied (and past SQLite's AUTOINCREMENT high-water mark)."""
    used = 0
    if source.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone():
        row = source.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table.name,)).fetchone()
        used = int(row[0]) if row and row[0] is not None else 0
    for column in table.identity:
        cursor = await conn.execute(
            sql.SQL("SELECT pg_get_serial_sequence(%s, %s), COALESCE(MAX({}), 0) FROM {}").format(
                sql.Identifier(column), sql.Identifier(table.name)
            ),
            (table.name, column),
        )
        found = await cursor.fetchone()
        assert found is not None
        sequence, largest = found
        last = max(int(largest), used)
        # setval(seq, n, true): the next id is n + 1; with no id used, the next is 1.
        await conn.execute("SELECT setval(%s::regclass, %s, %s)", (sequence, max(last, 1), last > 0))


async def _keep_migration_times(conn: psycopg.AsyncConnection[Any], source: sqlite3.Connection) -> None:
    """When each migration was applied, as the source says: a component may read it (the approvals store
    reports approved calls that never ran only for requests decided since its v3), and the copy is the
    same store, not a new one."""
    for component, version, applied_at in source.execute("SELECT component, version, applied_at FROM kazma_schema"):
        await conn.execute(
            "UPDATE kazma_schema SET applied_at = %s WHERE component = %s AND version = %s",
            (float(applied_at), str(component), int(version)),
        )


async def _target_hash(conn: psycopg.AsyncConnection[Any], table: _Table) -> tuple[int, str]:
    cursor = await conn.execute(
        sql.SQL("SELECT {} FROM {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in table.columns), sql.Identifier(table.name)
        )
    )
    return table_hash(await cursor.fetchall(), table.kinds)


# -- the copy ------------------------------------------------------------------------------------------


async def copy_store(
    source_path: Path, target_url: str, *, connect_timeout: float = 10.0, busy_timeout_ms: int = 5000
) -> CopyReport:
    """Copy the SQLite store at ``source_path`` into the empty PostgreSQL database at ``target_url``, verified.

    Raises :class:`CopyError` (one line, no password) when the target cannot be reached, already holds Kazma
    rows, or the schemas differ. The report says per table whether counts and hashes match.
    """
    shown = redact(target_url)
    if not await asyncio.to_thread(source_path.is_file):
        raise CopyError(f"no SQLite store at {source_path}")
    # Before the migrations below: they once added Kazma's tables to whatever SQLite file --from named.
    why = await asyncio.to_thread(not_a_store, source_path)
    if why is not None:
        raise CopyError(f"{source_path} is not a Kazma store: {why}; nothing changed")
    # The source gets the migrations every kazma command applies (additive): both sides then have every column.
    await (await open_database(source_path, busy_timeout_ms=busy_timeout_ms, migrations=all_migrations())).close()
    names = tables_in(all_migrations())
    try:
        conn = await psycopg.AsyncConnection.connect(
            target_url, autocommit=True, connect_timeout=max(1, int(connect_timeout)), application_name="kazma-copy"
        )
    except psycopg.Error as exc:
        raise CopyError(f"cannot reach {shown}: {_scrub(str(exc), target_url)}") from None
    nul_safe(conn)  # a SQLite value holding U+0000 is copied as Kazma's PostgreSQL store writes it
    # Read only, though not opened read-only: a read-only connection cannot open a WAL file whose -shm is gone.
    source = sqlite3.connect(source_path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        async with conn:
            _refuse_if_held(await _kazma_rows(conn, names), shown)  # before the migrations touch anything
            await apply_pg_migrations(target_url, pg_migrations(), application_name="kazma-copy-migrate")
            tables = _plan(source, names, await _target_tables(conn, names))
            source.execute("BEGIN")  # one snapshot of the source for the copy and its hashes
            async with conn.transaction():
                # A replica started meanwhile may have written: checked again where nothing can slip in between.
                for table in tables:
                    await conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(sql.Identifier(table.name)))
                _refuse_if_held(await _kazma_rows(conn, names), shown)
                for table in tables:
                    await _copy_table(conn, source, table)
                    await _advance_identities(conn, source, table)
                await _keep_migration_times(conn, source)
            copies = []
            for table in tables:
                rows, digest = table_hash(source.execute(table.source_select), table.kinds)
                target_rows, target_digest = await _target_hash(conn, table)
                copies.append(TableCopy(table.name, rows, target_rows, digest, target_digest))
            source.execute("COMMIT")
    except psycopg.Error as exc:
        raise CopyError(f"the copy into {shown} failed and was rolled back: {_scrub(str(exc), target_url)}") from None
    finally:
        source.close()
    report = CopyReport(str(source_path), shown, tuple(copies))
    log.info("store.copied", target=shown, tables=len(copies), rows=report.rows, verified=report.ok)
    return report
