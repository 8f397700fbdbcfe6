"""Decisions on PostgreSQL: the product's press against a raw psycopg compare-and-set, interleaved, three cases.

Issue 31's rows: 1 press per request, 3 presses per request (one request at a
time), and 3 presses with 60 requests in flight, each with ``fsync`` off and on.
"Product" is the approvals service (authorisation, the card check, the sealed
compare-and-set with its review and audit rows on the audit chain, group commit
through :class:`kazma.config.store.postgres.PgWriter`); "raw" is a bare loop of
``UPDATE … WHERE status = 'pending' RETURNING`` on one autocommit connection, one
transaction per press. Both sides press the same number of requests, alternating
every ``--chunk`` requests so the machine's other load hits both alike; every
request is opened (and the tables warmed) before timing starts. Prints every run
with the 1-minute load average beside it, then the medians; asserts nothing.

Beside the rates, each side's CPU per press in this process (``time.process_time``: the event loop and the
writer thread together, not the server's): on a shared machine the rates move with the other load, the CPU a
press costs here much less. And the server's CPU per press, read from its processes' ``/proc/<pid>/schedstat``
(the product's: every session on the scratch database but the raw side's; 0 when the server runs elsewhere).

What the two sides do is not the same work: "raw" writes one row of a three-column table and nothing else
(no audit event, no review row, no NOTIFY, no seal), one transaction (one commit) per press; the product
writes the request's outcome, its review row, its audit event on the chain and its NOTIFY, one transaction
per group (a lone press is a group of one, so the "1 press" row commits once per press on both sides).

    python bench/pg_decide.py [--dsn postgresql://…] [--requests 1200] [--runs 3] [--chunk 60]

Without ``--dsn`` it starts a throwaway server with the test suite's
``tests/pg_support.py`` (run from the repository root) and turns ``fsync`` and
``synchronous_commit`` on for the "fsync on" rows (``ALTER SYSTEM`` and a reload).
With ``--dsn`` the server's own settings stand, and the rows say which they are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import psycopg

from kazma.approvals import ApprovalService, ApprovalStore, Decision, button_data
from kazma.bot import start_gc
from kazma.bot.logging import configure_logging
from kazma.bot.store import pg_migrations
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.postgres import PgStore, open_pg_store

CONFIG = load_config_text('approvals: {approvers: ["telegram:1", "slack:U1", "discord:2"]}').config
# Every outcome sealed, as in production (approvals/seal.py): the seal is part of what a decision costs.
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
PRESSERS = (("telegram:1", "telegram"), ("slack:U1", "slack"), ("discord:2", "discord"))


@dataclass(frozen=True)
class Case:
    name: str
    presses: int
    in_flight: int


CASES = (
    Case("1 press", 1, 1),
    Case("3 presses", 3, 1),
    Case("3 presses, 60 in flight", 3, 60),
)


@dataclass
class Side:
    seconds: float = 0.0
    decisions: int = 0
    cpu: float = 0.0  # process CPU seconds spent on this side (time.process_time)
    presses: int = 0
    server: float = 0.0  # CPU seconds of this side's server processes (their /proc/<pid>/schedstat)

    @property
    def server_per_press(self) -> float:
        """Microseconds of the server's CPU per press (0 when its processes cannot be read from here)."""
        return 1e6 * self.server / self.presses if self.presses else 0.0

    @property
    def cpu_per_press(self) -> float:
        """Microseconds of this process's CPU per press."""
        return 1e6 * self.cpu / self.presses if self.presses else 0.0

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds if self.seconds else 0.0


async def _product_chunk(service: ApprovalService, ids: list[str], case: Case) -> int:
    won = 0
    for first in range(0, len(ids), case.in_flight):
        batch = ids[first : first + case.in_flight]
        results = await asyncio.gather(
            *(
                service.decide_from_button(button_data(rid, Decision.APPROVE), actor=actor, platform=platform)
                for rid in batch
                for actor, platform in PRESSERS[: case.presses]
            )
        )
        won += sum(r.won for r in results)
    return won


