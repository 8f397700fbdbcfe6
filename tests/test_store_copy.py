"""``kazma store copy``: a SQLite store made through the real stores lands whole in PostgreSQL, verified.

The target is a fresh database of the suite's own PostgreSQL server; the copy is read back through the
same stores' public methods on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from kazma.adapters.contract import ChatMove
from kazma.adapters.outbox import Outbox
from kazma.approvals.model import Status
from kazma.approvals.rules import RuleStore
from kazma.approvals.seal import seal_problem
from kazma.approvals.store import ApprovalStore
from kazma.bot.api_store import IdempotencyKeys
from kazma.bot.chat_moves import ChatMoves
from kazma.bot.cli.store_copy import (
    CopyError,
    CopyReport,
    TableCopy,
    copy_store,
    expand_url,
    redact,
    table_hash,
    tables_in,
)
from kazma.bot.console.accounts import AccountStore
from kazma.bot.console.sessions import Opening, SessionStore
from kazma.bot.store import all_migrations, pg_migrations
from kazma.config.store.database import open_database
from kazma.config.store.postgres import PgStore, open_pg_store
from kazma.engine.history import HistoryStore
from kazma.engine.plan import PlanOrigin, PlanSpec, StepSpec, StepStatus
from kazma.engine.plan_store import PlanStore
from kazma.engine.swarm.state_store import SwarmStateStore
from kazma.engine.swarm.store import SwarmTaskStore
from kazma.engine.swarm.types import Pattern, TaskStatus, WorkerResult
from kazma.engine.transcript import TranscriptStore
from tests.approvals_support import TEST_KEYRING
from tests.pg_support import find_bindir

T0 = 1_700_000_000.125

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")


def kazma(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command line in a process of its own (it sets up logging for the whole process)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAZMA_")}
    return subprocess.run([sys.executable, "-m", "kazma.bot.cli", *args], env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return tmp_path / "state" / "kazma.db"


async def _populate(path: Path) -> dict[str, str]:
    """A store with something in every component, made through the stores; the ids to find it by."""
    clock = Clock()
    conn = await open_database(path, migrations=all_migrations())
    try:
        approvals = ApprovalStore(conn, clock=clock, keyring=TEST_KEYRING)
        decided = await approvals.insert(tool="shell", args_json=json.dumps({"cmd": "ls"}), args_hash="h1",
                                         requested_by="agent:builder", conversation="web:c", deadline=T0 + 600,
                                         task_id=None, notes=("runs in the sandbox",))  # fmt: skip
        pending = await approvals.insert(
            tool="write_file", args_json="{}", args_hash="h2", requested_by="agent:b", conversation="web:c",
            deadline=T0 + 600, task_id=None, durable=True,
        )  # fmt: skip
        await approvals.record_card(decided.id, "telegram", "-100", "7")
        clock.now += 2.5
        assert (await approvals.finish(decided.id, Status.APPROVED, actor="telegram:111", platform="telegram"))[0]
        outbox = Outbox(conn, clock=clock)
        await outbox.enqueue(pending.id, ["telegram", "slack"])

        plans = PlanStore(conn, clock=clock)
        plan = await plans.create(
            "web:c",
            PlanSpec(goal="report", steps=[StepSpec(index=1, title="research", assignee="researcher"),
                                           StepSpec(index=2, title="write", assignee="builder")]),
            PlanOrigin("write a report", "web:admin", ("notes.md",)),
        )  # fmt: skip
        assert await plans.set_status(plan.id, 1, StepStatus.PENDING, StepStatus.IN_PROGRESS)
        await plans.record(plan.id, "started", step=1, actor="agent:kazma")
        question = await plans.ask(plan_id=plan.id, step=1, attempt=1, kind="ask_user", conversation="web:c",
                                   asked_by="researcher", question="which year?", choices=("2024", "2025"),
                                   answerer="web:admin")  # fmt: skip

        history = HistoryStore(conn, clock=clock)
        await history.append("web:c", "kazma", "user", "hello", prompt_tokens=5)
        await history.append("web:c", "kazma", "assistant", "hi", completion_tokens=2)

        tasks = SwarmTaskStore(conn, clock=clock)
        run = await tasks.admit(Pattern.PIPELINE, {"prompt": "p"}, owner="web:admin", route="web:c")
        assert await tasks.journal(run, 0, "researcher", WorkerResult("researcher", True, output="notes"))
        assert await tasks.finish(run, TaskStatus.SUCCEEDED, result={"output": "done"}, error=None)
        assert not await tasks.finish(run, TaskStatus.FAILED, result=None, error="late")  # a rejected write
        state = SwarmStateStore(conn, clock=clock)
        await state.save_breaker("builder", "open", 3, 30.0)
        await state.record_call("builder", ok=True, latency=1.25, prompt_tokens=10, completion_tokens=3, cost=0.5)

        transcript = TranscriptStore(conn, clock=clock)
        await transcript.record("web", "c", author="web:admin", name="admin", text="héllo ✓", direction="in")
        sessions = SessionStore(conn, clock=clock)
        await sessions.open(
            "tokenhash", Opening(login="admin", role="operator", proof="passkey", person="admin", identity="web:admin"),
            binding="b", lifetime=1e9, max_sessions=10,
        )  # fmt: skip
        accounts = AccountStore(conn, clock=clock)
        await accounts.invite("admin", created_by="cli:root", lifetime=1e9)
        rules = RuleStore(conn, clock=clock)
        rule = await rules.add(tool="shell", args_hash="h1", conversation="web:c", created_by="telegram:111",
                               created_via="telegram", request_id=decided.id, seconds=3600)  # fmt: skip
        assert await ChatMoves(conn).record(ChatMove("telegram", "-1", "-1001"))
        assert await IdempotencyKeys(conn).keep("ci", "key-1", "bodyhash", pending.id)
    finally:
        await conn.close()
    return {"decided": decided.id, "pending": pending.id, "plan": plan.id, "question": question.id,
            "task": run.task_id, "rule": rule.id}  # fmt: skip


async def _read_back(conn: PgStore, ids: dict[str, str]) -> None:
    """The copy, read through the stores on PostgreSQL: the same things a SQLite reader would see."""
    approvals = ApprovalStore(conn)
    decided = await approvals.get(ids["decided"])
    assert decided is not None
    assert (decided.status, decided.decided_by, decided.notes, decided.args) == (
        Status.APPROVED, "telegram:111", ("runs in the sandbox",), {"cmd": "ls"},
    )  # fmt: skip
    assert decided.created_at.timestamp() == T0
    assert seal_problem(TEST_KEYRING, decided) is None  # its seal made on SQLite verifies on PostgreSQL
    assert [e.event for e in await approvals.events(ids["decided"])] == ["opened", "card_posted", "decided"]
    assert [(c.platform, c.chat, c.message_id) for c in await approvals.cards(ids["decided"])] == [
        ("telegram", "-100", "7")
    ]
    pending = await approvals.get(ids["pending"])
    assert pending is not None
    assert (pending.status, pending.durable) == (Status.PENDING, True)
    assert sorted((p, a) for _, p, a, _ in await Outbox(conn).pending()) == [("slack", 0), ("telegram", 0)]

    plans = PlanStore(conn)
    plan = await plans.load(ids["plan"])
    assert plan is not None
    assert plan.origin == PlanOrigin("write a report", "web:admin", ("notes.md",))
    assert [(s.spec.title, s.status) for s in plan.steps.values()] == [
        ("research", StepStatus.IN_PROGRESS), ("write", StepStatus.PENDING),
    ]  # fmt: skip
    assert [(e.kind, e.actor) for e in await plans.events(ids["plan"])] == [("started", "agent:kazma")]
    assert [q.id for q in await plans.open_questions("web:c")] == [ids["question"]]

    history = HistoryStore(conn)
    assert [m["content"] for m in await history.recent("web:c", "kazma")] == ["hello", "hi"]
    assert await history.usage("web:c") == (5, 2)

    tasks = SwarmTaskStore(conn)
    task = await tasks.get(ids["task"])
    assert task is not None
    assert (task.status, task.result, task.route) == (TaskStatus.SUCCEEDED, {"output": "done"}, "web:c")
    assert [(s.idx, s.worker, s.output) for s in await tasks.journaled(ids["task"])] == [(0, "researcher", "notes")]
    assert [r.attempted_status for r in await tasks.rejected_writes(ids["task"])] == ["failed"]
    state = SwarmStateStore(conn)
    assert [(b.worker, b.failures) for b in await state.breakers()] == [("builder", 3)]

    [entry] = await TranscriptStore(conn).messages("web:c")
    assert (entry.text, entry.at) == ("héllo ✓", T0 + 2.5)
    session = await SessionStore(conn, clock=lambda: T0 + 10).find("tokenhash")
    assert session is not None
    assert session.login == "admin"
    rule = await RuleStore(conn, clock=lambda: T0 + 10).match("shell", "h1", "web:c")
    assert rule is not None
    assert rule.id == ids["rule"]
    assert await ChatMoves(conn).all() == [ChatMove("telegram", "-1", "-1001")]
    assert await IdempotencyKeys(conn).find("ci", "key-1") == (ids["pending"], "bodyhash")


async def test_a_populated_store_is_copied_whole_and_reads_back_the_same(source: Path, pg_dsn: str) -> None:
    ids = await _populate(source)
    report = await copy_store(source, pg_dsn)
    assert report.ok, report.lines()
    by_table = {t.table: t for t in report.tables}
    assert set(by_table) == set(tables_in(all_migrations()))
    assert by_table["approval_events"].source_rows == 4  # opened ×2, card_posted, decided
    assert by_table["card_outbox"].target_rows == 2
    assert all(t.source_hash == t.target_hash for t in report.tables)
    assert report.lines()[-1] == f"{len(report.tables)} tables, {report.rows} rows: every count and hash matches"
    applied = "SELECT component, version, applied_at FROM kazma_schema ORDER BY component, version"
    raw = sqlite3.connect(source)
    try:
        in_sqlite = raw.execute(applied).fetchall()
    finally:
        raw.close()
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(applied).fetchall() == in_sqlite  # the same store, migrated when it was

    store = await open_pg_store(pg_dsn, migrations=pg_migrations())
    try:
        await _read_back(store, ids)
        # identities went past the copied ids: new rows take fresh numbers, and the audit stays append-only
        history = HistoryStore(store)
        await history.append("web:c", "kazma", "user", "after the move")
        seqs = [int(r[0]) for r in await store.all("SELECT seq FROM agent_history ORDER BY seq")]
        assert seqs == [1, 2, 3]
        approvals = ApprovalStore(store)
        assert (await approvals.finish(ids["pending"], Status.DENIED, actor="web:admin", platform="web"))[0]
        assert [e.event for e in await approvals.events(ids["pending"])][-1] == "decided"
        with pytest.raises(psycopg.IntegrityError, match="append-only"):
            await store.all("DELETE FROM approval_events RETURNING seq")
    finally:
        await store.close()


async def test_a_target_holding_kazma_rows_is_refused_and_left_alone(source: Path, pg_dsn: str) -> None:
    await _populate(source)
    assert (await copy_store(source, pg_dsn)).ok
    with psycopg.connect(pg_dsn) as conn:
        before = conn.execute("SELECT COUNT(*) FROM approval_requests").fetchone()
    with pytest.raises(CopyError, match=r"already holds Kazma data \(in approval_requests, approval_events"):
        await copy_store(source, pg_dsn)
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT COUNT(*) FROM approval_requests").fetchone() == before


async def test_an_empty_migrated_target_is_accepted(source: Path, pg_dsn: str) -> None:
    await _populate(source)
    await (await open_pg_store(pg_dsn, migrations=pg_migrations())).close()  # a Kazma started once, no rows
    assert (await copy_store(source, pg_dsn)).ok


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_command_copies_the_configured_store_and_prints_a_summary(tmp_path: Path, pg_dsn: str) -> None:
    store_path = tmp_path / "state" / "kazma.db"
    asyncio.run(_populate(store_path))
    config = tmp_path / "kazma.yaml"
    config.write_text(f"store: {{path: {store_path}}}\n")
    user, _, rest = pg_dsn.partition("@")
    env = {"KAZMA_TEST_PG_USER": user.rpartition("/")[2]}
    result = kazma(["-c", str(config), "store", "copy", "--to", "postgresql://${KAZMA_TEST_PG_USER}@" + rest], env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"copied {store_path} -> {pg_dsn}"
    assert any(line.startswith("approval_events") and line.endswith("ok") for line in lines)
    assert lines[-1].endswith("every count and hash matches")

    again = kazma(["-c", str(config), "store", "copy", "--to", pg_dsn])
    assert again.returncode == 1
    [line] = again.stderr.splitlines()
    assert line.startswith("kazma store copy: the target ")
    assert "already holds Kazma data" in line


def test_an_unreachable_server_is_one_line_without_the_password(tmp_path: Path) -> None:
    store_path = tmp_path / "kazma.db"
    asyncio.run(_populate(store_path))
    url = f"postgresql://kazma:s3cret-pw@127.0.0.1:{_closed_port()}/kazma"
    result = kazma(["store", "copy", "--from", str(store_path), "--to", url, "--connect-timeout", "2"])
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("kazma store copy: cannot reach postgresql://kazma:***@127.0.0.1:")
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_bad_urls_and_missing_variables_are_one_line(tmp_path: Path) -> None:
    store_path = tmp_path / "kazma.db"
    for argv, expected in [
        (["--to", "mysql://x@y/z"], "kazma store copy: --to must be a postgresql:// URL"),
        (["--to", "postgresql://kazma:${KAZMA_NOT_SET_PW}@h/db"],
         "kazma store copy: --to names ${KAZMA_NOT_SET_PW}, which is not set in the environment"),
        (["--to", "postgresql://k@h/db"], f"kazma store copy: no SQLite store at {store_path}"),
    ]:  # fmt: skip
        result = kazma(["store", "copy", "--from", str(store_path), *argv])
        assert result.returncode == 1
        assert result.stderr.splitlines() == [expected]


def test_url_helpers() -> None:
    assert (
        redact("postgresql://kazma:pw@db:5432/k?sslmode=require") == "postgresql://kazma:***@db:5432/k?sslmode=require"
    )
    assert redact("postgresql://kazma@db/k") == "postgresql://kazma@db/k"
    assert expand_url("postgres://u:${PW:-x}@h/d", {"PW": "p@ss"}) == "postgres://u:p@ss@h/d"
    with pytest.raises(CopyError):
        expand_url("sqlite:///x", {})
    # the hash does not depend on row order, and reads each value as the column's kind
    assert table_hash([(1, 2.0, "a"), (2, 3.5, None)], ["int", "float", "text"]) == table_hash(
        [(2, 3.5, None), (1, 2, "a")], ["int", "float", "text"]
    )
    assert table_hash([(1, 2.0, "a")], ["int", "float", "text"]) != table_hash(
        [(1, 2.5, "a")], ["int", "float", "text"]
    )


async def test_identities_go_past_ids_sqlite_used_and_deleted(source: Path, pg_dsn: str) -> None:
    """AUTOINCREMENT never hands an id out twice: neither does the identity after the copy."""
    await _populate(source)
    raw = sqlite3.connect(source)
    try:
        raw.execute("DELETE FROM agent_history WHERE seq = 2")
        raw.commit()
    finally:
        raw.close()
    assert (await copy_store(source, pg_dsn)).ok
    store = await open_pg_store(pg_dsn, migrations=pg_migrations())
    try:
        await HistoryStore(store).append("web:c", "kazma", "user", "after the move")
        assert [int(r[0]) for r in await store.all("SELECT seq FROM agent_history ORDER BY seq")] == [1, 3]
    finally:
        await store.close()


def test_a_mismatch_is_named_in_the_summary() -> None:
    report = CopyReport(
        "k.db",
        "postgresql://k@h/d",
        (TableCopy("plans", 2, 2, "a" * 64, "a" * 64), TableCopy("plan_steps", 3, 2, "b" * 64, "c" * 64)),
    )
    assert not report.ok
    lines = report.lines()
    assert lines[2].endswith("ok")
    assert lines[3].endswith(f"MISMATCH: target has 2 rows, sha256 {'c' * 16}")
    assert lines[-1] == "verification failed for plan_steps"


async def test_text_holding_nul_is_copied_and_reads_back_the_same(source: Path, pg_dsn: str) -> None:
    """SQLite keeps U+0000 in text; PostgreSQL refuses it: the copy escapes it as Kazma's PostgreSQL store does."""
    conn = await open_database(source, migrations=all_migrations())
    try:
        await HistoryStore(conn).append("telegram:-1001", "kazma", "assistant", "a\x00b")
    finally:
        await conn.close()
    report = await copy_store(source, pg_dsn)
    assert report.ok, report
    store = await open_pg_store(pg_dsn, migrations=pg_migrations())
    try:
        assert [m["content"] for m in await HistoryStore(store).recent("telegram:-1001", "kazma")] == ["a\x00b"]
    finally:
        await store.close()
