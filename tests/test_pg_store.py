"""The approvals store and the card outbox on both backends: SQLite and a real PostgreSQL server.

Every test taking ``backend`` runs twice, once per engine, through the same public methods; the
PostgreSQL runs use the suite's own server (tests/pg_support.py) and a fresh database each.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psycopg
import pytest

from kazma.adapters.outbox import MIGRATIONS as OUTBOX
from kazma.adapters.outbox import Outbox
from kazma.approvals import MIGRATIONS as APPROVALS
from kazma.approvals.model import Status
from kazma.approvals.store import ApprovalStore, CardCheck, CardProblem
from kazma.bot.store import pg_migrations
from kazma.config.store.backend import StoreBackend, Tx
from kazma.config.store.database import open_database
from kazma.config.store.pg_tables import PgTables
from kazma.config.store.postgres import PgStore, apply_pg_migrations, open_pg_store, pyformat
from tests.approvals_support import ManualClock
from tests.pg_support import every_pool_session_opened_now, find_bindir
from tests.store_backends import NO_SERVER, Engine


@dataclass
class Backend:
    """One engine under test: the backend the stores use, and a way around them to the raw database."""

    name: str
    store: StoreBackend
    sqlite: sqlite3.Connection | None = None
    dsn: str | None = None

    def raw(self, sql: str, params: tuple[object, ...] = ()) -> None:
        """A statement straight to the database, as an operator with a SQL shell would send it."""
        if self.sqlite is not None:
            self.sqlite.execute(sql, params)
            return
        assert self.dsn is not None
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(pyformat(sql), params)


@pytest.fixture
async def backend(store_engine: Engine) -> AsyncIterator[Backend]:
    name, where = store_engine.name, store_engine.where
    if name == "sqlite":
        conn = await open_database(where, migrations=[*APPROVALS, *OUTBOX])
        raw = sqlite3.connect(where, isolation_level=None)
        try:
            yield Backend(name, ApprovalStore(conn).tables, sqlite=raw)
        finally:
            raw.close()
            await conn.close()
        return
    store = await open_pg_store(where, migrations=pg_migrations())
    try:
        yield Backend(name, store, dsn=where)
    finally:
        await store.close()


def _integrity_errors() -> tuple[type[Exception], ...]:
    return (sqlite3.IntegrityError, psycopg.IntegrityError)


async def _open(store: ApprovalStore, clock: ManualClock, n: int = 0, *, deadline_in: float = 600) -> str:
    request = await store.insert(
        tool="shell",
        args_json=f'{{"n": {n}}}',
        args_hash=f"hash-{n}",
        requested_by="agent:builder",
        conversation="web:c",
        deadline=clock.now + deadline_in,
        task_id=None,
        notes=("runs in the sandbox",),
    )
    return request.id


async def test_insert_then_get_and_list(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock)
    got = await store.get(request_id)
    assert got is not None
    assert (got.tool, got.args, got.status, got.notes, got.durable) == (
        "shell",
        {"n": 0},
        Status.PENDING,
        ("runs in the sandbox",),
        False,
    )
    assert got.created_at.timestamp() == clock.now  # epoch seconds kept to the microsecond (not float4)
    assert await store.get("nope") is None
    assert [r.id for r in await store.requests(pending_only=True)] == [request_id]
    assert [(e.event, e.actor, e.args_hash) for e in await store.events(request_id)] == [
        ("opened", "agent:builder", "hash-0")
    ]


async def test_finish_is_one_compare_and_set(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock)
    won, row = await store.finish(request_id, Status.APPROVED, actor="slack:U1", platform="slack")
    assert won
    assert row is not None
    assert row.status is Status.APPROVED
    lost, standing = await store.finish(
        request_id, Status.DENIED, actor="telegram:1", platform="telegram", lost_event="press_lost"
    )
    assert not lost
    assert standing is not None
    assert (standing.status, standing.decided_by) == (Status.APPROVED, "slack:U1")
    assert await store.finish("nope", Status.DENIED, actor=None, platform=None) == (False, None)
    late = await _open(store, clock, 1, deadline_in=5)
    clock.advance(10)
    won, row = await store.finish(late, Status.APPROVED, actor="a", platform="web", require_before_deadline=True)
    assert not won
    assert row is not None
    assert row.status is Status.PENDING
    assert await store.overdue() == [late]
    events = [(e.event, e.actor, e.detail) for e in await store.events(request_id)]
    assert events == [
        ("opened", "agent:builder", "tool=shell"),
        ("decided", "slack:U1", "approved"),  # the outcome, on the audit row too
        ("press_lost", "telegram:1", "standing: approved"),
    ]


async def test_press_checks_the_card_in_the_same_operation(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock)

    async def press(card: CardCheck | None, actor: str = "telegram:1") -> tuple[str | None, bool]:
        pressed = await store.press(
            request_id, Status.APPROVED, actor=actor, platform="telegram", reason=None, card=card
        )
        return pressed.problem, pressed.won

    assert await press(CardCheck("telegram", "-100", "7", needs_whole=True)) == (CardProblem.NOT_RECORDED, False)
    await store.record_card(request_id, "telegram", "-100", "7", whole=False)
    assert await press(CardCheck("telegram", "-100", "8", needs_whole=False)) == (CardProblem.NOT_HERE, False)
    assert await press(CardCheck("telegram", "-100", "7", needs_whole=True)) == (CardProblem.CUT, False)
    assert (await store.get(request_id)).status is Status.PENDING  # type: ignore[union-attr]
    assert await press(CardCheck("telegram", "-100", "7", needs_whole=False)) == (None, True)
    assert await press(None, actor="telegram:2") == (None, False)
    assert [e.event for e in await store.events(request_id)] == ["opened", "card_posted", "decided", "press_lost"]


async def test_a_refused_card_edit_is_counted_and_due_at_once_for_another_replica(backend: Backend) -> None:
    """Telegram refused the token (401) on one card's edit: the refusing process waits in its own memory. The rows
    were held by its backoff, every decided card's edit with them, so a replica whose token works left them
    unedited (live buttons) as long; they stay due, the refused one counted as a failed edit."""
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock, replica="a")
    decided = await _open(store, clock, 1)
    waiting = await _open(store, clock, 2)
    for request_id in (decided, waiting):
        await store.record_card(request_id, "telegram", "-100", request_id)
        await store.finish(request_id, Status.DENIED, actor="slack:U1", platform="slack")
    [refused] = await store.cards_to_settle(decided, "telegram")
    assert await store.claim_settle(refused, lease=30)
    assert await store.settle_refused(refused) == 1
    assert await store.settle_attempts(refused) == 1
    due = await store.unsettled_cards("telegram", due_by=clock.now)
    assert sorted(c.request_id for c in due) == sorted([decided, waiting])
    assert await store.next_settle_retry("telegram") is None
    assert await store.claim_settle(refused, lease=30)  # another replica takes it now


async def test_audit_rows_carry_the_request_hash(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock, 3)
    await store.audit(request_id, "execution_started", actor="agent:builder", detail="pid 1")
    await store.audit(None, "store_checked", platform="cli")
    started = await store.events(event="execution_started")
    assert [(e.request_id, e.args_hash, e.detail) for e in started] == [(request_id, "hash-3", "pid 1")]
    loose = await store.events(event="store_checked")
    assert [(e.request_id, e.args_hash, e.platform) for e in loose] == [(None, None, "cli")]
    seqs = [e.seq for e in await store.events()]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == 3


async def test_cards_recorded_retried_and_settled_once(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock)
    await store.record_card(request_id, "telegram", "-100", "7")
    await store.record_card(request_id, "telegram", "-100", "7")  # a second record of one card changes nothing
    await store.record_card(request_id, "slack", "C1", "1.2")
    assert sorted((c.platform, c.chat, c.message_id, c.whole) for c in await store.cards(request_id)) == [
        ("slack", "C1", "1.2", True),
        ("telegram", "-100", "7", True),
    ]
    assert await store.cards_to_settle(request_id, "telegram") == []  # still pending: buttons stay
    await store.finish(request_id, Status.DENIED, actor="slack:U1", platform="slack")
    [card] = await store.cards_to_settle(request_id, "telegram")
    assert await store.settle_failed(card, retry_in=30) == 1
    assert await store.settle_failed(card, retry_in=30) == 2
    assert await store.settle_attempts(card) == 2
    assert await store.next_settle_retry("telegram") == pytest.approx(clock.now + 30)
    assert [c.platform for c in await store.unsettled_cards(due_by=clock.now)] == ["slack"]
    assert {c.platform for c in await store.unsettled_cards()} == {"telegram", "slack"}
    await store.mark_card_settled(card, Status.DENIED)
    await store.mark_card_settled(card, Status.DENIED)  # settled once, audited once
    assert [c.platform for c in await store.unsettled_cards()] == ["slack"]
    assert await store.next_settle_retry("telegram") is None
    settled = await store.events(request_id, event="card_settled")
    assert [e.detail for e in settled] == ["-100/7 -> denied"]


async def test_outbox_enqueue_due_retry_done(backend: Backend) -> None:
    clock = ManualClock()
    outbox = Outbox(backend.store, clock=clock)
    await outbox.enqueue("r1", ["telegram", "slack"])
    await outbox.enqueue("r1", ["telegram"])  # once per (request, platform)
    [job] = await outbox.due("telegram")
    assert (job.request_id, job.platform, job.attempts) == ("r1", "telegram", 0)
    assert await outbox.claim(job, lease=30)
    assert not await outbox.claim(job, lease=30)  # held: nobody else posts it meanwhile
    assert await outbox.due("telegram") == []
    await outbox.retry_later(job, 20, "429")
    assert await outbox.due("telegram") == []
    assert await outbox.next_due_at("telegram") == pytest.approx(clock.now + 20)
    clock.advance(21)
    [again] = await outbox.due("telegram")
    assert again.attempts == 1
    await outbox.done(again, "posted")
    assert await outbox.next_due_at("telegram") is None
    assert await outbox.pending() == [("r1", "slack", 0, None)]


async def test_outbox_an_attempt_that_landed_nothing_is_taken_back_and_kept_posts_say_why(backend: Backend) -> None:
    """An attempt a platform refused before doing anything (a refused token) is no attempt that may have landed a
    card unrecorded; posts kept while the platform refuses Kazma's setup say why, without an attempt."""
    clock = ManualClock()
    outbox = Outbox(backend.store, clock=clock)
    await outbox.enqueue("r1", ["slack"])
    [job] = await outbox.due("slack")
    assert await outbox.claim(job, lease=30)
    await outbox.retry_later(job, 0, "slack card_post: refused", attempted=False)
    assert await outbox.pending() == [("r1", "slack", 0, "slack card_post: refused")]
    await outbox.enqueue("r2", ["slack"])
    kept, upto = await outbox.kept("slack", "Slack refused the bot token")
    assert kept == 2
    assert (await outbox.kept("slack", "Slack refused the bot token", above=upto))[0] == 0  # said once
    assert [(r, a, e) for r, _, a, e in await outbox.pending()] == [
        ("r1", 0, "Slack refused the bot token"),
        ("r2", 0, "Slack refused the bot token"),
    ]
    # Another replica, whose token works, tried r1 since: its newer error stays; a post enqueued since is told.
    await outbox.retry_later(job, 0, "slack card_post: HTTP 503")
    await outbox.enqueue("r3", ["slack"])
    kept, _ = await outbox.kept("slack", "Slack refused the bot token", above=upto)
    assert kept == 1
    assert [(r, e) for r, _, _, e in await outbox.pending()] == [
        ("r1", "slack card_post: HTTP 503"),
        ("r2", "Slack refused the bot token"),
        ("r3", "Slack refused the bot token"),
    ]


