"""SIGKILL between a decision and the card edits: after a restart every card is settled.

`kazma run` runs as a real process against three wire-level fakes in this test.
The fakes hang every card edit, an admin presses Approve on Discord, the
process decides and is killed while its edits hang; a new process must finish
the edits from what the store recorded.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals.model import Decision, Status
from kazma.bot.store import open_store
from kazma.config import load_config
from kazma.config.store.database import connect
from tests.fakes.telegram import Fault
from tests.platforms_support import DISCORD_ADMIN, PLATFORMS, Fakes, three_fakes
from tests.process_support import run_kazma


async def wait_connected(fakes: Fakes, since_identifies: int) -> None:
    await fakes.wait(lambda: len(fakes.discord.identifies) > since_identifies, timeout=60)
    polls = len(fakes.telegram.calls_to("getUpdates"))
    await fakes.wait(lambda: len(fakes.telegram.calls_to("getUpdates")) > polls, timeout=60)


@pytest.mark.slow
async def test_sigkill_after_decision_before_edits_then_restart_settles_every_card(tmp_path: Path) -> None:
    store_path = tmp_path / "k.db"
    config = tmp_path / "kazma.yaml"
    log = tmp_path / "kazma.log"
    async with three_fakes() as fakes:
        config.write_text(fakes.config_yaml(store_path))
        loaded = load_config(config, environ={})
        first = await run_kazma(config, log)
        try:
            await wait_connected(fakes, 0)

            # a request opened by another process: the running bus picks its card posts from the outbox
            conn = await open_store(loaded.config)
            outbox_conn = await connect(store_path)
            service = ApprovalService(ApprovalStore(conn), loaded.config)
            request = await service.open("shell", {"command": "deploy --prod"}, "agent:builder", "telegram:-1001")
            await Outbox(outbox_conn).enqueue(request.id, list(PLATFORMS))
            await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)

            fakes.telegram.script("editMessageText", Fault.hang())
            fakes.slack.fail("chat.update", "hang")
            fakes.discord.inject_fault("PATCH", r"/channels/\d+/messages/\d+", "hang")
            fakes.discord.inject_fault("PATCH", r"/webhooks/\d+/.+/messages/@original", "hang")
            await fakes.press("discord", Decision.APPROVE)

            async with asyncio.timeout(60):
                while (row := await service.store.get(request.id)) is None or row.status is Status.PENDING:
                    await asyncio.sleep(0.05)
            assert row.decided_by == f"discord:{DISCORD_ADMIN}"
            await fakes.wait(lambda: len(fakes.telegram.calls_to("editMessageText")) >= 1, timeout=60)
            assert all(c.settled_at is None for c in await service.store.cards(request.id))
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        assert first.returncode == -signal.SIGKILL
        assert all(fakes.has_buttons(p) for p in PLATFORMS)  # the kill left every card live

        identifies = len(fakes.discord.identifies)
        second = await run_kazma(config, log)
        try:
            await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS), timeout=60)
            for platform in PLATFORMS:
                assert f"APPROVED by discord:{DISCORD_ADMIN}" in fakes.card_text(platform), platform
            async with asyncio.timeout(30):
                while any(c.settled_at is None for c in await service.store.cards(request.id)):
                    await asyncio.sleep(0.05)
            assert len(await service.store.events(request.id, event="decided")) == 1
            assert len(fakes.discord.identifies) > identifies
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), timeout=60)
            await conn.close()
            await outbox_conn.close()
        assert second.returncode == 0, log.read_text()[-3000:]
