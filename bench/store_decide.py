"""Decisions per second: the approvals service against raw compare-and-set loops, interleaved.

For each case, the same number of requests is decided several ways, in one
process, alternating every ``--chunk`` requests so disk noise hits all alike:

* product: ``ApprovalService.decide_from_button`` (authorisation, the card check,
  the compare-and-set with ``RETURNING``, audit rows, group commit);
* raw sqlite3: ``UPDATE r SET status=? WHERE id=? AND status='pending'`` and a
  commit per press, stdlib ``sqlite3`` on the loop thread;
* raw aiosqlite: the same statement and commit through aiosqlite;
* product op alone: the very statements a press runs in the product
  (``ApprovalStore.press_op``: the card check, the compare-and-set with
  ``RETURNING``, the audit row), one transaction per request (as group
  commit gives a request's simultaneous presses), from stdlib
  ``sqlite3`` on the loop thread with no service, writer or event loop around
  them. ``ceiling`` is its rate ÷ raw sqlite3: what the product's schema and
  audit allow before any of its own code runs; ``÷op`` is the product ÷ these
  same writes by hand in one commit;
* product op together: the statements the product runs for a request's
  presses that share a group commit on SQLite (``ApprovalStore.press_op``'s
  ``Together``: one read of the request and its cards, one compare-and-set,
  the losers' audit rows in the chain's one insert), by hand the same way;
  ``÷tog`` is the product ÷ these. For one press it is ``op alone`` again.
  ``cpu÷tog`` is the same ratio by this process's CPU time per decision
  (every thread), which the neighbours on a shared machine change far less
  than the wall clock; the wall-clock ratios stay the figures of record.

Every file is WAL with ``synchronous=FULL``. The cases: one press per request,
one request at a time; three presses per request (one winner, two losers), one
request at a time; three presses per request with ``--in-flight`` requests at
once. Ratios are product ÷ raw. Prints numbers; asserts nothing.

    python bench/store_decide.py [--requests 2000] [--dir PATH] [--tmpfs /dev/shm] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import aiosqlite

from kazma.approvals import MIGRATIONS, ApprovalService, ApprovalStore, Decision, Status, button_data
from kazma.approvals.store import CardCheck, Pressed
from kazma.bot import start_gc
from kazma.bot.logging import configure_logging
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.database import connect, open_database
from kazma.config.store.group_commit import Together
from kazma.config.store.writer import Tx

CONFIG = load_config_text('approvals: {approvers: ["telegram:1", "slack:U1", "discord:2"]}').config
# Every outcome sealed, as in production (approvals/seal.py): the seal is part of what a decision costs.
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
PRESSERS = (("telegram:1", "telegram"), ("slack:U1", "slack"), ("discord:2", "discord"))
RAW_CAS = "UPDATE r SET status = ?, decided_by = ? WHERE id = ? AND status = 'pending'"


@dataclass(frozen=True)
class Case:
    name: str
    presses: int
    in_flight: int
    goal: float


CASES = (
    Case("1 press per request, one at a time", 1, 1, 0.8),
    Case("3 presses per request (1 winner, 2 losers)", 3, 1, 0.5),
    Case("3 presses, 60 requests in flight", 3, 60, 0.5),
)


@dataclass
class Tally:
    seconds: float = 0.0
    decisions: int = 0
    cpu: float = 0.0  # this process's CPU time (every thread: the writer's too) while the side ran

    @property
    def cpu_each(self) -> float:
        return self.cpu / self.decisions if self.decisions else 0.0

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds if self.seconds else 0.0


Chunk = Callable[[list[int]], Awaitable[int]]


async def opened(path: Path, requests: int) -> tuple[aiosqlite.Connection, ApprovalService, list[str]]:
    """A product store at ``path`` with ``requests`` pending requests, and their ids."""
    conn = await open_database(path, migrations=MIGRATIONS)
    service = ApprovalService(ApprovalStore(conn, keyring=KEYS), CONFIG)
    return conn, service, [(await service.open("shell", {"n": i}, "bench", "bench")).id for i in range(requests)]


async def close_product(conn: aiosqlite.Connection, service: ApprovalService) -> None:
    writer = await service.store.tables.writer()
    await writer.close()
    await conn.close()


async def product_side(path: Path, requests: int, case: Case) -> tuple[Chunk, Callable[[], Awaitable[None]]]:
    conn, service, ids = await opened(path, requests)

    async def decide(rid: str) -> int:
        presses = [
            service.decide_from_button(button_data(rid, Decision.APPROVE), actor=actor, platform=platform)
            for actor, platform in PRESSERS[: case.presses]
        ]
        results = await asyncio.gather(*presses) if len(presses) > 1 else [await presses[0]]
        return sum(r.won for r in results)

    async def chunk(numbers: list[int]) -> int:
        won = 0
        for start in range(0, len(numbers), case.in_flight):
            batch = numbers[start : start + case.in_flight]
            won += sum(await asyncio.gather(*(decide(ids[n]) for n in batch)))
        return won

    async def close() -> None:
        await close_product(conn, service)

    return chunk, close


def raw_table(conn: sqlite3.Connection, requests: int) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS r (id TEXT PRIMARY KEY, status TEXT NOT NULL, decided_by TEXT)")
    conn.executemany("INSERT INTO r VALUES (?, 'pending', NULL)", [(f"r{i}",) for i in range(requests)])


async def sqlite3_side(path: Path, requests: int, case: Case) -> tuple[Chunk, Callable[[], Awaitable[None]]]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    raw_table(conn, requests)

    async def chunk(numbers: list[int]) -> int:
        won = 0
        for n in numbers:
            for actor, _ in PRESSERS[: case.presses]:
                conn.execute("BEGIN IMMEDIATE")
                won += conn.execute(RAW_CAS, ("approved", actor, f"r{n}")).rowcount
                conn.execute("COMMIT")
        return won

    async def close() -> None:
        conn.close()

    return chunk, close


async def op_side(
    path: Path, requests: int, case: Case, *, together: bool = False
) -> tuple[Chunk, Callable[[], Awaitable[None]]]:
    setup, service, ids = await opened(path, requests)
    await close_product(setup, service)  # from here on, only stdlib sqlite3 touches the file
    store = service.store
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = FULL")
    tx = Tx(conn)

    async def chunk(numbers: list[int]) -> int:
        won = 0
        for n in numbers:
            conn.execute("BEGIN IMMEDIATE")
            ops = [
                store.press_op(
                    ids[n], Status.APPROVED, actor=actor, platform=platform, reason=None,
                    card=CardCheck(platform, None, None, needs_whole=True),
                )
                for actor, platform in PRESSERS[: case.presses]
            ]  # fmt: skip
            first = ops[0]
            if together and len(ops) > 1 and isinstance(first, Together):
                won += sum(p.won for p in first.together(tx, [cast(Together[Pressed], op).part for op in ops]))
            else:
                won += sum(op(tx).won for op in ops)
            tx._run_deferred()  # the audit rows, linked to the chain at the end of the transaction as the writer does
            conn.execute("COMMIT")
            tx._committed()
        return won

    async def close() -> None:
        conn.close()

    return chunk, close


async def aiosqlite_side(path: Path, requests: int, case: Case) -> tuple[Chunk, Callable[[], Awaitable[None]]]:
    conn: aiosqlite.Connection = await connect(path)
    await conn.execute("CREATE TABLE IF NOT EXISTS r (id TEXT PRIMARY KEY, status TEXT NOT NULL, decided_by TEXT)")
    await conn.executemany("INSERT INTO r VALUES (?, 'pending', NULL)", [(f"r{i}",) for i in range(requests)])
    lock = asyncio.Lock()

    async def press(n: int, actor: str) -> int:
        async with lock:
            await conn.execute("BEGIN IMMEDIATE")
            cursor = await conn.execute(RAW_CAS, ("approved", actor, f"r{n}"))
            won = cursor.rowcount
            await cursor.close()
            await conn.execute("COMMIT")
        return won

    async def chunk(numbers: list[int]) -> int:
        won = 0
        for start in range(0, len(numbers), case.in_flight):
            batch = numbers[start : start + case.in_flight]
            won += sum(await asyncio.gather(*(press(n, a) for n in batch for a, _ in PRESSERS[: case.presses])))
        return won

    async def close() -> None:
        await conn.close()

    return chunk, close


async def run_case(folder: Path, case: Case, requests: int, chunk_size: int) -> dict[str, Tally]:
    sides = {
        "product": await product_side(folder / "product.db", requests, case),
        "raw sqlite3": await sqlite3_side(folder / "sqlite3.db", requests, case),
        "raw aiosqlite": await aiosqlite_side(folder / "aiosqlite.db", requests, case),
        "op alone": await op_side(folder / "op.db", requests, case),
        "op together": await op_side(folder / "op2.db", requests, case, together=True),
    }
    tallies = {name: Tally() for name in sides}
    size = max(chunk_size, case.in_flight)
    try:
        for start in range(0, requests, size):
            numbers = list(range(start, min(start + size, requests)))
            for name, (chunk, _) in sides.items():
                began, cpu = time.perf_counter(), time.process_time()
                won = await chunk(numbers)
                tallies[name].seconds += time.perf_counter() - began
                tallies[name].cpu += time.process_time() - cpu
                tallies[name].decisions += won
    finally:
        for _, close in sides.values():
            await close()
    return tallies


async def main() -> None:
    parser = argparse.ArgumentParser(description="decisions per second, product vs raw, interleaved")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=20, help="requests per side before switching sides")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir here)")
    parser.add_argument("--tmpfs", type=Path, default=None, help="also run on this tmpfs folder, e.g. /dev/shm")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    configure_logging("warning")  # measure the store, not the log sink
    start_gc.served()  # as `kazma run` does once it serves: what the start holds frozen (kazma.bot.start_gc)
    places = [("store dir", args.dir or Path.cwd())]
    if args.tmpfs is not None:
        places.append(("tmpfs", args.tmpfs))
    for run in range(1, args.runs + 1):
        print(f"run {run}: {args.requests} requests per case, sides interleaved every {args.chunk} requests")
        header = f"{'where':<10}{'case':<46}{'product/s':>11}{'sqlite3/s':>11}{'aiosql/s':>10}{'op/s':>9}"
        print(
            header + f"{'÷sqlite3':>10}{'÷aiosql':>9}{'goal':>7}{'ceiling':>9}{'÷op':>7}{'÷tog':>7}{'cpu÷tog':>9}"
            f"{'load':>7}"
        )
        for label, folder in places:
            for case in CASES:
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    tallies = await run_case(Path(tmp), case, args.requests, args.chunk)
                product, raw, aio, alone, joint = (
                    tallies[k].rate for k in ("product", "raw sqlite3", "raw aiosqlite", "op alone", "op together")
                )
                goal = case.goal if label == "store dir" else 0.25
                # The same ratio by CPU time per decision (this process, every thread): what the product's own code
                # costs beside the same writes by hand, whatever the neighbours do to the wall clock and the disk.
                mine, theirs = tallies["product"].cpu_each, tallies["op together"].cpu_each
                cpu_ratio = theirs / mine if mine else 0.0
                print(
                    f"{label:<10}{case.name:<46}{product:>11,.0f}{raw:>11,.0f}{aio:>10,.0f}{alone:>9,.0f}"
                    f"{product / raw:>10.2f}{product / aio:>9.2f}{'≥' + str(goal):>7}{alone / raw:>9.2f}"
                    f"{product / alone:>7.2f}{product / joint:>7.2f}{cpu_ratio:>9.2f}{os.getloadavg()[0]:>7.2f}"
                )
                for name, tally in tallies.items():
                    if tally.decisions != args.requests:
                        print(f"  !! {name} decided {tally.decisions} of {args.requests}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
