"""The PostgreSQL writer sends a transaction's audit rows and notifications as plain values (``ARRAY[?, …]``,
``VALUES``), not as lists psycopg dumps in Python; past a bound they go as arrays again. Attacked at both sides of
each bound: every value lands in its own column and row, in order, text with U+0000 and quotes kept, nothing
lost or repeated."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals.audit_verify import verify
from kazma.approvals.chain import FROM_REQUEST
from kazma.approvals.checkpointer import Checkpointer
from kazma.bot.store import pg_migrations
from kazma.config.store.backend import Tx
from kazma.config.store.pg_text import nul_safe
from kazma.config.store.postgres import PgWriter, open_pg_store
from tests.approvals_support import TEST_KEYRING, TEST_SIGNER, approvals_config
from tests.pg_support import find_bindir

pytestmark = pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries are not installed")

CHANNEL = "kazma_test_plain"
# Either side of the bounds (a single notice; VALUES up to 32; arrays past them. Audit rows: ARRAY[] to 64).
NOTICE_COUNTS = (1, 2, 32, 33, 70)
EVENT_COUNTS = (1, 3, 64, 65, 130)


async def test_a_transactions_notifications_arrive_once_each_in_the_order_asked(pg_dsn: str) -> None:
    listener = psycopg.connect(pg_dsn, autocommit=True)
    nul_safe(listener)
    listener.execute(f"LISTEN {CHANNEL}")
    writer = PgWriter(pg_dsn)
    try:
        sent: list[str] = []
        for count in NOTICE_COUNTS:
            payloads = [f"{count}/{n} it's 100% ?{n} %s" for n in range(count)]
            sent += payloads

            def notifies(tx: Tx, payloads: list[str] = payloads) -> None:
                for payload in payloads:
                    tx.notify(CHANNEL, payload)

            await writer.submit(notifies)
        got: list[str] = []
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            got += [n.payload for n in listener.notifies(timeout=0.5, stop_after=len(sent) - len(got))]
    finally:
        await writer.close()
        listener.close()
    assert got == sent


@pytest.mark.parametrize("count", EVENT_COUNTS)
async def test_audit_rows_of_one_transaction_land_each_in_its_own_row_and_column(pg_dsn: str, count: int) -> None:
    backend = await open_pg_store(pg_dsn, migrations=pg_migrations(), application_name="plain")
    try:
        service = ApprovalService(ApprovalStore(backend, keyring=TEST_KEYRING, audit=TEST_SIGNER), approvals_config())
        store = service.store
        request = await service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-100")
        wanted = [
            (f"event{n}", f"actor:{n}" if n % 3 else None, f"platform{n}", 1000.0 + n + n / 7,
             f"d'{n}\x00\"%s?" if n % 2 else None, f"person{n}" if n % 4 == 1 else None)
            for n in range(count)
        ]  # fmt: skip

        def appends(tx: Tx) -> None:
            for event, actor, platform, at, detail, person in wanted:
                store.chain.append(
                    tx, request.id, event, actor=actor, platform=platform, at=at, args_hash=FROM_REQUEST,
                    detail=detail, person=person,
                )  # fmt: skip

        await store.write(appends)  # the chain's head is known by now: these rows go out on its guess
        await asyncio.gather(store.write(appends), store.write(appends))  # two operations, one transaction
        await Checkpointer(store, TEST_SIGNER, min_interval=0.0).sign()
        events = await store.chain_events(limit=100_000)
        checkpoints = await store.chain_checkpoints(limit=100_000)
    finally:
        await backend.close()
    assert [e.seq for e in events] == list(range(1, 2 + 3 * count))
    for run in range(3):
        rows = events[1 + run * count : 1 + (run + 1) * count]
        assert [(e.event, e.actor, e.platform, e.at, e.detail, e.person) for e in rows] == wanted
        assert {e.request_id for e in rows} == {request.id}
        assert {e.args_hash for e in rows} == {request.args_hash}
    report = verify(events, checkpoints, TEST_SIGNER.public_keys())
    assert report.ok, [p.line() for p in report.problems]