async def test_a_refused_post_is_due_at_once_and_every_waiting_post_says_why_unmoved(backend: Backend) -> None:
    """Telegram refused the token (401) on one post: the refusing process waits in its own memory. Every waiting
    post was held by its backoff in the shared rows, so a replica whose token works posted none meanwhile; now they
    stay due, saying why, the refused attempt taken back, and a post claimed elsewhere is left as it is."""
    clock = ManualClock()
    outbox = Outbox(backend.store, clock=clock)
    for request_id in ("r1", "r2", "r3"):
        await outbox.enqueue(request_id, ["telegram"])
    await outbox.enqueue("r4", ["slack"])
    first, second, _ = await outbox.due("telegram")
    assert await outbox.claim(first, lease=100)  # another replica's
    assert await outbox.claim(second, lease=30)
    why = "telegram card_post: InvalidToken: Unauthorized"
    said, highest = await outbox.refused(second, why)
    assert said == 2
    assert [j.request_id for j in await outbox.due("telegram")] == ["r2", "r3"]
    assert [(r, p, a, e) for r, p, a, e in await outbox.pending()] == [
        ("r1", "telegram", 1, None),
        ("r2", "telegram", 0, why),
        ("r3", "telegram", 0, why),
        ("r4", "slack", 0, None),
    ]
    await outbox.enqueue("r5", ["telegram"])  # queued while the refusing process waits: it says why too
    assert (await outbox.kept("telegram", why, above=highest))[0] == 1
    assert [(r, e) for r, p, _, e in await outbox.pending() if p == "telegram"][1:] == [("r2", why), ("r3", why),
                                                                                        ("r5", why)]  # fmt: skip


