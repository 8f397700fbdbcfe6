"""FanOutBus logic: concurrency, retries, durability.

These tests drive the bus through an in-memory implementation of Kazma's own
PlatformAdapter protocol (no client library is involved), which lets them
hold one platform hung or failing deterministically. The same flows against
the real client libraries and wire-level fakes are in test_bus_platforms.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kazma.adapters import bus as bus_module
from kazma.adapters.bus import FanOutBus, NullBus
from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformError, Press
from kazma.adapters.outbox import MIGRATIONS as OUTBOX
from kazma.adapters.outbox import Outbox
from kazma.approvals import MIGRATIONS as APPROVALS
from kazma.approvals import ApprovalCard, ApprovalService, ApprovalStore, Decision, Outcome, PressResult, Status
from kazma.approvals.service import ApprovalRefused
from kazma.config.address import Address
from kazma.config.backoff import Backoff
from kazma.config.metrics import failure_count
from kazma.config.outgoing import Outgoing
from kazma.config.store.database import connect, open_database
from tests.approvals_support import approvals_config, settled_rows


@dataclass
class MemoryPlatform:
    name: str
    home: str | None = "home"
    posts: list[ApprovalCard] = field(default_factory=list)
    settled: list[tuple[CardRef, str]] = field(default_factory=list)
    texts: list[tuple[str, str, str | None]] = field(default_factory=list)
    hang: asyncio.Event | None = None  # set: post_card waits for it before answering
    failures: list[PlatformError] = field(default_factory=list)  # raised by post/settle in order
    posted: asyncio.Event = field(default_factory=asyncio.Event)
    settled_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def home_chat(self) -> str | None:
        return self.home

    async def start(self, handlers: Handlers) -> None:
        return

    async def stop(self) -> None:
        return

    async def send(self, to: Address, message: Outgoing) -> str:
        return await self.send_text(to.chat, message.text, agent=message.agent, thread=to.thread)

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        if self.failures:
            raise self.failures.pop(0)
        self.texts.append((chat, text, agent))
        return str(len(self.texts))

    async def send_choices(
        self,
        chat: str,
        text: str,
        choices: Sequence[tuple[str, str]],
        *,
        agent: str | None = None,
        thread: str | None = None,
    ) -> str:
        return await self.send_text(chat, text, agent=agent, thread=thread)

    async def post_card(self, card: ApprovalCard) -> CardRef:
        if self.hang is not None:
            await self.hang.wait()
        if self.failures:
            raise self.failures.pop(0)
        self.posts.append(card)
        self.posted.set()
        return CardRef(self.name, "home", str(len(self.posts)))

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.settled.append((ref, outcome.summary()))
        self.settled_event.set()


@dataclass
class Rig:
    bus: FanOutBus
    service: ApprovalService
    platforms: list[MemoryPlatform]


async def _noop_inbound(message: Inbound) -> None:
    return


@asynccontextmanager
async def rig(path: Path, platforms: list[MemoryPlatform], *, timeout: float = 5.0) -> AsyncIterator[Rig]:
    conn = await open_database(path, migrations=[*APPROVALS, *OUTBOX])
    outbox_conn = await connect(path)
    config = approvals_config()
    store = ApprovalStore(conn)
    bus = FanOutBus(
        platforms, store=store, outbox=Outbox(outbox_conn), config=config, platform_timeout=timeout, poll_interval=0.05
    )
    service = ApprovalService(store, config, publisher=bus)

    async def on_press(press: Press) -> PressResult:
        return await service.decide_from_button(press.data, actor=press.actor, platform=press.platform)

    await bus.start(Handlers(on_inbound=_noop_inbound, on_press=on_press))
    try:
        yield Rig(bus, service, platforms)
    finally:
        await bus.stop()
        await outbox_conn.close()
        await conn.close()


async def wait_for(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), timeout=20)


async def outbox_drained(bus: FanOutBus) -> None:
    """Wait until every post job is finished (a condition, polled with a deadline)."""
    async with asyncio.timeout(20):
        while await bus.outbox.pending():
            await asyncio.sleep(0.01)


async def test_card_reaches_every_platform_and_every_card_settles(tmp_path: Path) -> None:
    platforms = [MemoryPlatform("telegram"), MemoryPlatform("slack"), MemoryPlatform("discord")]
    async with rig(tmp_path / "k.db", platforms) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        for p in platforms:
            await wait_for(p.posted)
            assert [c.request_id for c in p.posts] == [request.id]
        result = await r.service.decide_from_button(f"kz1:{request.id}:a", actor="discord:222", platform="discord")
        assert result.won
        for p in platforms:
            await wait_for(p.settled_event)
            assert len(p.settled) == 1
            assert p.settled[0][1].startswith("approved by discord:222 via discord")
        cards = await settled_rows(r.service.store, request.id)
        assert sorted(c.platform for c in cards) == ["discord", "slack", "telegram"]
        assert all(c.settled_status == "approved" for c in cards)


async def test_a_hung_platform_does_not_delay_the_others(tmp_path: Path) -> None:
    release = asyncio.Event()
    platforms = [MemoryPlatform("telegram", hang=release), MemoryPlatform("slack"), MemoryPlatform("discord")]
    async with rig(tmp_path / "k.db", platforms, timeout=30) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await wait_for(platforms[1].posted)
        await wait_for(platforms[2].posted)
        assert platforms[0].posts == []  # still hung while the others are done
        release.set()
        await wait_for(platforms[0].posted)
        assert platforms[0].posts[0].request_id == request.id


async def test_retryable_failure_is_retried_and_counted(tmp_path: Path) -> None:
    flaky = MemoryPlatform(
        "slack",
        failures=[
            PlatformError("slack", "card_post", "HTTP 500", retryable=True),
            PlatformError("slack", "card_post", "ratelimited", retryable=True, retry_after=0.1),
        ],
    )
    before = failure_count("card_post", "slack")
    async with rig(tmp_path / "k.db", [flaky, MemoryPlatform("telegram")]) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await wait_for(flaky.posted)
        assert [c.request_id for c in flaky.posts] == [request.id]
        assert failure_count("card_post", "slack") == before + 2
        await outbox_drained(r.bus)


async def test_permanent_failure_gives_up_without_blocking(tmp_path: Path) -> None:
    broken = MemoryPlatform("discord", failures=[PlatformError("discord", "card_post", "403", retryable=False)])
    good = MemoryPlatform("telegram")
    async with rig(tmp_path / "k.db", [broken, good]) as r:
        await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await wait_for(good.posted)
        await outbox_drained(r.bus)
        assert broken.posts == []


async def test_unposted_cards_and_unsettled_edits_resume_after_restart(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    release = asyncio.Event()  # never set: the first "process" never manages to post to slack
    first = [MemoryPlatform("telegram"), MemoryPlatform("slack", hang=release)]
    async with rig(path, first, timeout=60) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await wait_for(first[0].posted)
        # decided while telegram's card is up, and every edit of it fails in this process (a stop finishes the
        # edits it was asked for, so only one that keeps failing is left for the next process)
        first[0].failures.extend(PlatformError("telegram", "edit", "502", retryable=True) for _ in range(50))
        decided = await r.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")
        assert decided.won
    second = [MemoryPlatform("telegram"), MemoryPlatform("slack")]
    async with rig(path, second) as r:
        await wait_for(second[0].settled_event)
        assert second[0].settled[0][1].startswith("denied by telegram:111")
        # the slack post was never made; the request has ended, so it is skipped, not posted late
        await outbox_drained(r.bus)
        assert second[1].posts == []
        row = await r.service.store.get(request.id)
        assert row is not None
        assert row.status is Status.DENIED


async def test_timeout_settles_cards_too(tmp_path: Path) -> None:
    platforms = [MemoryPlatform("telegram")]
    async with rig(tmp_path / "k.db", platforms) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c", deadline=0.2)
        await wait_for(platforms[0].posted)
        outcome = await r.service.wait(request.id)
        assert outcome.status is Status.TIMEOUT
        await wait_for(platforms[0].settled_event)
        assert "timed out" in platforms[0].settled[0][1]
        assert "not a denial" in platforms[0].settled[0][1]


async def test_broadcast_survives_one_failing_platform(tmp_path: Path) -> None:
    bad = MemoryPlatform("slack", failures=[PlatformError("slack", "send", "500", retryable=True)])
    good = MemoryPlatform("telegram")
    async with rig(tmp_path / "k.db", [bad, good]) as r:
        results = await r.bus.broadcast("step 2 done", agent="kazma")
        assert results == {"slack": None, "telegram": "1"}
        assert good.texts == [("home", "step 2 done", "kazma")]


async def test_null_bus_fails_closed() -> None:
    bus = NullBus()
    assert not bus.can_show_cards()
    assert await bus.send_text("telegram", "1", "hi") is None


async def test_a_card_that_cannot_be_queued_ends_its_request_at_once_and_the_asker_hears_why(tmp_path: Path) -> None:
    """The outbox here has a writer of its own, so the request and its card posts are two writes. When the second
    is refused (a trigger fails every insert into card_outbox), the request must not stay pending, card-less,
    until its deadline: it ends cancelled, and the asker is told nothing ran."""
    platform = MemoryPlatform("telegram")
    path = tmp_path / "a.db"
    async with rig(path, [platform]) as r:
        raw = await connect(path)
        try:
            await raw.execute(
                "CREATE TRIGGER no_cards BEFORE INSERT ON card_outbox BEGIN SELECT RAISE(ABORT, 'disk full'); END"
            )
            await raw.commit()
        finally:
            await raw.close()
        assert await r.bus.queue_statements("x") is None  # two writers: the fallback path is what is attacked
        with pytest.raises(ApprovalRefused, match="could not be queued"):
            await r.service.open("shell", {"command": "ls"}, "agent:builder", "telegram:-1001")
        (request,) = await r.service.store.requests()
        assert request.status is Status.CANCELLED
        assert "could not be queued" in (request.reason or "")
        assert await r.service.store.requests(pending_only=True) == []
        assert platform.posts == []


async def test_an_edit_another_replica_hands_back_waits_out_this_process_s_own_refused_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica whose token Telegram refused hands the edit back to the others at once (ApprovalStore.settle_refused
    tells them). One whose own token was refused too waits out its hold instead of trying it at once: two replicas
    with a stale token would hand each edit back and forth, one refused call each time, without end."""
    monkeypatch.setattr(bus_module, "RETRY", Backoff(base=1000, cap=1000, jitter=False))
    refusal = PlatformError("telegram", "card_settle", "InvalidToken: Unauthorized", retryable=True,
                            operator_must_act=True, nothing_done=True)  # fmt: skip
    telegram = MemoryPlatform("telegram")
    async with rig(tmp_path / "k.db", [telegram]) as r:
        request = await r.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        await wait_for(telegram.posted)
        telegram.failures.append(refusal)  # the decision's edit meets it
        assert (await r.service.decide(request.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        worker = r.bus._workers["telegram"]
        async with asyncio.timeout(20):
            while worker.held_until is None or worker.to_settle:
                await asyncio.sleep(0.01)
        await r.bus.settle_told(request.id)  # another replica's refused edit of it, handed back
        assert not worker.to_settle
        assert telegram.settled == []
        await r.bus.settle(request.id)  # a decision made here is tried at once all the same
        await wait_for(telegram.settled_event)
        assert [summary.split(" ")[0] for _, summary in telegram.settled] == ["denied"]
