"""Approvals at the trust boundary: refused presses cannot fill the store, and a platform that is configured but
did not start cannot hold a card, so dangerous calls are refused at once instead of waiting for nobody."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from kazma.adapters.bus import FanOutBus
from kazma.adapters.telegram import TelegramAdapter
from kazma.approvals import Decision, PressVerdict, Status
from kazma.bot.app import App, build_app
from kazma.config import load_config_text
from kazma.config.metrics import failure_count
from kazma.engine.model import ScriptedProvider
from tests.approvals_support import ManualClock, RecordingPublisher, approval_service
from tests.fakes.telegram import FakeTelegram

ARGS = {"command": "rm -rf build/", "timeout_s": 30}
NO_CARD = "no platform can show an approval card"


# -- refused presses -----------------------------------------------------------------------------


async def test_two_hundred_refused_presses_leave_one_audit_row_and_a_count(tmp_path: Path) -> None:
    clock = ManualClock()
    async with approval_service(tmp_path / "k.db", clock=clock, publisher=RecordingPublisher()) as service:
        request = await service.open("shell", ARGS, "agent:builder", "telegram:-100")
        button = f"kz1:{request.id}:a"
        before = failure_count("press_refused_unaudited", "telegram")
        for _ in range(200):
            result = await service.decide_from_button(button, actor="telegram:999", platform="telegram")
            assert result.verdict is PressVerdict.REFUSED
        rows = await service.store.events(request.id, event="press_refused")
        assert [(e.actor, e.detail) for e in rows] == [("telegram:999", "not an approver")]  # the first is on record
        assert failure_count("press_refused_unaudited", "telegram") == before + 199  # the rest are counted

        # Someone else's first refusal is still audited: one presser cannot hide another.
        other = await service.decide_from_button(button, actor="telegram:998", platform="telegram")
        assert other.verdict is PressVerdict.REFUSED
        rows = await service.store.events(request.id, event="press_refused")
        assert [e.actor for e in rows] == ["telegram:999", "telegram:998"]
        # And the window passes: the same presser is audited again a minute later.
        clock.advance(61)
        await service.decide_from_button(button, actor="telegram:999", platform="telegram")
        rows = await service.store.events(request.id, event="press_refused")
        assert [e.actor for e in rows] == ["telegram:999", "telegram:998", "telegram:999"]
        assert failure_count("press_refused_unaudited", "telegram") == before + 199

        row = await service.store.get(request.id)
        assert row is not None
        assert row.status is Status.PENDING
        won = await service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert won.won  # the flood changed nothing for a real approver


# -- fail closed on started platforms ------------------------------------------------------------


@asynccontextmanager
async def telegram_only(tmp_path: Path, fake: FakeTelegram, token: str, chats: str = "[-1001]") -> AsyncIterator[App]:
    """An app whose one platform is Telegram, with a home chat, pointed at ``fake`` with ``token``."""
    yaml = f"""
store: {{path: '{tmp_path / "k.db"}'}}
approvals: {{deadline_seconds: 600}}
platforms:
  telegram: {{token: '{token}', api_base_url: '{fake.base_url}', chats: {chats}, home_chat: -1001, admins: [111]}}
"""
    loaded = load_config_text(yaml, environ={})
    adapter = TelegramAdapter(loaded.config.platforms.telegram, poll_timeout=1, request_timeout=2)
    app = await build_app(
        loaded, adapters=[adapter], provider=ScriptedProvider([]), poll_interval=0.05, workspace_root=tmp_path / "ws"
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def test_a_dangerous_call_is_refused_at_once_when_the_only_card_platform_failed_to_start(
    tmp_path: Path,
) -> None:
    fake = FakeTelegram()
    await fake.start()
    try:
        before = failure_count("platform_start", "telegram")
        async with telegram_only(tmp_path / "down", fake, "1:rejected-by-the-fake") as app:
            assert failure_count("platform_start", "telegram") == before + 1
            assert isinstance(app.bus, FanOutBus)
            assert app.bus.adapters["telegram"].home_chat == "-1001"  # configured with a home chat…
            assert not app.bus.can_show_cards()  # …but not started, so it cannot show a card
            verdict = await asyncio.wait_for(
                app.policy.check("shell", ARGS, requested_by="agent:builder", conversation="telegram:-1001"), 5
            )
            assert not verdict.allowed
            assert NO_CARD in verdict.reason
            assert await app.service.store.requests() == []  # nobody was asked, nothing waits

        # The same platform, started, shows the card and the call waits for a person.
        async with telegram_only(tmp_path / "up", fake, fake.token) as app:
            assert app.bus.can_show_cards()
            asking = asyncio.create_task(
                app.policy.check("shell", ARGS, requested_by="agent:builder", conversation="telegram:-1001")
            )
            async with asyncio.timeout(5):
                while not (pending := await app.service.store.requests(pending_only=True)):
                    await asyncio.sleep(0.02)
            (request,) = pending
            await app.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
            verdict = await asyncio.wait_for(asking, 5)
            assert not verdict.allowed
            assert verdict.request_id == request.id
            assert NO_CARD not in verdict.reason
    finally:
        await fake.stop()


# -- who is served -------------------------------------------------------------------------------


async def test_with_no_chats_listed_a_strangers_group_gets_no_answer_and_no_swarm_history(tmp_path: Path) -> None:
    stranger_group, stranger = -2002, 999
    fake = FakeTelegram()
    await fake.start()
    try:
        async with telegram_only(tmp_path, fake, fake.token, chats="[]") as app:
            fake.push_message(stranger_group, stranger, "/swarm history")
            fake.push_message(stranger_group, stranger, "@kazma what is in your workspace?")
            fake.push_message(-1001, 111, "/swarm history")  # the home chat, after them: answered
            await fake.wait_until(lambda: bool(fake.bot_messages(-1001)), timeout=10)
            await app.conversations.drain()
            assert isinstance(app.bus, FanOutBus)
            adapter = app.bus.adapters["telegram"]
            assert isinstance(adapter, TelegramAdapter)
            await adapter.quiesce()
            assert fake.bot_messages(stranger_group) == []
            assert all(str(call.params.get("chat_id")) != str(stranger_group) for call in fake.calls)  # not even a sign
    finally:
        await fake.stop()