async def test_a_post_claimed_by_a_replica_that_died_is_due_again_after_its_lease(backend: Backend) -> None:
    clock = ManualClock()
    outbox = Outbox(backend.store, clock=clock)
    await outbox.enqueue("r1", ["telegram"])
    [job] = await outbox.due("telegram")
    assert await outbox.claim(job, lease=30)  # ... and the claimer dies mid-post
    clock.advance(29)
    assert await outbox.due("telegram") == []
    assert await outbox.next_due_at("telegram") == pytest.approx(clock.now + 1)
    clock.advance(1)
    [again] = await outbox.due("telegram")
    assert again.attempts == 1  # the dead replica's attempt is on record
    assert await outbox.claim(again, lease=30)
    assert await outbox.release_claims(live={"local"}) == 0
    assert await outbox.release_claims(live=set()) == 1  # its claimer is gone: due at once
    [third] = await outbox.due("telegram")
    assert third.attempts == 2


async def test_many_claims_of_one_post_at_once_have_one_winner(backend: Backend) -> None:
    outbox = Outbox(backend.store, clock=ManualClock())
    await outbox.enqueue("r1", ["telegram"])
    [job] = await outbox.due("telegram")
    wins = await asyncio.gather(*(outbox.claim(job, lease=30) for _ in range(20)))
    assert wins.count(True) == 1


