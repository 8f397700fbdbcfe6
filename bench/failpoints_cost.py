"""What the failpoints cost when none is set: decide throughput and press → settled latency, interleaved.

Two modes, in one process, taking turns run by run (so drift in the machine hits both alike):

* ``unset`` — ``KAZMA_FAILPOINTS`` unset, as Kazma ships: every call site is one ``if failpoints.armed:``;
* ``armed elsewhere`` — one point armed that these paths never reach (``leader.takeover``): every site on
  them now takes the module's lock and looks its name up. This is more work than the code before the
  failpoints (which had no check at all) could do, so it bounds from above what the sites can cost.

Decide throughput: ``--requests`` requests opened, then one Approve press each through
``ApprovalService.decide_from_button`` (sealed outcomes, audit rows, SQLite WAL, synchronous=FULL), all at
once. Settle latency: a request opened and posted on an in-memory platform by the real bus, pressed, and
timed until the platform's card is edited to the outcome, ``--rounds`` times. Prints numbers; asserts nothing.

    PYTHONPATH=. python bench/failpoints_cost.py [--runs 3] [--requests 1000] [--rounds 50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from kazma.approvals import MIGRATIONS, ApprovalService, ApprovalStore, Decision, button_data
from kazma.bot.logging import configure_logging
from kazma.config import failpoints, load_config_text
from kazma.config.keyring import DECISION_KEYS, Keyring
from kazma.config.store.database import open_database
from tests.test_bus import MemoryPlatform, rig

CONFIG = load_config_text('approvals: {approvers: ["telegram:1"]}').config
KEYS = Keyring.of(DECISION_KEYS, ("k1", "bench-decision-key-" + "0" * 32))
MODES = ("unset", "armed elsewhere")


def use(mode: str) -> None:
    if mode == "unset":
        failpoints.disarm()
    else:
        failpoints.arm_for_test("leader.takeover=delay:1")


async def decide_throughput(path: Path, requests: int) -> float:
    conn = await open_database(path, migrations=MIGRATIONS)
    try:
        service = ApprovalService(ApprovalStore(conn, keyring=KEYS), CONFIG)
        ids = [(await service.open("shell", {"n": i}, "bench", "bench")).id for i in range(requests)]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(service.decide_from_button(button_data(rid, Decision.APPROVE), actor="telegram:1", platform="telegram")
              for rid in ids)
        )  # fmt: skip
        elapsed = time.perf_counter() - start
        assert all(r.won for r in results)
        return requests / elapsed
    finally:
        await conn.close()


async def settle_latency(path: Path, rounds: int) -> list[float]:
    platform = MemoryPlatform("telegram")
    seconds: list[float] = []
    async with rig(path, [platform]) as r:
        for i in range(rounds):
            platform.posted.clear()
            platform.settled_event.clear()
            request = await r.service.open("shell", {"n": i}, "agent:bench", "telegram:-1")
            await asyncio.wait_for(platform.posted.wait(), 20)
            start = time.perf_counter()
            await r.service.decide(request.id, Decision.APPROVE, actor="telegram:111", platform="telegram")
            await asyncio.wait_for(platform.settled_event.wait(), 20)
            seconds.append(time.perf_counter() - start)
    return seconds


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    configure_logging("WARNING", "console")
    rows: list[tuple[int, str, float, list[float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(1, args.runs + 1):
            for mode in MODES if run % 2 else reversed(MODES):
                use(mode)
                rate = await decide_throughput(Path(tmp) / f"d-{run}-{mode[0]}.db", args.requests)
                latency = await settle_latency(Path(tmp) / f"s-{run}-{mode[0]}.db", args.rounds)
                rows.append((run, mode, rate, latency))
    failpoints.disarm()
    print(f"{'run':>3}  {'mode':<16} {'decides/s':>10}  {'settle p50 ms':>13}  {'p95 ms':>7}")
    for run, mode, rate, latency in rows:
        p50 = statistics.median(latency) * 1000
        p95 = statistics.quantiles(latency, n=20)[-1] * 1000
        print(f"{run:>3}  {mode:<16} {rate:>10.0f}  {p50:>13.2f}  {p95:>7.2f}")


if __name__ == "__main__":
    asyncio.run(main())
