"""Two replicas on one PostgreSQL: wake-ups by NOTIFY, posts and edits claimed once, the leader's recovery.

Each "replica" here is a full approvals service and bus with its own PostgreSQL
connections, lease and listener, in one test process; the platforms are shared
in-memory stand-ins (one object per platform, as there is one Telegram), so a
card posted twice or edited twice would show as two entries. Waiters poll the
store only once a minute here: a decision made on the other replica can reach
them within the test's bounds only through NOTIFY.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import psycopg
import pytest
from structlog.testing import capture_logs

from kazma.adapters.bus import FanOutBus
from kazma.adapters.contract import CardRef, Handlers, Inbound, PlatformError, Press
from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalService, ApprovalStore, Decision, PressResult, Status
from kazma.approvals.card import ApprovalCard
from kazma.approvals.model import Outcome
from kazma.approvals.service import REPLICA_GONE
from kazma.bot.replication import Replication
from kazma.bot.store import pg_migrations
from kazma.config.metrics import failure_count
from kazma.config.store.leader import LeaseTiming
from kazma.config.store.postgres import PgStore, open_pg_store
from kazma.config.store.replicas import live_replicas
from tests.approvals_support import approvals_config
from tests.test_bus import MemoryPlatform

FAST = LeaseTiming(check_interval=0.3, check_timeout=0.3, retry_interval=0.1, server_drop_after=1.0)


@dataclass
class Replica:
    name: str
    store: PgStore
    approvals: ApprovalStore
    outbox: Outbox
    bus: FanOutBus
    service: ApprovalService
    replication: Replication
    led: asyncio.Event


async def _noop(message: Inbound) -> None:
    return


@asynccontextmanager
async def replica(
    dsn: str, name: str, platforms: list[MemoryPlatform], *, lead: Callable[[Replica], Awaitable[None]] | None = None
) -> AsyncIterator[Replica]:
    store = await open_pg_store(dsn, migrations=pg_migrations(), application_name=f"kazma {name}")
    config = approvals_config()
    approvals = ApprovalStore(store, replica=name)
    outbox = Outbox(store, replica=name)
    bus = FanOutBus(platforms, store=approvals, outbox=outbox, config=config, shared=True, claim_seconds=30)
    service = ApprovalService(approvals, config, publisher=bus, poll_interval=60)
    led = asyncio.Event()
    holder: list[Replica] = []

    async def on_lead() -> None:
        if lead is not None:
            await lead(holder[0])
        led.set()

    async def on_follow(reason: str) -> None:
        led.clear()

    replication = Replication(
        conninfo=dsn,
        store=store,
        replica=name,
        service=service,
        bus=bus,
        outbox=outbox,
        lead=on_lead,
        follow=on_follow,
        timing=FAST,
    )
    me = Replica(name, store, approvals, outbox, bus, service, replication, led)
    holder.append(me)

    async def on_press(press: Press) -> PressResult:
        return await service.decide_from_button(press.data, actor=press.actor, platform=press.platform)

    await replication.start()
    await bus.start(Handlers(on_inbound=_noop, on_press=on_press))
    try:
        yield me
    finally:
        await bus.stop()
        await replication.stop()
        await store.close()


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.02)


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    return pg_dsn


async def test_a_decision_on_one_replica_wakes_the_call_waiting_on_another_and_settles_each_card_once(
    dsn: str,
) -> None:
    platforms = [MemoryPlatform("telegram"), MemoryPlatform("slack")]
    async with replica(dsn, "a", platforms) as a, replica(dsn, "b", platforms) as b:
        requests = [await a.service.open("shell", {"command": f"ls {n}"}, "agent:b", "web:c") for n in range(10)]

        async def all_posted() -> bool:
            return not await a.outbox.pending() and all(len(p.posts) >= len(requests) for p in platforms)

        await until(all_posted)
        waiters = [asyncio.create_task(a.service.wait(r.id)) for r in requests]
        for r in requests:
            result = await b.service.decide(r.id, Decision.DENY, actor="telegram:111", platform="telegram")
            assert result.won
        outcomes = await asyncio.wait_for(asyncio.gather(*waiters), timeout=15)  # poll_interval is 60 s
        assert {o.status for o in outcomes} == {Status.DENIED}

        async def all_settled() -> bool:
            return not await a.approvals.unsettled_cards() and all(len(p.settled) >= len(requests) for p in platforms)

        await until(all_settled)
        for platform in platforms:
            assert len(platform.posts) == len(requests)  # each card posted once, whichever replica did it
            refs = [ref for ref, _ in platform.settled]
            assert len(refs) == len(set(refs)) == len(requests)  # ... and edited once
            assert all(summary.startswith("denied by telegram:111") for _, summary in platform.settled)


async def test_cards_queued_on_one_replica_are_posted_by_the_other_when_it_is_the_only_one_able(dsn: str) -> None:
    hung = asyncio.Event()  # never set: replica a's telegram never answers a post
    stuck = MemoryPlatform("telegram", hang=hung)
    shared = MemoryPlatform("telegram")
    async with replica(dsn, "b", [shared]) as b:
        async with replica(dsn, "a", [stuck]) as a:
            request = await a.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
            await until(lambda: _claimed(a.store))  # one of them holds the post's claim
        # a stopped with its claim (if it had it): released by the leader's recovery, or run out. The server
        # lists a closed session until its backend has exited, so wait until b no longer sees a.
        await until(lambda: _gone_from(b, "a"))
        recovery = await b.replication.recover_gone(await b.replication.live())
        assert [r.id for r in recovery.cancelled] == [request.id]  # a's waiter is gone with it
        assert recovery.cancelled[0].reason == REPLICA_GONE
        await until(lambda: _settled_or_skipped(b, request.id))
    assert len(shared.posts) <= 1


async def _gone_from(r: Replica, name: str) -> bool:
    return name not in await r.replication.live()


async def _claimed(store: PgStore) -> bool:
    row = await store.one("SELECT count(*) FROM card_outbox WHERE claimed_by IS NOT NULL OR done_at IS NOT NULL")
    return bool(row[0])


async def _settled_or_skipped(r: Replica, request_id: str) -> bool:
    rows = await r.outbox.pending()
    return not rows and not await r.approvals.unsettled_cards()


async def test_exactly_one_replica_leads_and_the_other_takes_over_when_it_stops(dsn: str) -> None:
    platforms = [MemoryPlatform("telegram")]
    async with replica(dsn, "a", platforms) as a:
        await asyncio.wait_for(a.led.wait(), timeout=10)
        async with replica(dsn, "b", platforms) as b:
            health = await b.replication.health()
            assert (health.leader, health.holder, health.store_reachable) == (False, "a", True)
            assert await b.replication.live() == {"a", "b"}
            await a.replication.stop()  # the lease goes with its connection
            await asyncio.wait_for(b.led.wait(), timeout=10)
            health = await b.replication.health()
            assert (health.leader, health.holder) == (True, "b")
            assert await b.replication.live() == {"b"}


async def test_a_leader_whose_duties_fail_to_start_gives_the_lease_up_and_leadership_goes_on(dsn: str) -> None:
    """A replica that took the lease and could not start its duties (the chaos cell leader.takeover=error) led
    nothing and kept the lease: no replica polled a platform or swept again until someone restarted it."""
    platforms = [MemoryPlatform("telegram")]
    failures: list[str] = []

    async def fails_once(me: Replica) -> None:
        if not failures:
            failures.append(me.name)
            raise ConnectionError("the lease's duties failed")

    async with replica(dsn, "a", platforms, lead=fails_once) as a, replica(dsn, "b", platforms) as b:
        await until(lambda: _true(bool(failures)))
        # the lease moves on: one of them leads with its duties started (b, or a asking again)
        await until(lambda: _true(a.led.is_set() or b.led.is_set()), timeout=20)
        health = await b.replication.health()
        leader = a if a.led.is_set() else b
        assert health.holder == leader.name
        assert leader.replication.is_leader


async def _true(value: bool) -> bool:
    return value


async def test_a_replica_whose_wake_ups_are_cut_finds_the_decision_when_it_reconnects(dsn: str) -> None:
    platforms = [MemoryPlatform("telegram")]
    async with replica(dsn, "a", platforms) as a, replica(dsn, "b", platforms) as b:
        request = await a.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        waiter = asyncio.create_task(a.service.wait(request.id))
        connects = a.replication.listener.connects
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = %s",
                ("kazma-listen a",),
            )
        result = await b.service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
        assert result.won
        outcome = await asyncio.wait_for(waiter, timeout=15)  # told, or found at the resync after reconnecting
        assert outcome.status is Status.APPROVED
        await until(lambda: _reconnected(a.replication, connects))


async def _reconnected(replication: Replication, before: int) -> bool:
    return replication.listener.connects > before and replication.listener.connected


async def test_a_decision_made_while_the_listener_is_down_reaches_its_waiter_once_it_is_back(dsn: str) -> None:
    """The listener's backend is ended and it cannot reconnect until the decision is committed (its address,
    for that while, is a server that hangs up at once): no NOTIFY can carry the decision. The drop is logged
    and counted once; back, the replica's resync finds it (its waiter polls the store once a minute here),
    and its next wake-ups come by NOTIFY again."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    platforms = [MemoryPlatform("telegram")]
    async with replica(dsn, "a", platforms) as a, replica(dsn, "b", platforms) as b:
        first = await a.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        second = await a.service.open("shell", {"command": "pwd"}, "agent:b", "web:c")
        waiter = asyncio.create_task(a.service.wait(first.id))
        listener = a.replication.listener
        connects = listener.connects
        counted = failure_count("store_listen")
        refusing = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = refusing.sockets[0].getsockname()[1]
        with capture_logs() as logs:
            try:
                listener.conninfo = psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=port)
                with psycopg.connect(dsn, autocommit=True) as admin:
                    ended = admin.execute(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                        " WHERE application_name = %s AND datname = current_database()",
                        ("kazma-listen a",),
                    ).fetchall()
                assert len(ended) == 1
                await until(lambda: _true(not listener.connected and listener.problem is not None))
                result = await b.service.decide(first.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
                assert result.won
                assert listener.connects == connects  # it was not listening when the decision was committed
                assert not waiter.done()
            finally:
                listener.conninfo = dsn
                refusing.close()
            outcome = await asyncio.wait_for(waiter, timeout=15)  # poll_interval is 60 s: the resync found it
            assert outcome.status is Status.APPROVED
            await until(lambda: _reconnected(a.replication, connects))
        assert failure_count("store_listen") == counted + 1  # one outage, counted once however many attempts
        said = [e["event"] for e in logs if e["event"].startswith("store.listen_")]
        assert said == ["store.listen_lost", "store.listen_resumed"]
        # and heard again: a decision on b reaches a's next waiter by NOTIFY
        waiter = asyncio.create_task(a.service.wait(second.id))
        assert (await b.service.decide(second.id, Decision.DENY, actor="telegram:111", platform="telegram")).won
        assert (await asyncio.wait_for(waiter, timeout=15)).status is Status.DENIED


def test_every_metric_sample_says_which_replica_served_it() -> None:
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kazma.config.metrics import count_failure, with_label

    count_failure("test_replica_label", 'odd "platform" name')  # a label value with quotes and spaces
    labelled = with_label(generate_latest(REGISTRY), "replica", 'b:1 "x"').decode()
    samples = [s for family in text_string_to_metric_families(labelled) for s in family.samples]
    assert samples
    assert all(s.labels.get("replica") == 'b:1 "x"' for s in samples)
    failures = [s for s in samples if s.name == "kazma_failures_total" and s.labels["site"] == "test_replica_label"]
    assert [s.labels["platform"] for s in failures] == ['odd "platform" name']


async def test_a_replica_counts_as_gone_only_after_missing_longer_than_the_lease_takeover(dsn: str) -> None:
    platforms = [MemoryPlatform("telegram")]
    async with replica(dsn, "a", platforms) as a:
        async with replica(dsn, "b", platforms):
            assert await a.replication.settled_live() is None  # too early to judge anyone
            await until(lambda: _settled(a.replication, {"a", "b"}), timeout=15)
        # b has left: for a takeover bound it may only be reconnecting, then it is gone
        await until(lambda: _live_now(a.replication, {"a"}), timeout=5)
        assert await a.replication.settled_live() == {"a", "b"}
        await until(lambda: _settled(a.replication, {"a"}), timeout=15)


async def test_a_replica_missing_a_moment_is_not_gone_however_long_ago_the_last_look_was(dsn: str) -> None:
    """The leader judges what gone replicas left by who has been missing longer than the takeover bound. A replica
    that looked once (a follower's inbound claim) and not again until it led counted one missing at that moment as
    gone at once: its last sighting was old, though it said nothing of the time since. The missing one's pending
    requests were cancelled and its running calls marked lost while it lived (its lease session reconnected)."""
    platforms = [MemoryPlatform("telegram")]
    now = [1000.0]
    async with replica(dsn, "a", platforms) as a, replica(dsn, "b", platforms) as b:
        b.replication.clock = lambda: now[0]
        request = await a.service.open("shell", {"command": "ls"}, "agent:b", "web:c")
        assert await b.replication.live() == {"a", "b"}  # one look, long before the next
        now[0] += 10 * b.replication.absence
        await a.replication.lease.stop()  # a's lease session drops (as when it reconnects)
        await until(lambda: _not_listed(b.store, "a"))
        live = await b.replication.settled_live()
        if live is not None:  # what the leader's sweep does with it
            await b.replication.recover_gone(live)
        assert live is None  # missing from the first look after so long: too early to say for how long
        pending = await b.approvals.get(request.id)
        assert pending is not None
        assert pending.status is Status.PENDING
        now[0] += 0.6 * b.replication.absence
        assert await b.replication.settled_live() is None
        now[0] += 0.6 * b.replication.absence
        assert await b.replication.settled_live() == {"b"}  # missing from every look for longer: gone
        a.replication.lease.start()
        await until(lambda: _listed(b.store, "a"))
        now[0] += 0.6 * b.replication.absence
        assert await b.replication.settled_live() == {"a", "b"}  # back
        await a.replication.lease.stop()
        await until(lambda: _not_listed(b.store, "a"))
        now[0] += 0.6 * b.replication.absence
        assert await b.replication.settled_live() == {"a", "b"}  # missing from one look: maybe reconnecting
        now[0] += 0.6 * b.replication.absence
        assert await b.replication.settled_live() == {"a", "b"}  # missing for less than the bound since
        now[0] += 0.6 * b.replication.absence
        assert await b.replication.settled_live() == {"b"}


async def _listed(store: PgStore, name: str) -> bool:
    return name in await live_replicas(store.pool)


async def _not_listed(store: PgStore, name: str) -> bool:
    return name not in await live_replicas(store.pool)


async def _settled(replication: Replication, expected: set[str]) -> bool:
    return await replication.settled_live() == expected


async def _live_now(replication: Replication, expected: set[str]) -> bool:
    return await replication.live() == expected


async def test_doctor_names_the_replicas_and_the_leader(dsn: str) -> None:
    from kazma.bot.cli.checks import Level
    from kazma.bot.cli.doctor import check_replicas
    from kazma.config import load_config_text

    loaded = load_config_text(f"store: {{url: '{dsn}'}}")
    platforms = [MemoryPlatform("telegram")]
    async with replica(dsn, "a", platforms) as a:
        await asyncio.wait_for(a.led.wait(), timeout=10)
        async with replica(dsn, "b", platforms):
            check = await check_replicas(loaded)
            assert (check.level, check.detail) == (Level.OK, "a (leader), b")


@dataclass
class StaleToken(MemoryPlatform):
    """Telegram as a replica with a stale token sees it (a rolling token change): every post and edit answered
    401, which certainly did nothing; ``refusing`` False: it still takes them."""

    refusing: bool = True
    refused: int = 0

    def _refuse(self, site: str) -> None:
        if self.refusing:
            self.refused += 1
            raise PlatformError(self.name, site, "InvalidToken: Unauthorized", retryable=True,
                                operator_must_act=True, nothing_done=True)  # fmt: skip

    async def post_card(self, card: ApprovalCard) -> CardRef:
        self._refuse("card_post")
        return await super().post_card(card)

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        self._refuse("card_settle")
        await super().settle_card(ref, card, outcome)


@dataclass
class Gated(MemoryPlatform):
    """Telegram as a replica whose token works sees it: its edits wait for ``gate``."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        await self.gate.wait()
        await super().settle_card(ref, card, outcome)


async def test_a_replica_whose_token_is_refused_does_not_hold_the_card_posts_of_a_replica_whose_token_works(
    dsn: str,
) -> None:
    """During a rolling token change one replica still carries the old token: Telegram answers its post 401. Its
    refusal held every waiting post in the shared outbox by the longest backoff (a minute), again at each refused
    try, so the replica whose token works posted none of them in the meantime. Only the refusing replica waits."""
    stale = StaleToken("telegram")
    gate = asyncio.Event()
    good = MemoryPlatform("telegram", hang=gate)  # its posts wait, so the refusing replica tries some first
    async with replica(dsn, "a", [stale]) as a, replica(dsn, "b", [good]) as b:
        requests = [await a.service.open("shell", {"command": f"ls {n}"}, "agent:b", "web:c") for n in range(6)]

        async def refused_once() -> bool:
            return stale.refused >= 1

        await until(refused_once)
        gate.set()

        async def all_posted() -> bool:
            return not await b.outbox.pending()

        await until(all_posted, timeout=10)  # the refusing replica's hold is a minute
        assert sorted(c.request_id for c in good.posts) == sorted(r.id for r in requests)
        assert stale.posts == []


async def test_a_replica_whose_token_is_refused_does_not_hold_the_card_edits_of_a_replica_whose_token_works(
    dsn: str,
) -> None:
    """As with posts: a replica's refused edit of a decided card held every other decided card's edit in the shared
    rows, so the cards kept live buttons although another replica's token could edit them."""
    stale = StaleToken("telegram", refusing=False)
    good = Gated("telegram")
    async with replica(dsn, "a", [stale]) as a, replica(dsn, "b", [good]) as b:
        requests = [await a.service.open("shell", {"command": f"ls {n}"}, "agent:b", "web:c") for n in range(6)]

        async def all_posted() -> bool:
            return not await b.outbox.pending()

        await until(all_posted)
        stale.refusing = True
        for r in requests:
            assert (await a.service.decide(r.id, Decision.DENY, actor="telegram:111", platform="telegram")).won

        async def refused_once() -> bool:
            return stale.refused >= 1

        await until(refused_once)  # b's edits wait meanwhile, so the refusing replica tries some first
        good.gate.set()

        async def all_settled() -> bool:
            return not await b.approvals.unsettled_cards()

        await until(all_settled, timeout=10)  # the claims run out after 30 s, the safety scan after a minute
        assert stale.refused >= 1
        assert len(good.settled) == len(requests)