async def test_a_card_edit_is_claimed_once_and_a_dead_claim_runs_out(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock)
    await store.record_card(request_id, "telegram", "-100", "7")
    await store.finish(request_id, Status.DENIED, actor="telegram:1", platform="telegram", reason=None)
    [card] = await store.unsettled_cards("telegram", due_by=clock.now)
    wins = await asyncio.gather(*(store.claim_settle(card, lease=15) for _ in range(10)))
    assert wins.count(True) == 1
    assert await store.unsettled_cards("telegram", due_by=clock.now) == []  # a scan skips the claimed edit
    clock.advance(15)
    [again] = await store.unsettled_cards("telegram", due_by=clock.now)  # its claimer never came back
    assert await store.claim_settle(again, lease=15)
    assert await store.release_settle_claims(live={"local"}) == 0  # its claimer is alive
    assert await store.release_settle_claims(live={"another"}) == 1  # ... and now it is gone
    assert await store.claim_settle(again, lease=15)
    await store.mark_card_settled(again, Status.DENIED)
    clock.advance(60)
    assert not await store.claim_settle(again, lease=15)  # settled: nothing left to claim


async def test_decided_rows_and_the_audit_are_final_in_the_database(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    request_id = await _open(store, clock)
    pending = await _open(store, clock, 1)
    await store.finish(request_id, Status.APPROVED, actor="slack:U1", platform="slack")
    with pytest.raises(_integrity_errors(), match="final"):
        backend.raw("UPDATE approval_requests SET status = 'denied' WHERE id = ?", (request_id,))
    with pytest.raises(_integrity_errors(), match="final"):
        backend.raw("UPDATE approval_requests SET decided_by = 'someone else' WHERE id = ?", (request_id,))
    backend.raw("UPDATE approval_requests SET reason = 'still open' WHERE id = ?", (pending,))  # pending: allowed
    with pytest.raises(_integrity_errors(), match="append-only"):
        backend.raw("UPDATE approval_events SET actor = 'someone else'")
    with pytest.raises(_integrity_errors(), match="append-only"):
        backend.raw("DELETE FROM approval_events")
    if backend.name == "postgresql":
        with pytest.raises(psycopg.IntegrityError, match="append-only"):
            backend.raw("TRUNCATE approval_events")
    row = await store.get(request_id)
    assert row is not None
    assert (row.status, row.decided_by) == (Status.APPROVED, "slack:U1")
    assert len(await store.events()) == 3


async def test_a_failing_operation_leaves_the_rest_of_its_group(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    ids = [await _open(store, clock, n) for n in range(6)]
    writer = await backend.store.writer()

    def broken(tx: Tx) -> None:
        tx.run("INSERT INTO approval_events (request_id, event, at) VALUES (?, ?, ?)", ("x", "half", 1.0))
        tx.run("INSERT INTO no_such_table VALUES (1)")

    presses = [store.finish(rid, Status.APPROVED, actor=f"a{n}", platform="web") for n, rid in enumerate(ids)]
    results = await asyncio.gather(*presses[:3], writer.submit(broken), *presses[3:], return_exceptions=True)
    assert isinstance(results[3], sqlite3.OperationalError | psycopg.errors.UndefinedTable)
    assert [r[0] for r in results if isinstance(r, tuple)] == [True] * 6
    assert await store.events(event="half") == []  # nothing of the failed operation stays
    assert len(await store.events(event="decided")) == 6


async def test_many_presses_in_one_process_have_one_winner_each(backend: Backend) -> None:
    clock = ManualClock()
    store = ApprovalStore(backend.store, clock=clock)
    ids = [await _open(store, clock, n) for n in range(100)]
    presses = [
        store.press(rid, status, actor=actor, platform="web", reason=None, card=None)
        for rid in ids
        for actor, status in (("web:a", Status.APPROVED), ("web:b", Status.DENIED), ("web:c", Status.APPROVED))
    ]
    results = await asyncio.gather(*presses)
    winners: dict[str, int] = {}
    for pressed in results:
        assert pressed.request is not None
        assert pressed.request.status is not Status.PENDING
        winners[pressed.request.id] = winners.get(pressed.request.id, 0) + pressed.won
    assert winners == dict.fromkeys(ids, 1)
    assert len(await store.events(event="decided")) == 100
    assert len(await store.events(event="press_lost")) == 200


# -- PostgreSQL only --------------------------------------------------------------------------


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    if find_bindir() is None:
        pytest.skip(NO_SERVER)
    return str(request.getfixturevalue("pg_dsn"))


async def test_replicas_starting_together_migrate_once(pg_url: str) -> None:
    applied = await asyncio.gather(*(apply_pg_migrations(pg_url, pg_migrations()) for _ in range(3)))
    assert sorted(len(a) for a in applied) == [0, 0, len(pg_migrations())]
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT component, version FROM kazma_schema ORDER BY 1, 2").fetchall()
    assert rows == sorted((m.component, m.version) for m in pg_migrations())
    assert ("approvals", 5) in rows
    assert await apply_pg_migrations(pg_url, pg_migrations()) == []


async def test_two_writers_on_one_database_lock_rows_in_opposite_orders(pg_url: str) -> None:
    """Two replicas' groups taking the same rows in opposite orders: no deadlock, one winner each."""
    first = await open_pg_store(pg_url, migrations=pg_migrations(), application_name="replica-a")
    second = await open_pg_store(pg_url, migrations=pg_migrations(), application_name="replica-b")
    try:
        clock = ManualClock()
        a, b = ApprovalStore(first, clock=clock), ApprovalStore(second, clock=clock)
        ids = [await _open(a, clock, n) for n in range(60)]

        def presses(store: ApprovalStore, order: list[str], actor: str) -> list[asyncio.Future[tuple[bool, object]]]:
            return [
                asyncio.ensure_future(store.finish(rid, Status.APPROVED, actor=actor, platform="web")) for rid in order
            ]

        results = await asyncio.wait_for(
            asyncio.gather(*presses(a, ids, "web:a"), *presses(b, ids[::-1], "web:b")), timeout=30
        )
        wins = [won for won, _ in results]
        assert sum(wins) == 60
        assert len(await a.events(event="decided")) == 60
    finally:
        await first.close()
        await second.close()


async def test_a_lost_connection_fails_the_group_and_the_next_one_reconnects(pg_url: str) -> None:
    store = await open_pg_store(pg_url, migrations=pg_migrations(), application_name="kazma-lossy")
    try:
        clock = ManualClock()
        approvals = ApprovalStore(store, clock=clock)
        request_id = await _open(approvals, clock)
        with psycopg.connect(pg_url, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE application_name = 'kazma-lossy-writer') t"
            ).fetchone()
        assert ended == (1,)
        with pytest.raises(psycopg.OperationalError):
            await approvals.finish(request_id, Status.APPROVED, actor="web:a", platform="web")
        won, row = await approvals.finish(request_id, Status.DENIED, actor="web:b", platform="web")
        assert won
        assert row is not None
        assert row.decided_by == "web:b"
    finally:
        await store.close()


async def test_a_transaction_on_a_pool_session_opened_while_the_database_was_read_only_is_taken_once_it_takes_writes(
    pg_url: str,
) -> None:
    """A pool session takes the database's default_transaction_read_only when it opens and keeps it: after the
    operator's RESET, a plan step's, a transcript's or the audit's transaction that landed on one opened in the
    read-only time was refused (ReadOnlySqlTransaction), every write of the writer taken, until the pool
    replaced the session an hour later."""
    store = await open_pg_store(pg_url, migrations=pg_migrations(), application_name="kazma-stale")
    try:
        tables = PgTables.of(store)
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            database = psycopg.sql.Identifier(admin.info.dbname)
            await admin.execute(
                psycopg.sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database)
            )
            try:
                await every_pool_session_opened_now(store.pool, "on")
                with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                    async with tables.transaction() as tx:
                        await tx.run("DELETE FROM kazma_schema WHERE component = 'nobody'")
            finally:
                await admin.execute(
                    psycopg.sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database)
                )
        async with tables.transaction() as tx:
            assert await tx.run("DELETE FROM kazma_schema WHERE component = 'nobody'") == 0
    finally:
        await store.close()


