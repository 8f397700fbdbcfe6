"""Press → every card settled, across replicas on PostgreSQL: the pressing replica is not the posting one.

Replica A opens each request and posts its cards on three zero-latency
platforms; replica B (a separate approvals service with its own connections,
lease and listener) takes the press. B's decision reaches A only through the
database: the ``NOTIFY`` in the decision's commit wakes A's listener, A's bus
claims and makes the edits. The clock runs from B's ``decide`` call to the
last of A's cards showing the outcome, polled at 1 ms. Prints numbers;
asserts nothing.

    PYTHONPATH=. python bench/pg_settle.py [--dsn postgresql://…] [--requests 200]

Without ``--dsn`` it starts a throwaway server with the test suite's
``tests/pg_support.py`` (run from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

from kazma.adapters.bus import FanOutBus, NullBus
from kazma.adapters.contract import CardRef, Handlers, Inbound, Press
from kazma.adapters.outbox import Outbox
from kazma.approvals import ApprovalCard, ApprovalService, ApprovalStore, Decision, Outcome, PressResult
from kazma.bot.logging import configure_logging
from kazma.bot.replication import Replication
from kazma.bot.store import pg_migrations
from kazma.config import load_config_text
from kazma.config.address import Address
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.outgoing import Outgoing
from kazma.config.store.postgres import PgStore, open_pg_store

CONFIG = load_config_text('approvals: {approvers: ["telegram:1"]}').config
# Every outcome sealed, as in production (approvals/seal.py): the seal is part of what a decision costs.
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))


class ZeroPlatform:
    """Answers every call at once; remembers when each card was settled."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.home_chat: str | None = "home"
        self.posted = 0
        self.settled_at: dict[str, float] = {}  # request id -> when its card here was edited

    async def start(self, handlers: Handlers) -> None:
        return

    async def stop(self) -> None:
        return

    async def send(self, to: Address, message: Outgoing) -> str:
        return await self.send_text(to.chat, message.text, agent=message.agent, thread=to.thread)

    async def send_text(self, chat: str, text: str, *, agent: str | None = None, thread: str | None = None) -> str:
        return "1"

    async def send_choices(
        self,
        chat: str,
        text: str,
        choices: Sequence[tuple[str, str]],
        *,
        agent: str | None = None,
        thread: str | None = None,
    ) -> str:
        return "1"

    async def post_card(self, card: ApprovalCard) -> CardRef:
        self.posted += 1
        return CardRef(self.name, "home", card.request_id)

    async def settle_card(self, ref: CardRef, card: ApprovalCard, outcome: Outcome) -> None:
        self.settled_at[ref.message_id] = time.perf_counter()


async def _nothing(*args: object) -> None:
    return


async def _inbound(message: Inbound) -> None:
    return


async def run(dsn: str, requests: int) -> None:
    platforms = [ZeroPlatform("telegram"), ZeroPlatform("slack"), ZeroPlatform("discord")]
    stores: list[PgStore] = []
    replications: list[Replication] = []
    try:
        a_store = await open_pg_store(dsn, migrations=pg_migrations(), application_name="bench a")
        b_store = await open_pg_store(dsn, migrations=pg_migrations(), application_name="bench b")
        stores += [a_store, b_store]
        a_approvals = ApprovalStore(a_store, replica="a", keyring=KEYS)
        a_outbox = Outbox(a_store, replica="a")
        a_bus = FanOutBus(platforms, store=a_approvals, outbox=a_outbox, config=CONFIG, shared=True)
        a = ApprovalService(a_approvals, CONFIG, publisher=a_bus, poll_interval=30)
        # B has no platform of its own.
        b = ApprovalService(ApprovalStore(b_store, replica="b", keyring=KEYS), CONFIG, poll_interval=30)
        b_bus = NullBus()  # B shows no card itself: every edit is A's
        for name, store, service, bus, outbox in (("a", a_store, a, a_bus, a_outbox), ("b", b_store, b, b_bus, None)):
            replication = Replication(
                conninfo=dsn,
                store=store,
                replica=name,
                service=service,
                bus=bus,
                outbox=outbox,
                lead=_nothing,
                follow=_nothing,
            )
            await replication.start()
            replications.append(replication)

        async def on_press(press: Press) -> PressResult:
            raise AssertionError("no press comes from a platform here")

        await a_bus.start(Handlers(on_inbound=_inbound, on_press=on_press))
        latencies: list[float] = []
        for _ in range(requests):
            request = await a.open("shell", {"command": "ls"}, "bench", "web:bench")
            await _cards_recorded(a_approvals, request.id, len(platforms))
            pressed = time.perf_counter()
            result = await b.decide(request.id, Decision.DENY, actor="telegram:1", platform="telegram")
            assert result.won
            await _polled(lambda: all(request.id in p.settled_at for p in platforms))  # noqa: B023
            latencies.append(max(p.settled_at[request.id] for p in platforms) - pressed)
        await a_bus.stop()
        ms = sorted(x * 1000 for x in latencies)
        print(f"press on replica b -> all 3 cards settled by replica a, {requests} requests, zero-latency platforms:")
        print(f"  p50 {statistics.median(ms):.1f} ms   p95 {ms[int(len(ms) * 0.95) - 1]:.1f} ms   max {ms[-1]:.1f} ms")
    finally:
        for replication in replications:
            await replication.stop()
        for store in stores:
            await store.close()


async def _cards_recorded(store: ApprovalStore, request_id: str, count: int) -> None:
    while True:
        if len(await store.cards(request_id)) >= count:
            return
        await asyncio.sleep(0.001)


async def _polled(done: Callable[[], bool]) -> None:
    """At 1 ms resolution: what the benchmark measures is when the edits land, not when a wake-up came."""
    while True:
        if done():
            return
        await asyncio.sleep(0.001)


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    from tests.pg_support import PostgresServer  # the test suite's throwaway server

    with PostgresServer() as server, server.database() as db:
        yield db.dsn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a PostgreSQL database to use (default: a throwaway server)")
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    configure_logging("warning")
    if args.dsn:
        asyncio.run(run(args.dsn, args.requests))
        return
    with throwaway_server() as dsn:
        asyncio.run(run(dsn, args.requests))


if __name__ == "__main__":
    main()
