"""What runs beside what while Kazma starts, and what a start leaves for after it serves.

bubblewrap's trial run (a process of its own) used to run inside the event loop, after the store opened
and the platforms' libraries were imported: everything on the loop waited for it. It runs on a thread from
the start of the build now.

``kazma run`` says it runs (the web console opens) as soon as the platforms answer: the orphans' cancelling
and recovery's notices come after that line instead of before it, and a press arriving meanwhile is answered
as any other.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kazma.adapters.bus import FanOutBus
from kazma.adapters.contract import CardRef
from kazma.adapters.web.adapter import WebAdapter
from kazma.approvals import ApprovalService, ApprovalStore
from kazma.approvals.card import ApprovalCard, button_data
from kazma.approvals.model import Decision, Outcome, PressVerdict, Status
from kazma.approvals.orphans import BATCH, Orphans
from kazma.bot.app import build_app
from kazma.bot.store import open_store
from kazma.config import load_config_text
from kazma.engine.model import ScriptedProvider
from kazma.engine.tools.shell import ShellTool
from tests.test_orphans_after_start import _all_cancelled

# A bwrap that says it started, then succeeds only once something else answered it: only a loop that is free
# while the trial runs can (bounded: it gives up after about five seconds and fails the trial).
BWRAP = """#!/bin/sh
: > "{started}"
n=0
while [ ! -e "{answered}" ]; do
    n=$((n + 1))
    [ "$n" -gt 500 ] && exit 1
    sleep 0.01
done
exit 0
"""


async def test_bubblewraps_trial_run_does_not_hold_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, answered = tmp_path / "started", tmp_path / "answered"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bwrap = bin_dir / "bwrap"
    bwrap.write_text(BWRAP.format(started=started, answered=answered))
    bwrap.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    loaded = load_config_text(f"store: {{path: '{tmp_path / 'state' / 'k.db'}'}}\n", environ={})

    async def answer() -> None:  # on the event loop, while the trial runs
        async with asyncio.timeout(30):
            while not started.exists():  # another process makes it
                await asyncio.sleep(0.01)
        answered.touch()

    answering = asyncio.create_task(answer())
    app = await build_app(loaded, adapters=[], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
    try:
        await answering
        shell = app.conversations.runner.registry.get("shell")
        assert isinstance(shell, ShellTool)
        assert (shell.sandbox.binary, shell.sandbox.problem) == (str(bwrap), None)
    finally:
        await app.stores.close()


async def test_kazma_serves_before_its_orphans_are_cancelled_and_a_press_meanwhile_is_answered_right(
    tmp_path: Path,
) -> None:
    loaded = load_config_text(
        f"""
