"""One commit before a press is answered (SQLite): a Slack press's signed request is remembered in the very commit
of its decision, with the checkpoint holding it, before any card is edited; and that request posted again after a
restart decides nothing, writes nothing and tells nobody. Real Kazma, real Bolt, the wire-level fakes.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from kazma.adapters.slack.render import APPROVE_ACTION
from kazma.approvals.model import Status
from kazma.bot.app import App
from kazma.config.metrics import failure_count
from tests.platforms_support import PLATFORMS, SLACK_ADMIN, SLACK_CHANNEL, Fakes, kazma_on, three_fakes
from tests.test_slack_replays import FORM, Signed, post, signed


def captured_press(fakes: Fakes) -> Signed:
    """An Approve on the Slack card, exactly as Slack signs it: what an eavesdropper could post again."""
    msg = next(m for m in fakes.slack.channel(SLACK_CHANNEL) if m.block("kazma_actions"))
    block = msg.block("kazma_actions")
    assert block is not None
    value = str(next(e["value"] for e in block["elements"] if e["action_id"] == APPROVE_ACTION))
    payload = fakes.slack.block_action_payload(
        action_id=APPROVE_ACTION, value=value, user=SLACK_ADMIN, channel=SLACK_CHANNEL, message_ts=msg.ts
    )
    return signed(fakes.slack, urlencode({"payload": json.dumps(payload)}), FORM)


def groups_at_first_edit(app: App, writer: Any) -> list[int]:
    """The store's committed groups when the first card edit starts (filled once)."""
    seen: list[int] = []
    for adapter in app.bus.adapters.values():
        edit = adapter.settle_card

        async def counted(ref: Any, card: Any, outcome: Any, *, edit: Any = edit) -> None:
            if not seen:
                seen.append(int(writer.groups))
            await edit(ref, card, outcome)

        adapter.settle_card = counted  # type: ignore[method-assign]
    return seen


async def signed_rows(app: App) -> list[Any]:
    rows = await app.service.store.tables.all("SELECT event_key FROM inbound_claims WHERE platform = 'slack:signed'")
    return list(rows)


async def settled_down(app: App, writer: Any) -> None:
    """Until every post is done and its audit events signed, no pass is due or waits to ride, and the pause
    between passes is over (a person presses later than all that)."""
    checkpointer = app.checkpointer
    assert checkpointer is not None
    async with asyncio.timeout(20):
        while True:
            await writer.caught_up()
            events = await app.service.store.chain_events(limit=100_000)
            checkpoints = await app.service.store.chain_checkpoints(limit=100_000)
            rested = time.monotonic() - checkpointer._last_pass >= checkpointer.min_interval
            quiet = writer.riders == 0 and not checkpointer._due.is_set() and rested
            posting = await app.service.store.tables.one("SELECT COUNT(*) FROM card_outbox WHERE done_at IS NULL")
            if quiet and not posting[0] and events and checkpoints and checkpoints[-1].seq == events[-1].seq:
                return
            await asyncio.sleep(0.01)


async def test_a_slack_press_commits_once_before_its_cards_are_edited_and_its_replay_decides_nothing(
    tmp_path: Path,
) -> None:
    store = tmp_path / "k.db"
    async with three_fakes() as fakes:
        async with kazma_on(fakes, store) as app:
            request = await app.service.open("shell", {"command": "make release"}, "agent:builder", "telegram:-1001")
            await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS))
            writer: Any = await app.service.store.tables.writer()
            await settled_down(app, writer)
            first_edit = groups_at_first_edit(app, writer)
            press = captured_press(fakes)
            assert await signed_rows(app) == []
            before = int(writer.groups)
            assert fakes.slack_events_url is not None
            assert await post(fakes.slack_events_url, press) == 200
            outcome = await asyncio.wait_for(app.service.wait(request.id), timeout=20)
            assert outcome.status is Status.APPROVED
            await fakes.wait(lambda: not any(fakes.has_buttons(p) for p in PLATFORMS))
            # The signed request's record, the decision and the checkpoint holding it: one commit, then the edits.
            assert first_edit == [before + 1]
            assert len(await signed_rows(app)) >= 2  # its signature and its trigger id
            assert await app.checkpointer.witness(request.id, patience=0) is not None  # type: ignore[union-attr]
            events = [e.event for e in await app.service.store.events(request.id)]
        dropped = failure_count("replay_dropped", "slack")
        async with kazma_on(fakes, store) as again:
            # A new process, a new memory: only the store knows the request. It is posted again, byte for byte.
            assert fakes.slack_events_url is not None
            assert await post(fakes.slack_events_url, press) == 200
            async with asyncio.timeout(20):
                while failure_count("replay_dropped", "slack") == dropped:
                    await asyncio.sleep(0.01)
            writer = await again.service.store.tables.writer()
            await writer.caught_up()
            # Nothing written: not even the press_lost an unsigned second press of a decided request is audited.
            after = [e.event for e in await again.service.store.events(request.id)]
            assert after[: len(events)] == events
            assert "press_lost" not in after
            assert after.count("decided") == 1
            told = [*map(str, fakes.slack.ephemerals), *map(str, fakes.slack.responses)]
            assert [t for t in told if "Already" in t] == []  # nobody is told about a replay
    assert failure_count("replay_dropped", "slack") == dropped + 1


async def test_a_decision_pressed_again_with_a_new_signature_still_loses_and_is_audited(tmp_path: Path) -> None:
    # The replay guard rides with the decision; a genuine second press (its own signature and trigger id) is not
    # a replay: it meets the decision, loses and is audited as before.
    store = tmp_path / "k.db"
    async with three_fakes() as fakes, kazma_on(fakes, store) as app:
        request = await app.service.open("shell", {"command": "make release"}, "agent:builder", "telegram:-1001")
        await fakes.wait(lambda: all(fakes.has_buttons(p) for p in PLATFORMS))
        first, second = captured_press(fakes), captured_press(fakes)
        assert first.body != second.body  # its own trigger id, hence its own signature
        assert fakes.slack_events_url is not None
        assert await post(fakes.slack_events_url, first) == 200
        assert (await asyncio.wait_for(app.service.wait(request.id), timeout=20)).status is Status.APPROVED
        assert await post(fakes.slack_events_url, second) == 200
        async with asyncio.timeout(20):
            while "press_lost" not in [e.event for e in await app.service.store.events(request.id)]:
                await asyncio.sleep(0.02)
        told = [*map(str, fakes.slack.ephemerals), *map(str, fakes.slack.responses)]
        assert any("Already" in t for t in told)  # the loser is told what stands
