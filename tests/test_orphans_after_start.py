"""Orphans are cancelled after the start, in batches, and none of them can be approved meanwhile.

A process died with many requests pending. The next start only fences them
(one read) and serves; their cancelling runs afterwards. These tests press a
stale Approve of an orphan the batches have not reached yet, and check what a
restart always promised: it ends ``cancelled`` ("Kazma restarted before a
decision"), never approved, with no decision on record; every other orphan ends
the same way; a request opened after the start is none of them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kazma.adapters.bus import FanOutBus
from kazma.adapters.web.adapter import WebAdapter
from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals import store as approval_store
from kazma.approvals.card import button_data
from kazma.approvals.model import ApprovalRequest, Decision, PressVerdict, Status, Waits
from kazma.approvals.orphans import BATCH, Orphans
from kazma.approvals.service import REPLICA_GONE, RESTARTED
from kazma.approvals.withdrawal import Gone, withdrawn
from kazma.bot.app import App, build_app
from kazma.bot.store import open_store, pg_migrations
from kazma.config import LoadedConfig, load_config_text
from kazma.config.store.postgres import open_pg_store
from kazma.engine.model import ScriptedProvider
from tests.audit_support import AUDIT_KEY

ORPHANS = 2 * BATCH + 1  # three batches: the last one's orphan is pressed while the first batch commits


def _loaded(tmp: Path) -> LoadedConfig:
    return load_config_text(
        f"""