async def _raw_chunk(conn: psycopg.AsyncConnection[object], ids: list[str], case: Case) -> int:
    won = 0
    for rid in ids:
        for actor, _ in PRESSERS[: case.presses]:
            cursor = await conn.execute(
                "UPDATE raw_r SET status = 'approved', decided_by = %s WHERE id = %s AND status = 'pending'"
                " RETURNING decided_by",
                (actor, rid),
            )
            won += (await cursor.fetchone()) is not None
    return won


def _server_cpu(pids: list[int]) -> float:
    """CPU seconds the server processes ``pids`` have run so far (their /proc schedstat: nanoseconds on a core);
    0 for one this process cannot read (a server on another machine, or one that has ended)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


async def _backends(conn: psycopg.AsyncConnection[object]) -> list[int]:
    """The server processes of the product's side: every session on this database but ``conn``'s own (the raw
    side's), whichever of the writer's connection and the pool's read connections it is."""
    cursor = await conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return [int(cast(tuple[Any, ...], row)[0]) for row in await cursor.fetchall()]


async def run_case(dsn: str, case: Case, requests: int, chunk: int) -> tuple[Side, Side, str]:
    backend: PgStore = await open_pg_store(dsn, migrations=pg_migrations(), application_name="bench")
    raw = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        await raw.execute("CREATE TABLE raw_r (id text PRIMARY KEY, status text NOT NULL, decided_by text)")
        async with raw.cursor() as cursor:
            await cursor.executemany(
                "INSERT INTO raw_r VALUES (%s, 'pending', NULL)", [(f"r{i}",) for i in range(requests)]
            )
        service = ApprovalService(ApprovalStore(backend, keyring=KEYS), CONFIG)
        opened = await asyncio.gather(*(service.open("shell", {"n": i}, "bench", "bench") for i in range(requests)))
        product, bare = Side(), Side()
        size = max(chunk, case.in_flight)
        writer = await backend.writer()
        groups, retries = writer.groups, getattr(writer, "pipeline_retries", 0)
        for start in range(0, requests, size):
            numbers = range(start, min(start + size, requests))
            order = ("product", "raw") if (start // size) % 2 == 0 else ("raw", "product")
            # Read before each chunk: the pool may open a connection between chunks.
            pids = {"product": await _backends(raw), "raw": [raw.info.backend_pid]}
            for side in order:
                began, cpu, server = time.perf_counter(), time.process_time(), _server_cpu(pids[side])
                if side == "product":
                    product.decisions += await _product_chunk(service, [opened[n].id for n in numbers], case)
                    product.seconds += time.perf_counter() - began
                    product.cpu += time.process_time() - cpu
                    product.server += _server_cpu(pids[side]) - server
                    product.presses += len(numbers) * case.presses
                else:
                    bare.decisions += await _raw_chunk(raw, [f"r{n}" for n in numbers], case)
                    bare.seconds += time.perf_counter() - began
                    bare.cpu += time.process_time() - cpu
                    bare.server += _server_cpu(pids[side]) - server
                    bare.presses += len(numbers) * case.presses
        again = getattr(writer, "pipeline_retries", 0) - retries
        note = f"{writer.groups - groups} groups, {again} pipelined groups run again"
        return product, bare, note
    finally:
        await raw.close()
        await backend.close()


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[tuple[str, str, bool]]:
    """(an admin DSN, where, whether fsync may be switched here)."""
    if dsn is not None:
        yield dsn, "the given server", False
        return
    from tests.pg_support import PostgresServer  # the suite's throwaway server: run from the repository root

    with PostgresServer() as made, made.database() as db:
        yield db.dsn, "a throwaway test server", True


def set_fsync(admin_dsn: str, on: bool) -> str:
    value = "on" if on else "off"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        for name in ("fsync", "synchronous_commit", "full_page_writes"):
            admin.execute(f"ALTER SYSTEM SET {name} = {value}")
        admin.execute("SELECT pg_reload_conf()")
    # The reload is a signal the server takes in its own time: wait until a new session sees it.
    for _ in range(100):
        shown = current_fsync(admin_dsn)
        if shown == f"fsync={value}":
            break
        time.sleep(0.05)
    return shown


def current_fsync(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        shown = admin.execute("SELECT current_setting('fsync'), current_setting('synchronous_commit')").fetchone()
    return f"fsync={shown[0]}" if shown and shown[0] == shown[1] else f"fsync={shown}"


@contextlib.contextmanager
def scratch(admin_dsn: str) -> Iterator[str]:
    name = f"kazma_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dsn", default=None, help="a server to create scratch databases on (default: start one)")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--chunk", type=int, default=60, help="requests per side before switching sides")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--fsync", choices=("both", "on", "off"), default="both")
    args = parser.parse_args()
    configure_logging("warning")  # measure the store, not the log sink
    start_gc.served()  # as `kazma run` does once it serves: what the start holds frozen (kazma.bot.start_gc)
    ratios: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    server_cpu: dict[str, list[tuple[float, float]]] = {}
    with server(args.dsn) as (admin_dsn, where, switchable):
        modes = [False, True] if args.fsync == "both" else [args.fsync == "on"]
        print(f"{where} (pid {os.getpid()}): {args.requests} requests per row, sides interleaved every {args.chunk}")
        print(f"{'run':<5}{'durability':<12}{'case':<26}{'product/s':>11}{'raw CAS/s':>11}{'product ÷ raw':>15}"
              f"{'load 1m':>9}{'CPU µs/press product':>22}{'raw':>6}{'server µs/press product':>25}{'raw':>6}"
              "  writer")  # fmt: skip
        for run in range(1, args.runs + 1):
            for fsync in modes:
                durability = set_fsync(admin_dsn, fsync) if switchable else current_fsync(admin_dsn)
                for case in CASES:
                    with scratch(admin_dsn) as dsn:
                        product, bare, note = await run_case(dsn, case, args.requests, args.chunk)
                    ratio = product.rate / bare.rate
                    ratios.setdefault(f"{durability:<12}{case.name}", []).append(ratio)
                    print(f"{run:<5}{durability:<12}{case.name:<26}{product.rate:>11,.0f}{bare.rate:>11,.0f}"
                          f"{ratio:>15.3f}{os.getloadavg()[0]:>9.2f}{product.cpu_per_press:>22.0f}"
                          f"{bare.cpu_per_press:>6.0f}{product.server_per_press:>25.0f}{bare.server_per_press:>6.0f}"
                          f"  {note}")  # fmt: skip
                    cpu.setdefault(f"{durability:<12}{case.name}", []).append(product.cpu_per_press)
                    server_cpu.setdefault(f"{durability:<12}{case.name}", []).append(
                        (product.server_per_press, bare.server_per_press)
                    )
                    for label, side in (("product", product), ("raw", bare)):
                        if side.decisions != args.requests:
                            print(f"  !! {label} decided {side.decisions} of {args.requests}")
    print("median product ÷ raw psycopg compare-and-set:")
    for name, values in ratios.items():
        print(f"     {name:<38}{statistics.median(values):>8.3f}   runs: {', '.join(f'{v:.3f}' for v in values)}")
    print("median product CPU µs per press (this process, loop and writer thread):")
    for name, values in cpu.items():
        print(f"     {name:<38}{statistics.median(values):>8.0f}   runs: {', '.join(f'{v:.0f}' for v in values)}")
    print("median server CPU µs per press, product / raw (the backends' /proc/<pid>/schedstat):")
    for name, pairs in server_cpu.items():
        runs = ", ".join(f"{p:.0f}/{r:.0f}" for p, r in pairs)
        product_median = statistics.median(p for p, _ in pairs)
        raw_median = statistics.median(r for _, r in pairs)
        print(f"     {name:<38}{product_median:>8.0f} / {raw_median:.0f}   runs: {runs}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
