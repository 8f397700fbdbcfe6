"""A clean stop (SIGTERM) while a turn waits for approval: the request ends ``cancelled`` at the stop, before the
store closes, its card on every platform settles to that outcome and the person who asked is told.

It was ended only at the next start: the turns end with the event loop, after the store had closed, so the
request stayed pending with live buttons on every platform while Kazma was down, and a person who pressed one
then heard nothing. A real ``kazma run`` on the Telegram and Discord wire fakes (the chaos rig's scenario).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.chaos.checker import facts
from tests.chaos.rig import (
    ASK,
    MARKER,
    STEP_SECONDS,
    TG_ADMIN,
    TG_CHAT,
    History,
    Rig,
    _connected,
    _discord_text,
    _stop,
    _until,
    fakes,
)
from tests.fakes.openai import Completion, FakeToolCall
from tests.pg_support import find_bindir

STOPPED = "Kazma stopped before a decision; nothing ran"


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_a_clean_stop_cancels_a_pending_turn_settles_its_cards_and_tells_the_asker(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    dsn = None
    if store == "postgresql":
        if find_bindir() is None:
            pytest.skip("no PostgreSQL server binaries")
        dsn = str(request.getfixturevalue("pg_dsn"))
    s = Rig(tmp_path, store=store, dsn=dsn)
    where = dsn if dsn is not None else str(tmp_path / "state" / "k.db")
    async with fakes(s):
        s.model.script(
            Completion(tool_calls=(FakeToolCall("shell", f'{{"command": "echo ran >> {MARKER}"}}'),)),
            Completion(content="Not run: the approval was cancelled."),
        )
        proc = await s.start("")
        assert await _connected(s, proc, 0, 0, 0), s.log_tail()
        s.telegram.push_message(TG_CHAT, TG_ADMIN, ASK, username="ops")
        # the card is out on both platforms, with its buttons: the turn waits for a decision
        assert await _until(lambda: bool(s.tg_live()) and bool(s.dc_live()), proc, STEP_SECONDS), s.log_tail()
        assert await _stop(proc, signal.SIGTERM), "kazma did not stop within its bound"
        assert proc.returncode == 0, s.log_tail()
        h = History("", "", store, where, tmp_path / "ws")
        found = facts(h)
        [(_, status, _, reason)] = found.requests
        assert (status, reason) == ("cancelled", STOPPED)
        assert found.marker_lines == 0
        assert s.tg_live() == []
        assert s.dc_live() == []
        assert s.tg_cards()
        assert all("CANCELLED" in m.text for m in s.tg_cards())  # type: ignore[attr-defined]
        assert s.dc_cards()
        assert all("CANCELLED" in _discord_text(m) for m in s.dc_cards())
        told = [m.text for m in s.telegram.bot_messages(TG_CHAT) if "Approval needed" not in m.text]
        assert any(STOPPED in text and "was cancelled" in text for text in told), told