store: {{path: '{tmp / "state" / "k.db"}'}}
approvals: {{deadline_seconds: 600, approvers: ["telegram:111"]}}
""",
        environ={},
    )


async def _orphans(loaded: LoadedConfig, count: int) -> list[str]:
    """``count`` pending requests whose process is gone (the store closed without deciding them)."""
    conn = await open_store(loaded.config)
    service = ApprovalService(ApprovalStore(conn), loaded.config)
    try:
        opened = await asyncio.gather(
            *(service.open("shell", {"command": f"rm /srv/{n}"}, "agent:builder", "web:console") for n in range(count))
        )
    finally:
        await conn.close()
    return [r.id for r in opened]


async def _started(loaded: LoadedConfig, tmp: Path) -> App:
    app = await build_app(loaded, adapters=[], provider=ScriptedProvider([]), workspace_root=tmp / "ws")
    await app.start()
    return app


async def _all_cancelled(app: App, ids: list[str], reason: str = RESTARTED) -> None:
    async with asyncio.timeout(60):
        while app.service.orphans is not None:
            await asyncio.sleep(0.02)
    for request_id in ids:
        row = await app.service.store.get(request_id)
        assert row is not None
        assert (row.status, row.reason) == (Status.CANCELLED, reason), request_id


async def test_attack_a_stale_approve_on_an_orphan_not_yet_cancelled_cannot_approve_it(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    ids = await _orphans(loaded, ORPHANS)
    pressed = ids[-1]  # the oldest are cancelled first: this one waits for the third batch
    app = await _started(loaded, tmp_path)
    try:
        # Nothing awaited since the start returned: not one batch has run, every orphan is pending in the store.
        fenced = app.service.orphans
        assert isinstance(fenced, Orphans)
        assert len(fenced) == ORPHANS
        assert pressed in fenced
        result = await app.service.decide_from_button(
            button_data(pressed, Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert result.verdict is not PressVerdict.WON, result
        assert "cancelled" in result.message.lower(), result.message
        row = await app.service.store.get(pressed)
        assert row is not None
        assert (row.status, row.reason) == (Status.CANCELLED, RESTARTED)
        assert await app.service.store.events(pressed, event="decided") == []
        # a request opened now, after the start, is no orphan: the batches leave it pending, and it decides
        fresh = await app.service.open("shell", {"command": "make"}, "agent:builder", "web:console")
        await _all_cancelled(app, ids)
        alive = await app.service.store.get(fresh.id)
        assert alive is not None
        assert alive.status is Status.PENDING
        won = await app.service.decide_from_button(
            button_data(fresh.id, Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert won.verdict is PressVerdict.WON
    finally:
        await app.stop()


async def test_presses_racing_the_batches_never_approve_an_orphan(tmp_path: Path) -> None:
    """Approves on every orphan, concurrently with the batches: each ends cancelled, none approved."""
    loaded = _loaded(tmp_path)
    ids = await _orphans(loaded, ORPHANS)
    app = await _started(loaded, tmp_path)
    try:
        results = await asyncio.gather(
            *(
                app.service.decide_from_button(
                    button_data(request_id, Decision.APPROVE), actor="telegram:111", platform="telegram"
                )
                for request_id in reversed(ids)  # the newest first: the batches meet the presses halfway
            )
        )
        assert [r for r in results if r.verdict is PressVerdict.WON] == []
        await _all_cancelled(app, ids)
        for request_id in ids:
            assert await app.service.store.events(request_id, event="decided") == []
    finally:
        await app.stop()


async def test_a_stop_while_the_batches_run_still_tells_every_conversation_whose_orphan_it_cancelled(
    tmp_path: Path,
) -> None:
    """The notices of cancelled orphans were said only after the last batch, in the background: a SIGTERM soon
    after the start cancelled them, and the requests it had cancelled were never said anywhere (the next start
    finds them ended). The stop now says what was cancelled; what was not stays pending for the next start."""
    loaded = _loaded(tmp_path)
    ids = await _orphans(loaded, ORPHANS)
    web = WebAdapter()  # the orphans' conversation ("web:console"): where the notices are said
    app = await build_app(loaded, adapters=[web], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
    await app.start()
    bus = app.bus
    assert isinstance(bus, FanOutBus)
    first_batch = asyncio.Event()

    async def held_after_the_first_batch() -> None:  # the stop arrives while the second batch would begin
        first_batch.set()
        await asyncio.Event().wait()

    bus.rescan = held_after_the_first_batch  # type: ignore[method-assign,assignment]
    try:
        await asyncio.wait_for(first_batch.wait(), 60)
    finally:
        await app.stop()
    told = [m.text for m in web.messages("console") if "was cancelled" in m.text]
    rows = {request_id: await _status(loaded, request_id) for request_id in ids}
    cancelled = [request_id for request_id, status in rows.items() if status is Status.CANCELLED]
    assert len(cancelled) == BATCH  # one batch ran before the stop
    for request_id in cancelled:
        assert sum(request_id in text for text in told) == 1, request_id
    assert all(status is Status.PENDING for request_id, status in rows.items() if request_id not in cancelled)


async def test_the_start_reads_only_the_orphans_ids_and_each_still_ends_with_its_own_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 orphans' whole rows took a fifth of a second of CPU to read before the start served: it reads their
    ids and whether an open /mcp call held each (whose request is withdrawn, not cancelled for a restart), and
    each row is read only as its cancelling writes it."""
    loaded = _loaded(tmp_path)
    ids = await _orphans(loaded, 5)
    conn = await open_store(loaded.config)
    try:  # an /mcp call's request, its connection gone with the process
        held = await ApprovalService(ApprovalStore(conn), loaded.config).open(
            "deploy", {"to": "prod"}, "api:ci", "api:ci", durable=True, waits=Waits.CONNECTION
        )
    finally:
        await conn.close()
    rows_read: list[object] = []
    real = approval_store._row_to_request

    def counted(row: Any) -> ApprovalRequest:
        rows_read.append(row)
        return real(row)

    app = await build_app(loaded, adapters=[], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
    try:
        monkeypatch.setattr(approval_store, "_row_to_request", counted)
        orphans = await Orphans.find(app.service)
        assert (len(orphans), rows_read) == (6, [])  # fenced from their ids alone
        monkeypatch.undo()
        app.service.orphans = orphans
        await orphans.cancel_all(committed=lambda: None)
        assert sorted(r.id for r in orphans.cancelled) == sorted([*ids, held.id])
        for request_id in ids:
            row = await app.service.store.get(request_id)
            assert row is not None
            assert (row.status, row.reason) == (Status.CANCELLED, RESTARTED)
        mcp = await app.service.store.get(held.id)
        assert mcp is not None
        assert (mcp.status, mcp.reason) == (Status.CANCELLED, withdrawn(Gone.RESTARTED))
    finally:
        await app.stores.close()


async def _status(loaded: LoadedConfig, request_id: str) -> Status:
    conn = await open_store(loaded.config)
    try:
        row = await ApprovalStore(conn).get(request_id)
    finally:
        await conn.close()
    assert row is not None
    return row.status


async def test_attack_a_replica_restarted_serves_first_and_its_orphans_cannot_be_approved_meanwhile(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica on PostgreSQL killed with requests pending, started again under its name: its previous
    life's orphans are fenced and cancelled after the start, as on SQLite (they used to be cancelled one
    commit each before it served); a stale Approve on one the batches have not reached cannot approve it."""
    monkeypatch.setenv("KAZMA_REPLICA", "r1")
    monkeypatch.chdir(tmp_path)  # the keys' default place is beside the working directory
    monkeypatch.setenv("KAZMA_DECISION_KEY", "k1:" + "d" * 40)  # shared by replicas, as kazma run requires
    monkeypatch.setenv("KAZMA_AUDIT_KEY", AUDIT_KEY)
    loaded = load_config_text(
        f"""
store: {{url: '{pg_dsn}'}}
approvals: {{deadline_seconds: 600, approvers: ["telegram:111"]}}
""",
        environ={},
    )
    # the previous life of replica r1: its requests, owned by it, pending when it was killed
    store = await open_pg_store(pg_dsn, migrations=pg_migrations())
    previous = ApprovalService(ApprovalStore(store, replica="r1"), loaded.config)
    try:
        opened = await asyncio.gather(
            *(
                previous.open("shell", {"command": f"rm /srv/{n}"}, "agent:builder", "web:console")
                for n in range(ORPHANS)
            )
        )
    finally:
        await store.close()
    ids = [r.id for r in opened]
    app = await _started(loaded, tmp_path)
    try:
        fenced = app.service.orphans
        assert isinstance(fenced, Orphans)  # nothing awaited since the start returned: every one still fenced
        assert len(fenced) == ORPHANS
        pressed = ids[-1]
        result = await app.service.decide_from_button(
            button_data(pressed, Decision.APPROVE), actor="telegram:111", platform="telegram"
        )
        assert result.verdict is not PressVerdict.WON, result
        assert "cancelled" in result.message.lower(), result.message
        await _all_cancelled(app, ids, REPLICA_GONE)
        for request_id in ids:
            assert await app.service.store.events(request_id, event="decided") == []
    finally:
        await app.stop()
