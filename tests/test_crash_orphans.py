"""SIGKILL while a request is pending: after a restart its cards end `cancelled` everywhere, nobody can approve it.

`kazma run` runs as a real process against three wire-level fakes. A request
is opened and its cards posted with live buttons on every platform; the
process is killed before anyone decides. The restarted process must end the
orphan (its waiter died with the old process), settle every card to that
outcome with no button left, tell the conversation that asked, and refuse a
press on the stale card.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals.model import Status
from kazma.approvals.service import RESTARTED
from kazma.bot.store import open_store
from kazma.config import load_config
from kazma.config.store.database import connect
from tests.platforms_support import PLATFORMS, TG_ADMIN, TG_CHAT, three_fakes
from tests.process_support import run_kazma
from tests.test_crash_settle import wait_connected


@pytest.mark.slow
async def test_sigkill_with_a_request_pending_then_restart_cancels_it_on_every_card(tmp_path: Path) -> None:
    store_path = tmp_path / "k.db"
    config = tmp_path / "kazma.yaml"
    log = tmp_path / "kazma.log"
    async with three_fakes() as fakes:
        config.write_text(fakes.config_yaml(store_path))
        loaded = load_config(config, environ={})
        first = await run_kazma(config, log)
        conn = await open_store(loaded.config)
        outbox_conn = await connect(store_path)
        service = ApprovalService(ApprovalStore(conn), loaded.config)
        try:
            await wait_connected(fakes, 0)
            request = await service.open(
                "shell", {"command": "rm -rf /srv/old"}, "agent:builder", f"telegram:{TG_CHAT}"
            )
            await Outbox(outbox_conn).enqueue(request.id, list(PLATFORMS))
            await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
            # pending, its cards posted *and recorded* (a kill between a post and its record is the outbox's case)
            async with asyncio.timeout(30):
                while len(await service.store.cards(request.id)) < len(PLATFORMS):
                    await asyncio.sleep(0.02)
            stale_button = str(
                next(
                    b["callback_data"]
                    for m in fakes.telegram.bot_messages(TG_CHAT)
                    for b in m.buttons
                    if str(b["callback_data"]).endswith(":a")
                )
            )
            stale_card = next(m for m in fakes.telegram.bot_messages(TG_CHAT) if m.buttons)
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        assert first.returncode == -signal.SIGKILL
        assert all(fakes.has_buttons(p) for p in PLATFORMS)  # the kill left every card live

        told_before = len(fakes.telegram.bot_messages(TG_CHAT))
        second = await run_kazma(config, log)
        try:
            await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
            row = await service.store.get(request.id)
            assert row is not None
            assert row.status is Status.CANCELLED
            assert row.reason == RESTARTED
            for platform in PLATFORMS:
                text = fakes.card_text(platform)
                assert "CANCELLED" in text, platform
                assert "not a denial" in text, platform
            async with asyncio.timeout(30):
                while any(c.settled_at is None for c in await service.store.cards(request.id)):
                    await asyncio.sleep(0.05)
            # the conversation that asked is told, in words
            await fakes.wait(
                lambda: any(
                    RESTARTED in m.text and request.id in m.text
                    for m in fakes.telegram.bot_messages(TG_CHAT)[told_before:]
                ),
                timeout=30,
            )
            # a press on the stale card (its data still in a client's cache) changes nothing
            query = fakes.telegram.push_callback(TG_CHAT, stale_card.message_id, TG_ADMIN, stale_button)
            answer = await fakes.telegram.wait_for_answer(query, timeout=30)
            assert "cancelled" in str(answer["text"]).lower()
            after = await service.store.get(request.id)
            assert after is not None
            assert after.status is Status.CANCELLED
            assert await service.store.events(request.id, event="decided") == []
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), timeout=60)
            await conn.close()
            await outbox_conn.close()
        assert second.returncode == 0, log.read_text()[-3000:]
