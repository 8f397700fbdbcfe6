"""Decide throughput with the audit chain on and off, side by side, interleaved in one process.

"Off" is the store as it was before the chain: each audit event one plain
``INSERT`` in its operation, no hashes, no checkpoint. "On" is the product: the
events handed to the end of the transaction, numbered and hashed after the head
(under the chain's lock on PostgreSQL), the last one carrying the transaction's
commit seal (an HMAC), and a checkpointer per store signing the head with Ed25519
within a fiftieth of a second of each decision (at most every 20 ms: a burst shares one).
Everything else (the service, the card check, the sealed compare-and-set, group
commit) is the same code on both sides.

Both sides decide the same number of requests, alternating every ``--chunk``
requests so that disk noise and the machine's other load hit both alike; files
are created and warmed (their requests opened) before any timing starts. Each
case runs ``--runs`` times; the table prints every run and the median ratio.
A chunk holds several checkpoint intervals (240 requests: 80-400 ms here): with 60
(20 ms on SQLite in /dev/shm, about one interval) every chunk of the chain-on side
began with a pass due at once and left its last events to a pass made during the
other side's chunk, so it signed about twice as often as a process that keeps
deciding (1 press: 4.0 checkpoints per 100 decisions, against 2.2 with 240).
``--chunk 1 --split`` (every request on each side in turn) gives the steadiest
figure of what the chain itself costs, off ÷ bare (one request at a time: three
runs within 0.015 of one another here, where chunks of 240 spread over 0.05 to 0.14;
60 in flight, less steady either way), but not of the checkpointer's
share: its passes keep to the wall clock, of which each side then has a third, so
it signs about three times as often per decision as a process deciding alone.
On SQLite only: on PostgreSQL each chunk reads the server's CPU from /proc.

SQLite: a file in ``--dir`` (disk), WAL, ``synchronous=FULL``. PostgreSQL
(``--postgres``): a throwaway server from the test suite (fsync off, so commits
cost round trips, not disk flushes; ``--fsync`` turns it on, as in production),
or ``--dsn``; with ``--replicas N`` each side gets N stores (N writers, N connections:
what N ``kazma run`` replicas are to the database) and the presses are spread over them,
so the chain's lock is contended.

    python bench/audit_chain.py [--requests 2400] [--chunk 240] [--runs 3] [--dir PATH] [--postgres [--fsync]]
        [--replicas 3] [--split]

Beside the totals it prints the median over chunks of each side's CPU per decision (a chunk the machine's other
load hit hard moves a median less than a sum) and the checkpoints the chain-on side signed per 100 decisions while
timed. ``--split`` adds a third side, interleaved with the other two: the chain without its checkpointer (events
chained and sealed, nothing signed), so that what the chain costs a transaction and what the signatures cost
show apart (on ÷ chain-only is the checkpointer's share, chain-only ÷ off the chain's own).

``--tx-cpu`` measures instead what the chain itself costs a transaction on SQLite, little blurred by the
machine's other load: the CPU time of this thread (not the wall clock) for one transaction appending 1 or 3
events through the chain (head, hashes, commit seal, insert) and through the plain ``INSERT`` of the chain-off
side, on the writer's own ``Tx``, interleaved; the minimum and the median of many rounds.

``--account`` adds, per case, where each side's CPU per decision goes, measured in the decision flow itself
(thread CPU around the calls, so with their cache misses; each wrapped call costs ~1 us more): the chain's end of
transaction (head, hashes, seal, insert: ``AuditChain._flush``) against the chain-off side's ``INSERT``, and the
checkpointer's passes (in their own group or a decision's commit) per decision and per pass, with passes per 100.

Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite

from kazma.approvals import ApprovalService, ApprovalStore, Decision, button_data
from kazma.approvals.chain import AuditChain
from kazma.approvals.checkpointer import Checkpointer
from kazma.approvals.checkpoints import AuditSigner
from kazma.bot import start_gc
from kazma.bot.logging import configure_logging
from kazma.bot.store import all_migrations, pg_migrations
from kazma.config import load_config_text
from kazma.config.keyring import AUDIT_KEYS, DECISION_KEYS, Keyring
from kazma.config.store.backend import Tx
from kazma.config.store.database import open_database
from kazma.config.store.postgres import PgStore, open_pg_store
from kazma.config.store.writer import Tx as SqliteTx

CONFIG = load_config_text('approvals: {approvers: ["telegram:1", "slack:U1", "discord:2"]}').config
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
SIGNER = AuditSigner(Keyring.of(AUDIT_KEYS, ("a1", "YmVuY2gtYXVkaXQta2V5LW9mLTMyLWJ5dGVzLS0tLS0")))
PRESSERS = (("telegram:1", "telegram"), ("slack:U1", "slack"), ("discord:2", "discord"))
_PLAIN_EVENT = (
    "INSERT INTO approval_events (request_id, event, actor, platform, at, args_hash, detail, person)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


class PlainEvents(AuditChain):
    """The store before the chain: each event one INSERT where its operation runs (the chain turned off)."""

    @property
    def guesses_hold(self) -> bool:
        return True  # it never asks for the head: a press may go as one string, as before the chain

    def append(
        self,
        tx: Tx,
        request_id: str | None,
        event: str,
        *,
        actor: str | None,
        at: float,
        args_hash: Any,
        platform: str | None = None,
        detail: str | None = None,
        person: str | None = None,
    ) -> None:
        digest = args_hash if isinstance(args_hash, str) or args_hash is None else None
        # Sent as the chain's rows are: on PostgreSQL nobody waits for its answer (pipeline mode).
        tx.send(_PLAIN_EVENT, (request_id, event, actor, platform, at, digest, detail, person))


@dataclass(frozen=True)
class Case:
    name: str
    presses: int
    in_flight: int


CASES = (
    Case("1 press per request, one at a time", 1, 1),
    Case("3 presses per request, one at a time", 3, 1),
    Case("3 presses, 60 requests in flight", 3, 60),
)


@dataclass
class Side:
    services: list[ApprovalService]
    ids: list[str]
    checkpointers: list[asyncio.Task[None]]
    seconds: float = 0.0
    cpu: float = 0.0  # CPU seconds of the whole process (every thread) while this side ran
    decisions: int = 0
    chunk_cpu: list[float] = field(default_factory=list)  # CPU µs per decision of each chunk
    checkpoints: int = 0  # checkpoints written while timed (the chain-on side)
    # PostgreSQL: the server processes of the side's database (its writers' and pooled connections) and their CPU
    # while this side ran, from /proc/<pid>/schedstat (a local server only; empty elsewhere).
    server_pids: list[int] = field(default_factory=list)
    server_cpu: float = 0.0

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.chunk_cpu) if self.chunk_cpu else 0.0

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds if self.seconds else 0.0


Opener = Callable[[str], Awaitable[Any]]


async def side_of(backends: list[Any], requests: int, *, chained: bool, signing: bool = True) -> Side:
    services = []
    tasks = []
    for backend in backends:
        store = ApprovalStore(backend, keyring=KEYS, audit=SIGNER)
        if chained:
            if signing:
                tasks.append(asyncio.create_task(Checkpointer(store, SIGNER).run()))
        else:
            store.chain = PlainEvents(postgres=store.chain.postgres)
        services.append(ApprovalService(store, CONFIG))
    opened = await asyncio.gather(
        *(services[i % len(services)].open("shell", {"n": i}, "bench", "bench") for i in range(requests))
    )
    return Side(services, [r.id for r in opened], tasks)


async def server_pids(side: Side) -> list[int]:
    """The local server processes of the side's database, for their CPU (none on SQLite or a remote server)."""
    store = side.services[0].store
    if not store.chain.postgres:
        return []
    row = await store.tables.one("SELECT array_agg(pid) FROM pg_stat_activity WHERE datname = current_database()")
    return [pid for pid in (row[0] or []) if Path(f"/proc/{pid}/schedstat").exists()]  # noqa: ASYNC240 - /proc


