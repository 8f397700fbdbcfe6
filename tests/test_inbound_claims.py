"""Inbound claims on both backends: one winner per (platform, key), also between replicas racing for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest

from kazma.bot.inbound_claims import MIGRATIONS, RETENTION_SECONDS, InboundClaims
from kazma.bot.store import pg_migrations
from kazma.config.store.database import open_database
from tests.store_backends import Engine

Replicas = Callable[[str, "Clock"], Awaitable[InboundClaims]]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def replicas(store_engine: Engine) -> AsyncIterator[Replicas]:
    """Open the claims of one more replica: its own connection (SQLite) or its own pool and writer (PostgreSQL)."""
    name, where = store_engine.name, store_engine.where
    async with AsyncExitStack() as stack:

        async def open_replica(replica: str, clock: Clock) -> InboundClaims:
            if name == "sqlite":
                conn = await open_database(where, migrations=MIGRATIONS)
                stack.push_async_callback(conn.close)
                return InboundClaims(conn, replica=replica, clock=clock)
            from kazma.config.store.postgres import open_pg_store

            store = await open_pg_store(where, migrations=pg_migrations(), application_name=f"claims-{replica}")
            stack.push_async_callback(store.close)
            return InboundClaims(store, replica=replica, clock=clock)

        yield open_replica


async def test_the_first_claim_wins_and_later_ones_are_told_no(
    replicas: Replicas,
) -> None:
    clock = Clock()
    claims = await replicas("a", clock)
    assert await claims.claim("telegram", "123456:1000") is True
    assert await claims.claim("telegram", "123456:1000") is False
    # the key is the platform's: the same text on another platform is another event
    assert await claims.claim("slack", "123456:1000") is True
    assert await claims.holder("telegram", "123456:1000") == "a"
    assert await claims.holder("telegram", "123456:1001") is None


async def test_two_replicas_racing_for_the_same_events_get_one_winner_each(
    replicas: Replicas,
) -> None:
    clock = Clock()
    first, second = await replicas("a", clock), await replicas("b", clock)
    keys = [f"Ev{n:08d}" for n in range(60)]
    results = await asyncio.gather(
        *(claims.claim("slack", key) for key in keys for claims in (first, second)),
    )
    won = dict.fromkeys(keys, 0)
    for index, result in enumerate(results):
        won[keys[index // 2]] += int(result)
    assert won == dict.fromkeys(keys, 1)
    holders = {await first.holder("slack", key) for key in keys}
    assert holders <= {"a", "b"}
    assert await second.claim("slack", keys[0]) is False  # seen by the other replica's connection too


async def test_old_claims_are_forgotten_and_recent_ones_kept(
    replicas: Replicas,
) -> None:
    clock = Clock()
    claims = await replicas("a", clock)
    assert await claims.claim("discord", "message:1")
    clock.now += RETENTION_SECONDS - 60
    assert await claims.claim("discord", "message:2")
    clock.now += 120  # message:1 is a day and a minute old, message:2 a minute
    assert await claims.forget_older_than() == 1
    assert await claims.holder("discord", "message:1") is None
    assert await claims.holder("discord", "message:2") == "a"
    assert await claims.claim("discord", "message:2") is False
    assert await claims.forget_older_than(30) == 1
    assert await claims.holder("discord", "message:2") is None


async def test_a_claim_a_gone_replica_never_took_in_is_taken_over_once(replicas: Replicas) -> None:
    clock = Clock()
    alive = {"a", "b", "c"}

    async def live() -> set[str]:
        return set(alive)

    a, b, c = [await replicas(name, clock) for name in ("a", "b", "c")]
    for claims in (a, b, c):
        claims.live = live
    assert await a.claim("telegram", "bot:1")  # fetched by a, which then dies before taking it in
    assert await a.claim("telegram", "bot:2")
    await a.done("telegram", "bot:2")  # ... while this one it had taken in
    assert not await b.claim("telegram", "bot:1")  # a is alive: it is a's
    alive.discard("a")
    wins = await asyncio.gather(b.claim("telegram", "bot:1"), c.claim("telegram", "bot:1"))
    assert sorted(wins) == [False, True]  # one replica takes it over
    assert await a.holder("telegram", "bot:1") in {"b", "c"}
    assert not await b.claim("telegram", "bot:2")  # taken in before a died: never handled again
    assert not await c.claim("telegram", "bot:2")


async def test_the_inbox_hands_what_a_gone_replica_kept_and_never_took_in_to_the_next_one(replicas: Replicas) -> None:
    clock = Clock()
    alive = {"a", "b"}

    async def live() -> set[str]:
        return set(alive)

    a, b = [await replicas(name, clock) for name in ("a", "b")]
    a.live = b.live = live
    await a.fetched("telegram", [("bot:1", '{"update_id": 1}'), ("bot:2", '{"update_id": 2}')])
    assert await a.claim("telegram", "bot:1")  # its own poller kept it: let through once
    assert not await a.claim("telegram", "bot:1")
    await a.done("telegram", "bot:1")
    assert await b.unfinished("telegram") == []  # a is alive: bot:2 is still a's
    alive.discard("a")
    assert await b.unfinished("telegram") == ['{"update_id": 2}']  # taken over: b handles it
    assert await b.holder("telegram", "bot:2") == "b"
    assert await b.claim("telegram", "bot:2")  # ... once
    assert not await b.claim("telegram", "bot:2")
    await b.fetched("telegram", [("bot:1", '{"update_id": 1}')])  # delivered again: a took it in already
    assert not await b.claim("telegram", "bot:1")


async def test_a_message_kept_with_its_claim_is_handed_over_by_exactly_one_replica(replicas: Replicas) -> None:
    """A gateway message (Discord) is kept with its claim: the claimer counted gone while it still runs (its
    lease session dropped) loses the compare-and-set at taking it in, and the replica that took the claim over
    hands it over instead; the body is dropped once taken in."""
    clock = Clock()
    alive = {"a", "b"}

    async def live() -> set[str]:
        return set(alive)

    a, b = [await replicas(name, clock) for name in ("a", "b")]
    a.live = b.live = live
    assert await a.claim("discord", "message:1", '{"text": "hello"}')
    assert await a.claim("discord", "message:2", '{"text": "taken in"}')
    assert await a.done("discord", "message:2")
    assert await b.unfinished("discord") == []  # a is alive: message:1 is still a's to take in
    alive.discard("a")  # a's lease session drops; a itself is slow, not dead
    assert await b.unfinished("discord") == ['{"text": "hello"}']  # message:2 was taken in: never again
    assert not await a.done("discord", "message:1")  # a comes back to it: not a's any more, a drops it
    assert await b.claim("discord", "message:1")  # b hands it over, once
    assert not await b.claim("discord", "message:1")
    assert await b.done("discord", "message:1")
    assert await b.tables.all("SELECT event_key FROM inbound_claims WHERE payload IS NOT NULL") == []
    assert await b.unfinished("discord") == []


async def test_a_poller_that_stops_gives_back_what_it_kept_and_never_let_through(replicas: Replicas) -> None:
    clock = Clock()
    a, b = [await replicas(name, clock) for name in ("a", "b")]
    await a.fetched("telegram", [("bot:1", '{"update_id": 1}'), ("bot:2", '{"update_id": 2}')])
    assert await a.claim("telegram", "bot:1")  # handled here
    assert await a.release_unhandled("telegram") == 1  # bot:2 was only kept: Telegram sends it again
    assert await b.claim("telegram", "bot:2")  # ... to the next poller, which handles it
    assert not await b.claim("telegram", "bot:1")


async def test_a_signed_request_is_first_once_for_every_replica_and_stays_out_of_claims_and_the_inbox(
    replicas: Replicas,
) -> None:
    clock = Clock()
    a, b = await replicas("a", clock), await replicas("b", clock)
    keys = ["sig:v0=abc", "trigger:T1"]
    assert await a.first_signed("slack", keys) is True
    assert await a.first_signed("slack", keys) is False  # the same request again
    assert await b.first_signed("slack", keys) is False  # ... posted to another replica
    # One key seen is enough: Slack's retry of an event has a new signature and the same event id.
    assert await b.first_signed("slack", ["sig:v0=new", "trigger:T1"]) is False
    assert await b.first_signed("slack", ["sig:v0=other", "trigger:T2"]) is True
    # Kept apart from the platform's own claims, and already taken in: nothing to hand over or give back.
    assert await a.claim("slack", "trigger:T1") is True
    assert await a.unfinished("slack") == []
    assert await a.release_unhandled("slack") == 0
    clock.now += RETENTION_SECONDS + 1
    assert await a.forget_older_than() == 6  # five signed keys and the claim
    assert await a.first_signed("slack", keys) is True
