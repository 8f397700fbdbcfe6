"""The approvals API's door in the store, on SQLite and on PostgreSQL: idempotency keys and quotas held by
the store across OS processes, the keys' lifetime, and the order card posts go out in.

Two OS processes on one store (a SQLite file, or a PostgreSQL database) run the API's own code without
HTTP; the same idempotency attack over HTTP on two real `kazma run` replicas is in ``test_api_replicas.py``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from typing import Any

import psycopg

from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalStore
from kazma.bot.api_store import ApiOpen, IdempotencyKeys, QuotaFull
from kazma.config.store.postgres import PgTx
from tests.child_env import child_env
from tests.store_backends import Engine, open_store, raw_rows

KEYS = 100
WAIT = 120.0


async def _opener(engine: Engine, *args: str) -> asyncio.subprocess.Process:
    env = child_env()
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.api_opener", engine.name, engine.where, *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip


async def _race(engine: Engine, *runs: tuple[str, ...]) -> list[dict[str, Any]]:
    """One opener process per ``runs`` entry (its arguments after ENGINE WHERE), all let go at once; their
    JSON answers."""
    async with open_store(engine):  # migrated before any process starts
        pass
    procs = [await _opener(engine, *args) for args in runs]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), WAIT)
            assert line.strip() == b"ready", line + (await proc.stderr.read() if proc.stderr else b"")
        for proc in procs:  # both go at once
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        outputs = await asyncio.gather(*(asyncio.wait_for(p.communicate(), WAIT) for p in procs))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    results: list[dict[str, Any]] = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


async def test_two_processes_asking_with_the_same_keys_open_one_request_per_key(store_engine: Engine) -> None:
    results = await _race(store_engine, (str(KEYS),), (str(KEYS),))
    ids: dict[int, set[str]] = {}
    created: Counter[int] = Counter()
    for result in results:
        for key, request_id, status in result["answers"]:
            assert status in (200, 201)
            ids.setdefault(key, set()).add(request_id)
            created[key] += status == 201
    assert {k for k, v in ids.items() if len(v) != 1} == set()  # each key: one request, in both processes
    assert set(created.values()) == {1}  # ... opened by exactly one of them
    rows = raw_rows(store_engine, "SELECT id FROM approval_requests WHERE requested_by = 'api:ci'")
    assert len(rows) == KEYS
    published = Counter(rid for result in results for rid in result["published"])
    assert set(published) == {r[0] for r in rows}
    assert set(published.values()) == {1}  # one card each
    keys = raw_rows(store_engine, "SELECT replays FROM api_idempotency WHERE token_name = 'ci'")
    assert sorted(int(r[0]) for r in keys) == [1] * KEYS  # the other process's ask: a count, no audit row
    audit = raw_rows(store_engine, "SELECT event FROM approval_events WHERE event LIKE 'api_%'")
    assert Counter(r[0] for r in audit) == {"api_opened": KEYS}


async def test_keys_live_until_a_day_past_their_requests_deadline(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        keys = IdempotencyKeys(conn)
        store = ApprovalStore(conn)
        request = await store.insert(
            tool="deploy", args_json="{}", args_hash="h", requested_by="api:ci", conversation="api:ci",
            deadline=1_000.0, task_id=None,
        )  # fmt: skip
        assert await keys.keep("ci", "old", "b1", request.id, expires_at=1_000.0 + 86_400)
        assert await keys.keep("ci", "new", "b2", request.id, expires_at=5_000.0 + 86_400)
        assert await keys.forget_expired(now=1_000.0 + 86_400) == 0  # not before its end
        assert await keys.forget_expired(now=1_001.0 + 86_400) == 1
        assert await keys.find("ci", "old") is None
        assert await keys.find("ci", "new") == (request.id, "b2")


async def test_two_processes_together_never_exceed_a_tokens_quota(store_engine: Engine) -> None:
    results = await _race(store_engine, ("20", "7", "a-"), ("20", "7", "b-"))
    statuses = Counter(status for result in results for _, _, status in result["answers"])
    assert statuses == {201: 7, 429: 33}
    rows = raw_rows(store_engine, "SELECT COUNT(*) FROM approval_requests WHERE status = 'pending'")
    assert rows[0][0] == 7
    assert raw_rows(store_engine, "SELECT COUNT(*) FROM api_idempotency")[0][0] == 7  # refused: no key kept


async def test_agents_cards_go_first_and_api_tokens_take_turns(store_engine: Engine) -> None:
    async with open_store(store_engine) as conn:
        store, outbox = ApprovalStore(conn), Outbox(conn)
        order = ["api:ci", "api:ci", "api:ci", "agent:builder", "api:other", "agent:lead"]
        opened = []
        for n, requester in enumerate(order):
            request = await store.insert(
                tool="deploy", args_json=f'{{"n":{n}}}', args_hash=f"h{n}", requested_by=requester,
                conversation=requester, deadline=time.time() + 600, task_id=None,
            )  # fmt: skip
            await outbox.enqueue(request.id, ["telegram"])
            opened.append(request.id)
        due = [job.request_id for job in await outbox.due("telegram")]
        ci1, ci2, ci3, builder, other, lead = opened
        assert due == [builder, lead, ci1, other, ci2, ci3]


def _pending_row(tx: PgTx, request_id: str, now: float) -> None:
    tx.run(
        "INSERT INTO approval_requests (id, tool, args_json, args_hash, requested_by, conversation, created_at,"
        " deadline) VALUES (?, 'deploy', '{}', 'h', 'api:ci', 'api:ci', ?, ?)",
        (request_id, now, now + 600),
    )


async def test_postgresql_one_tokens_opens_take_turns_so_the_quota_is_exact(pg_dsn: str) -> None:
    """Two transactions of one token on two connections (two replicas' writers): the second waits for the first
    on the token's row and then counts what it committed. Without that turn both would count none pending
    (READ COMMITTED) and both open, past the quota."""
    async with open_store(Engine("postgresql", pg_dsn)):
        pass
    now = time.time()
    gate = ApiOpen(token="ci", actor="api:ci", key=None, body_hash="b", max_pending=1, expires_at=now + 1e5,
                   tool="deploy", args_hash="h", now=now)  # fmt: skip
    with psycopg.connect(pg_dsn, autocommit=True) as first, psycopg.connect(pg_dsn, autocommit=True) as second:
        first_cursor, second_cursor = first.cursor(), second.cursor()
        first_cursor.execute("BEGIN")
        assert gate.admit(PgTx(first_cursor), "req-first") is None
        _pending_row(PgTx(first_cursor), "req-first", now)

        def second_open() -> BaseException | None:
            second_cursor.execute("BEGIN")
            try:
                gate.admit(PgTx(second_cursor), "req-second")
                _pending_row(PgTx(second_cursor), "req-second", now)
                second_cursor.execute("COMMIT")
                return None
            except QuotaFull as exc:
                second_cursor.execute("ROLLBACK")
                return exc

        racing = asyncio.create_task(asyncio.to_thread(second_open))
        waiting = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s"
        async with asyncio.timeout(30):  # the second is held on the token's row, not let through
            while first.execute(waiting, (second.info.backend_pid,)).fetchone() != ("Lock",):
                assert not racing.done(), "the second open went ahead while the first was uncommitted"
                await asyncio.sleep(0.01)
        first_cursor.execute("COMMIT")
        refused = await asyncio.wait_for(racing, 30)
    assert isinstance(refused, QuotaFull)
    assert refused.pending == 1
    rows = raw_rows(Engine("postgresql", pg_dsn), "SELECT id FROM approval_requests")
    assert rows == [("req-first",)]