def test_placeholders_are_translated_outside_quotes_only() -> None:
    assert pyformat("SELECT * FROM t WHERE a = ? AND b LIKE 'x?%' AND c = ?") == (
        "SELECT * FROM t WHERE a = %s AND b LIKE 'x?%%' AND c = %s"
    )
    assert pyformat("SELECT 5 % ?") == "SELECT 5 %% %s"


async def test_an_approvals_store_on_postgresql_has_no_sqlite_connection(pg_url: str) -> None:
    store: PgStore = await open_pg_store(pg_url, migrations=pg_migrations())
    try:
        with pytest.raises(RuntimeError, match="not on SQLite"):
            _ = ApprovalStore(store).conn
        with pytest.raises(RuntimeError, match="not on SQLite"):
            _ = Outbox(store).conn
    finally:
        await store.close()


async def test_an_operation_held_up_by_another_replicas_lock_lets_its_group_commit(pg_url: str) -> None:
    """A row locked by another transaction: the rest of the group is answered at once, that press once it is free."""
    store = await open_pg_store(pg_url, migrations=pg_migrations(), application_name="kazma-held")
    holder = await psycopg.AsyncConnection.connect(pg_url)  # not autocommit: its lock stays until it commits
    try:
        clock = ManualClock()
        approvals = ApprovalStore(store, clock=clock)
        held = await _open(approvals, clock, 0)
        free = [await _open(approvals, clock, n) for n in range(1, 4)]
        await holder.execute("UPDATE approval_requests SET reason = 'held by another replica' WHERE id = %s", (held,))
        writer = await store.writer()
        # Submitted in one turn of the loop: one group, the held row first.
        held_press = asyncio.ensure_future(approvals.finish(held, Status.APPROVED, actor="web:a", platform="web"))
        free_presses = [
            asyncio.ensure_future(approvals.finish(rid, Status.DENIED, actor="web:a", platform="web")) for rid in free
        ]
        answered = await asyncio.wait_for(asyncio.gather(*free_presses), timeout=10)
        assert [won for won, _ in answered] == [True, True, True]
        assert not held_press.done()  # still waiting for the other transaction, on its own
        await holder.commit()
        won, row = await asyncio.wait_for(held_press, timeout=10)
        assert won
        assert row is not None
        assert (row.status, row.reason) == (Status.APPROVED, None)
        assert writer.run_alone == 4  # the group went one operation per transaction, the held one last
    finally:
        await holder.close()
        await store.close()


async def test_the_compare_and_set_finds_its_row_by_primary_key_before_any_statistics(pg_url: str) -> None:
    """Many pending rows on a table PostgreSQL has not analysed yet: one press must not scan them all."""
    store = await open_pg_store(pg_url, migrations=pg_migrations())
    await store.close()
    now = 1_800_000_000.0
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.cursor().executemany(
            "INSERT INTO approval_requests (id, tool, args_json, args_hash, requested_by, conversation,"
            " created_at, deadline) VALUES (%s, 'shell', '{}', 'h', 'agent:b', 'web:c', %s, %s)",
            [(f"r{i}", now, now + 600) for i in range(3000)],
        )
        plan = conn.execute(
            "EXPLAIN UPDATE approval_requests SET status = 'approved' WHERE id = %s AND status = 'pending'"
            " AND deadline > %s",
            ("r7", now),
        ).fetchall()
    text = "\n".join(str(row[0]) for row in plan)
    assert "approval_requests_pkey" in text, text