def server_seconds(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` ran so far (their schedstat's first field, in nanoseconds)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/schedstat") as stat:
            total += int(stat.read().split()[0])
    return total / 1e9


async def decide(side: Side, n: int, case: Case) -> int:
    rid = side.ids[n]
    presses = [
        side.services[(n + k) % len(side.services)].decide_from_button(
            button_data(rid, Decision.APPROVE), actor=actor, platform=platform
        )
        for k, (actor, platform) in enumerate(PRESSERS[: case.presses])
    ]
    return sum(r.won for r in await asyncio.gather(*presses))


async def checkpoints_of(side: Side) -> int:
    # The replicas of a side share one database: counted through each of them, every checkpoint was counted N
    # times (3 replicas, 3 presses: "101-144 per 100 decisions" were 34-48).
    return int((await side.services[0].store.tables.one("SELECT count(*) FROM audit_checkpoints"))[0])


async def run_case(
    make: Callable[[str], contextlib.AbstractAsyncContextManager[list[Any]]],
    case: Case,
    requests: int,
    chunk: int,
    *,
    split: bool = False,
) -> tuple[Side, Side, Side | None]:
    async with contextlib.AsyncExitStack() as stack:
        on = await side_of(await stack.enter_async_context(make("on")), requests, chained=True)
        off = await side_of(await stack.enter_async_context(make("off")), requests, chained=False)
        bare = None
        if split:
            bare = await side_of(await stack.enter_async_context(make("bare")), requests, chained=True, signing=False)
        sides = [on, off] if bare is None else [on, bare, off]
        signed_before = await checkpoints_of(on)
        for side in sides:
            side.server_pids = await server_pids(side)
        SPENT.clear()  # --account: the timed decisions only
        size = max(chunk, case.in_flight)
        for start in range(0, requests, size):
            numbers = list(range(start, min(start + size, requests)))
            for side in sides if (start // size) % 2 == 0 else sides[::-1]:
                began, cpu, served = time.perf_counter(), time.process_time(), server_seconds(side.server_pids)
                decided = 0
                for first in range(0, len(numbers), case.in_flight):
                    batch = numbers[first : first + case.in_flight]
                    decided += sum(await asyncio.gather(*(decide(side, n, case) for n in batch)))
                spent = time.process_time() - cpu
                side.seconds += time.perf_counter() - began
                side.cpu += spent
                side.server_cpu += server_seconds(side.server_pids) - served
                side.decisions += decided
                side.chunk_cpu.append(1e6 * spent / max(decided, 1))
        for task in on.checkpointers:
            task.cancel()
        await asyncio.gather(*on.checkpointers, return_exceptions=True)
        on.checkpoints = await checkpoints_of(on) - signed_before
        return on, off, bare


def sqlite_stores(folder: Path, replicas: int) -> Callable[[str], Any]:
    @contextlib.asynccontextmanager
    async def make(name: str) -> AsyncIterator[list[Any]]:
        conn: aiosqlite.Connection = await open_database(folder / f"{name}.db", migrations=all_migrations())
        try:
            yield [conn]
        finally:
            writer = await ApprovalStore(conn).tables.writer()
            await writer.close()
            await conn.close()

    return make


def postgres_stores(dsns: dict[str, str], replicas: int) -> Callable[[str], Any]:
    @contextlib.asynccontextmanager
    async def make(name: str) -> AsyncIterator[list[Any]]:
        stores: list[PgStore] = []
        try:
            for index in range(replicas):
                stores.append(
                    await open_pg_store(dsns[name], migrations=pg_migrations(), application_name=f"bench-{index}")
                )
            yield list(stores)
        finally:
            for store in stores:
                await store.close()

    return make


@contextlib.contextmanager
def pg_databases(dsn: str | None) -> Iterator[tuple[dict[str, str], str]]:
    if dsn is not None:
        import uuid

        import psycopg

        names = {side: f"kazma_bench_{side}_{uuid.uuid4().hex[:8]}" for side in ("on", "off", "bare")}
        with psycopg.connect(dsn, autocommit=True) as admin:
            for name in names.values():
                admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield {s: psycopg.conninfo.make_conninfo(dsn, dbname=n) for s, n in names.items()}, "the given server"
        finally:
            with psycopg.connect(dsn, autocommit=True) as admin:
                for name in names.values():
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return
    from tests.pg_support import PostgresServer  # the suite's throwaway server: run from the repository root

    with PostgresServer() as server, server.database() as on, server.database() as off, server.database() as bare:
        yield {"on": on.dsn, "off": off.dsn, "bare": bare.dsn}, "PostgreSQL (a throwaway test server, fsync off)"


def durable(dsn: str, ours: bool) -> None:
    """--fsync: the throwaway server's commits wait for the disk, as a production server's do (server-wide)."""
    import psycopg

    if not ours:
        raise SystemExit("--fsync switches the throwaway server only: give a --dsn server's own settings instead")
    with psycopg.connect(dsn, autocommit=True) as admin:
        for name in ("fsync", "synchronous_commit", "full_page_writes"):
            admin.execute(f"ALTER SYSTEM SET {name} = on")
        admin.execute("SELECT pg_reload_conf()")
    for _ in range(100):  # the reload is a signal the server takes in its own time: until a new session sees it
        with psycopg.connect(dsn, autocommit=True) as admin:
            row = admin.execute("SELECT current_setting('fsync'), current_setting('synchronous_commit')").fetchone()
        if row == ("on", "on"):
            return
        time.sleep(0.05)
    raise SystemExit(f"the server did not take fsync on: {row}")


# --account: thread CPU (ns) spent in the wrapped calls, by the store whose chain or checkpointer made them.
SPENT: dict[tuple[int, str], list[int]] = {}


def account() -> None:
    """Wrap the chain's and the checkpointer's calls to time them (see --account in the module's docstring)."""

    def timed(cls: Any, name: str, label: str, store_of: Callable[[Any], Any]) -> None:
        original = getattr(cls, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            began = time.thread_time_ns()
            try:
                return original(self, *args, **kwargs)
            finally:
                SPENT.setdefault((id(store_of(self)), label), []).append(time.thread_time_ns() - began)

        setattr(cls, name, wrapper)

    timed(AuditChain, "_flush", "chain", lambda chain: chain)
    timed(PlainEvents, "append", "chain", lambda chain: chain)
    timed(Checkpointer, "_judge", "pass", lambda checkpointer: checkpointer.store.chain)
    # Counted, not timed: its _judge is (its savepoint and its read of the decisions' seqs are not).
    signing = Checkpointer._sign_in_commit

    def in_commit(self: Checkpointer, tx: Tx, request_ids: list[str]) -> None:
        before = len(SPENT.get((id(self.store.chain), "pass"), []))
        signing(self, tx, request_ids)
        if len(SPENT.get((id(self.store.chain), "pass"), [])) > before:
            SPENT.setdefault((id(self.store.chain), "in commit"), []).append(0)

    Checkpointer._sign_in_commit = in_commit  # type: ignore[method-assign]


def accounted(side: Side, label: str) -> list[int]:
    return [v for service in side.services for v in SPENT.get((id(service.store.chain), label), [])]


def print_account(sides: dict[str, Side | None]) -> None:
    line = "  account, µs per decision:"
    for name, side in sides.items():
        if side is None:
            continue
        n = max(side.decisions, 1)
        chain, passes, in_commit = (accounted(side, label) for label in ("chain", "pass", "in commit"))
        line += f"  {name}: chain/insert {sum(chain) / 1e3 / n:.1f}"
        if passes:
            line += (
                f", passes {sum(passes) / 1e3 / n:.1f} ({100 * len(passes) / n:.1f}/100,"
                f" median {statistics.median(passes) / 1e3:.0f} µs, {len(in_commit)} in commit)"
            )
    print(line)


async def tx_cpu(folder: Path, rounds: int = 60, per_round: int = 100) -> None:
    """Thread CPU per transaction, chain vs plain INSERT (see the module's docstring)."""

    async def connection(name: str) -> sqlite3.Connection:
        path = folder / f"{name}.db"
        await (await open_database(path, migrations=all_migrations())).close()
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA synchronous = FULL")
        return conn

    def transactions(conn: sqlite3.Connection, chain: AuditChain, events: int, count: int) -> float:
        began = time.thread_time()
        for _ in range(count):
            conn.execute("BEGIN IMMEDIATE")
            tx = SqliteTx(conn)
            for _ in range(events):
                chain.append(tx, "bench-request-id-0000", "decided", actor="telegram:1", platform="telegram",
                             at=time.time(), args_hash="0" * 64, detail="approved")  # fmt: skip
            tx._run_deferred()
            conn.execute("COMMIT")
            tx._committed()
        return 1e6 * (time.thread_time() - began) / count

    print(f"thread CPU per transaction on SQLite ({folder}), {rounds} rounds of {per_round}: min / median µs")
    print(f"{'events':<8}{'chain':>18}{'plain':>18}{'chain - plain':>16}{'load 1m':>9}")
    for events in (1, 3):
        sides = {"chain": AuditChain(postgres=False, signer=SIGNER), "plain": PlainEvents(postgres=False)}
        conns = {name: await connection(f"tx{events}-{name}") for name in sides}
        spent: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, chain in sides.items():
                spent[name].append(transactions(conns[name], chain, events, per_round))
        low = {name: min(values) for name, values in spent.items()}
        mid = {name: statistics.median(values) for name, values in spent.items()}
        print(
            f"{events:<8}{low['chain']:>9.1f} / {mid['chain']:<6.1f}{low['plain']:>9.1f} / {mid['plain']:<6.1f}"
            f"{low['chain'] - low['plain']:>7.1f} / {mid['chain'] - mid['plain']:<6.1f}{os.getloadavg()[0]:>9.2f}"
        )
        for conn in conns.values():
            conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description="decide throughput, audit chain on vs off, interleaved")
    parser.add_argument("--requests", type=int, default=2400)
    parser.add_argument("--chunk", type=int, default=240, help="requests per side before switching sides")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the SQLite files go (default: here)")
    parser.add_argument("--postgres", action="store_true", help="run on PostgreSQL instead of SQLite")
    parser.add_argument("--dsn", default=None, help="a PostgreSQL server to make scratch databases on")
    parser.add_argument("--replicas", type=int, default=1, help="PostgreSQL: stores (writers) per side")
    parser.add_argument("--tx-cpu", action="store_true", help="the chain's own CPU per transaction (SQLite)")
    parser.add_argument("--split", action="store_true", help="a third side: the chain without its checkpointer")
    parser.add_argument("--account", action="store_true", help="where each side's CPU per decision goes (see above)")
    parser.add_argument(
        "--fsync", action="store_true", help="PostgreSQL's throwaway server with fsync and synchronous_commit on"
    )
    args = parser.parse_args()
    configure_logging("warning")  # measure the store, not the log sink
    start_gc.served()  # as `kazma run` does once it serves: what the start holds frozen (kazma.bot.start_gc)
    if args.account:
        account()
    if args.tx_cpu:
        with tempfile.TemporaryDirectory(dir=args.dir or Path.cwd()) as scratch:
            await tx_cpu(Path(scratch))
        return
    ratios: dict[str, list[float]] = {case.name: [] for case in CASES}
    cpu_ratios: dict[str, list[float]] = {case.name: [] for case in CASES}
    median_ratios: dict[str, list[float]] = {case.name: [] for case in CASES}
    with contextlib.ExitStack() as stack:
        if args.postgres:
            dsns, where = stack.enter_context(pg_databases(args.dsn))
            if args.fsync:
                where = where.replace("fsync off", "fsync on") if args.dsn is None else where
                durable(dsns["on"], args.dsn is None)
            where += f", {args.replicas} writer(s) per side"
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir or Path.cwd())))
            where = f"SQLite on disk ({folder.parent})"
        print(f"{where}: {args.requests} requests per case, sides interleaved every {args.chunk} requests")
        print(
            f"{'run':<5}{'case':<40}{'chain on/s':>12}{'chain off/s':>13}{'on ÷ off':>10}"
            f"{'CPU µs on':>11}{'CPU µs off':>11}{'off ÷ on':>10}{'chunk med':>11}{'ckpt/100':>10}{'load 1m':>9}"
            + (f"{'CPU µs bare':>13}{'off ÷ bare':>12}{'bare ÷ on':>11}" if args.split else "")
        )
        for run in range(1, args.runs + 1):
            for case in CASES:
                if args.postgres:
                    import psycopg

                    for dsn in dsns.values():  # every run on empty tables
                        with psycopg.connect(dsn, autocommit=True) as admin:
                            admin.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
                    make = postgres_stores(dsns, args.replicas)
                else:
                    case_dir = folder / f"run{run}-{case.in_flight}-{case.presses}"
                    case_dir.mkdir()
                    make = sqlite_stores(case_dir, 1)
                on, off, bare = await run_case(make, case, args.requests, args.chunk, split=args.split)
                ratio = on.rate / off.rate
                ratios[case.name].append(ratio)
                # CPU per decision: what the chain costs the process, less blurred by the machine's other load.
                cpu_on, cpu_off = (1e6 * side.cpu / max(side.decisions, 1) for side in (on, off))
                cpu_ratios[case.name].append(cpu_off / cpu_on)
                # The same from the median chunk of each side: a chunk a neighbour's burst hit weighs less.
                median_ratios[case.name].append(off.cpu_median / on.cpu_median)
                line = (
                    f"{run:<5}{case.name:<40}{on.rate:>12,.0f}{off.rate:>13,.0f}{ratio:>10.3f}"
                    f"{cpu_on:>11,.0f}{cpu_off:>11,.0f}{cpu_off / cpu_on:>10.3f}{off.cpu_median / on.cpu_median:>11.3f}"
                    f"{100 * on.checkpoints / max(on.decisions, 1):>10.1f}{os.getloadavg()[0]:>9.2f}"
                )
                if bare is not None:
                    cpu_bare = 1e6 * bare.cpu / max(bare.decisions, 1)
                    line += f"{cpu_bare:>13,.0f}{cpu_off / cpu_bare:>12.3f}{cpu_bare / cpu_on:>11.3f}"
                if on.server_pids:
                    line += "  server µs " + " ".join(
                        f"{name} {1e6 * side.server_cpu / max(side.decisions, 1):,.0f}"
                        for name, side in (("on", on), ("bare", bare), ("off", off))
                        if side is not None
                    )
                print(line)
                if args.account:
                    print_account({"on": on, "bare": bare, "off": off})
                    SPENT.clear()
                for label, side in (("on", on), ("off", off), ("without checkpointer", bare)):
                    if side is not None and side.decisions != args.requests:
                        print(f"  !! chain {label} decided {side.decisions} of {args.requests}")
        print("median on ÷ off (throughput), off ÷ on (CPU per decision; and from each side's median chunk):")
        for name, values in ratios.items():
            print(
                f"     {name:<40}{statistics.median(values):>35.3f}{statistics.median(cpu_ratios[name]):>32.3f}"
                f"{statistics.median(median_ratios[name]):>11.3f}"
            )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
