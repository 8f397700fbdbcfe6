"""Settling by request: a decision edits its own cards without scanning the store, edits go before queued
posts, failed edits wait in their rows, and an idle bus reads nothing until its slow safety scan."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from kazma.adapters import bus as bus_module
from kazma.adapters.bus import SAFETY_SCAN_SECONDS, FanOutBus
from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformError, Press
from kazma.adapters.outbox import MIGRATIONS as OUTBOX
from kazma.adapters.outbox import Outbox
from kazma.approvals import MIGRATIONS as APPROVALS
from kazma.approvals import ApprovalCard, ApprovalService, ApprovalStore, Decision, Outcome, PressResult, Status
from kazma.approvals.card import build_card
from kazma.approvals.model import ApprovalRequest
from kazma.approvals.store import PostedCard
from kazma.config.store.database import connect, open_database
from tests.approvals_support import approvals_config, settled_rows
from tests.test_bus import MemoryPlatform


class CountingStore(ApprovalStore):
    """The real store, counting its full scans for unsettled cards and its reads of one request's cards."""

    scans = 0
    card_reads = 0

    async def unsettled_cards(self, platform: str | None = None, *, due_by: float | None = None) -> list[PostedCard]:
        self.scans += 1
        return await super().unsettled_cards(platform, due_by=due_by)

    async def cards(self, request_id: str) -> list[PostedCard]:
        self.card_reads += 1
        return await super().cards(request_id)


@dataclass
class GatedPlatform(MemoryPlatform):
    """Each post waits for a ticket, so a test decides what happens between posts; logs posts and edits."""

    tickets: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    log: list[tuple[str, str]] = field(default_factory=list)
    held: asyncio.Event = field(default_factory=asyncio.Event)  # set: a post waits for its ticket

    async def post_card(self, card: ApprovalCard) -> CardRef:
        self.held.set()
        await self.tickets.acquire()
        ref = await super().post_card(card)
        self.log.append(("post", card.request_id))
        return ref

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        await super().settle_card(ref, card, outcome)
        self.log.append(("settle", card.request_id))


@dataclass
class Rig:
    bus: FanOutBus
    service: ApprovalService
    store: CountingStore


async def _noop_inbound(message: Inbound) -> None:
    return


@asynccontextmanager
async def rig(
    path: Path, platform: MemoryPlatform, *others: MemoryPlatform, poll_interval: float = 3600.0
) -> AsyncIterator[Rig]:
    conn = await open_database(path, migrations=[*APPROVALS, *OUTBOX])
    outbox_conn = await connect(path)
    config = approvals_config()
    store = CountingStore(conn)
    bus = FanOutBus(
        [platform, *others], store=store, outbox=Outbox(outbox_conn), config=config, poll_interval=poll_interval
    )
    service = ApprovalService(store, config, publisher=bus)

    async def on_press(press: Press) -> PressResult:
        return await service.decide_from_button(press.data, actor=press.actor, platform=press.platform)

    await bus.start(Handlers(on_inbound=_noop_inbound, on_press=on_press))
    try:
        yield Rig(bus, service, store)
    finally:
        await bus.stop()
        await outbox_conn.close()
        await conn.close()