store: {{path: '{tmp_path / "state" / "k.db"}'}}
approvals: {{deadline_seconds: 600, approvers: ["telegram:111"]}}
""",
        environ={},
    )
    conn = await open_store(loaded.config)
    try:  # a process died with these pending: two batches of orphans and one more
        dead = ApprovalService(ApprovalStore(conn), loaded.config)
        ids = [
            r.id
            for r in await asyncio.gather(
                *(
                    dead.open("shell", {"command": f"rm /srv/{n}"}, "agent:builder", "web:console")
                    for n in range(2 * BATCH + 1)
                )
            )
        ]
    finally:
        await conn.close()
    web = WebAdapter()
    app = await build_app(loaded, adapters=[web], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
    bus = app.bus
    assert isinstance(bus, FanOutBus)
    seen: list[tuple[bool, int, str]] = []

    async def serving() -> None:  # what `kazma run` does here: open the console, say it runs
        fenced = app.service.orphans
        assert isinstance(fenced, Orphans)
        pending = [await app.service.store.get(i) for i in ids]
        seen.append((bus.can_show_cards(), len(fenced), ",".join({r.status.value for r in pending if r})))

    first_batch, go_on = asyncio.Event(), asyncio.Event()

    async def held_after_the_first_batch() -> None:
        first_batch.set()
        await go_on.wait()

    bus.rescan = held_after_the_first_batch  # type: ignore[method-assign,assignment]
    await app.start(serving=serving)
    try:
        # serving came once the platform answered, before any orphan was cancelled
        assert seen == [(True, 2 * BATCH + 1, "pending")]
        await asyncio.wait_for(first_batch.wait(), 60)
        # the batches are under way: a request opened now decides on a press; an orphan's stale press cannot
        fresh = await app.service.open("shell", {"command": "make"}, "agent:builder", "web:console")
        won, stale = await asyncio.gather(
            app.service.decide_from_button(
                button_data(fresh.id, Decision.APPROVE), actor="telegram:111", platform="telegram"
            ),
            app.service.decide_from_button(
                button_data(ids[-1], Decision.APPROVE), actor="telegram:111", platform="telegram"
            ),
        )
        assert won.verdict is PressVerdict.WON, won
        assert stale.verdict is not PressVerdict.WON, stale
        go_on.set()
        await _all_cancelled(app, ids)
        decided = await app.service.store.get(fresh.id)
        assert decided is not None
        assert decided.status is Status.APPROVED
    finally:
        go_on.set()
        await app.stop()


class _HeldEdits(WebAdapter):
    """The console, whose card edits wait for the test: an edit under way is one the restart has not made yet."""

    def __init__(self, log: list[MutableMapping[str, Any]]) -> None:
        super().__init__()
        self.log = log
        self.editing = asyncio.Event()
        self.release = asyncio.Event()

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        self.editing.set()
        await self.release.wait()
        await super().settle_card(ref, card, outcome)
        self.log.append({"event": "test.card_edited", "request_id": card.request_id})


async def test_a_restart_says_it_recovered_only_once_its_orphans_cards_are_edited_and_their_conversations_told(
    tmp_path: Path,
) -> None:
    """``app.recovered`` is the line a restart's watcher waits for (an operator; the chaos cells, which looked for a
    card for eight seconds after each restart instead): it must come after the orphans ended, their conversations
    were told and their cards were edited, never in the middle of it."""
    loaded = load_config_text(
        f"""
store: {{path: '{tmp_path / "state" / "k.db"}'}}
approvals: {{deadline_seconds: 600, approvers: ["telegram:111"]}}
""",
        environ={},
    )
    conn = await open_store(loaded.config)
    try:  # a process died with two requests pending, the first one's card out on the console
        dead = ApprovalService(ApprovalStore(conn), loaded.config)
        ids = [
            (await dead.open("shell", {"command": f"rm /srv/{n}"}, "agent:builder", "web:console")).id for n in (1, 2)
        ]
        await dead.store.record_card(ids[0], "web", "console", "1")
    finally:
        await conn.close()
    with capture_logs() as logs:
        web = _HeldEdits(logs)
        app = await build_app(loaded, adapters=[web], provider=ScriptedProvider([]), workspace_root=tmp_path / "ws")
        await app.start()
        try:
            await asyncio.wait_for(web.editing.wait(), 30)  # the orphan's card is being edited, not yet done
            assert "app.recovered" not in [e["event"] for e in logs]
            web.release.set()
            async with asyncio.timeout(30):
                while "app.recovered" not in [e["event"] for e in logs]:
                    await asyncio.sleep(0.02)
            events = [e["event"] for e in logs]
            assert events.index("test.card_edited") < events.index("app.recovered")
            recovered = next(e for e in logs if e["event"] == "app.recovered")
            assert (recovered["orphans"], recovered["cancelled"]) == (2, 2)
            told = [m.text for m in web.messages("console") if "was cancelled" in m.text]
            for request_id in ids:
                row = await app.service.store.get(request_id)
                assert row is not None
                assert row.status is Status.CANCELLED
                assert sum(request_id in text for text in told) == 1, request_id
        finally:
            web.release.set()
            await app.stop()
