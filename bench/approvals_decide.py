"""Decisions per second: the approvals service against a bare aiosqlite compare-and-set loop.

Both run on the same kind of file (WAL, synchronous=FULL) in one process, one
after the other, so the overhead of the service (authorisation, audit rows,
reading back the outcome) is the difference. Prints numbers; asserts nothing.

    python bench/approvals_decide.py [--requests 2000] [--presses 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiosqlite

from kazma.approvals import MIGRATIONS, ApprovalService, ApprovalStore, Decision, button_data
from kazma.bot.logging import configure_logging
from kazma.config import load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.database import connect, open_database

CONFIG = load_config_text('approvals: {approvers: ["telegram:1", "slack:U1", "discord:2"]}').config
# Every outcome sealed, as in production (approvals/seal.py): the seal is part of what a decision costs.
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
PRESSERS = (("telegram:1", "telegram"), ("slack:U1", "slack"), ("discord:2", "discord"))


async def service_run(path: Path, requests: int, presses: int) -> tuple[float, int]:
    conn = await open_database(path, migrations=MIGRATIONS)
    service = ApprovalService(ApprovalStore(conn, keyring=KEYS), CONFIG)
    ids = [(await service.open("shell", {"n": i}, "bench", "bench")).id for i in range(requests)]
    jobs = [
        service.decide_from_button(button_data(rid, Decision.APPROVE), actor=actor, platform=platform)
        for rid in ids
        for actor, platform in PRESSERS[:presses]
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*jobs)
    elapsed = time.perf_counter() - start
    await conn.close()
    return elapsed, sum(r.won for r in results)


async def raw_run(path: Path, requests: int, presses: int) -> tuple[float, int]:
    conn: aiosqlite.Connection = await connect(path)
    await conn.execute("CREATE TABLE IF NOT EXISTS r (id TEXT PRIMARY KEY, status TEXT NOT NULL, decided_by TEXT)")
    await conn.executemany("INSERT INTO r VALUES (?, 'pending', NULL)", [(f"r{i}",) for i in range(requests)])
    lock = asyncio.Lock()

    async def press(rid: str, actor: str) -> bool:
        async with lock:
            cursor = await conn.execute(
                "UPDATE r SET status = 'approved', decided_by = ? WHERE id = ? AND status = 'pending'", (actor, rid)
            )
            won = cursor.rowcount == 1
            await cursor.close()
        return won

    jobs = [press(f"r{i}", actor) for i in range(requests) for actor, _ in PRESSERS[:presses]]
    start = time.perf_counter()
    results = await asyncio.gather(*jobs)
    elapsed = time.perf_counter() - start
    await conn.close()
    return elapsed, sum(results)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--presses", type=int, default=3, choices=(1, 2, 3))
    args = parser.parse_args()
    configure_logging("warning")  # measure the store, not the log sink
    with tempfile.TemporaryDirectory() as tmp:
        service_elapsed, service_wins = await service_run(Path(tmp) / "service.db", args.requests, args.presses)
        raw_elapsed, raw_wins = await raw_run(Path(tmp) / "raw.db", args.requests, args.presses)
    total = args.requests * args.presses
    print(f"{args.requests} requests x {args.presses} simultaneous presses = {total} presses (pid {os.getpid()})")
    print(f"{'':<22}{'presses/s':>12}{'decisions/s':>14}{'winners':>10}{'seconds':>10}")
    for name, elapsed, wins in (
        ("approvals service", service_elapsed, service_wins),
        ("raw aiosqlite CAS", raw_elapsed, raw_wins),
    ):
        print(f"{name:<22}{total / elapsed:>12.0f}{wins / elapsed:>14.0f}{wins:>10}{elapsed:>10.2f}")


if __name__ == "__main__":
    asyncio.run(main())
