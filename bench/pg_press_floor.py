"""The floor under issue 31's PostgreSQL press rows: a press's writes done by hand, as one statement, against
the raw compare-and-set of bench/pg_decide.py, interleaved on one connection each.

bench/pg_decide.py measures the product's press (the approvals service: authorisation, the card check, the
sealed compare-and-set, its review row, its audit event on the hash chain, its NOTIFY) against a bare
``UPDATE … WHERE status = 'pending' RETURNING`` of a three-column table. This script asks how close anything
could come to that anchor on the product's own schema: no Kazma code runs in the timed loop, only psycopg and
one prepared statement per press (a writable CTE, autocommit: one round trip, one commit), on requests opened by
the product (so the rows, their indexes and the triggers are the product's). Rows, each a cut of the one before:

- ``all writes``: the compare-and-set on ``approval_requests`` (the product's predicate: pending, before the
  deadline, the tool and the hash the seal was made over, a policy of one press, no card problem), the review
  row, the audit row on the chain (its lock tried, the row on its number, the sequence moved), the NOTIFY;
- ``no NOTIFY``; ``no NOTIFY, no audit row``; ``the compare-and-set alone`` (no review row either).

With ``--bare-schema`` the ``all writes`` and ``the compare-and-set alone`` rows run a second time on a database
whose requests were opened by the product and then stripped of what the product's schema adds to a write beyond
its rows (the pending-requests index, the events' per-request index, the review rows' foreign key, the triggers
that keep a decided outcome and a policy fixed): how much of the gap to the raw compare-and-set is the schema's.

In the ``all writes`` row a third side runs interleaved with the two: the product's own lone press
(``ApprovalService.decide_from_button``, as bench/pg_decide.py's "1 press" row), in a database of its own (its
audit chain is its own: the hand-made rows would move its head under it), so the product is seen beside its own
writes by hand (the contract issue 31 sets on SQLite) as well as beside the raw compare-and-set.

The audit row's hashes are fixed strings here (hashing is the client's, and the client's CPU is not what this
measures); the sequence number is the next one, so every row goes in. A NOTIFY has one listening session, as a
running Kazma has: its server CPU counts, as pg_decide counts every product session's.

    python bench/pg_press_floor.py [--requests 2400] [--runs 3] [--chunk 100]

Starts a throwaway server with the test suite's ``tests/pg_support.py`` (``fsync`` off: the floor of the
server's CPU, not of the disk). Prints every run and the medians; asserts nothing but that each press won.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.pg_support, run from anywhere

from kazma.approvals import ApprovalRequest, ApprovalService, ApprovalStore, Decision, button_data
from kazma.bot.logging import configure_logging
from kazma.bot.store import pg_migrations
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.postgres import PgStore, open_pg_store

CONFIG = load_config_text('approvals: {approvers: ["telegram:1"]}').config
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
CHAIN_LOCK: Final = 30225000957018153  # any constant: the lock is only tried, as the product's guessed append does

_CAS: Final = """UPDATE approval_requests r SET status = 'approved', decided_by = %(actor)s,
    decided_via = %(platform)s, decided_at = %(now)s, reason = NULL, decision_mac = %(mac)s, decision_key_id = 'k1',
    decided_person = NULL
  WHERE r.id = %(id)s AND r.status = 'pending' AND r.deadline > %(now)s AND r.tool = %(tool)s
    AND r.args_hash = %(hash)s AND r.approve_needed = 1 AND r.deny_needed = 1
    AND NOT EXISTS (SELECT 1 FROM approval_cards c WHERE c.request_id = %(id)s AND c.platform = %(platform)s)
  RETURNING r.id, r.tool, r.args_hash, r.conversation, r.deadline, r.status, r.decided_by, r.decided_via,
    r.decided_at, r.reason, r.decided_person"""
_REVIEW: Final = """INSERT INTO approval_reviews (request_id, reviewer, actor, platform, decision, reason, at)
  SELECT id, %(actor)s, %(actor)s, %(platform)s, 'approve', NULL, %(now)s FROM won ON CONFLICT DO NOTHING"""
_AUDIT: Final = f"""INSERT INTO approval_events (seq, request_id, event, actor, platform, at, args_hash, detail,
    prev_hash, chain_hash, person, commit_seal)
  SELECT %(seq)s, won.id, 'decided', %(actor)s, %(platform)s, %(now)s, %(hash)s, 'approved', %(prev)s, %(link)s,
    NULL, NULL FROM won, (SELECT pg_try_advisory_xact_lock({CHAIN_LOCK}) AS held) AS chain_lock
  WHERE chain_lock.held ON CONFLICT (seq) DO NOTHING RETURNING seq"""  # noqa: S608 - a constant


@dataclass(frozen=True)
class Row:
    name: str
    review: bool
    audit: bool
    notify: bool
    product: bool = False

    def statement(self) -> str:
        parts = [f"won AS ({_CAS})"]
        if self.review:
            parts.append(f"reviewed AS ({_REVIEW})")
        if self.audit:
            parts.append(f"added AS ({_AUDIT})")
        if self.notify:
            parts.append("notified AS (SELECT pg_notify('kazma_decided', id) FROM won)")
        tail = ["won.*"]
        if self.audit:
            tail.append("(SELECT setval('approval_events_seq_seq', max(seq)) FROM added)")
        if self.notify:
            tail.append("(SELECT count(*) FROM notified)")
        return f"WITH {', '.join(parts)} SELECT {', '.join(tail)} FROM won"  # noqa: S608 - constant SQL


# What the product's schema adds to a press's writes beyond the rows themselves (--bare-schema drops them).
BARE_SCHEMA: Final = (
    "DROP INDEX approval_requests_pending",
    "DROP INDEX approval_events_request",
    "ALTER TABLE approval_reviews DROP CONSTRAINT approval_reviews_request_id_fkey",
    "DROP TRIGGER approval_requests_final ON approval_requests",
    "DROP TRIGGER approval_requests_seal_final ON approval_requests",
    "DROP TRIGGER approval_requests_person_final ON approval_requests",
    "DROP TRIGGER approval_requests_policy_fixed ON approval_requests",
)

ROWS: Final = (
    Row("all writes", review=True, audit=True, notify=True, product=True),
    Row("no NOTIFY", review=True, audit=True, notify=False),
    Row("no NOTIFY, no audit row", review=True, audit=False, notify=False),
    Row("the compare-and-set alone", review=False, audit=False, notify=False),
)
_RAW: Final = (
    "UPDATE raw_r SET status = 'approved', decided_by = %s WHERE id = %s AND status = 'pending' RETURNING decided_by"
)


async def _opened(dsn: str, requests: int) -> tuple[PgStore, ApprovalService, list[ApprovalRequest]]:
    """A product on ``dsn`` with ``requests`` requests open (its store left open: the caller closes it)."""
    backend = await open_pg_store(dsn, migrations=pg_migrations(), application_name="bench")
    service = ApprovalService(ApprovalStore(backend, keyring=KEYS), CONFIG)
    opened = await asyncio.gather(*(service.open("shell", {"n": i}, "bench", "bench") for i in range(requests)))
    return backend, service, list(opened)


async def _sessions(conn: psycopg.AsyncConnection[Any], database: str) -> list[int]:
    """The server processes of every session on ``database`` (the product's writer and read connections)."""
    cursor = await conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (database,))
    return [int(row[0]) for row in await cursor.fetchall()]


