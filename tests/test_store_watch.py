"""The store vanishing under a running Kazma: SQLite would go on writing decisions into a file nobody will read,
so the watch notices, decisions stop with the reason, people are told, and /healthz says so."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kazma.approvals.model import Decision, PressVerdict, Status
from kazma.bot.store import StoreWatch
from kazma.config.metrics import failure_count
from tests.test_web_server import OPERATOR, Console, console


async def _lose_store_and_watch(con: Console, lose: str) -> str:
    """Make the store go away as ``lose`` says; run a quick watch wired to the app; return its reason."""
    store = con.app.loaded.config.store.path
    fast = StoreWatch(store, con.app._store_lost, interval=0.02)
    running = asyncio.create_task(fast.run())
    if lose == "deleted":
        store.unlink()
    else:
        other = store.with_name("other.db")
        other.write_bytes(b"SQLite format 3\x00 but not Kazma's store")
        other.replace(store)  # one rename: the path never goes missing, only its file changes
    await asyncio.wait_for(running, 5)  # the watch ends once it has reported the loss
    assert fast.lost is not None
    return fast.lost


async def test_a_deleted_store_file_halts_decisions_and_health(tmp_path: Path) -> None:
    async with console(tmp_path) as con, con.client() as client:
        watch = con.app.store_watch
        assert watch is not None  # the app watches the file it opened
        assert watch.check() is None
        request = await con.open_approval({"command": "ls"})
        csrf = await con.login(client, "alice", OPERATOR)
        before = failure_count("store_lost")

        reason = await _lose_store_and_watch(con, "deleted")
        assert reason == f"the store file {tmp_path / 'k.db'} was deleted while Kazma was running"
        assert watch.check() == reason  # the app's own watch sees it too
        assert con.app.service.halted == reason
        assert failure_count("store_lost") == before + 1

        result = await con.app.service.decide(request.id, Decision.APPROVE, actor="web:alice", platform="web")
        assert result.verdict is PressVerdict.REFUSED
        assert result.message == f"Kazma is not deciding right now: {reason}. Nothing was recorded."
        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        assert [e for e in await con.app.service.store.events(request.id) if e.event == "decided"] == []

        pressed = await client.post(
            f"{con.base}/approvals/{request.id}/decide", data={"csrf": csrf, "decision": "approve"}
        )
        assert "Kazma is not deciding right now" in await pressed.text()
        health = await client.get(f"{con.base}/healthz")
        assert health.status == 503
        assert await health.text() == f"not deciding: {reason}"
        told = [m.text for m in con.web.messages() if "stopped deciding approvals" in m.text]
        assert told
        assert reason in told[0]


async def test_a_store_file_replaced_by_another_halts_button_presses(tmp_path: Path) -> None:
    async with console(tmp_path) as con:
        request = await con.open_approval({"command": "ls"})
        reason = await _lose_store_and_watch(con, "replaced")
        assert reason == f"the store file {tmp_path / 'k.db'} was replaced by another file while Kazma was running"
        watch = con.app.store_watch
        assert watch is not None
        assert watch.check() == reason
        press = await con.app.service.decide_from_button(f"kz1:{request.id}:a", actor="web:alice", platform="web")
        assert press.verdict is PressVerdict.REFUSED
        assert reason in press.message
        row = await con.app.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
