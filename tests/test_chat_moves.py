"""A Telegram group upgraded to a supergroup changes its chat id: Kazma follows it, keeps it, and says so."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kazma.adapters.admission import Served
from kazma.adapters.contract import ChatMove
from kazma.adapters.telegram import TelegramAdapter
from kazma.approvals.card import button_data
from kazma.approvals.model import Decision, Status
from kazma.bot.app import App, build_app
from kazma.config import load_config_text
from tests.fakes.telegram import FakeTelegram

OLD, NEW = -4001, -1004001  # a basic group, and the supergroup it became
ADMIN = 111
ARGS = {"command": "make release"}


@asynccontextmanager
async def kazma(telegram: FakeTelegram, tmp_path: Path) -> AsyncIterator[tuple[App, TelegramAdapter]]:
    loaded = load_config_text(
        f"store: {{path: '{tmp_path / 'k.db'}'}}\n"
        f"platforms: {{telegram: {{token: '{telegram.token}', api_base_url: '{telegram.base_url}',"
        f" chats: [{OLD}], home_chat: {OLD}, admins: [{ADMIN}]}}}}\n",
        environ={},
    )
    adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1)
    app = await build_app(loaded, adapters=[adapter], poll_interval=0.05, workspace_root=tmp_path / "ws")
    await app.start()
    try:
        yield app, adapter
    finally:
        await app.stop()


def announcements(telegram: FakeTelegram) -> list[str]:
    return [m.text for m in telegram.bot_messages(NEW) if "id changed" in m.text]


async def test_a_supergroup_migration_moves_the_home_chat_and_cards_keep_working(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    telegram = FakeTelegram()
    await telegram.start()
    try:
        async with kazma(telegram, tmp_path) as (app, adapter):
            telegram.migrate_chat(OLD, NEW, user_id=ADMIN)
            await telegram.wait_until(lambda: bool(announcements(telegram)), timeout=20)
            (said,) = announcements(telegram)
            assert f"changed from {OLD} to {NEW}" in said
            assert f"`platforms.telegram.chats: [{NEW}]`" in said
            assert f"`platforms.telegram.home_chat: {NEW}`" in said
            assert adapter.home_chat == str(NEW)
            assert adapter.serves(str(NEW))
            assert not adapter.serves(str(OLD))
            assert await app.chat_moves.all() == [ChatMove("telegram", str(OLD), str(NEW))]
            moved = [r for r in caplog.records if r.msg == "chat.moved"]
            assert [getattr(r, "update_config", None) for r in moved] == [
                [f"platforms.telegram.chats: [{NEW}]", f"platforms.telegram.home_chat: {NEW}"]
            ]

            # the next card goes to the supergroup, and a press there decides it
            request = await app.service.open("shell", ARGS, "agent:builder", f"telegram:{NEW}")
            await telegram.wait_until(lambda: any(m.buttons for m in telegram.bot_messages(NEW)), timeout=20)
            card = next(m for m in telegram.bot_messages(NEW) if m.buttons)
            telegram.push_callback(NEW, card.message_id, ADMIN, button_data(request.id, Decision.APPROVE))
            outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
            assert (outcome.status, outcome.decided_by) == (Status.APPROVED, f"telegram:{ADMIN}")
            await telegram.wait_until(
                lambda: not telegram.message(NEW, card.message_id).buttons, timeout=20
            )  # settled in the new chat
            assert telegram.bot_messages(OLD) == []  # nothing was sent into the dead chat
            assert len(announcements(telegram)) == 1  # told in both chats, announced once

        # a restart with the old id still in kazma.yaml serves the supergroup, quietly
        async with kazma(telegram, tmp_path) as (app, adapter):
            assert adapter.home_chat == str(NEW)
            await app.bus.send_text("telegram", str(OLD), "a result for the old conversation")
            assert any("a result for the old conversation" in m.text for m in telegram.bot_messages(NEW))
            assert len(announcements(telegram)) == 1
    finally:
        await telegram.stop()


async def test_a_send_refused_as_migrated_follows_the_new_chat(tmp_path: Path) -> None:
    """The bot missed the service messages (it was offline): Telegram's refusal names the new id."""
    telegram = FakeTelegram()
    await telegram.start()
    try:
        async with kazma(telegram, tmp_path) as (app, adapter):
            telegram.migrated[OLD] = NEW
            await app.bus.send_text("telegram", str(OLD), "hello after the upgrade")
            assert [m.text for m in telegram.bot_messages(NEW) if "hello" in m.text] == ["hello after the upgrade"]
            assert adapter.home_chat == str(NEW)
            await telegram.wait_until(lambda: bool(announcements(telegram)), timeout=20)
            assert await app.chat_moves.all() == [ChatMove("telegram", str(OLD), str(NEW))]
    finally:
        await telegram.stop()


def test_served_chats_follow_a_move_and_chains_lead_to_the_newest() -> None:
    served = Served.of([-1, -2], -1)
    assert served.moved("-1", "-9") == Served(frozenset({"-9", "-2"}), "-9")
    assert served.moved("-7", "-9") == served

    adapter = TelegramAdapter(
        load_config_text(
            "platforms: {telegram: {token: '1:a', chats: [-1], home_chat: -1}}", environ={}
        ).config.platforms.telegram
    )
    assert adapter.follow_move("-5", "-6") is None  # not ours
    assert adapter.follow_move("-1", "-2") == ChatMove("telegram", "-1", "-2", was_home=True, was_listed=True)
    assert adapter.follow_move("-2", "-3") is not None
    assert adapter.moved_to("-1") == "-3"
    assert adapter.moved_to("-2") == "-3"
    assert adapter.home_chat == "-3"
