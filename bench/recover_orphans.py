"""A gone replica's orphans cancelled by ``ApprovalService.recover`` (the leader's sweep): in batches written
together by group commit (``RECOVER_BATCH``, the product) against one commit each in turn (``batch=1``, as before),
interleaved in one process, three runs, warmed. SQLite on disk (``--dir``), ``synchronous=FULL``.

    PYTHONPATH=. python bench/recover_orphans.py [--orphans 500] [--runs 3] [--dir PATH]

Prints numbers; asserts nothing but that every orphan was cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from kazma.approvals import service as service_module
from kazma.bot.logging import configure_logging
from tests.approvals_support import approval_service

PRODUCT = service_module.RECOVER_BATCH


async def recovered(batch: int, path: Path, orphans: int) -> float:
    """Seconds ``recover`` took to cancel ``orphans`` requests a gone replica left, ``batch`` at a time."""
    async with approval_service(path) as service:
        service.store.replica = "gone"
        await asyncio.gather(
            *(service.open("shell", {"n": i}, "agent:builder", "telegram:-100") for i in range(orphans))
        )
        began = time.perf_counter()
        recovery = await service.recover({"alive"}, batch=batch)
        spent = time.perf_counter() - began
        if len(recovery.cancelled) != orphans:
            raise SystemExit(f"cancelled {len(recovery.cancelled)} of {orphans}")
        return spent


async def main() -> None:
    parser = argparse.ArgumentParser(description="a gone replica's orphans: batched vs one commit each")
    parser.add_argument("--orphans", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the SQLite files go (default: here)")
    args = parser.parse_args()
    configure_logging("error")
    with tempfile.TemporaryDirectory(dir=args.dir or Path.cwd()) as scratch:
        folder = Path(scratch)
        await recovered(PRODUCT, folder / "warm.db", args.orphans)
        spent: dict[int, list[float]] = {1: [], PRODUCT: []}
        for run in range(args.runs):
            for batch in (1, PRODUCT) if run % 2 == 0 else (PRODUCT, 1):
                spent[batch].append(await recovered(batch, folder / f"b{batch}-r{run}.db", args.orphans))
    print(f"{args.orphans} orphans of a gone replica cancelled by recover(), SQLite on disk:")
    for batch, seconds in spent.items():
        label = "one commit each (before)" if batch == 1 else f"batches of {batch} (product)"
        runs = " / ".join(f"{s:.3f}" for s in seconds)
        print(f"  {label:<28} {runs} s (median {statistics.median(seconds):.3f})")


if __name__ == "__main__":
    asyncio.run(main())
