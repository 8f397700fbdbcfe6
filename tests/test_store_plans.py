"""The approvals store's hot statements use the indexes meant for them (SQLite's query plans)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg

from kazma.approvals import MIGRATIONS
from kazma.approvals.store import _CAS_BEFORE_DEADLINE, _PRESS_CARDS, _SEALED_FIELDS
from kazma.config.store.database import open_database
from kazma.config.store.postgres import open_pg_store
from kazma.engine.transcript import MIGRATIONS as TRANSCRIPT
from kazma.engine.transcript import PG_MIGRATIONS as TRANSCRIPT_PG
from kazma.engine.transcript import PRUNE


async def plans(path: Path, statements: list[tuple[str, tuple[object, ...]]]) -> list[str]:
    conn = await open_database(path, migrations=MIGRATIONS)
    await conn.close()
    raw = sqlite3.connect(path)
    try:
        return [
            " ".join(str(row[3]) for row in raw.execute("EXPLAIN QUERY PLAN " + sql, args)) for sql, args in statements
        ]
    finally:
        raw.close()


async def test_a_decision_goes_by_primary_key_and_the_sweeps_by_the_pending_rows_only(tmp_path: Path) -> None:
    cas, head, cards, overdue, unsettled = await plans(
        tmp_path / "k.db",
        [
            (_CAS_BEFORE_DEADLINE, ("approved", "a", "telegram", 1.0, None, "mac", "k1", "alice", "id", 1.0)),
            (_SEALED_FIELDS, ("id",)),  # what the seal binds, read before the compare-and-set
            (_PRESS_CARDS, ("telegram", "id")),  # the same for a press from a card, with its cards
            ("SELECT id FROM approval_requests WHERE status = 'pending' AND deadline <= ?", (1.0,)),
            (
                "SELECT request_id FROM approval_cards WHERE settled_at IS NULL AND platform = ?"
                " AND (retry_at IS NULL OR retry_at <= ?)",
                ("telegram", 1.0),
            ),
        ],
    )
    assert "sqlite_autoindex_approval_requests_1 (id=?)" in cas
    assert "sqlite_autoindex_approval_requests_1 (id=?)" in head
    assert "sqlite_autoindex_approval_requests_1 (id=?)" in cards
    assert "sqlite_autoindex_approval_cards_1 (request_id=? AND platform=?)" in cards
    assert "approval_requests_open" in overdue  # a partial index: decided requests are not in it
    assert "approval_cards_to_settle" in unsettled


async def test_no_index_holds_every_request_ever_decided(tmp_path: Path) -> None:
    conn = await open_database(tmp_path / "k.db", migrations=MIGRATIONS)
    try:
        rows = await conn.execute_fetchall(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'approval_requests'"
            " AND sql IS NOT NULL"
        )
    finally:
        await conn.close()
    assert {str(name) for name, _ in rows} == {"approval_requests_open"}
    assert all("WHERE status = 'pending'" in str(sql) for _, sql in rows)


async def test_the_transcript_prune_goes_by_time_not_through_every_message(tmp_path: Path) -> None:
    """The prune once read the whole transcript, holding the store's one write lock (decisions queued behind it)
    for as long as the scan of a large store took."""
    path = tmp_path / "k.db"
    conn = await open_database(path, migrations=TRANSCRIPT)
    await conn.close()
    raw = sqlite3.connect(path)
    try:
        plan = " ".join(str(row[3]) for row in raw.execute("EXPLAIN QUERY PLAN " + PRUNE, (1.0,)))
    finally:
        raw.close()
    assert "USING INDEX transcript_by_time (at<?)" in plan, plan


async def test_the_transcript_prune_goes_by_time_on_postgresql(pg_dsn: str) -> None:
    await (await open_pg_store(pg_dsn, migrations=TRANSCRIPT_PG)).close()
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SET enable_seqscan = off")  # a small table is scanned whatever its indexes: ask for one
        plan = " ".join(str(row[0]) for row in conn.execute("EXPLAIN " + PRUNE.replace("?", "%s"), (1.0,)))
    assert "transcript_by_time" in plan, plan