def _server_cpu(pids: list[int]) -> float:
    """CPU seconds the server processes ``pids`` have run so far (their /proc schedstat)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as stat:
            total += int(stat.read().split()[0])
    return total / 1e9


@dataclass
class Side:
    seconds: float = 0.0
    server: float = 0.0
    cpu: float = 0.0  # this process's CPU seconds on this side (time.process_time)
    presses: int = 0

    @property
    def rate(self) -> float:
        return self.presses / self.seconds if self.seconds else 0.0

    @property
    def server_us(self) -> float:
        return self.server / self.presses * 1e6 if self.presses else 0.0

    @property
    def cpu_us(self) -> float:
        return self.cpu / self.presses * 1e6 if self.presses else 0.0


async def run_row(
    dsn: str, product_dsn: str | None, row: Row, requests: int, chunk: int, strip: tuple[str, ...] = ()
) -> dict[str, Side]:
    backend, _, opened = await _opened(dsn, requests)
    await backend.close()
    if strip:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            for statement in strip:
                await admin.execute(statement)
    product = await _opened(product_dsn, requests) if product_dsn is not None else None
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    raw = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    listener = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        await listener.execute("LISTEN kazma_decided")
        await raw.execute("CREATE TABLE raw_r (id text PRIMARY KEY, status text NOT NULL, decided_by text)")
        async with raw.cursor() as cursor:
            await cursor.executemany(
                "INSERT INTO raw_r VALUES (%s, 'pending', NULL)", [(f"r{i}",) for i in range(requests)]
            )
        head = await (await conn.execute("SELECT max(seq) FROM approval_events")).fetchone()
        seq = int(head[0]) if head and head[0] is not None else 0
        statement = row.statement()
        pids = {"floor": [conn.info.backend_pid, listener.info.backend_pid], "raw": [raw.info.backend_pid]}
        sides = {"floor": Side(), "raw": Side()} | ({"product": Side()} if product else {})
        for start in range(0, requests, chunk):
            numbers = range(start, min(start + chunk, requests))
            turn = (start // chunk) % len(sides)
            order = list(sides)[turn:] + list(sides)[:turn]
            if product is not None and product_dsn is not None:
                pids["product"] = await _sessions(raw, str(psycopg.conninfo.conninfo_to_dict(product_dsn)["dbname"]))
            for side in order:
                began, server, cpu = time.perf_counter(), _server_cpu(pids[side]), time.process_time()
                for n in numbers:
                    answer: Any
                    if side == "product" and product is not None:
                        pressed = await product[1].decide_from_button(
                            button_data(product[2][n].id, Decision.APPROVE), actor="telegram:1", platform="telegram"
                        )
                        answer = pressed if pressed.won else None
                    elif side == "raw":
                        answer = await (await raw.execute(_RAW, ("telegram:1", f"r{n}"), prepare=True)).fetchone()
                    else:
                        seq += 1
                        params = {"actor": "telegram:1", "platform": "telegram", "now": time.time(),
                                  "mac": "v2:" + "a" * 64, "id": opened[n].id, "tool": "shell",
                                  "hash": opened[n].args_hash, "seq": seq, "prev": "b" * 64,
                                  "link": "c" * 64}  # fmt: skip
                        answer = await (await conn.execute(statement, params, prepare=True)).fetchone()
                    if answer is None:
                        raise RuntimeError(f"{side} press {n} did not win: the floor measures winning presses")
                target = sides[side]
                target.seconds += time.perf_counter() - began
                target.server += _server_cpu(pids[side]) - server
                target.cpu += time.process_time() - cpu
                target.presses += len(numbers)
        return sides
    finally:
        for connection in (conn, raw, listener):
            await connection.close()
        if product is not None:
            await product[0].close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2400)
    parser.add_argument("--chunk", type=int, default=100, help="presses per side before switching sides")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bare-schema", action="store_true", help="also run two rows without the schema's extras")
    args = parser.parse_args()
    configure_logging("warning")
    from tests.pg_support import PostgresServer  # the suite's throwaway server (fsync off)

    ratios: dict[str, list[float]] = {}
    with PostgresServer() as server, server.database() as db:
        print(f"a throwaway test server, fsync off (pid {os.getpid()}): {args.requests} presses a side per row")
        print(f"{'run':<5}{'row':<40}{'by hand/s':>11}{'raw CAS/s':>11}{'÷ raw':>8}"
              f"{'server µs by hand':>19}{'raw':>6}{'client µs by hand':>19}{'raw':>6}{'load 1m':>9}")  # fmt: skip
        plan: list[tuple[str, Row, tuple[str, ...]]] = [(row.name, row, ()) for row in ROWS]
        if args.bare_schema:
            plan += [(f"{row.name}, bare schema", row, BARE_SCHEMA) for row in (ROWS[0], ROWS[-1])]
        for run in range(1, args.runs + 1):
            for index, (label, row, strip) in enumerate(plan):
                product = row.product and not strip
                names = [f"kazma_floor_{run}_{index}"] + ([f"kazma_product_{run}"] if product else [])
                with psycopg.connect(db.dsn, autocommit=True) as admin:
                    for name in names:
                        admin.execute(f'CREATE DATABASE "{name}"')
                try:
                    dsns = [psycopg.conninfo.make_conninfo(db.dsn, dbname=name) for name in names]
                    sides = await run_row(dsns[0], dsns[1] if product else None, row, args.requests, args.chunk, strip)
                finally:
                    with psycopg.connect(db.dsn, autocommit=True) as admin:
                        for name in names:
                            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                floor, bare = sides["floor"], sides["raw"]
                ratio = floor.rate / bare.rate
                ratios.setdefault(label, []).append(ratio)
                print(f"{run:<5}{label:<40}{floor.rate:>11,.0f}{bare.rate:>11,.0f}{ratio:>8.3f}"
                      f"{floor.server_us:>19.0f}{bare.server_us:>6.0f}{floor.cpu_us:>19.0f}{bare.cpu_us:>6.0f}"
                      f"{os.getloadavg()[0]:>9.2f}")  # fmt: skip
                if "product" in sides:
                    made = sides["product"]
                    ratios.setdefault("product ÷ all writes by hand", []).append(made.rate / floor.rate)
                    ratios.setdefault("product ÷ raw", []).append(made.rate / bare.rate)
                    print(f"{'':<5}{'  the product (1 press)':<40}{made.rate:>11,.0f}{'':>11}"
                          f"{made.rate / bare.rate:>8.3f}{made.server_us:>19.0f}{'':>6}{made.cpu_us:>19.0f}"
                          f"   ÷ all writes by hand {made.rate / floor.rate:.3f}")  # fmt: skip
    print("medians (÷ raw psycopg compare-and-set unless said):")
    for name, values in ratios.items():
        print(f"     {name:<30}{statistics.median(values):>7.3f}   runs: {', '.join(f'{v:.3f}' for v in values)}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