async def until(condition: object, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def seed_unsettled(store: ApprovalStore, count: int, platform: str) -> None:
    """``count`` decided requests whose cards on ``platform`` still show buttons (another platform's work)."""
    for n in range(count):
        request = await store.insert(
            tool="shell",
            args_json=f'{{"n": {n}}}',
            args_hash=f"{n:064x}",
            requested_by="agent:b",
            conversation="web:c",
            deadline=time.time() + 3600,
            task_id=None,
        )
        await store.record_card(request.id, platform, "elsewhere", str(n))
        await store.finish(request.id, Status.DENIED, actor="slack:U111", platform="slack")


async def test_a_decision_settles_its_cards_without_scanning_the_store(tmp_path: Path) -> None:
    platform = MemoryPlatform("telegram")
    async with rig(tmp_path / "k.db", platform) as r:
        await seed_unsettled(r.store, 200, "discord")  # not this worker's: never read by it
        await until(lambda: r.bus._workers["telegram"].asleep_until is not None)
        scans_at_start = r.store.scans
        assert scans_at_start == 1  # the start-up scan, and nothing since
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await asyncio.wait_for(platform.posted.wait(), timeout=20)
        result = await r.service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert result.won
        await asyncio.wait_for(platform.settled_event.wait(), timeout=20)
        assert [ref.message_id for ref, _ in platform.settled] == ["1"]
        assert r.store.scans == scans_at_start  # settled by its id, not found by a scan
        cards = await settled_rows(r.store, request.id)
        assert [c.settled_status for c in cards] == ["approved"]
        assert r.store.scans == scans_at_start


async def test_the_rows_of_a_decisions_settled_cards_commit_together_after_their_edits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Press -> every card settled: each worker committed its card's row on its own as its edit returned, a commit
    # (and an fsync) per platform among the other platforms' edits, on the loop they wait for. A worker with no
    # other card to edit lets its row ride: the rows of one decision commit together, after the edits. (The ride
    # is a second here, so that all three rows are in its window however slow the machine.)
    monkeypatch.setattr(bus_module, "SETTLED_RIDE", 1.0)
    platforms = [MemoryPlatform(name) for name in ("telegram", "slack", "discord")]
    async with rig(tmp_path / "k.db", *platforms) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        for platform in platforms:
            await asyncio.wait_for(platform.posted.wait(), timeout=20)
        writer: Any = await r.store.tables.writer()
        assert (await r.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        decided_at = writer.groups
        for platform in platforms:
            await asyncio.wait_for(platform.settled_event.wait(), timeout=20)
        cards = await settled_rows(r.store, request.id)
        assert sorted((c.platform, c.settled_status) for c in cards) == [
            ("discord", "denied"), ("slack", "denied"), ("telegram", "denied"),
        ]  # fmt: skip
        assert writer.groups - decided_at == 1  # the three rows, one commit


async def test_a_decision_builds_its_card_once_and_reads_no_cards_for_any_platform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Press -> every card settled: each platform's worker built the same platform-neutral card again, and read
    # the request's cards again after its edit to see whether it was the last, all on the loop the other
    # platforms' edits wait for.
    platforms = [MemoryPlatform(name) for name in ("telegram", "slack", "discord")]
    async with rig(tmp_path / "k.db", *platforms) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        for platform in platforms:
            await asyncio.wait_for(platform.posted.wait(), timeout=20)
        builds: list[str] = []

        def counted(request: ApprovalRequest, **kwargs: Any) -> ApprovalCard:
            builds.append(request.id)
            return build_card(request, **kwargs)

        monkeypatch.setattr(bus_module, "build_card", counted)
        r.store.card_reads = 0
        observed = _settled_observations()
        assert (await r.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        for platform in platforms:
            await asyncio.wait_for(platform.settled_event.wait(), timeout=20)
        workers = r.bus._workers.values()
        await until(lambda: all(w.drained.is_set() for w in workers))  # every edit's after-work done
        shown = [[summary.split(" by ")[0] for _, summary in p.settled] for p in platforms]
        assert shown == [["denied"]] * 3  # every card, once, the one outcome
        assert builds == [request.id]  # once, not once per platform
        # None at all: the decision's transaction read them for the bus (not once more after each edit either)
        assert r.store.card_reads == 0
        assert _settled_observations() == observed + 1  # the last of the three edits said so, it alone
        assert {c.settled_status for c in await r.store.cards(request.id)} == {"denied"}


async def test_a_request_ended_by_other_than_a_press_reads_its_cards_once_for_every_platform(tmp_path: Path) -> None:
    # A cancel (or a deadline, a withdrawal, another process's decision) carries no cards: the bus reads them.
    platforms = [MemoryPlatform(name) for name in ("telegram", "slack", "discord")]
    async with rig(tmp_path / "k.db", *platforms) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        for platform in platforms:
            await asyncio.wait_for(platform.posted.wait(), timeout=20)
        r.store.card_reads = 0
        await r.service.cancel(request.id, reason="bench")
        for platform in platforms:
            await asyncio.wait_for(platform.settled_event.wait(), timeout=20)
        await until(lambda: all(w.drained.is_set() for w in r.bus._workers.values()))
        assert r.store.card_reads == 1
        assert {c.settled_status for c in await r.store.cards(request.id)} == {"cancelled"}


async def test_a_press_hands_over_the_cards_its_group_committed_with_it(tmp_path: Path) -> None:
    # The cards a won press hands to the bus are read at the end of its transaction, after the group's last
    # operation: a card recorded in the same group commit (its post landed as the press came in) is among them,
    # or it would keep its buttons until the slow safety scan.
    platforms = [MemoryPlatform(name) for name in ("telegram", "slack")]
    async with rig(tmp_path / "k.db", *platforms) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        for platform in platforms:
            await asyncio.wait_for(platform.posted.wait(), timeout=20)
        # Submitted in one turn of the loop: one group, the press first, the card's record after it.
        pressed, _ = await asyncio.gather(
            r.store.press(request.id, Status.APPROVED, actor="web:admin", platform="web", reason=None, card=None),
            r.store.record_card(request.id, "discord", "c9", "m9"),
        )
        assert pressed.won
        assert pressed.decided is not None
        assert pressed.decided.request is not None
        assert pressed.decided.request.status is Status.APPROVED
        assert {c.platform for c in pressed.decided.cards} == {"telegram", "slack", "discord"}
        assert sorted(pressed.decided.cards, key=lambda c: c.platform) == sorted(
            await r.store.cards(request.id), key=lambda c: c.platform
        )


def _settled_observations() -> float:
    """How many times "decision to every card settled" was observed in this process."""
    value = REGISTRY.get_sample_value("kazma_decision_to_settled_seconds_count")
    return 0.0 if value is None else value


async def test_an_idle_bus_sleeps_until_its_slow_safety_scan(tmp_path: Path) -> None:
    platform = MemoryPlatform("telegram")
    async with rig(tmp_path / "k.db", platform, poll_interval=SAFETY_SCAN_SECONDS) as r:
        await seed_unsettled(r.store, 50, "telegram")  # in the store before the worker's next look
        worker = r.bus._workers["telegram"]
        await until(lambda: worker.asleep_until is not None)
        asleep_until = worker.asleep_until
        assert asleep_until is not None
        assert asleep_until - time.time() > SAFETY_SCAN_SECONDS / 2  # no per-second look at the store
        assert SAFETY_SCAN_SECONDS >= 60


async def test_a_failed_edit_waits_in_its_row_and_is_retried_when_due(tmp_path: Path) -> None:
    platform = MemoryPlatform("telegram")
    async with rig(tmp_path / "k.db", platform) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await asyncio.wait_for(platform.posted.wait(), timeout=20)
        platform.failures.append(PlatformError("telegram", "card_settle", "server error", retryable=True))
        await r.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        await until(lambda: r.bus._workers["telegram"].retry_at is not None)
        (card,) = await r.store.cards(request.id)
        assert await r.store.settle_attempts(card) == 1
        due = await r.store.next_settle_retry("telegram")
        assert due is not None
        assert await r.store.unsettled_cards("telegram", due_by=due - 0.01) == []  # in backoff: not even read
        await asyncio.wait_for(platform.settled_event.wait(), timeout=30)  # the worker woke when it was due
        (card,) = await r.store.cards(request.id)
        assert card.settled_status == "denied"


async def test_a_card_edit_goes_before_the_posts_queued_on_its_platform(tmp_path: Path) -> None:
    platform = GatedPlatform("telegram")
    async with rig(tmp_path / "k.db", platform) as r:
        first = await r.service.open("shell", {"command": "first"}, "agent:b", "web:c")
        burst = [await r.service.open("shell", {"command": f"burst {n}"}, "agent:b", "web:c") for n in range(10)]
        platform.tickets.release()  # the first card goes up; the burst waits behind it
        await asyncio.wait_for(platform.posted.wait(), timeout=20)
        await r.service.decide(first.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        for _ in burst:
            platform.tickets.release()
        await until(lambda: len(platform.log) == 12)
        edit_at = platform.log.index(("settle", first.id))
        assert edit_at <= 2, platform.log  # at most the one post already under way went before it


async def test_a_card_posted_while_its_request_was_decided_is_settled_at_once(tmp_path: Path) -> None:
    # Chaos CI (swarm.checkpoint.paused, crash, restarted): Discord's post of a card was under way when the
    # person pressed on Telegram; the decision's one read of the request's cards missed the card not recorded
    # yet, so it kept its buttons until the slow safety scan.
    fast, slow = MemoryPlatform("telegram"), GatedPlatform("discord")
    async with rig(tmp_path / "k.db", fast, slow) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await asyncio.wait_for(fast.posted.wait(), timeout=20)
        await asyncio.wait_for(slow.held.wait(), timeout=20)  # Discord's post is under way, held at the platform
        assert (await r.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        await asyncio.wait_for(fast.settled_event.wait(), timeout=20)  # the decision's read of its cards is done
        slow.tickets.release()
        await asyncio.wait_for(slow.settled_event.wait(), timeout=20)
        assert slow.log == [("post", request.id), ("settle", request.id)]
        cards = await settled_rows(r.store, request.id)
        assert sorted((c.platform, c.settled_status) for c in cards) == [("discord", "denied"), ("telegram", "denied")]
